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
def test_drafts_equal_the_dense_oracle_of_their_mode(models, sequences, mode, pressure):
    """Every proposal of every request equals its mode's dense oracle at the position it was
    made; the other mode's oracle disagrees with some of them (so the check tells the modes
    apart). chunked_prefill: two rows and 6 query rows per step, so the 8- and 12-token prompts
    are prefilled in chunks beside running decodes. preemption: 12 KV blocks of 4 tokens for
    four requests that need up to 22 tokens each, so some request is evicted and recomputed.

    Planted bugs that failed this test (each on its own, then reverted): single_position
    drafting with depth k reading ``token_index = positions + depth`` (the token one position
    early); the paged window start ``w = max(0, min(e, V - S + 1))`` (one final entry too few
    rewritten); and running single_position requests through the paged window (mode ignored)."""
    model, dense = models
    if pressure == "chunked_prefill":
        proposer, outputs = _generate(model, mode, max_requests=2, max_tokens_per_step=2 * (1 + S))
    else:
        proposer, outputs = _generate(model, mode, num_kv_blocks=12)
        assert proposer.preempted_requests(), "the tiny KV pool preempted no request"
    for rid, output in enumerate(outputs):
        assert list(output) == sequences[rid][len(PROMPTS[rid]) : len(PROMPTS[rid]) + MAX_NEW_TOKENS]
    assert check_drafts_against_oracle(dense, proposer, sequences, mode) > 0
