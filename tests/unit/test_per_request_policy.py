"""PerRequestGoodputPolicy on its own (host numbers, no model): per-request lengths from the
acceptance estimates and a cost by rows (a 0.9 request drafts more than a 0.2 one), the module's
worked example, the drain objective, the join length, the row cost model, determinism."""

import numpy as np

from mtp_ctrl.controllers import PerRequestGoodputPolicy
from mtp_ctrl.controllers.draft_policy import DraftLengthQuery, GoodputPolicy
from mtp_ctrl.controllers.per_request_policy import RowCostModel
from mtp_ctrl.state import EngineShape

S, G = 3, 6
SHAPE = EngineShape(max_requests=8, max_model_len=64, block_size_tokens=4, num_speculative_tokens=S,
                    max_tokens_per_step=64)
RATES = {1: 0.9, 2: 0.6, 3: 0.2, 4: 0.9, 5: 0.6, 6: 0.2}


def row_costs(per_row=0.1, per_depth=0.0):
    """Warm-up row costs at grid G: ``1 + per_row (T - G) + per_depth D`` for every ragged count."""
    return {(G, T, D, False): 1.0 + per_row * (T - G) + per_depth * D for D in range(S + 1)
            for T in range(G, G * (1 + S) + 1)}


def trained(rates=RATES, steps=40, per_row=0.1, **options):
    """A policy that saw ``steps`` full-length verifies per request (expected counts), with every
    depth measured at grid G (no exploration) and the row costs above."""
    options.setdefault("explore_within", 1.0)  # no runner-up holds: the choice itself is the subject
    options.setdefault("retime_explored", False)  # nor a second timing of each depth
    policy = PerRequestGoodputPolicy(drain_objective=False, **options)
    policy.bind(SHAPE)
    policy.cost_model.set_row_costs(row_costs(per_row))
    for depth in range(S + 1):
        policy.cost_model.record(G, depth, 1.0, 1.0)
    ids = np.array(list(rates), dtype=np.int64)
    for _ in range(steps):
        policy.choose(DraftLengthQuery(ids, np.full(ids.shape, S), S, G))
        for request_id, rate in rates.items():
            for accepted in range(S + 1):
                weight = rate ** accepted * ((1 - rate) if accepted < S else 1.0)
                for _ in range(int(round(weight * 10))):
                    policy.observe(np.array([request_id]), np.array([S]), np.array([accepted]))
    return policy


def choose(policy, ids=tuple(RATES), caps=None, **fields):
    ids = np.array(ids, dtype=np.int64)
    caps = np.full(ids.shape, S, dtype=np.int64) if caps is None else np.array(caps, dtype=np.int64)
    return policy.choose(DraftLengthQuery(ids, caps, S, G, **fields))


def test_a_likely_request_drafts_more_than_an_unlikely_one():
    lengths = choose(trained())
    by_rate = {rate: [int(s) for request_id, s in zip(RATES, lengths) if RATES[request_id] == rate] for rate in (0.9, 0.6, 0.2)}
    assert min(by_rate[0.9]) > max(by_rate[0.2]), by_rate
    assert min(by_rate[0.9]) >= min(by_rate[0.6]) >= max(by_rate[0.2])
    assert max(by_rate[0.2]) == 0 and min(by_rate[0.9]) == S  # a row costs 10 % of a step: 0.2 drafts never pay
    free = choose(trained(per_row=0.0))  # rows cost nothing: everyone drafts S
    assert free.tolist() == [S] * len(RATES)
    assert choose(trained(per_row=5.0)).tolist() == [0] * len(RATES)  # a row costs 5 steps: nobody drafts


def test_caps_and_determinism():
    first, second = trained(), trained()
    caps = [1, 3, 3, 0, 2, 3]
    assert choose(first, caps=caps).tolist() == choose(second, caps=caps).tolist()
    assert (choose(first, caps=caps) <= np.array(caps)).all()


