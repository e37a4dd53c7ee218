"""What the goodput policy pays for a step and what it optimises (issue 34): the loop's wall time
per step between ``step()`` returns (an injected clock, no timing thresholds), which calls are
samples, every depth measured before it is judged (exploration), and the drain objective of a
batch nobody waits to join (the expected steps of its slowest request)."""

import types

import numpy as np
import pytest

from mtp_ctrl.controllers import SamplingParams
from mtp_ctrl.controllers import controller as controller_module
from mtp_ctrl.controllers.draft_lengths import REALISED_EVERY, TIMING_EVERY, DraftLengths
from mtp_ctrl.controllers.draft_estimates import expected_drain_steps
from mtp_ctrl.controllers.draft_policy import DraftLengthQuery, GoodputPolicy
from mtp_ctrl.controllers.step_costs import StepCostModel
from mtp_ctrl.state import EngineShape
from tests.unit.controller_fixtures import MTP_DEPTH, PROMPTS, OracleProposer, build_models
from tests.unit.draft_length_fixtures import controller_for
from tests.unit.megatron_fixtures import ensure_single_process_groups

S = 3
SHAPE = EngineShape(max_requests=64, max_model_len=128, block_size_tokens=4, num_speculative_tokens=S,
                    max_tokens_per_step=256)
# the 1B model's measured wall ms per step at batch 64 (bench/RESULTS.md, tiers3): D = 0..3
COSTS_1B = {0: 1.24e-3, 1: 1.46e-3, 2: 1.55e-3, 3: 1.61e-3}


def policy_with(rates, costs=COSTS_1B, grid=64, **kwargs):
    """A goodput policy whose request i accepts each draft with ``rates[i]`` (expected counts of 40
    full-length verifies) and whose cost model measured ``costs`` at ``grid``."""
    policy = GoodputPolicy(**kwargs)
    policy.bind(SHAPE)
    ids = np.arange(len(rates), dtype=np.int64)
    for depth, seconds in costs.items():
        policy.cost_model.record(grid, depth, wall_seconds=seconds, gpu_seconds=None)
    policy.choose(DraftLengthQuery(ids, np.full(len(rates), S), S, grid))  # rows for the requests
    rates = np.asarray(rates)[:, None]  # [n, 1]
    a = np.arange(S + 1)[None, :]  # accepted drafts
    counts = np.round(rates ** a * np.where(a < S, 1 - rates, 1.0) * 10).astype(np.int64).ravel()  # [n * (S + 1)]
    outcomes = (np.repeat(np.repeat(ids, S + 1), counts), np.tile(a[0], len(ids)).repeat(counts))
    for _ in range(40):
        policy.observe(outcomes[0], np.full(outcomes[0].shape, S), outcomes[1])
    return policy, ids


def drain_query(ids, grid=64, waiting=0, left=48):
    return DraftLengthQuery(ids, np.full(ids.shape[0], S), S, grid, 1, waiting, np.full(ids.shape[0], left))


def test_a_closed_batch_of_low_acceptance_drafts_nothing_a_queued_one_drafts():
    """0.2 acceptance at batch 64 (the 1B's costs): per step D = 1 is worth it (1.2 tokens for 1.18x
    the cost), but the batch ends with its slowest request (~45 steps at D = 1 against 48), so a
    batch nobody waits to join finishes sooner at D = 0. With requests waiting, tokens per second
    (a gain of 1.9 %: within the default margin ``min_gain`` = 1.02, which keeps the fewer drafts)."""
    policy, ids = policy_with([0.2] * 64, min_gain=1.0, switch_gain=1.0)  # each choice on its own
    assert policy.choose(drain_query(ids)).tolist() == [0] * 64
    assert policy.choose(drain_query(ids, waiting=5)).tolist() == [1] * 64
    margin, ids = policy_with([0.2] * 64)
    assert margin.choose(drain_query(ids, waiting=5)).tolist() == [0] * 64
    mixed, ids = policy_with([0.9, 0.6, 0.2] * 21 + [0.9])  # the 0.2 requests set the end
    assert mixed.choose(drain_query(ids)).tolist() == [0] * 64
    assert mixed.choose(drain_query(ids, waiting=5)).tolist() == [S] * 64
    high, ids = policy_with([0.9] * 64)
    assert high.choose(drain_query(ids)).tolist() == [S] * 64
    off, ids = policy_with([0.2] * 64, drain_objective=False, min_gain=1.0)
    assert off.choose(drain_query(ids)).tolist() == [1] * 64


def test_expected_drain_steps_matches_a_simulation():
    """The normal approximation against sampled batches (64 requests, 48 tokens each, the step's
    accepted drafts drawn per request): within 3 %, and D = 0 takes exactly the tokens left."""
    rng = np.random.default_rng(0)
    rates = np.array([0.9, 0.6, 0.2] * 21 + [0.2])
    reach = np.cumprod(np.repeat(rates[:, None], S, axis=1), axis=1)  # [64, S]
    caps = np.full(64, S)
    caps[:8] = 1  # capped requests draft min(D, cap)
    model = expected_drain_steps(np.full(64, 48), reach, caps, S)
    assert abs(model[0] - 48) < 0.2
    trials = 300
    for depth in range(1, S + 1):
        drafts = np.minimum(depth, caps)  # [64]
        left, steps = np.full((trials, 64), 48), np.zeros(trials)
        while (left > 0).any():
            hits = rng.random((trials, 64, S)) < rates[None, :, None]
            accepted = np.where(hits.all(axis=2), S, hits.argmin(axis=2))  # leading drafts accepted
            steps += (left > 0).any(axis=1)
            left = left - 1 - np.minimum(accepted, drafts)
        assert abs(model[depth] / steps.mean() - 1) < 0.03, (depth, model[depth], steps.mean())


