"""Skipped MTP windows caught up exactly (``InferenceConfig(mtp_idle_windows="skip")``,
``controllers/mtp_catch_up.py``): with a policy that gives runs of no-draft steps, or a draft depth
D that changes every step, the MTP proposer drafts the same tokens with the windows of the depths
past D skipped as with them run (greedy and seeded sampling), under churn, preemption, padded
steps, decode runs, prefix caching and a request paused while behind; the output is plain
decoding's; no-draft decode-only steps run no depth except a forced catch-up. The launch plans
(``WindowCatchUp``): lags per depth, forced catch-ups at M, the fixed-S shapes' plans."""

import dataclasses
import types

import numpy as np
import pytest

from mtp_ctrl.controllers import MTPProposer, SamplingParams
from mtp_ctrl.controllers.graph_warmup import NO_DRAFT_PHASE
from mtp_ctrl.controllers.mtp_catch_up import SKIP, WindowCatchUp
from tests.unit.controller_fixtures import MTP_DEPTH
from tests.unit.draft_length_fixtures import (ARRIVALS, SQUEEZE, BurstyLengths, RandomDepths,  # noqa: F401
                                              RetiringDepths, controller_for, mtp_model, plain)  # module fixtures


class RecordingMTP(MTPProposer):
    """Records every draft row of a sampling request: (request id, e, drafts of the step's D depths);
    counts the decode-only steps that ran the windows while nobody drafted; records each launch's
    (D, plan), and ``clock()`` beside it; and each scheduled step's (decode-only, clock, whether the
    launch reached the proposer's draft phase: ``propose`` or ``on_no_drafts``)."""

    def __init__(self, clock=None, **options):
        super().__init__("paged", **options)
        self.drafts, self.idle_windows, self.plans = [], 0, []
        self.clock, self.clocks = clock, []  # clock(): a value recorded with each launch's plan
        self.scheduled, self._draft_phase_ran, self._run_steps_seen = [], False, 0

    def on_no_drafts(self, batch):
        self._draft_phase_ran = True
        super().on_no_drafts(batch)

    def on_step_scheduled(self, step):
        self.scheduled.append((step.decode_only, None if self.clock is None else self.clock(), self._draft_phase_ran))
        self._run_steps_seen += 1
        if self._run_steps_seen == step.num_steps:  # once a launch: every step of a decode run was scheduled
            self._draft_phase_ran, self._run_steps_seen = False, 0
        super().on_step_scheduled(step)

    def launches_without_draft_phase(self, after=None):
        """Decode-only steps (scheduled with the clock at ``after`` or later) whose launch ran no draft
        phase, and those that ran one."""
        steps = [ran for decode_only, clock, ran in self.scheduled
                 if decode_only and (after is None or clock >= after)]
        return steps.count(False), steps.count(True)

    def plan_launch(self, step):
        plan = super().plan_launch(step)
        self.plans.append((step.num_drafts, step.decode_only, plan))
        if self.clock is not None:
            self.clocks.append(self.clock())
        return plan

    def propose(self, batch):
        self._draft_phase_ran = True
        drafts = super().propose(batch)
        step, depths = batch.step, batch.depths(MTP_DEPTH)
        if depths == 0:
            self.idle_windows += step.num_prefill == 0
            return drafts
        count = step.num_sampling_requests
        ends = batch.bonus_positions[:count].tolist()  # host-ok: CPU test
        self.drafts += list(zip(step.request_ids[:count], ends, drafts[:count, :depths].tolist()))
        return drafts


def pause_some(controller, ids):
    """Pause the first request that is live and not paused already (KV pressure pauses some); its id."""
    for request_id in ids:
        try:
            controller.pause_request(request_id)
            return request_id
        except ValueError:  # finished, or already paused
            continue
    return None


def drive(controller, pause_at=None, arrivals=ARRIVALS):
    """``arrivals`` through ``controller``; with ``pause_at``, a live request is paused at that step for
    three steps (it keeps its slot, and how far its windows fell behind). Returns the outputs."""
    ids, step, paused = [None] * len(arrivals), 0, None
    while step == 0 or controller.has_unfinished_requests() or None in ids:
        for index, (arrival_step, prompt, params) in enumerate(arrivals):
            if arrival_step == step:
                ids[index] = controller.add_request(prompt, params)
        if step == pause_at:
            paused = pause_some(controller, ids)
        elif pause_at is not None and step == pause_at + 3 and paused is not None:
            controller.resume_request(paused)
        controller.step()
        step += 1
    return [controller.result(request_id).output_tokens for request_id in ids]


