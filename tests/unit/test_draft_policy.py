"""The draft-length policies on their own (host numbers, no model): the goodput rule's choices,
its acceptance estimates, determinism, the batch lookup of per-request rows, the step cost model
(warm-up seed, then the loop's wall time per step), the drain objective, exploration, how long the controller holds a choice, and
bad arguments."""

import numpy as np
import pytest

from mtp_ctrl.controllers import SamplingParams
from mtp_ctrl.controllers.draft_lengths import DraftLengths
from mtp_ctrl.controllers.draft_policy import (DraftLengthPolicy, DraftLengthQuery, FixedDraftLength, GoodputPolicy,
                                               RandomDraftLengths)
from mtp_ctrl.controllers.request_rows import RequestRows
from mtp_ctrl.controllers.step_costs import StepCostModel
from mtp_ctrl.state import EngineShape

S = 3
SHAPE = EngineShape(max_requests=8, max_model_len=64, block_size_tokens=4, num_speculative_tokens=S,
                    max_tokens_per_step=64)


def query(request_ids, caps=None, batch_size=8):
    request_ids = np.asarray(request_ids, dtype=np.int64)
    caps = np.full(request_ids.shape, S, dtype=np.int64) if caps is None else np.asarray(caps, dtype=np.int64)
    return DraftLengthQuery(request_ids, caps, S, batch_size)


def trained(acceptance_by_request, steps=40):
    """A goodput policy that saw ``steps`` full-length verifies per request, each depth accepted
    with the given conditional probability (deterministic: the expected counts)."""
    policy = GoodputPolicy()
    policy.bind(SHAPE)
    for _ in range(steps):
        ids = np.array(list(acceptance_by_request), dtype=np.int64)
        policy.choose(query(ids))
        for request_id, rate in acceptance_by_request.items():
            # a request that accepts each draft with `rate`: accepted count k with probability rate^k (1 - rate)
            for accepted in range(S + 1):
                weight = rate ** accepted * ((1 - rate) if accepted < S else 1.0)
                for _ in range(int(round(weight * 10))):
                    policy.observe(np.array([request_id]), np.array([S]), np.array([accepted]))
    return policy


def test_fixed_gives_each_request_its_cap():
    policy = FixedDraftLength()
    policy.bind(SHAPE)
    assert policy.choose(query([1, 2, 3], caps=[0, 2, 3])).tolist() == [0, 2, 3]
    assert list(policy.warmup_depths(S)) == [S]


def test_goodput_drafts_where_it_pays():
    policy = trained({1: 0.9, 2: 0.9})
    assert policy.choose(query([1, 2])).tolist() == [S, S]  # cheap drafts, high acceptance: all of them
    assert policy.acceptance(1)[0] > 0.8
    low = trained({3: 0.02, 4: 0.02})
    low.cost_model.per_draft_depth = 0.5  # drafting is expensive next to a verify
    assert low.choose(query([3, 4])).tolist() == [0, 0]


def test_goodput_uses_the_measured_profile_and_caps():
    policy = trained({1: 0.6})
    policy.cost_model.set_measured({(8, d): 1.0 + (10.0 if d > 1 else 0.0) for d in range(S + 1)})
    assert policy.choose(query([1], batch_size=5)).tolist() == [1]  # grid 5 reads the 8-request profile
    assert policy.choose(query([1], caps=[0], batch_size=5)).tolist() == [0]


def test_goodput_is_deterministic_and_forgets():
    a, b = trained({1: 0.5, 2: 0.7}), trained({1: 0.5, 2: 0.7})
    for _ in range(5):
        assert a.choose(query([1, 2])).tolist() == b.choose(query([1, 2])).tolist()
    a.forget(1)
    assert np.allclose(a.acceptance(1), a.acceptance(99))  # back to the model's average


def test_estimates_drift_back_to_the_prior_when_nobody_drafts():
    policy = trained({1: 0.0})
    before = policy.acceptance(1)[0]
    for _ in range(200):
        policy.choose(query([1]))  # nobody verifies: no observation
    assert policy.acceptance(1)[0] > before + 0.3


