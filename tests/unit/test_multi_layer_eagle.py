"""MultiLayerEagleProposer (CPU, TP = 1): every greedy draft equals the dense layers' draft over the
verified sequence (chunked prefill, interpreted kernels); output == plain decoding for S = 1..3,
greedy, seeded sampling and rejection acceptance, under churn, pausing and preemption with padded
steps, on a hybrid Mamba target too; bad heads and layer counts raise."""

import pytest
import torch

from mtp_ctrl.controllers import EagleProposer, MultiLayerEagleProposer, SamplingParams
from mtp_ctrl.models import (
    MultiLayerEagleHeads,
    build_eagle_head,
    build_multi_layer_eagle_heads,
    dense_multi_layer_eagle_forward,
)
from tests.unit.controller_fixtures import PROMPTS, make_controller, random_arrivals, run_with_arrivals
from tests.unit.eagle_fixtures import (AUX_LAYERS, assert_drafts_equal_dense, build_eagle_models, outputs_with_a_pause,
                                      plain_greedy_outputs)
from tests.unit.megatron_fixtures import ensure_single_process_groups
from tests.unit.multi_layer_eagle_fixtures import (
    RecordingMultiLayerEagleProposer,
    build_heads,
    dense_multi_layer_drafts,
)


@pytest.fixture(scope="module")
def models():
    ensure_single_process_groups()
    return build_eagle_models()


@pytest.fixture(scope="module")
def plain_greedy(models):
    return plain_greedy_outputs(models[0])


def test_drafts_equal_the_dense_layers_across_chunks(models, plain_greedy, model_twins):
    """S = 3, 4-token blocks, the 12-token prompt prefilled in two chunks (max_tokens_per_step 10):
    every window (cache rows, a mid-prompt chunk's rows, rejected rows cut off) gives the drafts the
    dense layers give over the whole verified sequence, layer by layer. The proposer's and the
    step's kernels interpreted, the model's attention, rope and sampling on their twins."""
    model, dense, _, _ = models
    heads, dense_heads = build_heads(model, dense, 3)
    assert_drafts_equal_dense(model, RecordingMultiLayerEagleProposer(heads), 3, plain_greedy,
                              lambda tokens: dense_multi_layer_drafts(dense, dense_heads, tokens), limit=10)


@pytest.mark.parametrize("num_layers, temperature, acceptance", [
    (1, 0.0, "exact_match"), (1, 0.8, "exact_match"), (2, 0.8, "exact_match"), (2, 0.8, "rejection"),
])
def test_equals_plain_greedy_sampled_and_rejection(models, torch_twins, num_layers, temperature, acceptance):
    """Rejection acceptance keeps plain decoding's distribution, not its tokens: there, the greedy
    requests (every other one) must still equal plain decoding."""
    model, _, _, _ = models
    heads, _ = build_heads(model, None, num_layers)
    prompts = [list(p) for p in PROMPTS]
    greedy = [acceptance == "exact_match" or seed % 2 == 0 for seed in range(len(prompts))]
    params = [SamplingParams(max_new_tokens=8, temperature=0.0 if acceptance != "exact_match" and greedy[seed]
                             else temperature, seed=seed) for seed in range(len(prompts))]
    plain = make_controller(model, 0).generate(prompts, params)
    controller = make_controller(model, num_layers, proposer=MultiLayerEagleProposer(heads), acceptance=acceptance)
    spec = controller.generate(prompts, params)
    for index, (got, want) in enumerate(zip(spec, plain)):
        if greedy[index]:
            assert got.output_tokens == want.output_tokens, index
        else:
            assert len(got.output_tokens) == 8 and got.finish_reason == want.finish_reason


def test_churn_preemption_sampling_padded_steps_equal_plain(models, torch_twins):
    """S = 3, overlap on, every step padded to a graph shape (mixed steps included), few KV blocks
    (requests are preempted and recomputed: their windows restart at position 0)."""
    model, _, _, _ = models
    heads, _ = build_heads(model, None, 3)
    arrivals = random_arrivals(seed=1, count=7)
    plain = run_with_arrivals(make_controller(model, 0, max_model_len=24, overlap_scheduling=False), arrivals)
    controller = make_controller(model, 3, proposer=MultiLayerEagleProposer(heads), max_model_len=24, num_kv_blocks=8,
                                 max_tokens_per_step=20, cuda_graph_batch_sizes=(2, 4))
    assert run_with_arrivals(controller, arrivals) == plain
    assert sum(controller.result(rid).preemptions for rid in range(controller.debug_view().next_request_id)) > 0
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks


def test_pause_and_resume_equal_plain(models, plain_greedy, torch_twins):
    model, _, _, _ = models
    heads, _ = build_heads(model, None, 2)
    controller = make_controller(model, 2, proposer=MultiLayerEagleProposer(heads))
    assert outputs_with_a_pause(controller) == plain_greedy


def test_hybrid_mamba_target_equals_plain(torch_twins):
    from tests.unit.hybrid_fixtures import build_hybrid_model

    ensure_single_process_groups()
    model = build_hybrid_model(mtp_num_layers=0)
    torch.manual_seed(3)
    heads = build_multi_layer_eagle_heads(model, 2, (1, 3))
    prompts = [list(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=11)
    plain = make_controller(model, 0).generate(prompts, params)
    controller = make_controller(model, 2, proposer=MultiLayerEagleProposer(heads), num_kv_blocks=14)
    spec = controller.generate(prompts, params)
    assert [r.output_tokens for r in spec] == [r.output_tokens for r in plain]


def test_bad_heads_and_layer_counts_raise_and_the_target_stays_usable(models, plain_greedy, torch_twins):
    model, dense, head, _ = models
    heads, dense_heads = build_heads(model, dense, 2)
    with pytest.raises(TypeError, match="heads must be MultiLayerEagleHeads"):
        MultiLayerEagleProposer(head)
    with pytest.raises(TypeError, match="EagleProposer|head"):
        EagleProposer(heads)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="num_layers"):
            build_multi_layer_eagle_heads(model, bad, AUX_LAYERS)
    with pytest.raises(TypeError, match="layers"):
        MultiLayerEagleHeads([])
    with pytest.raises(ValueError, match="aux_layer_ids"):
        MultiLayerEagleHeads([build_eagle_head(model, (0,)), build_eagle_head(model, (0, 1))])
    with pytest.raises(ValueError, match="num_speculative_tokens .3. must equal the number of draft layers .* .2."):
        make_controller(model, 3, proposer=MultiLayerEagleProposer(heads))
    from tests.unit.hybrid_fixtures import build_hybrid_model

    other = build_multi_layer_eagle_heads(build_hybrid_model(mtp_num_layers=0), 2, (3,))  # layer 3: the target has 2
    with pytest.raises(ValueError, match="aux_layer_ids"):
        make_controller(model, 2, proposer=MultiLayerEagleProposer(other))
    features = torch.zeros(5, 1, model.config.hidden_size)
    with pytest.raises(ValueError, match="next_tokens"):
        dense_multi_layer_eagle_forward(dense, dense_heads, features, torch.zeros(1, 5, dtype=torch.int64))  # needs 6
    assert heads.layers[1].fc is None and "layers.1.fc.weight" not in heads.state_dict()
    controller = make_controller(model, 2, proposer=MultiLayerEagleProposer(heads))
    results = controller.generate([list(p) for p in PROMPTS[:2]], SamplingParams(max_new_tokens=10))
    assert [list(r.output_tokens) for r in results] == plain_greedy[:2]
    assert AUX_LAYERS == controller.runner.aux_layer_ids