def test_every_depth_is_measured_before_it_is_judged():
    """Seeds say drafting is free; every depth the batch may take is run (one hold each, at most
    explore_tries) until the loop measured it, then the measured best is kept; explore_every steps
    after the last exploration each other depth is timed again once (retime_explored: the first
    measurements are a cold host's), the best-scoring first, then only the runner-up runs for one
    hold when it is within explore_within."""
    policy = GoodputPolicy(explore_every=4, explore_within=0.8)
    policy.bind(SHAPE)
    policy.cost_model.set_measured({(8, d): 1e-4 for d in range(S + 1)})  # warm-up replays: all alike
    ids = np.arange(8, dtype=np.int64)
    query = DraftLengthQuery(ids, np.full(8, S), S, 8)
    costs = {0: 1e-3, 1: 1.5e-3, 2: 5e-3, 3: 9e-3}  # the loop's wall times: drafting costs
    tried = []
    for _ in range(2 * (S + 1)):
        depth = int(policy.choose(query)[0])
        tried.append(depth)
        policy.cost_model.record(8, depth, wall_seconds=costs[depth], gpu_seconds=None)
        if all(policy.cost_model.is_measured(8, d) for d in range(S + 1)):
            break
    assert sorted(tried) == list(range(S + 1)), tried  # each depth once, none before it was needed
    assert tried[0] == S  # the most promising on its seed first
    picks = []
    for _ in range(24):
        picks.append(int(policy.choose(query)[0]))
        policy.cost_model.record(8, picks[-1], wall_seconds=costs[picks[-1]], gpu_seconds=None)
    assert picks[::4] == [1] * 6 and picks[1::4] == [1] * 6 and picks[2::4] == [1] * 6, picks  # D = 1 is best
    assert picks[3::4] == [0, 2, 3, 0, 0, 0], picks  # every other depth timed again once, then the runner-up
    capped = DraftLengthQuery(ids, np.full(8, 1), S, 16)  # a new grid, caps 1: only D <= 1 is run
    assert {int(policy.choose(capped)[0]) for _ in range(6)} <= {0, 1}


def test_a_depth_measured_dear_while_serving_starts_is_measured_afresh_soon():
    """Depth 2 is timed dear while serving starts (a cold host) and depth 1 wins; the runner-up
    comes back after 4 x decide_every steps (the wait then doubles), and its hold's first steady
    sample replaces the old estimate (``StepCostModel.remeasure``), so the policy returns to it."""
    policy = GoodputPolicy(decide_every=1, longest_hold=1, drain_objective=False, optimistic_prior=0.9,
                           prior_weight=100.0)
    policy.bind(SHAPE)
    ids = np.arange(8, dtype=np.int64)
    query = DraftLengthQuery(ids, np.full(8, 2), S, 8)
    steady = {0: 1.0e-3, 1: 1.2e-3, 2: 1.3e-3}  # what each depth costs once the host is warm
    cold = {0: 1.0e-3, 1: 1.2e-3, 2: 2.0e-3}  # depth 2's first measurements, taken cold (still the runner-up)
    picks = []
    for step in range(60):
        depth = int(policy.choose(query)[0])
        picks.append(depth)
        costs = cold if step < 3 else steady
        policy.cost_model.record(8, depth, wall_seconds=costs[depth], gpu_seconds=None)
    assert 1 in picks[:6] and 2 not in picks[3:6], picks  # depth 2 looked dear: depth 1 ran
    comeback = picks.index(2, 3)
    assert comeback <= 3 + 4 + 2, picks  # the runner-up after ~4 x decide_every steps, not explore_every
    # measured afresh: depth 2 is the best and is kept, but for depth 0's one second timing (retime_explored)
    assert picks[comeback:].count(0) == 1 and picks[-10:] == [2] * 10, picks
    assert policy.cost_model.wall[(8, 2)] == pytest.approx(steady[2])


def test_a_key_estimate_is_the_mean_of_its_first_samples_then_a_moving_average():
    """A new or remeasured key's estimate is the mean of its samples until it has 1 / smoothing of
    them (one unlucky first sample weighs 1 / n, not 0.9^n), then moves by ``smoothing``; the GPU
    figure likewise once the loop's samples replace the warm-up's seed."""
    model = StepCostModel(smoothing=0.1)
    model.set_measured({(8, 2): 1.0e-3})
    samples = [2.0e-3] + [1.0e-3] * 9  # a first sample beside a collection (under the 3x outlier bound)
    for sample in samples:
        model.record(8, 2, wall_seconds=sample, gpu_seconds=sample)
    assert model.wall[(8, 2)] == pytest.approx(sum(samples) / 10)  # 1.1 ms; an average from the first: 1.39
    assert model.gpu[(8, 2)] == pytest.approx(sum(samples) / 10)
    model.record(8, 2, wall_seconds=2.0e-3, gpu_seconds=None)  # the 11th: a moving average from now on
    assert model.wall[(8, 2)] == pytest.approx(1.1e-3 + 0.1 * (2.0e-3 - 1.1e-3))
    model.remeasure(8, 2)  # measured afresh: the mean starts over
    for sample in (1.6e-3, 1.2e-3):
        model.record(8, 2, wall_seconds=sample, gpu_seconds=None)
    assert model.wall[(8, 2)] == pytest.approx(1.4e-3)