@pytest.mark.parametrize("catch_up_positions,steps_per_launch,pause_at,overlap,prefix_caching,depths", [
    (8, 1, 4, True, False, False),  # M = 8; a request paused while behind
    (2, 1, None, False, True, True),  # forced catch-ups; prefix caching (window floors, recomputed requests)
    (4, 4, 2, True, True, True),  # decode runs (a launch plans each of its steps), D changes every step,
    # a pause, prefix caching
])
def test_skipped_windows_draft_what_run_windows_draft(mtp_model, plain, torch_twins, catch_up_positions,
                                                      steps_per_launch, pause_at, overlap, prefix_caching, depths):
    """``depths``: a depth D in [0, S] each step (``RandomDepths``: depths past D skipped), else
    runs of no-draft steps (``BurstyLengths``)."""
    recorded = {}
    for skip in (False, True):
        proposer = RecordingMTP(skip_idle_windows=skip, catch_up_positions=catch_up_positions)
        policy = (RandomDepths if depths else BurstyLengths)(seed=catch_up_positions)
        controller = controller_for(mtp_model, MTP_DEPTH, proposer, policy,
                                    decode_steps_per_launch=steps_per_launch, overlap_scheduling=overlap,
                                    prefix_caching=prefix_caching, **SQUEEZE)
        launched = {}  # graph key -> a padded step launched with it
        controller.on_launch = lambda step, key: launched.setdefault(key, step) if key is not None else None
        assert drive(controller, pause_at) == plain[1]
        recorded[skip] = proposer
        plans = set()
        for key, step in launched.items():  # warm-up captures the plan of every padded step (a graph per plan)
            padding = controller.context.build_padding_step(step.dimensions, step.num_steps, step.num_drafts,
                                                            step.verify_width)
            no_draft_phase = key[6] == NO_DRAFT_PHASE and step.decode_only and key[3] == key[4] == 0
            assert no_draft_phase or key[6] in proposer.warmup_plans(padding), (key, step.num_prefill)
            plans.add(key[6])
        assert len(plans) >= (3 if skip else 1) and (None in plans) != skip, plans
        if pause_at is None:
            assert any(controller.result(rid).preemptions for rid in range(len(ARRIVALS)))  # KV pressure
    run, skipped = recorded[False], recorded[True]
    assert len(run.drafts) > 8 and run.drafts == skipped.drafts  # token for token, sampled requests too
    assert run.idle_windows > 0 and skipped.idle_windows < run.idle_windows  # forced catch-ups only
    assert all(plan is None for _, _, plan in run.plans)
    partial = [(drafts, plan) for drafts, decode_only, plan in skipped.plans if any(0 < d < MTP_DEPTH for d, _ in plan)]
    assert all(d in (drafts, MTP_DEPTH) for drafts, plan in partial for d, _ in plan)  # D' = D, or all S
    if depths:  # decode-only steps that drafted 0 < D < S skipped the deeper depths, some of them behind
        assert partial and any(rows > 0 for _, plan in partial for d, rows in plan if 0 < d < MTP_DEPTH), partial


@pytest.mark.parametrize("opted_out", [(0, 2, 4), (0, 1, 2, 3, 4, 5)])
def test_requests_that_never_draft_are_never_caught_up(mtp_model, plain, torch_twins, opted_out):
    """Requests with ``num_speculative_tokens=0`` never draft, so their skipped windows are never
    caught up: with every request opted out, no decode-only launch runs an MTP depth (M = 2 forces a
    catch-up every other step otherwise), nor any launch with prompt chunks; with some opted out, the
    others draft what they draft with
    every window run (their catch-ups stay exact). The output is plain decoding's either way, under
    preemption and padded steps."""
    arrivals = tuple((step, prompt, dataclasses.replace(params, num_speculative_tokens=0) if index in opted_out
                      else params) for index, (step, prompt, params) in enumerate(ARRIVALS))
    recorded = {}
    for skip in (False, True):
        proposer = RecordingMTP(skip_idle_windows=skip, catch_up_positions=2)
        controller = controller_for(mtp_model, MTP_DEPTH, proposer, RandomDepths(seed=3), **SQUEEZE)
        assert drive(controller, arrivals=arrivals) == plain[1]
        recorded[skip] = proposer
    # the draft rows of the requests that may draft (an opted-out request's rows, drafted beside them
    # up to the step's D, are masked: it verifies none)
    run, skipped = ([row for row in recorded[skip].drafts if row[0] not in opted_out] for skip in (False, True))
    assert run == skipped
    decode_depths = [d for _, decode_only, plan in recorded[True].plans if decode_only for d, _ in plan]
    if len(opted_out) == len(ARRIVALS):
        # no decode-only launch reaches the proposer (no draft phase: no window, no forced catch-up)
        for skip in (False, True):
            without, with_draft_phase = recorded[skip].launches_without_draft_phase()
            assert without > 4 and with_draft_phase == 0
        assert not decode_depths
        # nor any window of a prompt (no prefix caching: nothing would read them)
        assert not any(d for _, _, plan in recorded[True].plans for d, _ in plan)
    else:
        assert len(run) > 4 and any(decode_depths)


