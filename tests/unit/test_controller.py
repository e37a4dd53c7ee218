"""TextGenerationController (CPU, TP = 1): lossless greedy and sampled speculation, acceptance
counts, the sampled distribution, and stop rules end to end.

The reference for greedy output is a plain loop over the dense twin (megatron's local-spec
GPTModel with causal SDPA attention, same weights): a full forward over prompt + output per
token, argmax of the last logits.
"""

import random

import pytest
import torch

from mtp_ctrl.controllers import FinishReason, SamplingParams
from tests.unit.controller_fixtures import (
    CONTINUATION_LENGTH,
    MTP_DEPTH,
    PROMPTS,
    OracleProposer,
    RecordingMTPProposer,
    build_models,
    chi_square_p_value,
    dense_greedy,
    filtered_softmax,
    make_controller,
    run_with_arrivals,
)
from tests.unit.megatron_fixtures import VOCAB_SIZE, dense_full_sequence, ensure_single_process_groups
from tests.unit.megatron_fixtures import torch_twins as twin_ops

# (step index at which the request arrives, prompt, max_new_tokens): requests join a running
# batch and finish at different steps.
STAGGERED = ((0, PROMPTS[0], 8), (0, PROMPTS[1], 5), (2, PROMPTS[2], 7), (3, PROMPTS[3], 6))


@pytest.fixture(scope="module")
def models():
    ensure_single_process_groups()
    return build_models()


@pytest.fixture(scope="module")
def greedy_continuations(models):
    """Dense-oracle greedy continuation of every prompt, ``CONTINUATION_LENGTH`` tokens."""
    _, dense = models
    return [dense_greedy(dense, prompt, CONTINUATION_LENGTH) for prompt in PROMPTS]


def _staggered_arrivals():
    return [(step, prompt, SamplingParams(max_new_tokens=n)) for step, prompt, n in STAGGERED]


@pytest.fixture(scope="module")
def plain_staggered_outputs(models):
    """Outputs of plain decoding (S = 0) of the staggered schedule."""
    model, _ = models
    return run_with_arrivals(make_controller(model, 0), _staggered_arrivals())


def _sequences_by_request_id(continuations, prompt_indices):
    """Oracle sequences (prompt + greedy continuation) keyed by the request ids the controller
    assigns (0, 1, ... in order of add_request)."""
    return {rid: list(PROMPTS[i]) + continuations[i] for rid, i in enumerate(prompt_indices)}


# ----- lossless greedy ---------------------------------------------------------------------


def test_plain_decoding_equals_dense_reference_loop(plain_staggered_outputs, greedy_continuations):
    """S = 0 with requests joining and leaving a running batch gives, per request, exactly the
    tokens of the no-cache dense reference loop."""
    for (_, _, max_new_tokens), output, continuation in zip(STAGGERED, plain_staggered_outputs, greedy_continuations):
        assert list(output) == continuation[:max_new_tokens]


@pytest.fixture(scope="module")
def speculative_runs(models):
    """Runs the staggered schedule once per (S, mtp_attention) asked for, with the model's own
    MTP drafts (recorded); returns ``run(S, mode) -> (controller, proposer, outputs)``. The runs use
    the kernels' torch twins (a module fixture cannot take the function-scoped torch_twins): the
    same loop at S = MTP depth with paged MTP attention runs the interpreted kernels in
    test_overlap's padded churn test, and plain decoding runs them here (the dense-reference test)."""
    model, _ = models
    cache = {}

    def run(num_speculative_tokens, mtp_attention):
        key = (num_speculative_tokens, mtp_attention)
        if key not in cache:
            proposer = RecordingMTPProposer(mtp_attention)
            controller = make_controller(model, num_speculative_tokens, proposer=proposer, mtp_attention=mtp_attention)
            with twin_ops():
                cache[key] = controller, proposer, run_with_arrivals(controller, _staggered_arrivals())
        return cache[key]

    return run


