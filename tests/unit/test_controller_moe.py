"""MoE decoder and MTP layers (megatron's MoELayer in the paged spec), CPU:

- the model holds megatron's MoE layers where ``moe_layer_freq`` puts them, MTP layers included;
- a row routes and computes in a batch as it does alone (what makes speculation lossless), on
  megatron's path and on the sync-free one (models/moe_inference.py, the default);
- the sync-free path gives megatron's eager MoELayer's tokens (moe_backend="megatron"), and
  S = 2 == S = 0 under churn and preemption, with steps padded to CUDA-graph shapes;
- the paged model's plain greedy output equals megatron's full-sequence forward (dense twin);
- speculative (S = 2) output equals plain (S = 0), greedy and seeded sampling, with the real
  MTP heads and with an oracle proposer that gets drafts accepted;
- tensor parallelism (TP = 2) and expert parallelism (EP = 2) over gloo give TP = 1's tokens;
- settings that couple rows or draw noise are refused with errors naming them.
"""

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_layer import MoELayer

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from mtp_ctrl.models import InferenceTopKRouter, PagedGPTRunner, moe_layer_pattern, moe_layers
from mtp_ctrl.models.moe import InferenceAllGatherTokenDispatcher
from mtp_ctrl.models.moe_inference import InferenceMoELayer, graph_moe_forward
from tests.unit.controller_fixtures import OracleProposer, dense_greedy, random_arrivals, run_with_arrivals
from tests.unit.megatron_fixtures import (
    build_dense_twin,
    build_tiny_model,
    ensure_single_process_groups,
    free_port,
    init_process_groups,
    spawn_ranks,
    tiny_config,
    torch_twins,
)
from tests.unit.moe_fixtures import (
    MOE_PROMPTS,
    build_moe_model,
    expert_parallel_state_dict,
    generate_cases,
    moe_config,
)

GREEDY, SAMPLED = dict(temperature=0.0), dict(temperature=0.9, top_k=20, seed=7)
CASES = ((0, GREEDY), (2, GREEDY), (0, SAMPLED), (2, SAMPLED))
PARALLEL_CASES = (1, 3)  # the S = 2 cases (at TP = 1 they equal S = 0's): each spawn costs seconds per case


@pytest.fixture(scope="module")
def megatron_groups():
    ensure_single_process_groups()


@pytest.fixture(scope="module")
def moe_model(megatron_groups):
    return build_moe_model()


@pytest.fixture(scope="module")
def tp1_outputs(moe_model):
    with torch_twins():  # the MoE kernel runs interpreted in test_moe_gemm / test_moe_inference
        return generate_cases(moe_model, CASES)


def test_moe_layers_follow_the_pattern_and_mtp_follows_the_last_layer(moe_model):
    assert not isinstance(moe_model.decoder.layers[0].mlp, MoELayer)
    assert isinstance(moe_model.decoder.layers[1].mlp, MoELayer)
    assert all(isinstance(layer.transformer_layer.mlp, MoELayer) for layer in moe_model.mtp.layers)
    layers = moe_layers(moe_model)
    assert len(layers) == 1 + 2
    assert all(isinstance(layer.router, InferenceTopKRouter) for layer in layers)
    assert all(isinstance(layer.token_dispatcher, InferenceAllGatherTokenDispatcher) for layer in layers)
    assert all(layer.shared_experts is not None and layer.num_local_experts == 4 for layer in layers)
    assert layers[0].experts.local_experts[0].linear_fc1.weight.shape[0] == 48  # moe_ffn_hidden_size (no gating)
    assert all(isinstance(layer, InferenceMoELayer) for layer in layers)
    assert PagedGPTRunner(moe_model).cuda_graph_capturable  # the sync-free path: steps replay graphs
    assert not PagedGPTRunner(moe_model, moe_backend="megatron").cuda_graph_capturable  # megatron's syncs
    assert moe_layer_pattern(moe_config(num_layers=4, moe_layer_freq=2)) == [True, False, True, False]
    dense_last = build_tiny_model(moe_config(moe_layer_freq=[1, 0]))
    assert isinstance(dense_last.decoder.layers[0].mlp, MoELayer)
    assert not any(isinstance(layer.transformer_layer.mlp, MoELayer) for layer in dense_last.mtp.layers)


