"""Per-request, per-step draft lengths (issue 34) with the model's own MTP drafting and an oracle
drafter: output == plain decoding whatever lengths the draft-length policy picks (churn,
preemption, padded steps, greedy and seeded sampling, overlap on and off); at most ``s_r`` drafts
accepted; a step's verify width follows the drafts its requests hold; no draft phase in a step
where nobody drafts; the
``SamplingParams(num_speculative_tokens=...)`` cap. The EAGLE family and rejection acceptance:
``test_draft_lengths_proposers.py``."""

import numpy as np
import pytest
import torch

from mtp_ctrl.controllers import MTPProposer, PerRequestGoodputPolicy, Proposer, SamplingParams
from mtp_ctrl.controllers.draft_policy import DraftLengthPolicy, FixedDraftLength, GoodputPolicy, RandomDraftLengths
from mtp_ctrl.state.batch_dimensions import ragged_token_counts
from tests.unit.controller_fixtures import MTP_DEPTH, PROMPTS, OracleProposer
from tests.unit.draft_length_fixtures import (ARRIVALS, QUEUED, SQUEEZE, CheckedRandomLengths, MixedTiers,  # noqa: F401
                                              ZeroLengths, controller_for, mtp_model, plain, run)  # fixtures too


@pytest.mark.parametrize("steps_per_launch", [1, 4])
def test_oracle_drafts_accept_exactly_the_chosen_lengths(mtp_model, plain, torch_twins, steps_per_launch):
    """Drafts that are always right (the plain output, greedy and sampled): each request accepts
    its chosen length s_r (never more: the host pairs each read-back with the lengths it verified,
    decode runs too), and the output is plain decoding's, with preemption, padded steps and
    overlap on."""
    ids, outputs = plain
    sequences = {rid: list(prompt) + list(out) + [0] * (MTP_DEPTH + 2)
                 for rid, (_, prompt, _), out in zip(ids, ARRIVALS, outputs)}
    policy = CheckedRandomLengths(seed=1)
    controller = controller_for(mtp_model, MTP_DEPTH, OracleProposer(sequences, lambda rid, index: MTP_DEPTH),
                                policy, decode_steps_per_launch=steps_per_launch, **SQUEEZE)
    new_ids, got = run(controller, ARRIVALS)
    assert got == outputs and new_ids == ids
    assert any(controller.result(rid).preemptions for rid in new_ids)  # KV pressure evicted a request
    exact = sum(verified == accepted for verified, accepted in policy.outcomes)
    assert exact >= 0.7 * len(policy.outcomes)  # all but steps run past a stop (drafts past the sequence)
    assert {verified for verified, _ in policy.outcomes} == set(range(MTP_DEPTH + 1))  # every length occurred
    counts = controller.metrics.as_dict()["draft_length_counts"]
    assert sum(counts) == controller.metrics.verify_steps and min(counts) > 0


@pytest.mark.parametrize("mode,overlap,skip", [("paged", True, False), ("single_position", False, False),
                                               ("paged", True, True)])
def test_mtp_proposer_random_lengths_equal_plain(mtp_model, plain, torch_twins, mode, overlap, skip):
    """skip: no-draft decode-only steps run no window (``mtp_idle_windows="skip"``), later steps
    catch up (``test_mtp_catch_up.py``: the drafts are the same); the output is plain decoding's."""
    controller = controller_for(mtp_model, MTP_DEPTH, MTPProposer(mode, skip_idle_windows=skip),
                                CheckedRandomLengths(seed=2), overlap_scheduling=overlap, **SQUEEZE)
    assert run(controller, ARRIVALS)[1] == plain[1]