@pytest.mark.parametrize("mtp_attention", ["paged", "single_position"])
@pytest.mark.parametrize("num_speculative_tokens", range(1, MTP_DEPTH + 1))
def test_speculative_greedy_equals_plain(speculative_runs, plain_staggered_outputs, num_speculative_tokens,
                                        mtp_attention):
    """Greedy speculation with the model's own MTP drafts (any S up to the MTP depth, both MTP
    attention modes) emits exactly the tokens of S = 0, for requests of different prompt
    lengths that arrive and finish at different steps; no block or row is left behind."""
    controller, _, outputs = speculative_runs(num_speculative_tokens, mtp_attention)
    assert outputs == plain_staggered_outputs
    assert controller.context.table.num_live == 0
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks


@pytest.mark.parametrize("num_speculative_tokens", range(1, MTP_DEPTH + 1))
def test_paged_mtp_drafts_equal_dense_mtp_argmax(models, speculative_runs, greedy_continuations,
                                                 num_speculative_tokens):
    """mtp_attention="paged" drafts as trained: draft k + 1 of a proposal made after verifying
    position ``e`` is the argmax of the dense twin's MTP depth k at position ``e - 1``, over the
    verified tokens followed by the proposal's first k drafts (so the per-request window of
    each depth's paged cache, rewritten every step, holds what a full forward would)."""
    _, dense = models
    _, proposer, _ = speculative_runs(num_speculative_tokens, "paged")
    assert proposer.proposals
    for request_id, end, drafts in proposer.proposals:  # request ids follow STAGGERED, i.e. PROMPTS, order
        verified = (list(PROMPTS[request_id]) + greedy_continuations[request_id])[: end + 1]
        _, mtp_logits = dense_full_sequence(dense, torch.tensor(verified + drafts, dtype=torch.int64))
        want = [int(mtp_logits[depth][end - 1].argmax()) for depth in range(num_speculative_tokens)]
        assert drafts == want, (request_id, end)


# ----- acceptance paths ---------------------------------------------------------------------


def _run_oracle(models, continuations, correct_count, max_new_tokens=10, **config_fields):
    """Generate for every prompt with S = MTP_DEPTH and the oracle's drafts; the output must be
    the greedy continuation whatever was accepted, and no block or row is left behind."""
    model, _ = models
    proposer = OracleProposer(_sequences_by_request_id(continuations, range(len(PROMPTS))), correct_count)
    controller = make_controller(model, MTP_DEPTH, proposer=proposer, **config_fields)
    results = controller.generate(list(PROMPTS), SamplingParams(max_new_tokens=max_new_tokens))
    for result, continuation in zip(results, continuations):
        assert list(result.output_tokens) == continuation[:max_new_tokens]
    assert controller.context.table.num_live == 0
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks
    return controller, proposer, results


def _check_observed_equals_injected(proposer, results):
    """Each verify step accepted exactly the injected count of the proposal it verified (the
    last proposal of a request is never verified; with overlap scheduling a request may run one
    step past its stop, whose proposal is discarded), and the results count the same."""
    for result in results:
        observed = proposer.observed[result.request_id]
        injected = proposer.injected[result.request_id]
        assert len(injected) in (len(observed) + 1, len(observed) + 2)
        assert observed == injected[: len(observed)]
        assert result.decode_steps == len(observed)
        assert result.accepted_drafts == sum(observed)