@torch.no_grad()
def test_rows_route_and_compute_as_they_would_one_at_a_time(moe_model):
    """A verify step runs 1 + S rows where plain decoding runs one: each MoE layer must give
    every row the experts and the output it gets alone (dropless top-k, no capacity)."""
    generator = torch.Generator().manual_seed(3)
    for layer in moe_layers(moe_model):
        rows = torch.randn(9, 1, 64, generator=generator)  # [T, 1, H]
        probs, routing_map = layer.router(rows)  # [T, E] each
        output, _ = layer(rows)  # [T, 1, H]
        graph_output = graph_moe_forward(layer, rows, backend="grouped_mm")  # [T, 1, H]
        assert routing_map.sum(-1).tolist() == [2] * 9  # every row gets its top-2: nothing dropped
        for row in range(rows.shape[0]):
            torch.testing.assert_close(graph_moe_forward(layer, rows[row:row + 1], backend="grouped_mm"),
                                       graph_output[row:row + 1], atol=1e-6, rtol=1e-6)
            alone_probs, alone_map = layer.router(rows[row:row + 1])
            assert torch.equal(alone_map, routing_map[row:row + 1])
            torch.testing.assert_close(alone_probs, probs[row:row + 1], atol=1e-6, rtol=1e-6)
            alone_output, _ = layer(rows[row:row + 1])
            torch.testing.assert_close(alone_output, output[row:row + 1], atol=1e-5, rtol=1e-5)


def test_plain_greedy_equals_megatron_full_sequence_forward(moe_model, tp1_outputs):
    """The paged MoE model's greedy tokens are the argmax of megatron's own full causal forward
    (the dense twin: same weights, same MoE layers, SDPA attention, no cache)."""
    dense = build_dense_twin(moe_config(), moe_model)
    for prompt, output in zip(MOE_PROMPTS, tp1_outputs[0]):
        assert output == dense_greedy(dense, prompt, len(output))


def test_speculative_equals_plain_greedy_and_sampled(tp1_outputs):
    plain_greedy, spec_greedy, plain_sampled, spec_sampled = tp1_outputs
    assert spec_greedy == plain_greedy
    assert spec_sampled == plain_sampled
    assert plain_sampled != plain_greedy  # the sampling case samples


def test_sync_free_path_equals_megatron_moe_layer(moe_model, tp1_outputs):
    """megatron's eager MoELayer (the comparison) gives the sync-free path's tokens, S = 0 and 2."""
    with torch_twins():
        assert generate_cases(moe_model, CASES[:2], moe_backend="megatron") == tp1_outputs[:2]


@pytest.mark.parametrize("seed", range(2))
def test_speculative_equals_plain_under_churn_and_preemption(moe_model, seed):
    """Random arrivals (greedy and seeded sampled, stop rules), a KV pool small enough to pause and
    preempt, steps padded to graph shapes (rows past the real ones route and compute too):
    S = 2 == S = 0 token for token, MoE decoder and MoE MTP layers; nothing leaks."""
    arrivals = random_arrivals(seed, 6)
    with torch_twins():
        outputs = []
        for S, padded in ((0, ()), (2, ()), (2, (2, 4))):
            config = InferenceConfig(num_speculative_tokens=S, max_requests=4, block_size_tokens=4, max_model_len=24,
                                     max_tokens_per_step=64, num_kv_blocks=14, cuda_graph_batch_sizes=padded)
            controller = TextGenerationController(moe_model, config)
            outputs.append(run_with_arrivals(controller, arrivals))
            assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
    assert sum(len(tokens) for tokens in outputs[0]) >= len(arrivals)  # every request ran


def test_accepted_drafts_through_moe_verify_rows(moe_model, tp1_outputs, model_twins):
    """Random MTP heads rarely draft the greedy token, so an oracle drafts the plain output with
    0, 1 or 2 correct drafts per proposal: accepted rows went through the MoE verify path."""
    sequences = {rid: list(prompt) + output + [0] * 3 for rid, (prompt, output)
                 in enumerate(zip(MOE_PROMPTS, tp1_outputs[0]))}
    proposer = OracleProposer(sequences, lambda rid, index: (rid + index) % 3)
    config = InferenceConfig(num_speculative_tokens=2, max_requests=3, block_size_tokens=4, max_model_len=32,
                             max_tokens_per_step=64)
    controller = TextGenerationController(moe_model, config, proposer=proposer)
    results = controller.generate([list(p) for p in MOE_PROMPTS], SamplingParams(max_new_tokens=6))
    assert [list(result.output_tokens) for result in results] == tp1_outputs[0]
    assert sum(result.accepted_drafts for result in results) > 0