def test_the_worked_example():
    """The module docstring's: three requests of 0.9 / 0.6 / 0.2 at every depth (estimates from 1e5
    outcomes each, prior weight 0), a step costing 1 + 0.1 (rows - 3): s = (3, 1, 0)."""
    policy = PerRequestGoodputPolicy(drain_objective=False, prior_weight=0.0)
    policy.bind(SHAPE)
    policy.cost_model.set_row_costs({(3, T, D, False): 1.0 + 0.1 * (T - 3) for D in range(S + 1) for T in range(3, 13)})
    for depth in range(S + 1):
        policy.cost_model.record(3, depth, 1.0, 1.0)
    ids = np.array([7, 8, 9])
    choose(policy, ids)  # makes their rows
    for request_id, rate in zip(ids.tolist(), (0.9, 0.6, 0.2)):  # accepted k of S with probability rate^k (1 - rate)
        weights = [rate ** k * ((1 - rate) if k < S else 1.0) for k in range(S + 1)]
        accepted = np.repeat(np.arange(S + 1), np.round(np.array(weights) * 1e5).astype(np.int64))
        policy.observe(np.full(accepted.shape, request_id), np.full(accepted.shape, S), accepted)
    lengths = policy.choose(DraftLengthQuery(ids, np.full(3, S), S, 3))
    assert lengths.tolist() == [3, 1, 0]


def test_drain_objective_and_join_length():
    policy = trained()
    policy.drain_objective = True
    lengths = choose(policy, num_waiting=0, tokens_left=np.full(len(RATES), 40))
    assert lengths.shape == (len(RATES),) and (lengths[[0, 3]] >= lengths[[2, 5]]).all()
    choose(policy)
    assert 0 <= policy.join_length() <= S


def test_row_costs_pad_to_the_next_measured_count_and_add_the_loops_gap():
    model = RowCostModel()
    model.set_row_costs({(8, 8, 0, False): 1.0, (8, 12, 1, False): 1.2, (8, 16, 1, False): 1.5})
    assert model.row_seconds(8, np.array([8, 9, 12, 13]), np.array([0, 1, 1, 1])).tolist() == [1.0, 1.2, 1.2, 1.5]
    model.set_measured({(8, 1): 1.5})
    model.record(8, 1, 2.0, 1.5)  # the loop's wall 0.5 over its GPU time at D = 1
    assert model.row_seconds(8, np.array([12]), np.array([1])).tolist() == [1.7]
    plain = RowCostModel()  # no row costs: linear in rows between the D = 0 and D = 1 costs
    plain.record(8, 0, 1.0, None)
    plain.record(8, 1, 2.0, None)
    assert np.allclose(plain.row_seconds(8, np.array([8, 12, 16]), np.array([0, 1, 1])), [1.0, 1.5, 2.0])


def test_a_depth_the_warm_up_did_not_time_takes_the_linear_guess_not_a_shallower_depths_cost():
    model = RowCostModel()
    model.set_row_costs({(8, 8, 0, False): 1.0, (8, 16, 1, False): 2.0})  # D = 0 and 1 timed, D = 2 not
    for depth, wall in ((0, 1.0), (1, 2.0), (2, 3.0)):
        model.record(8, depth, wall, None)
    assert np.allclose(model.row_seconds(8, np.array([8, 16, 24]), np.array([0, 1, 2])), [1.0, 2.0, 3.0])


def test_steps_with_prefill_chunks_cost_their_token_bucket():
    """In a queue most steps carry a prompt chunk: their rows plus the chunk's pad to a token bucket
    (powers of two), and such a step is not ragged: each decode request runs ``1 + D`` rows whatever
    it drafts. Batch 6 of 0.9 / 0.6 / 0.2 requests, 6 chunk rows, buckets 16 and 32: D = 0 fits 16
    (12 rows), any D >= 1 pads to 32 (18 rows and up), so a ragged choice that would fit 16 (2 drafts
    for each 0.9 request: 10 rows) is not there to take. At bucket 32 twice bucket 16's cost drafting
    pays (~13.8 tokens for 2 against 6 for 1) and everyone drafts S; at three times it does not."""
    policy = trained(per_row=0.01)
    assert choose(policy).tolist() == [3, 3, 1, 3, 3, 1]
    model = policy.cost_model
    for bucket_32, expected in ((2.0, [3] * 6), (3.0, [0] * 6)):
        model.set_row_costs({**row_costs(per_row=0.01), **{(G, T, D, True): 1.0 if T == 16 else bucket_32
                                                            for D in range(S + 1) for T in (16, 32)}})
        for _ in range(200):
            model.record_launches(1, 1)  # every step carries a prefill chunk...
            model.record_prefill_rows(6)  # ... of 6 rows
        lengths = choose(policy)
        assert lengths.tolist() == expected, (bucket_32, lengths)