def test_all_correct_drafts_are_all_accepted(models, greedy_continuations, torch_twins):
    """Drafts equal to the greedy continuation: every verify step accepts all S, so a request
    needs ceil((max_new_tokens - 1) / (S + 1)) verify steps; output unchanged."""
    S, max_new_tokens = MTP_DEPTH, 10
    controller, proposer, results = _run_oracle(models, greedy_continuations, lambda rid, index: S)
    _check_observed_equals_injected(proposer, results)
    for result in results:
        assert result.decode_steps == -(-(max_new_tokens - 1) // (S + 1))
        assert set(proposer.observed[result.request_id]) == {S}
        assert result.mean_accepted_length == 1 + S and result.acceptance_rate == 1.0
    assert controller.metrics.acceptance_per_depth == [1.0] * S


def test_all_wrong_drafts_are_all_rejected(models, greedy_continuations, torch_twins):
    """Drafts that are all wrong: every verify step accepts 0 and emits the target's own token."""
    max_new_tokens = 6
    controller, proposer, results = _run_oracle(models, greedy_continuations, lambda rid, index: 0,
                                                max_new_tokens=max_new_tokens)
    _check_observed_equals_injected(proposer, results)
    for result in results:
        assert result.accepted_drafts == 0 and result.decode_steps == max_new_tokens - 1
    assert controller.metrics.acceptance_per_depth == [0.0] * MTP_DEPTH


@pytest.mark.parametrize("layout", [dict(block_size_tokens=4), dict(block_size_tokens=1, cuda_graph_batch_sizes=(2, 4))],
                         ids=["block4", "block1_padded_batches"])
def test_mixed_drafts_accept_exactly_the_injected_prefix(models, greedy_continuations, layout, torch_twins):
    """A seeded random pattern of correct-prefix lengths (0..S) per request and proposal: each
    verify step accepts exactly the injected count; the metrics' acceptance per depth is the
    fraction of verify steps whose count exceeds that depth. Also with 1-token blocks (a
    rejection rewinds across up to S blocks) and decode batches padded to CUDA-graph sizes. Both on
    the kernels' twins: the rewind kernel crosses several blocks in test_kv_rewind, and the padded
    loop runs through the interpreted kernels in test_overlap's padded churn test."""
    S = MTP_DEPTH
    pattern_rng = random.Random(5)
    pattern = {(rid, index): pattern_rng.randint(0, S) for rid in range(len(PROMPTS)) for index in range(12)}
    controller, proposer, results = _run_oracle(models, greedy_continuations, lambda rid, index: pattern[rid, index],
                                                **layout)
    _check_observed_equals_injected(proposer, results)
    all_counts = [count for result in results for count in proposer.observed[result.request_id]]
    assert len(set(all_counts)) == S + 1  # the pattern hit every count 0..S
    expected_rates = [sum(count > depth for count in all_counts) / len(all_counts) for depth in range(S)]
    assert controller.metrics.acceptance_per_depth == pytest.approx(expected_rates)
    assert controller.metrics.verify_steps == len(all_counts)


# ----- sampling ------------------------------------------------------------------------------


def test_seeded_sampling_is_lossless_and_seed_dependent(models, torch_twins):
    """Sampled requests (temperature 0.8, top-k, top-p) give the same tokens with S = 2 as with
    S = 0 for the same seeds; the same seed twice in a batch gives the same tokens, another
    seed other tokens. The real MTP drafts, sampled with the target's noise, get accepted."""
    model, _ = models
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0], PROMPTS[0]]
    seeds = [11, 12, 11, 99]
    params = [SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=seed) for seed in seeds]
    plain = [result.output_tokens for result in make_controller(model, 0).generate(prompts, params)]
    speculative_results = make_controller(model, 2).generate(prompts, params)
    assert [result.output_tokens for result in speculative_results] == plain
    assert plain[0] == plain[2]
    assert plain[0] != plain[3]
    assert sum(result.accepted_drafts for result in speculative_results) > 0