def test_a_depth_never_measured_is_given_up_after_explore_tries():
    """A loop that never reaches a steady step measures nothing: each depth is tried explore_tries
    times, then the policy decides on its estimates alone."""
    policy = GoodputPolicy(explore_tries=2)
    policy.bind(SHAPE)
    query = DraftLengthQuery(np.arange(4, dtype=np.int64), np.full(4, S), S, 4)
    picks = [int(policy.choose(query)[0]) for _ in range(20)]
    assert policy.explored == 2 * (S + 1) and sorted(picks[:8]) == sorted(list(range(S + 1)) * 2)
    assert len(set(picks[8:])) == 1, picks  # the analytic default's best, from then on


def _step(G, V, D, prefill=0, steps=1, decode=None):
    """What ``DraftLengths.step_timing`` reads of a step (``decode``: its decode requests, G if None;
    each prefill request a chunk of 3 rows)."""
    decode = G if decode is None else decode
    starts = np.concatenate([np.arange(decode + 1) * (1 + V), decode * (1 + V) + 3 * np.arange(1, prefill + 1)])
    return types.SimpleNamespace(num_prefill=prefill, verify_width=V, num_drafts=D, num_steps=steps,
                                 num_decode=decode, host_query_start_loc=starts,
                                 dimensions=types.SimpleNamespace(request_count=G))


def test_the_loop_hands_row_costs_and_prefill_rows_to_any_cost_model():
    """The row-cost hooks are ``StepCostModel``'s (no-ops there): a cost model that overrides them
    gets the warm-up's row costs and every applied mixed step's prefill rows, and the base model
    takes both."""

    class RowsSeen(StepCostModel):
        def __init__(self):
            super().__init__()
            self.row_costs, self.prefill_rows = None, []

        def set_row_costs(self, row_costs):
            self.row_costs = row_costs

        def record_prefill_rows(self, rows):
            self.prefill_rows.append(rows)

    for cost_model in (StepCostModel(), RowsSeen()):
        policy = GoodputPolicy()
        lengths = DraftLengths(policy, SHAPE)  # binds the policy
        policy.cost_model = cost_model
        lengths.set_step_costs({(8, 0): 1e-3}, row_costs={(8, 8, 0, False): 1e-3})
        lengths.step_timing([(_step(8, 2, 2), 1e-3), (_step(8, 2, 2, prefill=2, decode=5), 1e-3)], 3e-3, 2)
    assert cost_model.row_costs == {(8, 8, 0, False): 1e-3}
    assert cost_model.prefill_rows == [6]  # the mixed launch's two chunks of 3 rows


def test_step_timing_counts_every_busy_call_as_realised():
    """With the tokens the applied launch's decode requests emitted, every call after a return with
    work left that applied one launch with decode requests verifying what it drafted (V = D) is a
    realised sample, steady or not; a call after an idle return, a switch's launch (V != D), a
    launch without decode requests or two launches are not. Realised-only samples at one key are
    summed and handed over once they hold REALISED_EVERY steps, or when a sample at another key
    comes; a steady sample carries its own and the sum waiting at its key."""
    lengths = DraftLengths(GoodputPolicy(), SHAPE)
    assert lengths.step_timing([(_step(8, 2, 2), 1e-3)], 5e-3, 1, 16, work_left=True) is None  # the first call
    assert lengths.step_timing([(_step(8, 2, 2), 1e-3)], 5e-3, 1, 16, work_left=False).tokens == 16  # steady too
    assert lengths.step_timing([(_step(8, 2, 2), 1e-3)], 5e-3, 1, 16, work_left=True) is None  # after an idle return
    assert lengths.step_timing([(_step(8, 2, 0), 1e-3)], 5e-3, 1, 16, work_left=True) is None  # a switch: V = 2, D = 0
    assert lengths.step_timing([(_step(8, S, 0, prefill=8, decode=0), 1e-3)], 5e-3, 1, 0, work_left=True) is None
    lengths.step_timing([(_step(8, 0, 0, prefill=1), 1e-3)], 5e-3, 1, 7, work_left=True)  # a mixed step (steady)
    # after a mixed call (the first call is realised only): one steady sample in TIMING_EVERY calls, each
    # carrying the realised samples summed since it at its key, so a long run hands over once in TIMING_EVERY
    walls = [(5 + index % 4) * 1e-4 for index in range(5 + 4 * TIMING_EVERY)]  # the last 3 wait
    handed = [lengths.step_timing([(_step(8, 0, 0), 4e-4)], wall, 1, 8, work_left=True) for wall in walls]
    assert all(timing is None or timing.steady for timing in handed)
    steady = [timing for timing in handed if timing is not None]
    assert [timing.steps for timing in steady] == [2] + [TIMING_EVERY] * 4
    assert all(timing[:2] == (8, 0) and timing.tokens == 8 * timing.steps == timing.request_steps for timing in steady)
    assert [timing.wall_seconds for timing in steady] == [walls[1 + TIMING_EVERY * index] for index in range(5)]
    assert sum(timing.realised_seconds for timing in steady) == pytest.approx(sum(walls[:-3]))
    assert lengths.step_timing([(_step(8, 0, 0), 1e-3)] * 2, 5e-3, 2, 16, work_left=True) is None  # two launches
    summed = lengths.step_timing([(_step(8, 0, 0), 4e-4)], 6e-4, 1, 8, work_left=True)  # no steady call: a sum
    assert not summed.steady and summed.steps == REALISED_EVERY and summed[4:8] == (False, False, 32, 32)
    assert summed.realised_seconds < 0 and summed.wall_seconds * REALISED_EVERY == pytest.approx(sum(walls[-3:]) + 6e-4)
    steady = lengths.step_timing([(_step(8, 0, 0, steps=4), 8e-3)], 4e-3, 4, 32, work_left=True)  # a decode run
    assert steady[:9] == (8, 0, 1e-3, 2e-3, False, True, 32, 32, 4) and steady.realised_seconds < 0
    assert lengths.step_timing([(_step(8, 0, 0), 4e-4)], 6e-4, 1, 8, work_left=True) is None  # pending
    # a sample at another key (D = 1 now: the switch's launch first) hands the pending one over
    assert lengths.step_timing([(_step(8, 0, 1), 4e-4)], 6e-4, 1, 8, work_left=True) is None
    assert lengths.step_timing([(_step(8, 1, 1), 5e-4)], 9e-4, 1, 12, work_left=True).steps == 1  # steady, its own
    handed = lengths.step_timing([(_step(8, 1, 1), 5e-4)], 9e-4, 1, 12, work_left=True)  # not sampled: realised
    assert handed[:2] == (8, 0) and not handed.steady and handed.steps == 1  # the D = 0 sample left