@pytest.mark.parametrize("all_retired,prefix_caching", [(True, False), (False, True)])
def test_retired_requests_never_draft_and_are_never_caught_up(mtp_model, plain, torch_twins, all_retired,
                                                               prefix_caching):
    """A policy retires requests from speculation mid-run (``DraftLengthPolicy.retiring``): each
    verifies no draft once the drafts in flight are verified (at most two outcomes), also after a
    preemption; the others draft what they draft with every window run; with every request retired
    (and the later ones admitted retired) no decode-only launch from the retiring one on runs an MTP
    depth (M = 2 forces a catch-up every other step otherwise). The output is plain decoding's, under
    preemption, padded steps and sampling."""
    recorded, policies = {}, {}
    for skip in (False, True):
        policy = RetiringDepths(seed=5, retire_at=4, all_retired=all_retired)
        proposer = RecordingMTP(skip_idle_windows=skip, catch_up_positions=2, clock=lambda: policy.choices)
        controller = controller_for(mtp_model, MTP_DEPTH, proposer, policy, prefix_caching=prefix_caching, **SQUEEZE)
        launched = {}  # graph key -> a padded step launched with it
        controller.on_launch = lambda step, key: launched.setdefault(key, step) if key is not None else None
        assert drive(controller) == plain[1]
        for key, step in launched.items():  # warm-up captures every plan launched (a graph per plan)
            padding = controller.context.build_padding_step(step.dimensions, step.num_steps, step.num_drafts,
                                                            step.verify_width)
            no_draft_phase = key[6] == NO_DRAFT_PHASE and step.decode_only and key[3] == key[4] == 0
            assert no_draft_phase or key[6] in proposer.warmup_plans(padding), (key, step.num_prefill)
        recorded[skip], policies[skip] = proposer, policy
        assert policy.retired and all(count <= 2 for count in policy.drafted_after.values()), policy.drafted_after
    run, skipped = recorded[False], recorded[True]
    retired = policies[True].retired
    assert [row for row in run.drafts if row[0] not in retired] == \
        [row for row in skipped.drafts if row[0] not in retired]
    after = [plan for (_, decode_only, plan), choices in zip(skipped.plans, skipped.clocks)
             if decode_only and choices >= policies[True].retire_at]
    if all_retired:  # once the drafts in flight are verified, no decode-only launch runs a draft phase
        assert not any(depths for plan in after for depths, _ in plan)  # no depth runs, no catch-up
        without, with_draft_phase = skipped.launches_without_draft_phase(after=policies[True].retire_at + 1)
        assert without > 4 and with_draft_phase == 0, (without, with_draft_phase)
    else:
        assert any(depths for plan in after for depths, _ in plan)  # the others still draft


def test_a_skipped_prompt_chunk_leaves_the_next_chunks_window_its_bound(mtp_model, torch_twins):
    """A never-drafting request's first prompt chunk runs beside never-drafting decodes only (no
    MTP window: SKIP), its last beside a drafting request's prompt (windows run): its window spans
    that chunk and S, not the whole prompt so far (which overflowed the step's window rows). Output
    == plain decoding, with windows skipped and run."""
    long_prompt = np.random.default_rng(0).integers(0, 90, 20).tolist()
    arrivals = ((0, [17, 3, 58], SamplingParams(max_new_tokens=30, num_speculative_tokens=0)),
                (1, long_prompt, SamplingParams(max_new_tokens=6, num_speculative_tokens=0)),
                (2, [10, 20, 30, 40, 50, 60, 70, 11], SamplingParams(max_new_tokens=12)))
    fields = dict(max_model_len=64, max_tokens_per_step=20)
    expected = drive(controller_for(mtp_model, 0, **fields), arrivals=arrivals)
    for idle_windows in ("run", "skip"):
        proposer = RecordingMTP(skip_idle_windows=idle_windows == "skip")
        controller = controller_for(mtp_model, MTP_DEPTH, proposer, mtp_idle_windows=idle_windows, **fields)
        assert drive(controller, arrivals=arrivals) == expected
    mixed_skips = [plan for _, decode_only, plan in proposer.plans if not decode_only and plan == (SKIP,)]
    assert mixed_skips  # the first chunk's step ran no window