def test_in_a_queue_a_drafts_prefill_rows_are_dear_and_low_acceptance_requests_draft_nothing():
    """While requests wait, a freed slot takes the next one: a step's prompt chunks come with the
    requests that finish, so a candidate's chunk rows scale with its tokens a step. Every step mixed
    with 100 chunk rows, a row 0.1 of a plain step (a mixed step ``1 + 0.1 (T - G)``): at the chunks
    as they came a 0.2 draft pays (0.2 tokens for 0.1, where a step yields ~1 token for 1); with the
    chunk rows its token brings (~8 rows a token here) it costs more than its worth."""
    policy = trained(per_row=0.1)
    model = policy.cost_model
    model.set_row_costs({**row_costs(per_row=0.1), **{(G, T, D, True): 1.0 + 0.1 * (T - G)
                                                       for D in range(S + 1) for T in range(G, 512)}})
    for _ in range(200):
        model.record_launches(1, 1)
        model.record_prefill_rows(100)
    fixed_chunks = choose(policy)  # nobody waits (no drain objective here): the chunks as they came
    assert fixed_chunks[[2, 5]].min() >= 1 and fixed_chunks[[0, 3]].tolist() == [S, S], fixed_chunks
    for _ in range(4):  # a queue: the chunks scale with each candidate's tokens
        lengths = choose(policy, num_waiting=100)
        assert lengths[[2, 5]].tolist() == [0, 0], lengths  # the 0.2 requests
        assert (lengths[[0, 3]] >= lengths[[1, 4]].max()).all() and (lengths[[1, 4]] <= 1).all(), lengths


def test_expected_drafts_follow_what_such_drafts_realised():
    """Drafts that land less often than their estimates said pull ``draft_yield`` below 1."""
    policy = trained()
    assert abs(policy.draft_yield() - 1.0) < 0.1
    choose(policy)
    ids = np.repeat(np.array(list(RATES), dtype=np.int64), 200)  # as many outcomes as the training's: none lands
    policy.observe(ids, np.full(ids.shape, S), np.zeros(ids.shape, dtype=np.int64))
    assert policy.draft_yield() < 0.7


def test_a_joined_request_counts_from_its_first_outcome_but_not_after_it_left():
    policy = trained()
    prior = policy.acceptance(99).copy()  # not seen: the batch's average
    policy.observe(np.full(8, 99), np.full(8, S), np.zeros(8, dtype=np.int64))  # joined, never chosen: 0 accepted
    assert policy.acceptance(99)[0] < prior[0] - 0.2
    policy.forget(98)
    policy.observe(np.full(8, 98), np.full(8, S), np.zeros(8, dtype=np.int64))  # left, its last outcomes
    assert np.allclose(policy.acceptance(98), policy.acceptance(97))  # no row: the average


def test_mixed_steps_cost_the_mean_of_their_recent_buckets():
    """The recent mixed steps' prefill rows one by one, not their average: 10 decode rows with chunks
    of 2 or 14 rows pad to 16 or 32 half the time each (at their average, 8, always to 32)."""
    model = RowCostModel()
    model.set_row_costs({(8, 8, 0, False): 1.0, (8, 16, 0, False): 1.0,
                         (8, 16, 0, True): 2.0, (8, 32, 0, True): 4.0})
    for rows in (2, 14) * 8:
        model.record_launches(1, 1)
        model.record_prefill_rows(rows)
    expected = 1.0 + model.mixed_share * (0.5 * 2.0 + 0.5 * 4.0 - 1.0)
    assert np.allclose(model.row_seconds(8, np.array([10]), np.array([0])), [expected])


