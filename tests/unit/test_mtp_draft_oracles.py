"""MTP drafts of both modes == their dense oracles (tests/unit/mtp_draft_oracles.py), through the
public controller API: chunked prefill (a small max_tokens_per_step) and preemption (a tiny KV
pool). Greedy requests, so the verified tokens are the dense greedy continuation."""

import pytest

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from tests.unit.controller_fixtures import PROMPTS, build_models, dense_greedy
from tests.unit.megatron_fixtures import ensure_single_process_groups
from tests.unit.mtp_draft_oracles import RecordingProposer, check_drafts_against_oracle

S = 2
MAX_NEW_TOKENS = 9


@pytest.fixture(scope="module")
def models():
    ensure_single_process_groups()
    return build_models()


@pytest.fixture(scope="module")
def sequences(models):
    """Prompt + greedy continuation per request id (ids follow PROMPTS order), S tokens past the end."""
    _, dense = models
    return {rid: list(prompt) + dense_greedy(dense, prompt, MAX_NEW_TOKENS + S + 1)
            for rid, prompt in enumerate(PROMPTS)}


def _generate(model, mode, **config_fields):
    proposer = RecordingProposer(mode)
    fields = dict(num_speculative_tokens=S, max_requests=4, block_size_tokens=4, max_model_len=22,
                  max_tokens_per_step=64, mtp_attention=mode)
    fields.update(config_fields)
    controller = TextGenerationController(model, InferenceConfig(**fields), proposer=proposer)
    results = controller.generate(list(PROMPTS), SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
    return proposer, [result.output_tokens for result in results]


@pytest.mark.parametrize("mode", ["paged", "single_position"])
@pytest.mark.parametrize("pressure", ["chunked_prefill", "preemption"])
def test_drafts_equal_the_dense_oracle_of_their_mode(models, sequences, mode, pressure, torch_twins):
    """Every proposal of every request equals its mode's dense oracle at the position it was
    made; the other mode's oracle disagrees with some of them (so the check tells the modes
    apart). chunked_prefill: two rows and 6 query rows per step, so the 8- and 12-token prompts
    are prefilled in chunks beside running decodes. preemption: 12 KV blocks of 4 tokens for
    four requests that need up to 22 tokens each, so some request is evicted and recomputed.

    Planted bugs in mtp_proposer.py that failed this test (each on its own, then reverted):
    depth k reading ``token_index = positions + depth`` (the token one position early: all four
    cases); the window start ``min(e, V - S + 1)`` (a draft-built entry kept: both paged cases);
    the single_position mode run through the paged window (both single_position cases)."""
    # The torch twins: the subject is which positions the proposer drafts from. The interpreted
    # kernels run paged drafting beside chunked prefills in test_overlap's padded churn test.
    model, dense = models
    if pressure == "chunked_prefill":
        proposer, outputs = _generate(model, mode, max_requests=2, max_tokens_per_step=2 * (1 + S))
    else:
        proposer, outputs = _generate(model, mode, num_kv_blocks=12)
        assert proposer.preempted_requests(), "the tiny KV pool preempted no request"
    for rid, output in enumerate(outputs):
        assert list(output) == sequences[rid][len(PROMPTS[rid]) : len(PROMPTS[rid]) + MAX_NEW_TOKENS]
    assert check_drafts_against_oracle(dense, proposer, sequences, mode) > 0


def test_single_position_survives_a_step_with_no_sampling_request(models, sequences, model_twins):
    """Regression: this crashed before MTPProposer skipped drafting when nothing samples.

    One request with the 12-token prompt and 3 query rows per step: its first chunks do not
    sample, so propose() gets ``step.num_sampling_requests == 0``. MTPProposer("single_position")
    builds 0 rows and calls runner.mtp_forward, which fails in megatron's attention with
    "cannot reshape tensor of 0 elements". The paged mode passes the same schedule (its window
    has the chunk's rows). Expected: no drafting work (or an empty forward) for such a step."""
    model, dense = models
    proposer = RecordingProposer("single_position")
    config = InferenceConfig(num_speculative_tokens=S, max_requests=1, block_size_tokens=4, max_model_len=22,
                             max_tokens_per_step=1 + S, mtp_attention="single_position")
    controller = TextGenerationController(model, config, proposer=proposer)
    result = controller.generate([PROMPTS[3]], SamplingParams(max_new_tokens=3))[0]
    assert list(result.output_tokens) == sequences[3][len(PROMPTS[3]) : len(PROMPTS[3]) + 3]
    check_drafts_against_oracle(dense, proposer, {0: sequences[3]}, "single_position")