def test_catch_up_positions_is_checked(mtp_model):
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="catch_up_positions"):
            MTPProposer("paged", skip_idle_windows=True, catch_up_positions=bad)
    with pytest.raises((TypeError, ValueError), match="mtp_catch_up_positions"):
        controller_for(mtp_model, MTP_DEPTH, mtp_catch_up_positions=0)


def steps(num_drafts, verify_width, slots=(0, 1), num_steps=1, decode_only=True):
    """What ``WindowCatchUp`` reads of a StepMetadata (host values): ``slots``' requests decode (beside
    a prefill chunk unless ``decode_only``)."""
    return types.SimpleNamespace(num_drafts=num_drafts, verify_width=verify_width, num_steps=num_steps,
                                 decode_only=decode_only, host_slot_ids=np.asarray(slots, np.int64),
                                 num_decode=len(slots))


def test_window_plans_keep_a_lag_per_depth_and_force_a_catch_up_at_m():
    S, M = 3, 8
    catch_up = WindowCatchUp(num_slots=5, num_depths=S, capacity=M)
    assert catch_up.plan_launch(steps(1, 1)) == ((1, 0),)  # depths 1, 2 skipped: 2 positions behind
    assert catch_up.lags(0) == catch_up.lags(1) == (0, 2, 2) and catch_up.lags(2) == (0, 0, 0)
    assert catch_up.plan_launch(steps(2, 1)) == ((2, 8),)  # depth 1 catches up (M rows more)
    assert catch_up.lags(0) == (0, 0, 4)
    assert catch_up.plan_launch(steps(0, 2, slots=(0,))) == (SKIP,)  # D = 0 as before: 3 more positions
    assert catch_up.lags(0) == (3, 3, 7) and catch_up.lags(1) == (0, 0, 4)
    assert catch_up.plan_launch(steps(1, 1)) == ((S, 8),)  # 7 + 2 > M: a forced catch-up of every depth
    assert catch_up.lags(0) == catch_up.lags(1) == (0, 0, 0)
    assert catch_up.plan_launch(steps(2, 2, num_steps=4)) == ((2, 0), (2, 0), (S, 8), (2, 0))  # a decode run
    assert catch_up.lags(0) == (0, 0, 3)
    assert catch_up.plan_launch(steps(1, 1, decode_only=False)) == ((S, 8),)  # prefill chunks: every depth
    assert catch_up.lags(0) == (0, 0, 0)
    assert catch_up.plan_launch(steps(S, S)) == ((S, 0),) and catch_up.lags(1) == (0, 0, 0)


def test_warmup_plans_fixed_s_unchanged_and_skipped_depths_enumerated():
    S, M = 2, 8
    catch_up = WindowCatchUp(num_slots=3, num_depths=S, capacity=M)
    assert catch_up.warmup_plans(steps(S, S)) == (((S, 0),), ((S, M),))  # the fixed S policy takes the first
    assert catch_up.warmup_plans(steps(S, 1, decode_only=False))[0] == ((S, 0),)
    assert catch_up.warmup_plans(steps(0, 1)) == ((SKIP,), ((S, M),))  # D = 0: skip, forced catch-up
    assert catch_up.warmup_plans(steps(1, 1)) == (((1, 0),), ((1, M),), ((S, M),))  # the steady plan first
    run_plans = catch_up.warmup_plans(steps(1, 1, num_steps=3))
    assert run_plans[0] == ((1, 0),) * 3 and ((1, 0), (1, 0), (S, M)) in run_plans
    assert len(set(run_plans)) == len(run_plans)