def test_random_lengths_stay_within_caps():
    policy = RandomDraftLengths(seed=0, all_zero=0.0)
    lengths = np.stack([policy.choose(query(range(6), caps=[0, 1, 2, 3, 3, 3])) for _ in range(50)])
    assert (lengths <= np.array([0, 1, 2, 3, 3, 3])).all() and (lengths >= 0).all()
    assert set(lengths[:, 5].tolist()) == {0, 1, 2, 3}


def test_analytic_cost_grows_with_depth_and_batch():
    model = StepCostModel()
    assert model.seconds(4, 0) < model.seconds(4, 2) < model.seconds(8, 2)


@pytest.mark.parametrize("field,value", [("decay", 0.0), ("prior_weight", -1.0), ("optimistic_prior", 1.5),
                                         ("decide_every", 0), ("longest_hold", 0), ("longest_hold", 4),
                                         ("explore_within", 1.5), ("population_evidence", -1.0), ("min_gain", -0.5),
                                         ("retire_after", 0)])
def test_bad_goodput_arguments(field, value):
    with pytest.raises(ValueError, match=field):
        GoodputPolicy(**{field: value})


@pytest.mark.parametrize("make, field", [
    (lambda: GoodputPolicy(decide_every=True), "decide_every"),
    (lambda: GoodputPolicy(drain_objective="no"), "drain_objective"),
    (lambda: GoodputPolicy(explore_within=None), "explore_within"),
    (lambda: GoodputPolicy(population_evidence="2"), "population_evidence"),
    (lambda: GoodputPolicy(decay=True), "decay"),
    (lambda: GoodputPolicy(retire_after=2.0), "retire_after"),
    (lambda: StepCostModel(smoothing="x"), "smoothing"),
    (lambda: StepCostModel(per_row=None), "per_row"),
])
def test_arguments_of_the_wrong_type_are_named(make, field):
    with pytest.raises(TypeError, match=field):
        make()


def test_request_rows_look_up_a_batch_and_reuse_freed_rows():
    index = RequestRows()
    rows, new = index.rows(np.array([7, 3, 7, 11]), create=True)  # a decode run repeats ids
    assert sorted(new.tolist()) == [0, 1, 2] and rows[0] == rows[2] and len(set(rows.tolist())) == 3
    assert index.rows(np.array([11, 5, 3]))[0].tolist() == [rows[3], -1, rows[1]]  # 5: not held
    index.remove(3)
    index.remove(99)  # not held: nothing
    again, new = index.rows(np.array([40, 7]), create=True)
    assert new.tolist() == [rows[1]] and again.tolist() == [rows[1], rows[0]]  # 40 takes 3's row
    assert index.capacity == 3 and len(index) == 3


def test_request_rows_dense_table_and_binary_search_agree():
    """Ids spanning a short range are looked up in a dense table (rebuilt when ids come or go), a
    wide span by binary search: both give each id's row and -1 for ids not held, below, between,
    above or far outside the range."""
    rng = np.random.default_rng(0)
    index, rows_of = RequestRows(), {}
    for round_index in range(6):
        wide = round_index % 2 == 1  # odd rounds hold an id far away: the span is wide
        ids = rng.choice(np.arange(1000, 1100), size=20, replace=False)
        ids = np.append(ids, 2 ** 40 + round_index) if wide else ids
        rows, _ = index.rows(ids, create=True)
        rows_of.update(zip(ids.tolist(), rows.tolist()))
        gone = rng.choice([i for i in rows_of if i < 2 ** 40], size=5, replace=False).tolist()
        for request_id in gone + ([] if wide else [i for i in rows_of if i >= 2 ** 40]):
            index.remove(request_id)
            del rows_of[request_id]
        probe = np.concatenate([list(rows_of), np.arange(990, 1110), [-5, -2 ** 62, 2 ** 62, 2 ** 40 + 9]])
        expected = [rows_of.get(request_id, -1) for request_id in probe.tolist()]
        assert index.rows(np.tile(probe, 3))[0].tolist() == expected * 3, round_index
    extremes = RequestRows()  # ids spanning more than int64 holds: a binary search, no overflow
    rows, _ = extremes.rows(np.array([-2 ** 62, 2 ** 62]), create=True)
    assert extremes.rows(np.array([2 ** 62, 0, -2 ** 62]))[0].tolist() == [rows[1], -1, rows[0]]


