"""MoE models on CUDA: the sync-free MoE path (models/moe_inference.py) replays CUDA graphs with
no host sync, == eager == megatron's MoELayer == plain; megatron's own MoE forward still syncs (why
it stays the eager comparison); the grouped expert products == their torch twin on the GPU; and
TP = 2 / EP = 2 == TP = 1 on two GPUs (NCCL): megatron's path with both of its dispatchers, and the
sync-free path with its exchange captured in the graphs.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core import parallel_state

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from mtp_ctrl.models import PagedGPTRunner, count_kv_layers, moe_layers
from tests.functional.sync_checks import no_host_sync
from tests.unit.megatron_fixtures import (
    NUM_BLOCKS,
    allocate_kv_caches,
    build_tiny_model,
    ensure_single_process_groups,
    free_port,
    make_metadata,
    tiny_config,
)
from mtp_ctrl.triton_ops import align_expert_pairs, grouped_expert_matmul, reference
from tests.unit.moe_fixtures import MOE_PROMPTS, expert_parallel_state_dict, moe_config

BUCKETS = (1, 2, 4)
CASES = ((0, dict()), (2, dict()), (0, dict(temperature=0.9, top_k=20, seed=7)), (2, dict(temperature=0.9, top_k=20, seed=7)))


@pytest.fixture(scope="module")
def moe_model():
    ensure_single_process_groups()
    return build_tiny_model(moe_config()).cuda()


def _config(num_speculative_tokens, graphs, moe_backend="triton"):
    return InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=4, block_size_tokens=4,
                           max_model_len=48, max_tokens_per_step=64, cuda_graph_batch_sizes=BUCKETS if graphs else (),
                           moe_backend=moe_backend)


def _tokens(model, graphs, cases=CASES, moe_backend="megatron"):
    outputs = []
    for num_speculative_tokens, sampling in cases:
        controller = TextGenerationController(model, _config(num_speculative_tokens, graphs, moe_backend))
        results = controller.generate([list(p) for p in MOE_PROMPTS], SamplingParams(max_new_tokens=8, **sampling))
        if moe_backend == "megatron" or not graphs:
            assert not controller.debug_view().cuda_graphs_enabled  # megatron's MoE steps never run in a CUDA graph
        else:
            assert controller.debug_view().num_cuda_graphs > 0  # the sync-free path's steps replay graphs
        controller.close()
        outputs.append([list(r.output_tokens) for r in results])
    return outputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
def test_moe_ops_equal_their_twins_on_the_gpu(backend, dtype):
    """align_expert_pairs == its twin exactly; grouped_expert_matmul == the per-expert twin, for
    a routing with empty experts, a crowded expert and pairs of another rank's experts."""
    generator = torch.Generator().manual_seed(5)
    num_rows, top_k = 70, 6
    ids = torch.stack([torch.randperm(16, generator=generator)[:top_k] for _ in range(num_rows)])  # [T, k] of 16
    ids[:30, 0] = 9  # a crowded expert
    ids = ids.cuda()
    for block_rows in (16, 64):
        got, want = align_expert_pairs(ids, 8, 8, block_rows), reference.align_expert_pairs(ids, 8, 8, block_rows)
        for name in ("sorted_pairs", "sorted_rows", "expert_offsets", "block_experts", "block_starts"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    segments = align_expert_pairs(ids, 8, 8, 16)  # local experts 8..15 (EP rank 1 of 2)
    rows = torch.randn(num_rows, 256, generator=generator).to("cuda", dtype)  # [T, K]
    weight = (torch.randn(8, 384, 256, generator=generator) / 16).to("cuda", dtype)  # [E, N, K]
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(grouped_expert_matmul(rows, weight, segments, backend=backend),
                               reference.grouped_expert_matmul(rows, weight, segments), **tolerance)
    sorted_rows = torch.randn(num_rows * top_k, 256, generator=generator).to("cuda", dtype)
    torch.testing.assert_close(
        grouped_expert_matmul(sorted_rows, weight, segments, gather_rows=False, scatter_pairs=True, backend=backend),
        reference.grouped_expert_matmul(sorted_rows, weight, segments, False, True), **tolerance)


@torch.no_grad()
def check_step_graph_replays_without_host_sync(model, backend):
    """A decode step of the MoE model (decoder + MTP depth, every layer MoE but the first) is
    captured under set_sync_debug_mode("error") and its replays equal eager forwards (with TP or
    EP > 1 the step's all-gather and reduce-scatter are inside the graph)."""
    runner = PagedGPTRunner(model, moe_backend=backend)
    assert runner.cuda_graph_capturable
    config = model.config
    num_kv_heads_local = config.num_query_groups // config.tensor_model_parallel_size
    caches = allocate_kv_caches(count_kv_layers(model), NUM_BLOCKS, num_kv_heads_local=num_kv_heads_local,
                                head_dim=config.kv_channels, device="cuda")
    prefill = make_metadata([[0, 1]], [(0, 5)], device="cuda")
    runner.forward(torch.arange(5, device="cuda"), prefill.positions, prefill, caches)
    metadata = make_metadata([[0, 1]], [(5, 3)], device="cuda")  # 1 + S = 3 rows at positions 5..7
    token_ids = torch.zeros(3, dtype=torch.int64, device="cuda")  # [T]

    def step():
        logits, hidden = runner.forward(token_ids, metadata.positions, metadata, caches)
        draft_logits, _ = runner.mtp_forward(0, hidden, token_ids, metadata.positions, metadata, caches)
        return logits, draft_logits

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels and stacks the expert weights outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with no_host_sync():
        with torch.cuda.graph(graph):
            graph_logits, graph_draft_logits = step()
    for seed in (3, 4):
        token_ids.copy_(torch.randint(0, 96, (3,), generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        with no_host_sync():
            want_logits, want_draft_logits = step()  # eager, same inputs: the sync-free path syncs eagerly neither
        torch.testing.assert_close(graph_logits, want_logits, atol=0, rtol=0)
        torch.testing.assert_close(graph_draft_logits, want_draft_logits, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
def test_sync_free_moe_step_replays_a_graph_without_host_sync(moe_model, backend):
    check_step_graph_replays_without_host_sync(moe_model, backend)


@torch.no_grad()
def test_megatron_moe_forward_syncs_with_the_host(moe_model):
    """Why megatron's path runs eagerly: one forward of megatron's MoE layer syncs."""
    runner = PagedGPTRunner(moe_model, moe_backend="megatron")
    caches = allocate_kv_caches(count_kv_layers(moe_model), NUM_BLOCKS, num_kv_heads_local=2, head_dim=16,
                                device="cuda")
    metadata = make_metadata([[0, 1]], [(0, 5)], device="cuda")
    input_ids = torch.arange(5, device="cuda")
    runner.forward(input_ids, metadata.positions, metadata, caches)  # warm-up outside the check
    torch.cuda.synchronize()
    with no_host_sync():
        with pytest.raises(RuntimeError, match="synchroniz") as raised:
            runner.forward(input_ids, metadata.positions, metadata, caches)
    # the sync is in megatron's MoE code (dispatcher or experts), not in the paged model around it
    assert any("transformer/moe/" in str(entry.path) for entry in raised.traceback), raised.traceback
    assert not runner.cuda_graph_capturable


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
def test_graph_steps_equal_eager_equal_megatron_and_speculation_is_lossless(moe_model, backend):
    """The sync-free path's replayed graphs give its eager tokens and megatron's eager MoELayer's;
    S = 2 equals S = 0, greedy and seeded sampling (fp32)."""
    graphs = _tokens(moe_model, graphs=True, moe_backend=backend)
    assert graphs == _tokens(moe_model, graphs=False, moe_backend=backend)
    assert graphs[1] == graphs[0] and graphs[3] == graphs[2]
    megatron = _tokens(moe_model, graphs=True, moe_backend="megatron")
    differing = [(case, prompt) for case in range(len(CASES)) for prompt in range(len(MOE_PROMPTS))
                 if graphs[case][prompt] != megatron[case][prompt]]
    # fp32, different summation orders: a differing request must be an argmax near-tie; report it
    assert len(differing) <= 1, (differing, graphs, megatron)


def test_bf16_moe_graph_steps_equal_megatron_up_to_near_ties():
    """bf16: the sync-free path (graphs) and megatron's eager MoELayer round differently (fused
    fp32 accumulation vs bf16 per-expert GEMMs), so a greedy near-tie may break differently:
    outputs agree on their first tokens, and S = 2 == S = 0 on the graph path."""
    ensure_single_process_groups()
    model = build_tiny_model(moe_config(params_dtype=torch.bfloat16, bf16=True)).cuda()
    graphs = _tokens(model, graphs=True, cases=CASES[:2], moe_backend="triton")
    megatron = _tokens(model, graphs=False, cases=CASES[:1], moe_backend="megatron")
    assert graphs[1] == graphs[0]
    agree = sum(a[:2] == b[:2] for a, b in zip(graphs[0], megatron[0]))
    print(f"bf16 MoE: {agree}/{len(MOE_PROMPTS)} requests agree with megatron's path on their first 2 tokens; "
          f"graph {graphs[0]} megatron {megatron[0]}")
    assert agree >= len(MOE_PROMPTS) - 1


def test_dense_model_still_captures_graphs():
    ensure_single_process_groups()
    model = build_tiny_model(tiny_config(mtp_num_layers=2)).cuda()
    controller = TextGenerationController(model, _config(2, graphs=True))
    controller.generate([list(p) for p in MOE_PROMPTS], SamplingParams(max_new_tokens=8))
    assert controller.debug_view().num_cuda_graphs > 0
    controller.close()


def _parallel_worker(rank, world_size, port, tensor_parallel_size, expert_parallel_size, dispatcher, expected_path):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size,
                                             expert_model_parallel_size=expert_parallel_size)
    try:
        expected = torch.load(expected_path)
        model = build_tiny_model(moe_config(tensor_parallel_size=tensor_parallel_size,
                                            expert_parallel_size=expert_parallel_size,
                                            moe_token_dispatcher_type=dispatcher))
        if expert_parallel_size > 1:  # EP ranks draw other weights: load TP = 1's, each rank its experts
            ep_rank = parallel_state.get_expert_model_parallel_rank()
            model.load_state_dict(expert_parallel_state_dict(expected["state_dict"], model, ep_rank))
        model = model.cuda()
        assert len(moe_layers(model)[0].experts.local_experts) == 4 // expert_parallel_size
        where = (tensor_parallel_size, expert_parallel_size, dispatcher, rank)
        # megatron's path (its all-gather / all-to-all dispatchers, eager)
        assert _tokens(model, graphs=True) == expected["outputs"], where
        # the sync-free path: the exchange (all-gather, reduce-scatter over NCCL) inside the graphs
        check_step_graph_replays_without_host_sync(model, "triton")
        graphs = _tokens(model, graphs=True, moe_backend="triton")
        assert graphs == _tokens(model, graphs=False, moe_backend="triton"), where
        assert graphs[1] == graphs[0] and graphs[3] == graphs[2], where  # S = 2 == S = 0
        assert graphs == expected["sync_free_outputs"], where  # == the one-GPU run, token for token
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("tensor_parallel_size, expert_parallel_size, dispatcher",
                         [(2, 1, "allgather"), (1, 2, "allgather"), (1, 2, "alltoall")],
                         ids=["tp2-allgather", "ep2-allgather", "ep2-alltoall"])
def test_parallel_moe_equals_tp1(moe_model, tmp_path, tensor_parallel_size, expert_parallel_size, dispatcher):
    """TP = 2 / EP = 2 on two GPUs (NCCL) == TP = 1 on one: megatron's path (both dispatchers,
    eager), and the sync-free path in CUDA graphs (captured with no host sync, == its eager steps,
    S = 2 == S = 0)."""
    path = tmp_path / "tp1.pt"
    torch.save({"outputs": _tokens(moe_model, graphs=False),
                "sync_free_outputs": _tokens(moe_model, graphs=True, moe_backend="triton"),
                "state_dict": {key: value.cpu() if torch.is_tensor(value) else value  # megatron's _extra_state: None
                               for key, value in moe_model.state_dict().items()}}, path)
    mp.spawn(_parallel_worker, args=(2, free_port(), tensor_parallel_size, expert_parallel_size, dispatcher, str(path)),
             nprocs=2, join=True)
