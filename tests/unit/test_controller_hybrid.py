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
from tests.unit.megatron_fixtures import torch_twins as twin_ops

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
    with twin_ops():  # a module fixture starts before the function-scoped torch_twins
        return run_with_arrivals(make_controller(model, 0, **CONFIG), _arrivals())


def _assert_released(controller):
    context = controller.context
    assert context.table.num_live == 0
    assert context.allocator.num_free_blocks == context.allocator.num_blocks
    assert context.mamba.num_free_slots == context.mamba.num_slots


def test_plain_equals_recompute_from_scratch(model, plain_outputs, torch_twins):
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
def test_speculative_greedy_equals_plain(model, plain_outputs, num_speculative_tokens, torch_twins):
    # the twins: the padded accepted-count test below runs this hybrid loop's kernels interpreted
    controller = make_controller(model, num_speculative_tokens, **CONFIG)
    assert run_with_arrivals(controller, _arrivals()) == plain_outputs
    _assert_released(controller)


@pytest.mark.parametrize("layout", [dict(), dict(cuda_graph_batch_sizes=(2, 4))], ids=["exact", "padded_batches"])
def test_every_accepted_count_commits_the_right_state(model, layout, request):
    """Drafts from the true greedy continuation with a random number of correct leading drafts
    (0..S): every verify step accepts the injected count and commits the Mamba state after that
    row, so the output is still the plain one. Padded batches send padding requests to the
    scratch slot. The padded layout interprets the step's and the Mamba state's kernels (the
    model's attention, rope and sampling on their twins), the exact one uses every twin."""
    request.getfixturevalue("model_twins" if layout else "torch_twins")
    max_new_tokens = 8
    with twin_ops():
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


def test_preempted_requests_recompute_their_state(model, torch_twins):
    """A KV pool too small for all four requests forces the newest out; it comes back with a
    fresh Mamba slot, is recomputed from prompt + output, and ends with the unconstrained output.
    (Without prefix caching: a cached recompute restores a snapshot, test_prefix_cache_hybrid.py.)"""
    params = [SamplingParams(max_new_tokens=9)] * len(PROMPTS)
    unconstrained = make_controller(model, 1, max_model_len=22, prefix_caching=False).generate(list(PROMPTS), params)
    controller = make_controller(model, 1, max_model_len=22, num_kv_blocks=12, prefix_caching=False)
    results = controller.generate(list(PROMPTS), params)
    assert [r.output_tokens for r in results] == [r.output_tokens for r in unconstrained]
    assert max(result.preemptions for result in results) >= 1
    _assert_released(controller)


def _run_paused(controller, params):
    """ARRIVALS with ``params[i]``; the third request is paused after its first step (mid-prompt:
    it arrives at step 1 and its prompt is longer than that step's chunk) and resumed at step 5.
    Returns the steps launched and each request's output tokens."""
    launched = []
    controller.on_launch = lambda step, graph_key: launched.append(step)  # the documented debug hook
    request_ids, step_index = [None] * len(ARRIVALS), 0
    while step_index == 0 or controller.has_unfinished_requests() or None in request_ids:
        for index, (arrival_step, prompt, _) in enumerate(ARRIVALS):
            if arrival_step == step_index:
                request_ids[index] = controller.add_request(prompt, params[index])
        if step_index == 2:
            controller.pause_request(request_ids[2])
        if step_index == 5:
            controller.resume_request(request_ids[2])
        controller.step()
        step_index += 1
    return launched, [controller.result(request_id).output_tokens for request_id in request_ids]


def test_padded_mixed_steps_equal_plain_with_arrivals_pausing_and_sampling(model, torch_twins):
    """With batch buckets every step pads to a CUDA-graph shape, steps that carry prefill chunks
    included (their Mamba chunks run the varlen path with the decode rows of the padded grid);
    greedy and seeded sampled requests, arrivals mid-run and a request paused mid-prompt give
    the plain exact-shape outputs."""
    params = [SamplingParams(max_new_tokens=n) if index % 2 == 0 else
              SamplingParams(max_new_tokens=n, temperature=0.8, top_k=20, seed=100 + index)
              for index, (_, _, n) in enumerate(ARRIVALS)]
    _, plain = _run_paused(make_controller(model, 0, **CONFIG), params)
    controller = make_controller(model, 2, cuda_graph_batch_sizes=(2, 4), **CONFIG)
    launched, outputs = _run_paused(controller, params)
    assert outputs == plain
    assert all(step.graph_padded for step in launched)
    assert any(step.num_decode and step.num_prefill for step in launched)  # a mixed step, padded
    _assert_released(controller)