def test_step_costs_follow_the_loop_not_the_warmup_seed():
    model = StepCostModel(smoothing=0.5)
    assert model.seconds(8, 0) < model.seconds(8, 2)  # nothing measured: the analytic default
    model.set_measured({(8, 0): 1e-4, (8, 2): 2e-4})  # warm-up replays (GPU only)
    assert model.seconds(8, 2) == 2e-4 and model.seconds(5, 2) == 2e-4  # grid 5 reads grid 8
    assert not model.is_measured(8, 0)
    model.record(8, 0, wall_seconds=5e-4, gpu_seconds=1.5e-4)  # the loop's wall time per step, bubbles and all
    assert model.seconds(8, 0) == 5e-4 and model.is_measured(8, 0) and model.is_measured(5, 0)
    assert model.seconds(8, 2) == 2e-4 and not model.is_measured(8, 2)  # not run yet: its GPU seed (optimistic)
    assert model.seconds(8, 1) == 5e-4  # no seed either: the cheapest wall time seen at grid 8
    model.record(8, 2, wall_seconds=6e-4, gpu_seconds=1e-3)  # the wall, not max(GPU, host)
    assert model.seconds(8, 2) == 6e-4 and model.gpu[(8, 2)] == 1e-3  # the first in-loop GPU time replaces the seed
    model.record(8, 2, wall_seconds=8e-4, gpu_seconds=2e-3)  # then moving averages
    assert np.isclose(model.seconds(8, 2), 7e-4) and np.isclose(model.gpu[(8, 2)], 1.5e-3)
    assert model.table()["G=8, D=2"]["step_ms"] == model.seconds(8, 2) * 1e3
    with pytest.raises(ValueError, match="smoothing"):
        StepCostModel(smoothing=0.0)


def test_goodput_follows_the_measured_wall_time():
    """Warm-up replays say drafting is nearly free; the loop measures D = 2 at 4x D = 0: draft nothing."""
    policy = trained({1: 0.8, 2: 0.8})
    policy.cost_model.set_measured({(8, d): 1e-4 for d in range(S + 1)})
    assert policy.choose(query([1, 2])).tolist() == [S, S]
    for depth, seconds in ((0, 5e-4), (1, 1.2e-3), (2, 2e-3), (3, 2.6e-3)):
        for _ in range(3):  # steady steps (a lone sample over 3x the cheapest would be dropped)
            policy.cost_model.record(8, depth, wall_seconds=seconds, gpu_seconds=1e-4)
    assert policy.choose(query([1, 2])).tolist() == [0, 0]


def test_a_batch_held_at_zero_in_a_queue_is_retired_until_nobody_waits():
    """GoodputPolicy, through the controller's side (DraftLengths): D = 0 chosen on its scores at a
    settled grid for ``retire_after`` steps while requests wait retires the live requests that may
    draft (told once each to ``on_retired``); requests admitted then are retired too (caps 0 for
    good, also for a policy that would give them drafts); a request admitted before, sampling only
    now, is retired at its first choice; once nobody waits, new requests may draft again."""
    policy = GoodputPolicy(decide_every=4, longest_hold=8, retire_after=16, retime_explored=False)
    lengths = DraftLengths(policy, SHAPE)
    for depth in range(S + 1):  # every depth measured at the grid: drafting costs 10x a plain step
        for _ in range(3):
            policy.cost_model.record(8, depth, wall_seconds=1e-3 if depth == 0 else 1e-2, gpu_seconds=None)
    assert policy.settled(8)
    waiting, retired = [3], []
    lengths.queue_view = lambda ids: (waiting[0], None)
    lengths.on_retired = retired.append
    assert lengths.admitted(1) and lengths.admitted(2) and lengths.admitted(3)
    ids = np.array([1, 2])  # request 3 is prefilling: it samples later
    for _ in range(40):
        assert lengths.choose(ids, 2, 8).tolist() == [0, 0]
    assert retired == [1, 2] and policy.speculation_retired and policy.retired == 2
    assert not lengths.admitted(4)  # admitted retired: not told (the caller tells its proposer)
    for _ in range(9):  # past the hold: request 3 samples, and is retired at once
        assert lengths.choose(np.array([1, 2, 3, 4]), 4, 8).tolist() == [0] * 4
    assert retired == [1, 2, 3] and policy.retired == 4
    waiting[0] = 0
    for _ in range(9):
        lengths.choose(np.array([1, 2, 3, 4]), 4, 8)
    assert not policy.speculation_retired and lengths.admitted(5)  # nobody waits: new requests draft again
    assert lengths.admitted(1) is False  # a retired request stays retired (e.g. back after a preemption)
    never = GoodputPolicy(decide_every=4, longest_hold=8, retire_after=None, retime_explored=False)
    never_lengths = DraftLengths(never, SHAPE)
    for depth in range(S + 1):
        for _ in range(3):
            never.cost_model.record(8, depth, wall_seconds=1e-3 if depth == 0 else 1e-2, gpu_seconds=None)
    never_lengths.queue_view = lambda ids: (3, None)
    for _ in range(100):
        never_lengths.choose(ids, 2, 8)
    assert never.retired == 0 and never_lengths.admitted(9)