def queued_loop(policy, steps=80, G=12, new_tokens=16, seed=0, per_row=0.03):
    """A scripted queue (no model): requests labelled 0.9 / 0.6 / 0.2 by id % 3 (each draft lands
    with that chance, given the ones before), refilled as they finish; the controller's side is
    ``DraftLengths`` (holds, joins); outcomes come to ``observe`` one step late. A step costs its
    rows (``row_costs``: ``per_row`` of a plain step each). Returns ``{rate: [s at each of a
    request's decode steps from its 5th on, while it has more than S tokens left]}``."""
    from mtp_ctrl.controllers.draft_lengths import DraftLengths
    rng = np.random.default_rng(seed)
    shape = EngineShape(max_requests=G, max_model_len=64, block_size_tokens=4, num_speculative_tokens=S,
                        max_tokens_per_step=G * (1 + S))
    lengths_of = DraftLengths(policy, shape)
    tier = {(G, d): 1.0 + per_row * G * d for d in range(S + 1)}
    lengths_of.set_step_costs(tier, row_costs={(G, T, d, False): 1.0 + per_row * (T - G) for d in range(S + 1)
                                               for T in range(G, G * (1 + S) + 1)})
    for depth in range(S + 1):  # every depth measured: no exploration
        policy.cost_model.record(G, depth, tier[(G, depth)], tier[(G, depth)])
    slots, next_id = {}, 0  # id -> [tokens left, drafts held, decode steps]
    lengths_of.queue_view = lambda ids: (1000, np.array([slots[i][0] for i in ids.tolist()]))
    by_rate, pending = {0.9: [], 0.6: [], 0.2: []}, None
    for _ in range(steps):
        while len(slots) < G:
            slots[next_id], next_id = [new_tokens, 0, 0], next_id + 1
        ids = np.array(sorted(slots), dtype=np.int64)
        if pending is not None:
            policy.observe(*pending)
        chosen = lengths_of.choose(ids, ids.shape[0], G)
        verified = np.array([slots[i][1] for i in ids.tolist()], dtype=np.int64)
        rates = np.array([(0.9, 0.6, 0.2)[i % 3] for i in ids.tolist()])
        lands = rng.random((ids.shape[0], S)) < rates[:, None]
        accepted = np.minimum(np.cumprod(lands, axis=1).sum(axis=1), verified)
        pending = (ids, verified, accepted)
        for request_id, s, a, rate in zip(ids.tolist(), chosen.tolist(), accepted.tolist(), rates.tolist()):
            slot = slots[request_id]
            slot[2] += 1
            if slot[2] > 4 and slot[0] > S:  # a request drafts at most its tokens left - 1: not the last steps
                by_rate[rate].append(s)
            slot[0], slot[1] = slot[0] - 1 - a, s
            if slot[0] <= 0:
                del slots[request_id]
                lengths_of.drop(request_id)
    return by_rate


def test_a_queue_orders_lengths_by_acceptance_within_a_few_steps():
    """Requests join every step and live ~8-20 steps (24 tokens): from a request's 5th step on
    (while it has more than S tokens left) a 0.9 request drafts more than a 0.6 one, which drafts
    more than a 0.2 one (a row costs 3 % of a plain step: s = 3 / 2 / 0 once the estimates are right;
    ~2.3 / 1.5 / 0.4 here; at 16 tokens GoodputPolicy's prior (weight 4, every depth toward the
    batch's) gave ~1.7 / 1.4 / 0.7: the first assertion fails)."""
    by_rate = queued_loop(PerRequestGoodputPolicy(), new_tokens=24)
    means = {rate: float(np.mean(s)) for rate, s in by_rate.items()}
    assert means[0.9] > means[0.6] + 0.4 and means[0.6] > means[0.2] + 0.4, means
    assert means[0.9] > 1.5 and means[0.2] < 1.0, means


