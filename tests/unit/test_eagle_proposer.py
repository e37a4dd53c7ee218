"""EagleProposer (CPU, TP = 1): output == plain decoding for S = 1..4, greedy and seeded
sampling, under churn, pausing and preemption, overlap on and off, on a hybrid Mamba target too;
every greedy draft equals the dense head's draft over the verified sequence; bad heads raise."""

import pytest
import torch

from mtp_ctrl.controllers import EagleProposer, SamplingParams
from mtp_ctrl.models import build_eagle_head
from tests.unit.controller_fixtures import PROMPTS, make_controller, random_arrivals, run_with_arrivals
from tests.unit.eagle_fixtures import (AUX_LAYERS, RecordingEagleProposer, assert_drafts_equal_dense, build_eagle_models,
                                      dense_eagle_drafts, outputs_with_a_pause, plain_greedy_outputs)
from tests.unit.megatron_fixtures import ensure_single_process_groups


@pytest.fixture(scope="module")
def models():
    ensure_single_process_groups()
    return build_eagle_models()


@pytest.fixture(scope="module")
def plain_greedy(models):
    return plain_greedy_outputs(models[0])


def test_greedy_equals_plain(models, plain_greedy, torch_twins):
    controller = make_controller(models[0], 3, proposer=EagleProposer(models[2]))
    results = controller.generate([list(p) for p in PROMPTS], SamplingParams(max_new_tokens=10))
    assert [list(r.output_tokens) for r in results] == plain_greedy


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_one_draft_equals_plain_greedy_and_sampled(models, torch_twins, temperature):
    """S = 1 (step 1 only, no head-on-head steps), greedy and seeded sampling."""
    model, _, head, _ = models
    prompts = [list(p) for p in PROMPTS]
    params = [SamplingParams(max_new_tokens=10, temperature=temperature, seed=seed) for seed in range(len(prompts))]
    plain = make_controller(model, 0).generate(prompts, params)
    spec = make_controller(model, 1, proposer=EagleProposer(head)).generate(prompts, params)
    assert [r.output_tokens for r in spec] == [r.output_tokens for r in plain]


def test_drafts_equal_the_dense_head_across_chunks_and_tail_blocks(models, plain_greedy, model_twins):
    """S = 4 with 4-token blocks: draft positions cross into the head's tail blocks; the 12-token
    prompt is prefilled in two chunks (max_tokens_per_step 10). The one EAGLE controller run that
    interprets the kernels (the others use their twins; here the model's attention, rope and
    sampling run theirs)."""
    model, dense, head, dense_head = models
    assert_drafts_equal_dense(model, RecordingEagleProposer(head), 4, plain_greedy,
                              lambda tokens: dense_eagle_drafts(dense, dense_head, tokens, 4), limit=12)


def test_churn_preemption_sampling_padded_steps_equal_plain(models, torch_twins):
    """S = 4, overlap on, every step padded to a graph shape (mixed steps included): the real
    counts and the mid-prompt chunk's next token come from the device, as in a replayed graph."""
    model, _, head, _ = models
    arrivals = random_arrivals(seed=1, count=7)
    plain = run_with_arrivals(make_controller(model, 0, max_model_len=24, overlap_scheduling=False), arrivals)
    controller = make_controller(model, 4, proposer=EagleProposer(head), max_model_len=24, num_kv_blocks=14,
                                 max_tokens_per_step=20, cuda_graph_batch_sizes=(2, 4))
    assert run_with_arrivals(controller, arrivals) == plain
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks


def test_pause_and_resume_equal_plain(models, plain_greedy, torch_twins):
    model, _, head, _ = models
    controller = make_controller(model, 3, proposer=EagleProposer(head))
    assert outputs_with_a_pause(controller) == plain_greedy


def test_hybrid_mamba_target_equals_plain(torch_twins):
    from tests.unit.hybrid_fixtures import build_hybrid_model

    ensure_single_process_groups()
    model = build_hybrid_model(mtp_num_layers=0)
    torch.manual_seed(3)
    head = build_eagle_head(model, (1, 3))
    prompts = [list(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=11)
    plain = make_controller(model, 0).generate(prompts, params)
    spec = make_controller(model, 3, proposer=EagleProposer(head), num_kv_blocks=14).generate(prompts, params)
    assert [r.output_tokens for r in spec] == [r.output_tokens for r in plain]


def test_bad_heads_raise_and_the_target_stays_usable(models, plain_greedy, torch_twins):
    model, _, head, _ = models
    with pytest.raises(TypeError, match="head"):
        EagleProposer(model)
    from tests.unit.hybrid_fixtures import build_hybrid_model

    other = build_eagle_head(build_hybrid_model(mtp_num_layers=0), (3,))  # layer 3: the target has 2
    with pytest.raises(ValueError, match="aux_layer_ids"):
        make_controller(model, 2, proposer=EagleProposer(other))
    with pytest.raises(ValueError, match="num_speculative_tokens|exceeds"):
        make_controller(model, 2)  # no MTP layers and no proposer
    controller = make_controller(model, 2, proposer=EagleProposer(head))
    results = controller.generate([list(p) for p in PROMPTS[:2]], SamplingParams(max_new_tokens=10))
    assert [list(r.output_tokens) for r in results] == plain_greedy[:2]
    assert AUX_LAYERS == controller.runner.aux_layer_ids