def test_a_policy_that_retires_a_request_not_in_its_choice_is_named():
    class RetiresAStranger(FixedDraftLength):
        def retiring(self):
            return [99]

    lengths, told = DraftLengths(RetiresAStranger(), SHAPE), []
    lengths.on_retired = told.append
    lengths.add(1, SamplingParams(num_speculative_tokens=2))  # capped: the policy is asked
    with pytest.raises(ValueError, match="retiring.*99"):
        lengths.choose(np.array([1]), 1, 8)
    assert not told and lengths.admitted(99)  # nothing changed


def test_goodput_counts_every_observation_of_a_batch():
    policy = GoodputPolicy()
    policy.bind(SHAPE)
    ids = np.arange(10, 16, dtype=np.int64)
    policy.choose(query(ids))  # new requests: their rows are made by the choice (observe makes none)
    policy.observe(np.tile(ids, 2), np.full(12, S), np.tile([0, 0, 0, S, S, S], 2))  # a 2-step decode run
    prior = policy.acceptance(99)[0]
    assert all(policy.acceptance(i)[0] < prior for i in ids[:3])  # rejected every draft
    assert all(policy.acceptance(i)[0] > prior for i in ids[3:])  # accepted every draft
    assert np.allclose(policy.acceptance(10), policy.acceptance(11))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # 0 / 0: no prior, a depth not reached
def test_goodput_observe_counts_each_depth_reached_and_accepted():
    """observe's counts equal the definition, outcome by outcome: draft k reached when the request
    verified >= k drafts and accepted the k - 1 before it; accepted when it accepted >= k. Repeated
    requests (a decode run, a held choice), zero lengths and a request not held (model only)."""
    rng = np.random.default_rng(3)
    ids = np.array([4, 9, 2, 7], dtype=np.int64)
    lengths = rng.integers(0, S + 1, 40)
    accepted = (rng.random(40) * (lengths + 1)).astype(np.int64)  # [40] in [0, length]
    request_ids = rng.choice(np.append(ids, 50), 40)  # 50: never chosen, so not held
    policy = GoodputPolicy(prior_weight=0.0, decay=1.0)  # the estimate is then accepted / reached
    policy.bind(SHAPE)
    policy.choose(query(ids))
    policy.observe(request_ids, lengths, accepted)
    for request_id in ids:
        mine = request_ids == request_id
        reached = [int(((lengths[mine] > k) & (accepted[mine] >= k)).sum()) for k in range(S)]
        taken = [int((accepted[mine] > k).sum()) for k in range(S)]
        expected = [t / r if r else np.nan for t, r in zip(taken, reached)]
        assert np.allclose(policy.acceptance(int(request_id)), expected, equal_nan=True), request_id