def test_a_realised_sample_keeps_the_tokens_expected_when_its_steps_were_launched():
    """The expected tokens of a realised sample are those of the choice in force at each launch
    (``DraftLengths.launched``), summed over the calls it covers, not the policy's value when the
    sample is recorded; ``record_timing`` hands them to the cost model (``token_calibration``)."""
    policy = GoodputPolicy()
    lengths = DraftLengths(policy, SHAPE)
    step = types.SimpleNamespace(**vars(_step(8, 1, 1)), host_draft_lengths=(1,) * 8, host_verify_lengths=(1,) * 8,
                                 num_sampling_requests=8, host_request_ids=np.arange(8))
    policy.cost_model.record(8, 1, 1e-3, None)  # D = 1 measured: its realised sums are kept
    timings = []
    for call in range(2 * REALISED_EVERY):
        policy.expected_tokens = np.array([1.0, 2.0 if call < REALISED_EVERY else 1.5])  # the choice in force
        lengths.launched(step)
        policy.expected_tokens = np.array([1.0, 9.0])  # a later choice: not what those steps were expected to do
        lengths.applied(step, np.ones((1, 8), dtype=np.int64))
        timings.append(lengths.step_timing([(step, 1e-3)], 1.2e-3, 1, 12, work_left=True))
    handed = [timing for timing in timings if timing is not None and timing.tokens >= 0]
    assert len(handed) >= 2 and handed[0].expected_tokens == pytest.approx(2.0 * handed[0].request_steps)
    assert all(1.5 * t.request_steps - 1e-9 <= t.expected_tokens <= 2.0 * t.request_steps + 1e-9 for t in handed)
    for timing in handed:
        lengths.record_timing(timing)
    # 12 tokens for 8 request-steps a call where 2 then 1.5 a request-step were expected (16 then 12)
    assert 12 / 16 <= policy.cost_model.token_calibration(8, 1) <= 1.0


def test_a_call_whose_build_asked_the_policy_is_no_sample():
    """A decision is the policy's own host time, whatever the depth: the step() call whose build
    asked the policy (a hold ended) is neither a steady nor a realised sample of the depth it
    applied; the next call samples again."""
    lengths = DraftLengths(GoodputPolicy(), SHAPE)
    lengths.set_step_costs({(8, d): 1e-3 for d in range(S + 1)})
    lengths.step_timing([(_step(8, 0, 0), 4e-4)], 6e-4, 1, 8, work_left=True)  # the first call
    assert lengths.step_timing([(_step(8, 0, 0), 4e-4)], 6e-4, 1, 8, work_left=True).steady
    lengths.choose(np.arange(8, dtype=np.int64), 8, 8)  # no choice held: the policy decides
    assert lengths.step_timing([(_step(8, 0, 0), 4e-4)], 9e-3, 1, 8, work_left=True) is None
    timing = lengths.step_timing([(_step(8, 0, 0), 4e-4)], 6e-4, 1, 8, work_left=True)
    assert timing.steady and timing.wall_seconds == 6e-4 and timing.steps == 1  # nothing of the decision's call
    lengths.choose(np.arange(8, dtype=np.int64), 8, 8)  # held: no decision
    assert lengths.step_timing([(_step(8, 0, 0), 4e-4)], 6e-4, 1, 8, work_left=True) is None  # realised, pending
    assert lengths.step_timing([(_step(8, 0, 0), 4e-4)], 6e-4, 1, 8, work_left=True) is None