@pytest.mark.parametrize("policy,steps_per_launch", [("per_request", 1), ("random", 4)])
def test_ragged_rows_equal_plain_and_free_every_block(mtp_model, plain, torch_twins, policy, steps_per_launch):
    """Ragged rows (each decode request runs ``1 + s_r`` rows) under ``PerRequestGoodputPolicy``, and
    under random lengths with decode runs (their steps keep ``1 + V`` rows a request) between single
    ragged steps: plain decoding's output (churn, preemption, sampling), and every KV block back in
    the pool at the end (the rewinds freed nothing twice and leaked nothing)."""
    chosen = PerRequestGoodputPolicy(decide_every=1) if policy == "per_request" else RandomDraftLengths(seed=3)
    controller = controller_for(mtp_model, MTP_DEPTH, MTPProposer("paged"), chosen,
                                decode_steps_per_launch=steps_per_launch, **SQUEEZE)
    steps = []
    controller.on_launch = lambda step, key: steps.append((step.num_steps, step.host_query_lengths[: step.num_decode]
                                                          .tolist(), step.verify_width))
    assert run(controller, ARRIVALS)[1] == plain[1]
    allocator = controller.context.allocator
    assert allocator.num_free_blocks == allocator.num_blocks
    ragged = [rows for num_steps, rows, width in steps if num_steps == 1 and any(r < 1 + width for r in rows)]
    assert ragged, steps  # some single step ran fewer rows than its tier
    runs = [rows for num_steps, rows, width in steps if num_steps > 1]
    assert (steps_per_launch > 1) == bool(runs) and all(set(rows) == {1 + width} for num_steps, rows, width in steps
                                                        if num_steps > 1)


class CountingMTP(MTPProposer):
    def __init__(self, **options):
        super().__init__("paged", **options)
        self.proposals = {True: 0, False: 0}  # by whether the step was decode-only

    def propose(self, batch):
        self.proposals[batch.step.decode_only] += 1
        return super().propose(batch)


def test_skipped_idle_windows_run_no_depth(mtp_model, plain, torch_twins):
    """``InferenceConfig(mtp_idle_windows="skip")``: a decode-only step where nobody drafts runs no
    MTP depth (paged mode otherwise runs every depth's window on it) unless a request would fall
    more than ``catch_up_positions`` behind; steps with prefill chunks run them either way (a
    prompt's entries are written once)."""
    with pytest.raises(ValueError, match="mtp_idle_windows"):
        controller_for(mtp_model, MTP_DEPTH, mtp_idle_windows="never")
    with pytest.raises(TypeError, match="mtp_idle_windows"):
        controller_for(mtp_model, MTP_DEPTH, mtp_idle_windows=True)
    with pytest.raises(TypeError, match="skip_idle_windows"):
        MTPProposer("paged", skip_idle_windows=1)
    for skip, expected_runs in ((False, True), (True, False)):  # (M = 64: no forced catch-up in 9 tokens)
        proposer = CountingMTP(skip_idle_windows=skip, catch_up_positions=64)
        assert run(controller_for(mtp_model, MTP_DEPTH, proposer, ZeroLengths()), ARRIVALS)[1] == plain[1]
        assert (proposer.proposals[True] > 0) == expected_runs and proposer.proposals[False] > 0


class OneDraft(DraftLengthPolicy):
    def choose(self, query):
        return np.minimum(query.caps, 1)


def test_depths_past_d_skip_their_windows(mtp_model, plain, torch_twins):
    """``mtp_idle_windows="skip"``: a decode-only step that drafts D = 1 < S runs MTP depth 0 only
    (counted by forward hooks on each depth's layer); the depths past D run on steps with prefill
    chunks (and forced catch-ups: none with M = 64 in 9 tokens); "run" runs every depth every step."""
    for skip in (False, True):
        calls, seen, deltas = [0] * MTP_DEPTH, [0] * MTP_DEPTH, []

        def count(depth):
            return lambda *args: calls.__setitem__(depth, calls[depth] + 1)

        def on_launch(step, graph_key):
            deltas.append((step.decode_only, step.num_drafts, [now - before for now, before in zip(calls, seen)]))
            seen[:] = calls

        hooks = [mtp_model.mtp.layers[depth].eh_proj.register_forward_hook(count(depth)) for depth in range(MTP_DEPTH)]
        controller = controller_for(mtp_model, MTP_DEPTH, MTPProposer("paged", skip_idle_windows=skip,
                                                                      catch_up_positions=64), OneDraft())
        controller.on_launch = on_launch
        try:
            assert run(controller, ARRIVALS)[1] == plain[1]
        finally:
            for hook in hooks:
                hook.remove()
        assert any(decode_only and drafts == 1 for decode_only, drafts, _ in deltas)
        for decode_only, drafts, delta in deltas:
            depth_zero_only = skip and decode_only and drafts == 1
            assert delta == ([1] + [0] * (MTP_DEPTH - 1) if depth_zero_only else [1] * MTP_DEPTH), deltas