@pytest.mark.parametrize("field, value", [
    ("moe_expert_capacity_factor", 1.0),
    ("moe_input_jitter_eps", 0.01),
    ("moe_router_force_load_balancing", True),
])
def test_row_coupling_settings_are_refused(megatron_groups, field, value):
    with pytest.raises(ValueError, match=field):
        build_tiny_model(moe_config(**{field: value}))


def test_bad_moe_settings_are_refused(megatron_groups):
    with pytest.raises(ValueError, match="moe_layer_freq"):
        build_tiny_model(moe_config(moe_layer_freq=[1, 2]))
    with pytest.raises(ValueError, match="moe_token_dispatcher_type"):
        build_tiny_model(moe_config(moe_token_dispatcher_type="flex"))
    with pytest.raises(ValueError, match="expert_model_parallel_size"):
        build_tiny_model(moe_config(expert_parallel_size=2))  # parallel_state has EP = 1
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="alltoall"):
            build_tiny_model(moe_config(moe_token_dispatcher_type="alltoall"))


# ----- tensor and expert parallelism over gloo ---------------------------------------------


def _parallel_worker(rank: int, world_size: int, port: int, tensor_parallel_size: int, expert_parallel_size: int,
                     expected_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size,
                                             expert_model_parallel_size=expert_parallel_size)
    try:
        expected = torch.load(expected_path)
        model = build_tiny_model(moe_config(tensor_parallel_size=tensor_parallel_size,
                                            expert_parallel_size=expert_parallel_size))
        if expert_parallel_size > 1:  # EP ranks draw other weights: load TP = 1's, each rank its experts
            ep_rank = parallel_state.get_expert_model_parallel_rank()
            model.load_state_dict(expert_parallel_state_dict(expected["state_dict"], model, ep_rank))
            assert len(moe_layers(model)[0].experts.local_experts) == 4 // expert_parallel_size
        with torch_twins():
            got = generate_cases(model, [CASES[case] for case in PARALLEL_CASES])
        for case, got_case in zip(PARALLEL_CASES, got):
            assert got_case == expected["outputs"][case], f"TP {tensor_parallel_size} EP {expert_parallel_size} " \
                                                          f"rank {rank}, case {CASES[case]}: {got_case}"
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp1_expected_path(moe_model, tp1_outputs, tmp_path_factory):
    path = tmp_path_factory.mktemp("moe_parallel") / "tp1.pt"
    torch.save({"outputs": tp1_outputs, "state_dict": moe_model.state_dict()}, path)
    return str(path)


@pytest.mark.parametrize("tensor_parallel_size, expert_parallel_size", [(2, 1), (1, 2)], ids=["tp2", "ep2"])
def test_parallel_moe_matches_tp1(tp1_expected_path, tensor_parallel_size, expert_parallel_size):
    spawn_ranks(_parallel_worker, (2, free_port(), tensor_parallel_size, expert_parallel_size, tp1_expected_path))


def test_dense_config_is_unchanged(megatron_groups):
    """Without experts the builder makes the same dense model as before (no MoE layer, graphs allowed)."""
    model = build_tiny_model(tiny_config(mtp_num_layers=1))
    assert not moe_layers(model) and PagedGPTRunner(model).cuda_graph_capturable


def test_hybrid_mamba_moe_speculative_equals_plain(megatron_groups):
    """A Mamba layer's MLP can be MoE too (layer pattern "M*", both layers MoE): S = 2 == S = 0.
    On the twins: the subject is the wiring; the MoE loop's kernels run interpreted in the verify-row
    test above, the hybrid's in test_controller_hybrid."""
    from mtp_ctrl.models import build_gpt_model
    from tests.unit.megatron_fixtures import MAX_SEQUENCE_LENGTH, VOCAB_SIZE

    config = moe_config(moe_layer_freq=[1, 1], mamba_state_dim=8, mamba_head_dim=16, mamba_num_groups=2)
    torch.manual_seed(5)
    model = build_gpt_model(config, VOCAB_SIZE, MAX_SEQUENCE_LENGTH, layer_pattern="M*").eval()
    assert len(moe_layers(model)) == 2 + 2
    with torch_twins():
        plain, speculative = generate_cases(model, ((0, GREEDY), (2, GREEDY)), prompts=MOE_PROMPTS[:2],
                                            max_new_tokens=5)
    assert speculative == plain