def test_realised_samples_reach_the_cost_model_as_every_call_would():
    """Handed over in sums of REALISED_EVERY steps, the realised samples of a long run at one depth
    give the cost model the calibration and tokens per request-step that one record per call gives
    (equal walls: the decay per step makes the sums alike)."""
    models = []
    for batched in (True, False):
        policy = GoodputPolicy()
        lengths = DraftLengths(policy, SHAPE)
        lengths.set_step_costs({(8, 0): 4e-4, (8, 2): 8e-4})
        lengths.step_timing([(_step(8, 2, 2), 8e-4)], 1e-3, 1, 24, work_left=True)
        for _ in range(41):
            timing = lengths.step_timing([(_step(8, 2, 2), 8e-4)], 1e-3, 1, 24, work_left=True)
            if batched:
                lengths.record_timing(timing)
            elif timing is not None and timing.steady:
                lengths.record_timing(timing)
            else:  # one record per call
                policy.cost_model.record_realised(8, 2, 1e-3, 1, 24, 8)
        models.append(policy.cost_model)
    batched, per_call = models
    assert batched.calibration(8, 2) == pytest.approx(per_call.calibration(8, 2), rel=1e-6)
    assert batched.realised_tokens(8, 2) == pytest.approx(per_call.realised_tokens(8, 2)) == pytest.approx(3.0)


def test_realised_walls_calibrate_each_depth():
    """A depth's calibration is its realised wall over the model's cost of the same steps (kept only
    once the model measured the key); a depth with too few realised steps takes the grid's pooled
    ratio; a sample is clipped at 2x the model; realised tokens per request-step are kept beside."""
    model = StepCostModel()
    for depth, seconds in ((0, 1e-3), (2, 2e-3)):
        model.record(8, depth, seconds, None)
    model.record_realised(8, 1, 5e-3, 1, 16, 8)  # D = 1 not measured yet: no ratio to keep
    assert (8, 1) not in model.realised and model.calibration(8, 1) == 1.0
    for _ in range(20):
        model.record_realised(8, 2, 2.5e-3, 1, 20, 8)  # the loop pays 1.25x the steady samples at D = 2
    assert model.calibration(8, 2) == pytest.approx(1.25) and model.policy_seconds(8, 2) == pytest.approx(2.5e-3)
    assert model.realised_tokens(8, 2) == pytest.approx(2.5)
    assert model.calibration(8, 0) == pytest.approx(1.25)  # not realised yet: the grid's pooled ratio
    for _ in range(20):
        model.record_realised(8, 0, 1e-3, 1, 8, 8)
    assert model.calibration(8, 0) == pytest.approx(1.0) and 1.0 < model.calibration(8, 1) < 1.25
    model.record_realised(8, 0, 1.0, 1, 8, 8)  # a collection pause: clipped at 2x the model
    assert model.calibration(8, 0) < 1.1
    row = model.table()["G=8, D=2"]
    assert row["realised_ms"] == pytest.approx(2.5) and row["calibration"] == pytest.approx(1.25)


def test_the_policy_drafts_only_where_the_realised_goodput_is_higher():
    """Acceptance 0.5, the 1B's steady costs, requests waiting (tokens per second): drafting S pays
    (1.875 tokens for 1.3x a plain step). Where the loop realised every drafting depth at 1.6x its
    steady cost (and D = 0 at its model), drafting loses (1.875 / 2.58 < 1 / 1.24): the policy drafts
    nothing; realised as modelled, it drafts S again."""
    policy, ids = policy_with([0.5] * 64)
    assert policy.choose(drain_query(ids, waiting=5)).tolist() == [S] * 64
    for _ in range(30):
        for depth, seconds in COSTS_1B.items():
            policy.cost_model.record_realised(64, depth, seconds * (1.6 if depth else 1.0), 1, 64, 64)
    assert policy.choose(drain_query(ids, waiting=5)).tolist() == [0] * 64
    for _ in range(200):
        for depth, seconds in COSTS_1B.items():
            policy.cost_model.record_realised(64, depth, seconds, 1, 64, 64)
    assert policy.choose(drain_query(ids, waiting=5)).tolist() == [S] * 64


def test_the_policy_counts_on_the_tokens_the_loop_emitted_not_those_it_expected():
    """Realised steps that emit fewer tokens than the policy expected of them (token_calibration:
    tokens over expected, per depth, bounded) lower what a depth counts on: drafting S at 0.5
    acceptance expects 1.875 tokens a step for 1.3x a plain step's cost; where the loop emitted
    0.6x the expected tokens at every drafting depth, the policy drafts nothing; emitting them
    as expected, it drafts S again. Before a depth has enough realised steps its calibration is 1."""
    policy, ids = policy_with([0.5] * 64)
    assert policy.choose(drain_query(ids, waiting=5)).tolist() == [S] * 64
    expected = policy.expected_tokens.copy()  # [S + 1] a request's tokens a step at each depth
    assert policy.cost_model.token_calibration(64, S) == 1.0
    for emitted in (0.6, 1.0):
        for _ in range(200):
            for depth, seconds in COSTS_1B.items():
                tokens = round(64 * expected[depth] * (emitted if depth else 1.0))
                policy.cost_model.record_realised(64, depth, seconds, 1, tokens, 64, expected_tokens=expected[depth])
        assert policy.cost_model.token_calibration(64, S) == pytest.approx(emitted, rel=0.01)
        assert policy.cost_model.token_calibration(64, 0) == pytest.approx(1.0)
        assert policy.choose(drain_query(ids, waiting=5)).tolist() == ([0] if emitted < 1 else [S]) * 64
    for _ in range(200):  # a wild run of steps is bounded (token_calibration_range)
        policy.cost_model.record_realised(64, S, COSTS_1B[S], 1, 0, 64, expected_tokens=expected[S])
    assert policy.cost_model.token_calibration(64, S) == policy.cost_model.token_calibration_range[0]