class CallCounter:
    """Counts Python and C calls (numpy's included) under ``sys.setprofile``; ``python_calls``: the
    Python ones by function name."""

    def __enter__(self):
        import collections
        import sys
        self.calls, self.python_calls = 0, collections.Counter()

        def count(frame, event, arg):
            if event in ("call", "c_call"):
                self.calls += 1
            if event == "call":
                self.python_calls[frame.f_code.co_name] += 1
        sys.setprofile(count)
        return self

    def __exit__(self, *exc):
        import sys
        sys.setprofile(None)


def test_a_decision_is_a_fixed_number_of_calls_whatever_the_batch():
    """No per-request Python: a search (and a choice between searches, which makes fewer calls) makes
    about as many calls at 6 requests as at 60 (a per-request loop: 54 more), in either objective."""
    counts = {}
    for n in (6, 60):
        shape = EngineShape(max_requests=64, max_model_len=64, block_size_tokens=4, num_speculative_tokens=S,
                            max_tokens_per_step=256)
        for drain in (False, True):
            policy = PerRequestGoodputPolicy(search_every=2)
            policy.bind(shape)
            policy.cost_model.set_row_costs({(64, T, d, False): 1.0 + 0.01 * T for d in range(S + 1)
                                             for T in range(64, 257, 16)})
            for depth in range(S + 1):
                policy.cost_model.record(64, depth, 1.0, 1.0)
            ids = np.arange(n, dtype=np.int64)
            fields = dict(num_waiting=0, tokens_left=np.full(n, 20)) if drain else dict(num_waiting=5)
            query = DraftLengthQuery(ids, np.full(n, S), S, 64, **fields)
            policy.observe(ids, np.full(n, S), ids % (S + 1))
            policy.choose(query)  # rows made
            policy.observe(ids, np.full(n, S), ids % (S + 1))
            calls = {}
            for _ in range(2):  # one search, one choice on the kept price (search_every=2)
                searches = policy.searches
                with CallCounter() as counter:
                    policy.choose(query)
                calls[policy.searches > searches] = counter.calls
            counts[(n, drain)] = (calls[True], calls[False])
    for drain in (False, True):  # a branch may differ with the data (a one-depth best), not per request
        assert np.abs(np.subtract(counts[(6, drain)], counts[(60, drain)])).max() <= 8, counts
    assert all(kept < search / 3 for search, kept in counts.values()), counts


def test_estimates_stay_finite_with_a_zero_optimistic_prior():
    """``optimistic_prior=0`` before any draft lands: the batch's first-depth estimate is 0, and a
    request's deeper priors (scaled by its own over the batch's) stay finite, not 0/0."""
    policy = PerRequestGoodputPolicy(optimistic_prior=0.0)
    policy.bind(SHAPE)
    assert np.isfinite(policy.acceptance(0)).all()


def test_observe_looks_each_request_up_once():
    """``observe`` of requests that hold rows looks the batch up once (``RequestRows.rows``), as
    ``GoodputPolicy.observe`` does, not a second time (beside it: a check for missing rows and the
    draft yield's sums); it counts what ``GoodputPolicy`` counts, and a joined request (no row yet)
    gets its row and its outcomes."""
    ids = np.tile(np.arange(1, 7), 4)  # four steps' outcomes of the batch
    lengths, accepted = np.full(ids.shape, S), ids % (S + 1)
    calls, policies = {}, {}
    for kind in (GoodputPolicy, PerRequestGoodputPolicy):
        policy = policies[kind] = kind(prior_weight=1.0)
        policy.bind(SHAPE)
        choose(policy)  # rows for requests 1..6
        with CallCounter() as counter:
            policy.observe(ids, lengths, accepted)
        calls[kind] = counter.python_calls["rows"]
    assert calls[PerRequestGoodputPolicy] == calls[GoodputPolicy] == 1, calls
    for request_id in range(1, 7):  # the first depth's estimate (deeper ones have per-request priors)
        assert policies[GoodputPolicy].acceptance(request_id)[0] == \
            policies[PerRequestGoodputPolicy].acceptance(request_id)[0]
    joined = policies[PerRequestGoodputPolicy]
    joined.observe(np.array([5, 9, 9]), np.array([S, S, S]), np.array([S, 0, 0]))  # 9 joined since the choice
    assert joined.acceptance(9)[0] < joined.acceptance(5)[0]