def test_step_costs_drop_a_lone_outlier_but_follow_a_lasting_change():
    model = StepCostModel(smoothing=1.0)  # each accepted sample replaces the estimate
    model.record(8, 0, wall_seconds=1e-3, gpu_seconds=None)
    model.record(8, 2, wall_seconds=50e-3, gpu_seconds=None)  # a pause on the first D = 2 step
    assert model.seconds(8, 2) == 1e-3 and not model.is_measured(8, 2)  # dropped: the cheapest wall at grid 8
    model.record(8, 2, wall_seconds=1.5e-3, gpu_seconds=None)
    assert model.seconds(8, 2) == 1.5e-3
    for _ in range(3):  # a lasting change is taken on its third sample
        model.record(8, 2, wall_seconds=9e-3, gpu_seconds=None)
    assert model.seconds(8, 2) == 9e-3


class Repeating(DraftLengthPolicy):
    """Returns S for everyone, except 1 on the choices listed in ``change_at``."""

    decide_every, longest_hold = 2, 8

    def __init__(self, change_at=()):
        super().__init__()
        self.change_at, self.steps = set(change_at), []  # query.steps of each choice

    def choose(self, query):
        self.steps.append(query.steps)
        return np.full(query.caps.shape, 1 if len(self.steps) in self.change_at else S, dtype=np.int64)


def test_a_repeated_choice_holds_twice_as_long_up_to_longest_hold():
    policy = Repeating(change_at=(6,))
    lengths = DraftLengths(policy, SHAPE)
    ids = np.array([3, 5], dtype=np.int64)
    for _ in range(60):
        lengths.choose(ids, 2, 8)
    # held 2, then doubled while repeated (4, 8, 8); the 6th choice differs: back to 2, then 2 (the
    # 7th differs from the 6th), doubling again
    assert policy.steps[:10] == [1, 2, 4, 8, 8, 8, 2, 2, 4, 8], policy.steps
    asked = len(policy.steps)
    policy.joins_take_held_depth = False
    lengths.choose(np.array([3, 5, 7], dtype=np.int64), 3, 8)  # a request joined: asked at once
    assert len(policy.steps) == asked + 1