def test_step_timing_samples_steady_calls_after_a_call_at_the_same_depth():
    """A call is a sample when it applied a steady launch (V = D) and the call before applied one
    of the same (G, D): the switch's first call (V = old width) and a call after a prefill are not;
    the wall time is per step of a decode run; one in TIMING_EVERY of a run is kept."""
    lengths = DraftLengths(GoodputPolicy(), SHAPE)
    assert lengths.step_timing([(_step(8, 2, 2), 1e-3)], 5e-3, 1) is None  # the first call seen
    assert lengths.step_timing([(_step(8, 2, 0), 1e-3)], 5e-3, 1) is None  # a switch to D = 0: V = 2
    timing = lengths.step_timing([(_step(8, 0, 0), 4e-4)], 6e-4, 1)  # the loop now runs D = 0
    assert timing[:5] == (8, 0, 6e-4, 4e-4, False)
    kept = [lengths.step_timing([(_step(8, 0, 0), 4e-4)], 6e-4, 1) is not None for _ in range(2 * TIMING_EVERY)]
    assert kept == ([False] * (TIMING_EVERY - 1) + [True]) * 2
    assert lengths.step_timing([(_step(8, 0, 0, prefill=1), 4e-4)], 6e-4, 1) is None
    assert lengths.step_timing([(_step(8, 0, 0), 4e-4)], 6e-4, 1) is None  # after a prefill: not yet
    assert lengths.step_timing([(_step(8, 0, 0, steps=4), 8e-3)], 4e-3, 4)[:5] == (8, 0, 1e-3, 2e-3, False)  # a decode run
    assert lengths.step_timing([(_step(8, 0, 0), 4e-4)], None, 1) is None  # no previous return


def test_step_timing_samples_steps_with_prefill_chunks_apart():
    """A steady step with prefill chunks (V = D) after a call at the same (G, D), decode-only or
    mixed, is a mixed sample; a decode-only call right after a mixed one is not a sample (prefill
    in its wall time); every call's applied launches move the cost model's mixed share."""
    policy = GoodputPolicy()
    policy.bind(SHAPE)
    lengths = DraftLengths(policy, SHAPE)
    assert lengths.step_timing([(_step(8, 2, 2), 1e-3)], 5e-3, 1) is None  # the first call seen
    assert lengths.step_timing([(_step(8, 2, 2, prefill=1), 2e-3)], 3e-3, 1)[:5] == (8, 2, 3e-3, 2e-3, True)
    assert lengths.step_timing([(_step(8, 2, 2), 1e-3)], 1e-3, 1) is None  # after a mixed call
    assert lengths.step_timing([(_step(8, 3, 2, prefill=1), 2e-3)], 3e-3, 1) is None  # V = 3: not steady
    # the second step after a switch (its call before verified the old width, at the new D)
    assert lengths.step_timing([(_step(8, 2, 2, prefill=1), 2e-3)], 3e-3, 1)[:5] == (8, 2, 3e-3, 2e-3, True)
    share = policy.cost_model.mixed_share
    assert 0 < share < 1
    assert lengths.step_timing([(_step(8, 2, 2), 1e-3), (_step(8, 2, 2, prefill=1), 1e-3)], 3e-3, 1) is None
    assert policy.cost_model.mixed_share > share  # one decode-only and one mixed launch: toward 1/2


def test_a_depth_costs_decode_only_and_mixed_steps_by_their_share():
    """Mixed steps' wall times are kept apart; a depth's cost blends them by the share of recent
    launches with prefill chunks; a depth whose mixed cost is not measured takes its decode cost
    times the grid's mean mixed / decode ratio. In a queue (mostly mixed steps) whose mixed step
    pads to the next token bucket at D = 3, the policy then drafts 2 where decode-only costs say 3."""
    model = StepCostModel()
    decode = {0: 1.0e-3, 1: 1.1e-3, 2: 1.2e-3, 3: 1.3e-3}
    for depth, seconds in decode.items():
        model.record(64, depth, wall_seconds=seconds, gpu_seconds=None)
    model.record(64, 2, wall_seconds=1.5e-3, gpu_seconds=None, mixed=True)
    model.record(64, 3, wall_seconds=2.6e-3, gpu_seconds=None, mixed=True)  # its rows pad to twice the tokens
    assert model.wall == {(64, d): t for d, t in decode.items()} and model.mixed_share == 0
    assert model.seconds(64, 3) == 1.3e-3  # no mixed step lately: decode-only
    model.record_launches(mixed=200, total=200)
    share = model.mixed_share
    assert share > 0.99
    assert model.seconds(64, 3) == pytest.approx(1.3e-3 + share * (2.6e-3 - 1.3e-3))
    ratio = (1.5 / 1.2 + 2.6 / 1.3) / 2
    assert model.mixed_seconds(64, 1) == pytest.approx(1.1e-3 * ratio)
    assert model.table()["G=64, D=3"]["mixed_ms"] == pytest.approx(2.6)

    def queued_choice(share):
        policy, ids = policy_with([0.9, 0.6, 0.2] * 21 + [0.9], costs=decode)
        policy.cost_model.mixed_wall = dict(model.mixed_wall)
        policy.cost_model.mixed_wall[(64, 1)] = 1.3e-3
        policy.cost_model.mixed_share = share
        return policy.choose(drain_query(ids, waiting=5))[0]

    assert queued_choice(0.0) == 3 and queued_choice(0.95) == 2