def test_sampled_distribution_matches_dense_softmax(models, torch_twins):
    """Speculative sampling (S = 1) over many seeds: the first token follows the dense twin's
    filtered softmax at the prompt's last position, and the second token (verified against a
    draft) follows its marginal sum_t1 p(t1) p(t2 | prompt, t1) (chi-square, significance 0.1%)."""
    model, dense = models
    temperature, top_k, top_p, num_seeds = 0.8, 4, 0.95, 48
    prompt = list(PROMPTS[1])
    params = [SamplingParams(max_new_tokens=2, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
              for seed in range(num_seeds)]
    controller = make_controller(model, 1, max_requests=num_seeds, max_model_len=16, max_tokens_per_step=8 * num_seeds)
    outputs = torch.tensor([result.output_tokens for result in controller.generate([prompt] * num_seeds, params)])

    def next_token_probs(tokens):
        logits, _ = dense_full_sequence(dense, torch.tensor(tokens, dtype=torch.int64))
        return filtered_softmax(logits[-1], temperature, top_k, top_p)

    first_probs = next_token_probs(prompt)  # [V] float64
    second_probs = sum(first_probs[t] * next_token_probs(prompt + [t]) for t in first_probs.nonzero().flatten().tolist())
    for probs, tokens in ((first_probs, outputs[:, 0]), (second_probs, outputs[:, 1])):
        counts = torch.bincount(tokens, minlength=VOCAB_SIZE).double()
        assert counts[probs == 0].sum() == 0  # nothing outside the top-k / top-p support
        expected = probs * num_seeds
        large = expected >= 5  # cells expecting fewer than 5 draws are pooled into one
        small = (probs > 0) & ~large
        pooled_counts = torch.cat([counts[large], counts[small].sum().reshape(1)])
        pooled_expected = torch.cat([expected[large], expected[small].sum().reshape(1)])
        keep = pooled_expected > 0
        assert keep.sum() >= 2
        assert chi_square_p_value(pooled_counts[keep], pooled_expected[keep]) > 1e-3


# ----- stop rules ----------------------------------------------------------------------------


def _first_new_index(tokens, candidates):
    """The first index in ``candidates`` whose token does not occur earlier in ``tokens``."""
    return next(i for i in candidates if tokens[i] not in tokens[:i])


def test_stop_rules_cut_a_step_that_accepted_past_the_stop(models, greedy_continuations, model_twins):
    """With every draft accepted (S = 3: 4 tokens per verify step), each stop keeps the step's
    tokens up to the stop and drops the accepted rest: an eos token that was an accepted draft
    of the first verify step, a stop sequence, max_new_tokens, and max_model_len (8-token
    prompt, max_model_len 20)."""
    model, _ = models
    S, max_model_len = MTP_DEPTH, 20
    eos_output = greedy_continuations[0]
    eos_index = _first_new_index(eos_output, range(1, S + 1))  # one of the first verify step's drafts
    stop_output = greedy_continuations[3]
    stop_index = _first_new_index(stop_output, range(5, 8))  # inside the second verify step
    stop_sequence = tuple(stop_output[stop_index - 1 : stop_index + 1])
    requests = [
        (PROMPTS[0], SamplingParams(max_new_tokens=12, eos_token_ids=(eos_output[eos_index],))),
        (PROMPTS[1], SamplingParams(max_new_tokens=6)),
        (PROMPTS[2], SamplingParams(max_new_tokens=15)),
        (PROMPTS[3], SamplingParams(max_new_tokens=12, stop_sequences=(stop_sequence,))),
    ]
    proposer = OracleProposer(_sequences_by_request_id(greedy_continuations, range(4)), lambda rid, index: S)
    controller = make_controller(model, S, proposer=proposer, max_model_len=max_model_len)
    results = controller.generate([prompt for prompt, _ in requests], [params for _, params in requests])

    eos_result, length_result, model_len_result, stop_result = results
    assert list(eos_result.output_tokens) == eos_output[: eos_index + 1]
    assert eos_result.finish_reason == FinishReason.EOS
    assert eos_result.decode_steps == 1 and eos_result.accepted_drafts == S  # the eos draft was accepted
    assert list(length_result.output_tokens) == greedy_continuations[1][:6]
    assert length_result.finish_reason == FinishReason.LENGTH
    assert list(model_len_result.output_tokens) == greedy_continuations[2][: max_model_len - len(PROMPTS[2])]
    assert model_len_result.finish_reason == FinishReason.MAX_MODEL_LEN
    assert list(stop_result.output_tokens) == stop_output[: stop_index + 1]
    assert stop_result.finish_reason == FinishReason.STOP_SEQUENCE
    for result in results:  # each stop fell inside a verify step: its accepted tail was dropped
        assert len(result.output_tokens) < 1 + result.decode_steps * (S + 1)
    assert controller.context.table.num_live == 0