@pytest.mark.parametrize("ragged", [False, True])
def test_verify_width_follows_the_drafts_held_and_changes_every_step(mtp_model, plain, torch_twins, ragged):
    """A decode-only step verifies V = the most drafts any of its decode requests holds (chosen when
    it last sampled): 1 + V logits rows per request, graph shape and key included, so steps of plain
    decoding's width (V = 0) occur too; a decode-only step's key says it masks draft rows exactly
    when some request holds fewer than V. Random lengths change V from step to step; the output stays plain
    decoding's (churn, preemption, padded steps, sampling). ``ragged``: each decode request runs
    ``1 + s_r`` forward rows (the drafts it holds; ``InferenceConfig.ragged_rows``), its logits
    rows repeat row ``s_r`` past it, and a decode-only step pads its rows to a ragged token count
    (masked below the tier's ``G (1 + V)``); else ``1 + V`` rows each (the padded layout)."""
    controller = controller_for(mtp_model, MTP_DEPTH, MTPProposer("paged"), RandomDraftLengths(seed=7),
                                ragged_rows=ragged, **SQUEEZE)
    held, widths, masks, mixed_widths = {}, [], [], []  # request id -> drafts it holds; V of each step; keys' masks
    ragged_steps = []  # decode-only steps whose rows were not G (1 + V)

    def check(step, graph_key):
        if step.num_decode:  # with or without prefill chunks
            expected = max(held[request_id] for request_id in step.request_ids[: step.num_decode])
            drafts = [held[request_id] for request_id in step.request_ids[: step.num_decode]]
            assert step.verify_width == expected, (step.verify_width, expected)
            assert list(step.host_verify_lengths) == drafts
            G = step.dimensions.request_count
            assert step.logits_indices.shape[0] == G * (1 + expected)
            rows = step.host_query_lengths[: step.num_decode].tolist()
            assert rows == ([1 + d for d in drafts] if ragged else [1 + expected] * len(drafts)), rows
            starts = step.host_query_start_loc.tolist()
            logits = [starts[r] + min(j, rows[r] - 1) for r in range(len(drafts)) for j in range(1 + expected)]
            assert step.logits_indices[: len(logits)].tolist() == logits
            full = step.dimensions.token_count == G * (1 + expected)
            if step.num_prefill == 0:
                assert step.attention.max_query_len == 1 + expected
                if ragged:
                    assert step.dimensions.token_count in ragged_token_counts(G, expected)
                    assert step.dimensions.token_count >= sum(rows)
                    ragged_steps.append(not full)
                else:
                    assert full
            else:
                mixed_widths.append(expected)
            assert graph_key is None or graph_key[3] == expected
            if graph_key is not None:
                fewest = min(drafts)
                # a step with prefill chunks masks at any V > 0 (one graph per mixed shape and tier), a
                # decode-only step at a ragged token count below the tier always (the one graph warmed up)
                assert graph_key[5] == (fewest < expected or (step.num_prefill > 0 and expected > 0) or
                                        (step.num_prefill == 0 and not full)), (graph_key, fewest)
                masks.append(graph_key[5])
            widths.append(expected)
        else:
            assert step.verify_width == MTP_DEPTH  # no decode request: S (one logits row per final chunk)
            if step.num_prefill and graph_key is not None:
                assert graph_key[5], graph_key  # masked: the variant warmup() captures of a mixed shape
        sampling = step.request_ids[: step.num_sampling_requests]
        held.update(zip(sampling, step.host_draft_lengths[: len(sampling)]))

    controller.on_launch = check  # the documented debug hook
    assert run(controller, ARRIVALS)[1] == plain[1]
    assert set(widths) == set(range(MTP_DEPTH + 1))  # every tier ran, plain width included
    assert len(set(mixed_widths)) > 1, mixed_widths  # steps with prefill chunks change tier too
    assert True in masks and False in masks, masks
    changes = sum(a != b for a, b in zip(widths, widths[1:]))
    assert changes >= len(widths) // 3, widths
    assert (True in ragged_steps) == ragged, ragged_steps