def test_one_depth_chosen_again_for_a_changing_batch_holds_twice_as_long():
    """A queue's batch changes every few steps (a request finishes, the next joins): one depth for
    everyone chosen again doubles the hold as it does for an unchanged batch (the policy is asked
    once in longest_hold steps, not once in decide_every); a choice of lengths by request for
    another batch starts over."""
    policy = Repeating()  # S for everyone
    lengths = DraftLengths(policy, SHAPE)
    for step in range(60):
        ids = np.arange(step // 3, step // 3 + 4, dtype=np.int64)  # one leaves and one joins every 3 steps
        lengths.choose(ids, 4, 8)
    assert policy.steps[:6] == [1, 2, 4, 8, 8, 8], policy.steps
    by_request = ByRequest()
    lengths = DraftLengths(by_request, SHAPE)
    for step in range(12):
        ids = np.arange(step // 3, step // 3 + 4, dtype=np.int64)
        lengths.choose(ids, 4, 8)
    assert set(by_request.steps[1:]) == {1, 2}, by_request.steps  # never doubled: the batch and its lengths changed


def test_a_joining_request_takes_the_held_depth_until_the_hold_ends():
    """``joins_take_held_depth`` (the default): a request that joins while a choice holds drafts
    the held depth D (its cap if lower) without asking the policy; the hold does not restart, and
    when it ends the policy sees every request."""
    policy = Repeating(change_at=(1,))  # D = 1 on the first choice, S after
    lengths = DraftLengths(policy, SHAPE)
    lengths.add(8, SamplingParams(num_speculative_tokens=0))  # capped below D
    assert lengths.choose(np.array([3, 5], dtype=np.int64), 2, 8).tolist() == [1, 1]
    assert lengths.choose(np.array([5, 7, 8], dtype=np.int64), 3, 8).tolist() == [1, 1, 0]  # 3 left, 7 and 8 joined
    assert len(policy.steps) == 1
    assert lengths.choose(np.array([5, 7, 8], dtype=np.int64), 3, 8).tolist() == [S, S, 0]  # the hold (2) ended
    assert policy.steps == [1, 2]


class ByRequest(Repeating):
    joins_take_held_depth = False  # lengths per request: a join asks at once

    def choose(self, query):
        self.steps.append(query.steps)
        return query.request_ids % (S + 1)


def test_a_held_choice_serves_a_batch_that_lost_requests():
    """Requests leaving do not ask the policy (the others keep their lengths, in the new row
    order); a new request does."""
    policy = ByRequest()
    lengths = DraftLengths(policy, SHAPE)
    assert lengths.choose(np.array([5, 6, 7, 9], dtype=np.int64), 4, 8).tolist() == [1, 2, 3, 1]
    assert lengths.choose(np.array([9, 6], dtype=np.int64), 2, 8).tolist() == [1, 2]  # two finished, rows moved
    assert len(policy.steps) == 1
    assert lengths.choose(np.array([9, 6, 11], dtype=np.int64), 3, 8).tolist() == [1, 2, 3]  # one joined
    assert len(policy.steps) == 2


def test_in_a_queue_a_depth_is_priced_by_its_rows_and_the_prompt_chunks_its_tokens_bring():
    """While requests wait, a freed slot takes the next request: a step's prompt chunks come with the
    requests that finish, as many as its tokens finish. With the warm-up's row costs (decode-only
    steps weight-bound: a row 0.01 of a step; steps with chunks compute-bound: a row 0.1) and every
    recent step carrying 100 chunk rows, a depth's drafts cost their rows at the mixed steps' price
    plus the chunk rows their tokens bring: at acceptance 0.3 no depth pays (D = 0), where the
    decode-only costs (nobody waits) make drafting pay (D >= 1)."""
    G = 8
    policy = GoodputPolicy(drain_objective=False, explore_within=1.0, min_gain=1.0)
    policy.bind(SHAPE)
    model = policy.cost_model
    model.set_row_costs({**{(G, G * (1 + D), D, False): 1.0 + 0.01 * G * D for D in range(S + 1)},
                         **{(G, T, D, True): 1.0 + 0.1 * (T - G) for D in range(S + 1) for T in range(G, 256)}})
    for depth in range(S + 1):  # every depth measured (no exploration): the loop's wall = the GPU's
        model.record(G, depth, 1.0 + 0.01 * G * depth, 1.0 + 0.01 * G * depth)
    for _ in range(200):  # every recent step carried 100 chunk rows
        model.record_launches(1, 1)
        model.record_prefill_rows(100)
    ids = np.arange(G, dtype=np.int64)
    for _ in range(40):
        policy.choose(query(ids, batch_size=G))
        for accepted in range(S + 1):
            weight = 0.3 ** accepted * ((1 - 0.3) if accepted < S else 1.0)
            for _ in range(int(round(weight * 10))):
                policy.observe(ids, np.full(G, S), np.full(G, accepted))
    free = policy.choose(query(ids, batch_size=G))  # nobody waits: decode-only costs blended by the mixed share
    assert policy.last_depth >= 1, free
    for _ in range(3):  # a queue: every depth priced by its rows, its chunk rows scaled by its tokens
        lengths = policy.choose(DraftLengthQuery(ids, np.full(G, S), S, G, num_waiting=50))
        assert lengths.tolist() == [0] * G, lengths


def test_a_decision_imports_nothing_while_serving():
    """The first decisions of a fresh process (a request ranked, the drain, a queue) import no module:
    an import there is host time inside a serving step (numpy's np.unique imports numpy.ma lazily,
    ~50 ms on the GPU hosts)."""
    import subprocess
    import sys

    script = """
import sys
import numpy as np
import torch
from mtp_ctrl.controllers.draft_policy import DraftLengthQuery, GoodputPolicy
from mtp_ctrl.state import EngineShape
shape = EngineShape(max_requests=8, max_model_len=64, block_size_tokens=4, num_speculative_tokens=2,
                    max_tokens_per_step=64, device=torch.device("cpu"))
policy = GoodputPolicy()
policy.bind(shape)
before = set(sys.modules)
ids = np.arange(8, dtype=np.int64)
for waiting, left in ((0, None), (0, np.full(8, 20)), (4, np.arange(8) + 5)):
    policy.choose(DraftLengthQuery(ids, np.full(8, 2), 2, 8, 1, waiting, left, 30 if waiting else None))
    policy.observe(ids, np.full(8, 2), np.ones(8, dtype=np.int64))
    policy.forget(int(ids[0]))
    ids = ids + 1
print(sorted(set(sys.modules) - before))
"""
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.strip().splitlines()[-1] == "[]"
