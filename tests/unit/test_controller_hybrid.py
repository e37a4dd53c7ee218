"""TextGenerationController on a hybrid model (Mamba-2 + attention decoder, attention MTP layers),
CPU, TP = 1: speculative greedy == plain greedy == a recompute-from-scratch reference, the Mamba
commit at every accepted count (oracle drafts, padded batches), and preemption with unchanged
outputs and every block and state slot returned."""

import random

import pytest

from mtp_ctrl.controllers import SamplingParams
from tests.unit.controller_fixtures import PROMPTS, OracleProposer, make_controller, run_with_arrivals
from tests.unit.hybrid_fixtures import build_hybrid_model
from tests.unit.megatron_fixtures import ensure_single_process_groups

MTP_DEPTH = 2
MAX_NEW_TOKENS = (6, 4, 5, 5)
# (arrival step, prompt, max_new_tokens); 16 query rows per step split the longer prompts into chunks
ARRIVALS = tuple(zip((0, 0, 1, 2), PROMPTS, MAX_NEW_TOKENS))
CONFIG = dict(max_tokens_per_step=16)


@pytest.fixture(scope="module")
def model():
    ensure_single_process_groups()
    return build_hybrid_model(mtp_num_layers=MTP_DEPTH, chunk_size=4)


def _arrivals():
    return [(step, prompt, SamplingParams(max_new_tokens=n)) for step, prompt, n in ARRIVALS]


@pytest.fixture(scope="module")
def plain_outputs(model):
    return run_with_arrivals(make_controller(model, 0, **CONFIG), _arrivals())


def _assert_released(controller):
    context = controller.context
    assert context.table.num_live == 0
    assert context.allocator.num_free_blocks == context.allocator.num_blocks
    assert context.mamba.num_free_slots == context.mamba.num_slots


def test_plain_equals_recompute_from_scratch(model, plain_outputs):
    """Each token of the reference is the greedy token of a new request holding prompt + output
    so far: one prefill from zero Mamba state and an empty KV cache (no decode rows, no commit)."""
    controller = make_controller(model, 0, **CONFIG)
    for prompt, expected in zip(PROMPTS, plain_outputs):
        tokens = list(prompt)
        for _ in range(len(expected)):
            tokens += controller.generate([tokens], SamplingParams(max_new_tokens=1))[0].output_tokens
        assert tuple(tokens[len(prompt):]) == tuple(expected)
    _assert_released(controller)


@pytest.mark.parametrize("num_speculative_tokens", [1, 2])
def test_speculative_greedy_equals_plain(model, plain_outputs, num_speculative_tokens):
    controller = make_controller(model, num_speculative_tokens, **CONFIG)
    assert run_with_arrivals(controller, _arrivals()) == plain_outputs
    _assert_released(controller)


@pytest.mark.parametrize("layout", [dict(), dict(cuda_graph_batch_sizes=(2, 4))], ids=["exact", "padded_batches"])
def test_every_accepted_count_commits_the_right_state(model, layout):
    """Drafts from the true greedy continuation with a random number of correct leading drafts
    (0..S): every verify step accepts the injected count and commits the Mamba state after that
    row, so the output is still the plain one. Padded batches send padding requests to the
    scratch slot."""
    max_new_tokens = 8
    plain = make_controller(model, 0, **CONFIG).generate(
        list(PROMPTS), SamplingParams(max_new_tokens=max_new_tokens + MTP_DEPTH + 1))
    sequences = {rid: list(PROMPTS[rid]) + list(result.output_tokens) for rid, result in enumerate(plain)}
    pattern_rng = random.Random(7)
    pattern = {(rid, index): pattern_rng.randint(0, MTP_DEPTH) for rid in range(len(PROMPTS)) for index in range(12)}
    proposer = OracleProposer(sequences, lambda rid, index: pattern[rid, index])
    controller = make_controller(model, MTP_DEPTH, proposer=proposer, **CONFIG, **layout)
    results = controller.generate(list(PROMPTS), SamplingParams(max_new_tokens=max_new_tokens))
    for result in results:
        assert list(result.output_tokens) == sequences[result.request_id][len(PROMPTS[result.request_id]):][
            :max_new_tokens]
        observed = proposer.observed[result.request_id]
        assert observed == proposer.injected[result.request_id][: len(observed)]
    assert {count for counts in proposer.observed.values() for count in counts} == set(range(MTP_DEPTH + 1))
    _assert_released(controller)


def test_preempted_requests_recompute_their_state(model):
    """A KV pool too small for all four requests forces the newest out; it comes back with a
    fresh Mamba slot, is recomputed from prompt + output, and ends with the unconstrained output."""
    params = [SamplingParams(max_new_tokens=9)] * len(PROMPTS)
    unconstrained = make_controller(model, 1, max_model_len=22).generate(list(PROMPTS), params)
    controller = make_controller(model, 1, max_model_len=22, num_kv_blocks=12)
    results = controller.generate(list(PROMPTS), params)
    assert [r.output_tokens for r in results] == [r.output_tokens for r in unconstrained]
    assert max(result.preemptions for result in results) >= 1
    _assert_released(controller)