def test_mixed_steps_verify_their_own_tier_under_a_queue(mtp_model, torch_twins):
    """A request joins nearly every step: most steps carry prefill chunks beside decode requests,
    and each verifies V = the most drafts its decode requests hold (every tier 0..S occurs, with
    paged MTP's windows run on them), with KV pressure and padded steps; the output stays plain
    decoding's, greedy and sampled."""
    expected = run(controller_for(mtp_model, 0), QUEUED)[1]
    controller = controller_for(mtp_model, MTP_DEPTH, MTPProposer("paged"), CheckedRandomLengths(seed=5),
                                **SQUEEZE)
    controller.on_launch = tiers = MixedTiers(MTP_DEPTH)
    assert run(controller, QUEUED)[1] == expected
    assert tiers.every_tier(), tiers.widths


class CountingDrafter(Proposer):
    """Drafts token 0 at every depth; records the depths each ``propose`` call was asked for."""

    def __init__(self):
        self.depths = []

    def propose(self, batch):
        self.depths.append(batch.num_drafts)
        return torch.zeros(batch.num_requests, self.draft_context.shape.num_speculative_tokens, dtype=torch.int64)

    def on_no_drafts(self, batch):  # stateless: nothing to keep
        pass


def test_all_zero_steps_run_no_draft_phase_and_depths_follow_the_longest(mtp_model, plain, torch_twins):
    proposer = CountingDrafter()
    assert run(controller_for(mtp_model, 3, proposer, ZeroLengths()), ARRIVALS)[1] == plain[1]
    assert proposer.depths == []
    proposer, policy = CountingDrafter(), RandomDraftLengths(seed=6)
    assert run(controller_for(mtp_model, 3, proposer, policy, decode_steps_per_launch=4), ARRIVALS)[1] == plain[1]
    assert proposer.depths and 0 not in proposer.depths
    assert sorted(set(proposer.depths)) == sorted({int(lengths.max()) for lengths in policy.chosen
                                                   if lengths.size and lengths.max() > 0})


def test_sampling_params_cap(mtp_model, torch_twins):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)
    with pytest.raises(TypeError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=1.5)
    arrivals = [(0, prompt, SamplingParams(max_new_tokens=6, num_speculative_tokens=cap))
                for (_, prompt, _), cap in zip(ARRIVALS[:3], (0, 1, 7))]
    expected = run(controller_for(mtp_model, 0), arrivals)[1]
    controller = controller_for(mtp_model, MTP_DEPTH, policy=FixedDraftLength())
    assert run(controller, arrivals)[1] == expected
    counts = controller.metrics.as_dict()["draft_length_counts"]
    assert counts[0] > 0 and counts[1] > 0 and counts[MTP_DEPTH] > 0 and counts[2] == 0


def test_caps_of_requests_aborted_before_any_step_leave_the_others_caps(mtp_model, torch_twins):
    """A request's cap is written with the next step's lookup (in one batch): requests capped and
    aborted while queued, before any step, leave no row behind, and the others verify at most their
    own caps (1 and 0 here: no step verifies 2 drafts or more)."""
    caps = (1, 0, 0, 1, 1, 0)
    arrivals = [(0, prompt, SamplingParams(max_new_tokens=6, num_speculative_tokens=cap))
                for (_, prompt, _), cap in zip(ARRIVALS * 2, caps)]
    controller = controller_for(mtp_model, MTP_DEPTH, policy=FixedDraftLength())
    ids = [controller.add_request(prompt, params) for _, prompt, params in arrivals]
    for request_id in ids[:3]:
        controller.abort_request(request_id)
    while controller.has_unfinished_requests():
        controller.step()
    kept = ids[3:]
    expected = run(controller_for(mtp_model, 0), arrivals[3:])[1]
    assert [controller.result(request_id).output_tokens for request_id in kept] == expected
    counts = controller.metrics.as_dict()["draft_length_counts"]
    assert counts[1] > 0 and counts[0] > 0 and sum(counts[2:]) == 0


class EveryFourSteps(CheckedRandomLengths):
    """Random lengths, a choice held for up to 4 steps of the same batch (``decide_every``)."""

    decide_every = 4

    def __init__(self):
        super().__init__(seed=8, all_zero=0.2)
        self.steps = []  # query.steps of each choice

    def choose(self, query):
        self.steps.append(query.steps)
        return super().choose(query)