def test_one_step_launches_plan_and_lag_as_a_decode_run_of_them():
    """A launch of one step (its own fast path) plans and moves the lags as a decode run of the
    same steps does, from random lags (requests that joined at different steps)."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        S, M = int(rng.integers(1, 4)), int(rng.integers(4, 17))
        single, run = (WindowCatchUp(num_slots=6, num_depths=S, capacity=M) for _ in range(2))
        seed = int(rng.integers(1 << 30))
        for catch_up in (single, run):  # the same history: random launches over random slots
            history = np.random.default_rng(seed)
            for _ in range(int(history.integers(0, 6))):
                slots = history.choice(5, size=int(history.integers(1, 6)), replace=False)
                catch_up.plan_launch(steps(int(history.integers(0, S + 1)), int(history.integers(0, S + 1)),
                                           slots=slots, decode_only=bool(history.random() < 0.8)))
        slots = rng.choice(5, size=int(rng.integers(1, 6)), replace=False)
        drafts, width, count = int(rng.integers(0, S + 1)), int(rng.integers(0, S + 1)), int(rng.integers(1, 5))
        plans = [single.plan_launch(steps(drafts, width, slots=slots))[0] for _ in range(count)]
        assert tuple(plans) == run.plan_launch(steps(drafts, width, slots=slots, num_steps=count))
        assert [single.lags(slot) for slot in range(6)] == [run.lags(slot) for slot in range(6)]


class EagerLags:
    """The lag bookkeeping written out per slot and step (the rule ``WindowCatchUp`` keeps, with
    no shortcut): a launch plans from its decode slots' largest lags, then each of its steps resets
    the depths it ran for every slot of the launch and moves the others on by ``1 + V``; a launch
    that drafts nothing, none of whose slots may ever draft, runs no window."""

    def __init__(self, num_slots, S, M):
        self.lags, self.S, self.planner = np.zeros((num_slots, S), np.int64), S, WindowCatchUp(1, S, M)
        self.may_draft = np.ones(num_slots, bool)  # a slot whose request never drafts plans nothing

    def set_may_draft(self, slot, may_draft):
        if self.may_draft[slot] != may_draft:
            self.may_draft[slot], self.lags[slot] = may_draft, 0

    def plan_launch(self, step):
        decode = step.host_slot_ids[: step.num_decode]
        decode = decode[self.may_draft[decode]]
        if step.num_drafts == 0 and not self.may_draft[step.host_slot_ids].any():  # nobody drafts, or ever will
            return (SKIP,) * step.num_steps  # (each admitted so here: prompt windows skipped too)
        plan = self.planner.plan(step, self.lags[decode].max(axis=0) if decode.shape[0] else [0] * self.S)
        for run, _ in plan:
            for slot in step.host_slot_ids:
                self.lags[slot, :run] = 0
                self.lags[slot, run:] += 1 + step.verify_width
        return plan


@pytest.mark.parametrize("never_drafting", [False, True])
def test_steady_launches_plan_and_lag_as_every_slot_written_out(never_drafting):
    """Launches of the same slots step after step take a shortcut (one lag for all of them); plans
    and lags equal the per-slot bookkeeping's over random histories: slot sets repeated, shrunk and
    changed, prefill chunks, decode runs, random depths and widths, lags read at random points.
    ``never_drafting``: slots also take requests that never draft (``set_may_draft``), whose lags
    plan nothing (their own lags are not compared: nothing reads them)."""
    rng = np.random.default_rng(11 + never_drafting)

    def compare_lags(lazy, eager, num_slots):
        slots = [slot for slot in range(num_slots) if eager.may_draft[slot]]
        assert [lazy.lags(slot) for slot in slots] == [tuple(eager.lags[slot].tolist()) for slot in slots]

    for _ in range(150):
        S, M, num_slots = int(rng.integers(1, 4)), int(rng.integers(2, 17)), 7
        lazy, eager = WindowCatchUp(num_slots=num_slots, num_depths=S, capacity=M), EagerLags(num_slots, S, M)
        slots = rng.choice(num_slots, size=int(rng.integers(1, num_slots + 1)), replace=False)
        for _ in range(int(rng.integers(5, 40))):
            change = rng.random()
            if never_drafting and rng.random() < 0.15:  # a slot takes a request that never drafts, or one that may
                slot, may_draft = int(rng.integers(num_slots)), bool(rng.random() < 0.5)
                lazy.set_may_draft(slot, may_draft)
                eager.set_may_draft(slot, may_draft)
            if change < 0.15:  # another set of slots
                slots = rng.choice(num_slots, size=int(rng.integers(1, num_slots + 1)), replace=False)
            elif change < 0.25 and slots.shape[0] > 1:  # a request finished
                slots = np.delete(slots, int(rng.integers(slots.shape[0])))
            decode_only = bool(rng.random() < 0.85)
            step = steps(int(rng.integers(0, S + 1)), int(rng.integers(0, S + 1)), slots=slots,
                         num_steps=int(rng.integers(1, 4)) if rng.random() < 0.2 else 1, decode_only=decode_only)
            if not decode_only:  # the last requests bring prefill chunks
                step.num_decode = int(rng.integers(0, slots.shape[0]))
            assert lazy.plan_launch(step) == eager.plan_launch(step)
            if rng.random() < 0.2:
                compare_lags(lazy, eager, num_slots)
        compare_lags(lazy, eager, num_slots)
