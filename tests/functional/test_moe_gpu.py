"""MoE models on CUDA: why their steps run eagerly, eager tokens with graph buckets configured,
S = 2 == S = 0, and TP = 2 / EP = 2 == TP = 1 on two GPUs (NCCL; both of megatron's dispatchers).

megatron's expert dispatch reads per-expert token counts on the host (``.cpu()`` in the all-gather
dispatcher, ``.tolist()`` in SequentialMLP, a D2H sync in the all-to-all dispatcher), so a step
with an MoE layer cannot be captured in a CUDA graph. The first test holds that reason true (if a
future megatron-core drops the sync, it fails and says graphs can be enabled for MoE); the others
check that the controller then runs every step eagerly and stays lossless.
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
from tests.unit.moe_fixtures import MOE_PROMPTS, expert_parallel_state_dict, moe_config

BUCKETS = (1, 2, 4)
CASES = ((0, dict()), (2, dict()), (0, dict(temperature=0.9, top_k=20, seed=7)), (2, dict(temperature=0.9, top_k=20, seed=7)))


@pytest.fixture(scope="module")
def moe_model():
    ensure_single_process_groups()
    return build_tiny_model(moe_config()).cuda()


def _config(num_speculative_tokens, graphs):
    return InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=4, block_size_tokens=4,
                           max_model_len=48, max_tokens_per_step=64, cuda_graph_batch_sizes=BUCKETS if graphs else ())


def _tokens(model, graphs, cases=CASES):
    outputs = []
    for num_speculative_tokens, sampling in cases:
        controller = TextGenerationController(model, _config(num_speculative_tokens, graphs))
        results = controller.generate([list(p) for p in MOE_PROMPTS], SamplingParams(max_new_tokens=8, **sampling))
        assert not controller.debug_view().cuda_graphs_enabled  # an MoE model's steps never run in a CUDA graph
        controller.close()
        outputs.append([list(r.output_tokens) for r in results])
    return outputs


@torch.no_grad()
def test_megatron_moe_forward_syncs_with_the_host(moe_model):
    """The reason MoE steps run eagerly: one forward of megatron's MoE layer syncs."""
    runner = PagedGPTRunner(moe_model)
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


def test_graph_buckets_run_eagerly_and_speculation_is_lossless(moe_model):
    """With graph buckets configured the MoE model pads to the buckets but runs eagerly: same
    tokens as without buckets; S = 2 equals S = 0, greedy and seeded sampling (fp32)."""
    with_buckets, without = _tokens(moe_model, graphs=True), _tokens(moe_model, graphs=False)
    assert with_buckets == without
    assert with_buckets[1] == with_buckets[0] and with_buckets[3] == with_buckets[2]


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
        got = _tokens(model, graphs=True)
        assert got == expected["outputs"], (tensor_parallel_size, expert_parallel_size, dispatcher, rank)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("tensor_parallel_size, expert_parallel_size, dispatcher",
                         [(2, 1, "allgather"), (1, 2, "allgather"), (1, 2, "alltoall")],
                         ids=["tp2-allgather", "ep2-allgather", "ep2-alltoall"])
def test_parallel_moe_equals_tp1(moe_model, tmp_path, tensor_parallel_size, expert_parallel_size, dispatcher):
    path = tmp_path / "tp1.pt"
    torch.save({"outputs": _tokens(moe_model, graphs=False),
                "state_dict": {key: value.cpu() for key, value in moe_model.state_dict().items()}}, path)
    mp.spawn(_parallel_worker, args=(2, free_port(), tensor_parallel_size, expert_parallel_size, dispatcher, str(path)),
             nprocs=2, join=True)