def test_a_choice_holds_while_the_batch_is_unchanged(mtp_model, plain, torch_twins):
    """The policy is asked only when the batch changed or its choice served ``decide_every`` steps;
    its outcomes come in batches, each paired with the lengths verified (CheckedRandomLengths),
    and the output stays plain decoding's."""
    policy = EveryFourSteps()
    controller = controller_for(mtp_model, MTP_DEPTH, MTPProposer("paged"), policy, **SQUEEZE)
    assert run(controller, ARRIVALS)[1] == plain[1]
    assert 4 in policy.steps and max(policy.steps) == 4  # held for 4 steps, never longer
    assert len(policy.steps) < controller.metrics.steps and policy.outcomes


def test_goodput_holds_nothing_for_requests_that_left(mtp_model, plain, torch_twins):
    """With overlap a finished request's last step is applied after the policy forgot it: that late
    outcome must not give it a row back (the policy's work per choice would grow with every request
    ever served). A forgotten request reads as one never seen."""
    policy = GoodputPolicy(decide_every=1)
    controller = controller_for(mtp_model, MTP_DEPTH, MTPProposer("paged"), policy, **SQUEEZE)
    ids, outputs = run(controller, ARRIVALS)
    assert outputs == plain[1]
    never_seen = policy.acceptance(10_000)
    for request_id in ids:
        assert np.array_equal(policy.acceptance(request_id), never_seen), request_id


def test_goodput_learns_step_costs_from_the_loop(mtp_model, plain, torch_twins):
    """The loop's steady steps reach the policy's cost model (wall seconds per step by grid and
    depths; no GPU time on the CPU), and the output stays plain decoding's."""
    policy = GoodputPolicy(decide_every=2)
    controller = controller_for(mtp_model, MTP_DEPTH, MTPProposer("paged"), policy, **SQUEEZE)
    assert run(controller, ARRIVALS)[1] == plain[1]
    assert policy.cost_model.wall and all(seconds > 0 for seconds in policy.cost_model.wall.values())
    assert not policy.cost_model.gpu  # off CUDA: no warm-up seed, no CUDA events
    assert {grid for grid, _ in policy.cost_model.wall} <= {2, 4}  # the padded grids (SQUEEZE's graph sizes)
    assert 0 < policy.cost_model.mixed_share < 1  # the share of launches with prefill chunks (requests joined)


def test_single_position_drafting_reads_no_stale_row_of_a_padded_entry(mtp_model, torch_twins):
    """Single-position MTP gathers each grid entry's last accepted hidden row; an entry that samples
    nothing this step (graph padding, a prompt chunk that ends no prompt) keeps the row an earlier,
    larger step left it, past this step's rows. Random lengths on graph-padded grids (padded on the
    CPU too), a request joining late: outputs equal plain decoding's."""
    arrivals = ((0, PROMPTS[2], SamplingParams(max_new_tokens=5)), (4, PROMPTS[1], SamplingParams(max_new_tokens=9)))
    fields = dict(max_requests=6, block_size_tokens=8, max_model_len=38, max_tokens_per_step=18,
                  overlap_scheduling=False, prefix_caching=False, cuda_graph_batch_sizes=(3, 4))
    expected = run(controller_for(mtp_model, 0, **fields), arrivals)[1]
    controller = controller_for(mtp_model, 2, MTPProposer("single_position"), RandomDraftLengths(seed=369), **fields)
    assert run(controller, arrivals)[1] == expected


class ZeroNowJoinAtTwo(DraftLengthPolicy):
    """Drafts nothing for the requests it is asked about; requests joining its held choice draft 2."""

    decide_every = 8
    per_request_lengths = True

    def choose(self, query):
        return np.zeros_like(query.caps)

    def join_length(self):
        return 2


def test_a_step_that_samples_nothing_leaves_the_held_choice_alone(mtp_model, torch_twins):
    """A step whose only request is a prompt chunk that ends no prompt has no lengths to choose: the
    held choice (not uniform: its depth 2 is the joins', its requests draft 0) stays as it was, and
    the next step's requests take their lengths from it."""
    arrivals = ((0, PROMPTS[0], SamplingParams(max_new_tokens=3)),
                (5, tuple(range(1, 21)), SamplingParams(max_new_tokens=4)))  # 20 prompt tokens: two chunks
    fields = dict(max_model_len=32, max_tokens_per_step=12, overlap_scheduling=False, prefix_caching=False)
    expected = run(controller_for(mtp_model, 0, **fields), arrivals)[1]
    assert run(controller_for(mtp_model, 2, policy=ZeroNowJoinAtTwo(), **fields), arrivals)[1] == expected