@pytest.fixture(scope="module")
def mtp_model():
    ensure_single_process_groups()
    return build_models()[0]


def test_the_loop_wall_time_decides(mtp_model, torch_twins, monkeypatch):
    """The controller times each step() call from the previous return (here a clock that advances
    by COSTS[D] of each step applied): an oracle whose first draft always lands (2 tokens a step
    from D = 1) but whose steps cost 3x a plain one per depth. Every depth is measured at the injected cost, the policy ends on
    D = 0, and the output is plain decoding's."""
    costs = {0: 1.0, 1: 4.0, 2: 7.0}  # seconds of the fake clock per step (S = 2)
    prompts = [list(p) for p in PROMPTS[:2]]
    params = SamplingParams(max_new_tokens=32)
    plain = [list(r.output_tokens) for r in controller_for(mtp_model, 0, max_model_len=48).generate(prompts, params)]
    sequences = {rid: prompts[rid] + plain[rid] + [0] * (MTP_DEPTH + 2) for rid in range(2)}
    policy = GoodputPolicy(decide_every=2)
    controller = controller_for(mtp_model, 2, OracleProposer(sequences, lambda rid, index: 1), policy,
                                max_model_len=48)
    clock = types.SimpleNamespace(now=0.0)

    def advance(step, readbacks, overlapped):  # the documented hook: a step was applied
        clock.now += costs[step.num_drafts] * step.num_steps

    controller.on_apply = advance
    monkeypatch.setattr(controller_module, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    assert [list(r.output_tokens) for r in controller.generate(prompts, params)] == plain
    grid = 2
    assert {d: policy.cost_model.wall.get((grid, d)) for d in costs} == costs  # each depth, at its wall time
    assert policy.last_depth == 0
    # realised tokens a request-step: 1 at D = 0; the oracle's first draft always lands, so 2 at most at D > 0
    assert policy.cost_model.realised_tokens(grid, 0) == 1.0 and 1.0 < policy.cost_model.realised_tokens(grid, 1) <= 2.0


def test_new_requests_are_expected_to_spread_like_the_ones_that_left():
    """A closed batch of new requests (no evidence yet) after a mixed one: their average acceptance
    would say D = S, but the drain objective gives them the spread of the requests that left (a
    third at 0.2 set the end), so it drafts nothing; with a population of 0.9s it drafts S."""
    for rates, expected in (([0.9, 0.6, 0.2] * 21 + [0.9], 0), ([0.9] * 64, S)):
        policy, ids = policy_with(rates)
        for request_id in ids.tolist():
            policy.forget(request_id)
        new = np.arange(100, 164, dtype=np.int64)
        assert policy.choose(drain_query(new)).tolist() == [expected] * 64, rates[:3]
        assert np.allclose(policy.acceptance(100), policy.acceptance(10_000))  # the estimate itself: the average


def test_requests_with_evidence_of_their_own_are_not_given_the_population_spread():
    """After a mixed batch left, a closed batch of 0.9 requests that each verified a few full drafts
    (more than ``population_evidence``) is judged on its own evidence and the average: it drafts S.
    Quantile priors on top of that evidence would count the spread twice (the slowest-looking of
    64 requests after three steps given the population's 0.2) and draft nothing."""
    policy, ids = policy_with([0.9, 0.6, 0.2] * 21 + [0.9])
    for request_id in ids.tolist():
        policy.forget(request_id)
    new = np.arange(100, 164, dtype=np.int64)
    policy.choose(drain_query(new))  # rows for the new requests
    accepted = np.where(np.arange(64) % 8 == 0, 1, S)  # every 8th accepted only one draft of three
    for _ in range(3):
        policy.observe(new, np.full(64, S), accepted)
    assert policy.choose(drain_query(new)).tolist() == [S] * 64


def test_the_population_ranking_is_kept_until_requests_leave():
    """The drain objective ranks the population once and keeps the ranking while nobody leaves; when
    requests leave with evidence, it is ranked again: after a mixed batch the new requests draft
    nothing, and after 128 requests at 0.9 (the whole ring) left, a new batch drafts S, with the
    priors a fresh ranking gives."""
    policy, ids = policy_with([0.9, 0.6, 0.2] * 21 + [0.9])
    for request_id in ids.tolist():
        policy.forget(request_id)
    new = np.arange(100, 164, dtype=np.int64)
    assert policy.choose(drain_query(new)).tolist() == [0] * 64
    assert policy.choose(drain_query(new)).tolist() == [0] * 64  # nobody left: the same ranking
    good = np.arange(200, 328, dtype=np.int64)  # 128 requests at 0.9 (the ring's size) verify and leave
    policy.choose(drain_query(good))
    accepted = np.full(128, S)  # every draft of a 0.9 request lands (expected counts: 0.9^3 ~ 0.73 of steps)
    accepted[::4] = 2
    for _ in range(10):
        policy.observe(good, np.full(128, S), accepted)
    for request_id in good.tolist() + new.tolist():
        policy.forget(request_id)
    fresh = np.arange(500, 564, dtype=np.int64)
    assert policy.choose(drain_query(fresh)).tolist() == [S] * 64  # a stale ranking: the mixed batch's priors


def test_a_near_tie_keeps_the_depth_held_and_a_clear_gain_switches():
    """``switch_gain``: a depth other than the last choice's (on the scores) must beat it by that
    factor. 0.2 acceptance with requests waiting: D = 1 scores 1.9 % above D = 0 (the test above), so
    a policy holding D = 0 keeps it, and one holding D = 1 keeps that. At 0.6 acceptance a policy
    holds D = 0 while a draft costs 2.9x a plain step, and switches to D = S once it costs 1.3x."""
    held_zero, ids = policy_with([0.2] * 64, min_gain=1.0)
    assert held_zero.choose(drain_query(ids)).tolist() == [0] * 64  # the drain objective: D = 0
    assert held_zero.choose(drain_query(ids, waiting=5)).tolist() == [0] * 64  # 1.9 % < switch_gain
    held_one, ids = policy_with([0.2] * 64, min_gain=1.0, switch_gain=1.0)
    assert held_one.choose(drain_query(ids, waiting=5)).tolist() == [1] * 64
    held_one.switch_gain = 1.05
    assert held_one.choose(drain_query(ids, waiting=5)).tolist() == [1] * 64
    high, ids = policy_with([0.6] * 64, costs={0: 1.0e-3, 1: 2.9e-3, 2: 2.9e-3, 3: 2.9e-3})  # drafts 2.9x dearer
    assert high.choose(drain_query(ids, waiting=5)).tolist() == [0] * 64
    for _ in range(100):  # the drafts' cost falls to 1.3x a plain step's
        for depth in range(1, S + 1):
            high.cost_model.record(64, depth, wall_seconds=1.3e-3, gpu_seconds=None)
    assert high.choose(drain_query(ids, waiting=5)).tolist() == [S] * 64
    with pytest.raises(ValueError, match="switch_gain"):
        GoodputPolicy(switch_gain=0.9)
    with pytest.raises(TypeError, match="switch_gain"):
        GoodputPolicy(switch_gain="1.1")


def test_a_draining_batch_prices_decode_only_steps():
    """Nobody joins a batch that drains, so its steps carry no prompt chunks: the drain objective
    prices each depth's decode-only steps, whatever share of the steps before it had chunks (here
    every one, and D = 0's mixed steps cost 8x its decode steps: priced blended, D = 0 would lose)."""
    policy, ids = policy_with([0.2] * 64, min_gain=1.0, switch_gain=1.0)
    policy.cost_model.record(64, 0, wall_seconds=1.0e-2, gpu_seconds=None, mixed=True)
    for depth in range(1, S + 1):
        policy.cost_model.record(64, depth, wall_seconds=2.0e-3, gpu_seconds=None, mixed=True)
    for _ in range(200):
        policy.cost_model.record_launches(mixed=1, total=1)
    assert policy.cost_model.mixed_share > 0.99
    assert policy.choose(drain_query(ids)).tolist() == [0] * 64
    np.testing.assert_allclose(policy.last_seconds, [COSTS_1B[d] for d in range(S + 1)])
    assert policy.cost_model.policy_seconds(64, 0) > 5 * COSTS_1B[0]  # what a queue's step is priced at


def test_a_depth_held_only_by_switch_gain_never_retires_the_batch():
    """Retirement is for good, so it needs D = 0 best on the scores: a policy that keeps D = 0 only
    because D = 1's 4 % gain is under ``switch_gain`` never retires; one whose scores pick D = 0 does."""
    costs = {0: 1.24e-3, 1: 1.43e-3, 2: 1.60e-3, 3: 1.75e-3}  # 0.2 acceptance: D = 1 scores ~1.04x D = 0
    for switch_gain, dear in ((1.05, False), (1.05, True)):
        policy, ids = policy_with([0.2] * 64, costs={0: costs[0], **{d: 2.9e-3 for d in (1, 2, 3)}} if dear
                                  else costs, switch_gain=switch_gain, retire_after=4, explore_every=10 ** 6,
                                  retime_explored=False)
        assert policy.settled(64)
        assert policy.choose(drain_query(ids)).tolist() == [0] * 64  # a draining batch: D = 0
        chosen = [int(policy.choose(drain_query(ids, waiting=5))[0]) for _ in range(40)]
        assert chosen.count(0) > 30  # D = 0 held (a runner-up hold of D = 1 now and then)
        assert policy.speculation_retired is dear and (policy.retired > 0) is dear
