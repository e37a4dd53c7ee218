"""A queue's steps priced with the prompt chunks their finishing requests bring (issue 34):
``RowCostModel.queue_seconds`` (plain decoding's finish groups, drafting's Poisson joins), the
goodput policy's choice between a batch in lockstep and one spread, and what the controller tells
the policy about the requests that join."""

import math

import numpy as np
import pytest

from mtp_ctrl.controllers import SamplingParams
from mtp_ctrl.controllers import PerRequestGoodputPolicy
from mtp_ctrl.controllers.draft_policy import DraftLengthPolicy, DraftLengthQuery, GoodputPolicy
from mtp_ctrl.controllers.step_costs import RowCostModel
from mtp_ctrl.state import EngineShape
from tests.unit.draft_length_fixtures import controller_for, mtp_model  # noqa: F401 (fixture)


def stepped_model(largest=128):
    """G = 4: decode-only steps 1.0 (D = 0, 4 rows) and 1.5 (D = 1, 8 rows); a step with prompt chunks
    1.0 + 0.01 T at the bucket (16, 32, 64, ``largest``) its T rows pad to, either depth; chunks of 8 rows."""
    model = RowCostModel()
    buckets = [t for t in (16, 32, 64, largest) if t <= largest]
    model.set_row_costs({(4, 4, 0, False): 1.0, (4, 8, 1, False): 1.5,
                         **{(4, t, d, True): 1.0 + 0.01 * t for t in buckets for d in (0, 1)}})
    model.record_prefill_chunks(16, 2)
    return model, buckets


def bucket_seconds(rows, buckets):
    padded = next((t for t in buckets if t >= rows), buckets[-1])
    return (1.0 + 0.01 * padded) * max(rows / buckets[-1], 1.0)


def test_plain_steps_pay_their_finish_groups_and_drafting_steps_poisson_joins():
    model, buckets = stepped_model()
    assert model.chunk_rows == 8.0
    # plain (no request drafts): the 4 requests finish together, once a period of 10 steps: one step of 4 chunks
    plain = model.queue_seconds(4, np.array([4]), np.array([0]), np.array([0.0]), np.array([0.4]), np.array([4]), 10)
    assert np.allclose(plain, 1.0 + (bucket_seconds(4 + 32, buckets) - 1.0) / 10)
    spread = model.queue_seconds(4, np.array([4]), np.array([0]), np.array([0.0]), np.array([0.4]),
                                 np.array([1, 1, 1, 1]), 10)  # one finish a step: four mixed steps of 1 chunk
    assert np.allclose(spread, 1.0 + 4 * (bucket_seconds(4 + 8, buckets) - 1.0) / 10)
    # every request drafts (8 rows, D = 1): k ~ Poisson(0.7) joins a step (at most the batch, 4), each
    # step the bucket of 8 + 8 k rows: against a Monte Carlo of the joins
    drafting = model.queue_seconds(4, np.array([8]), np.array([1]), np.array([1.0]), np.array([0.7]), np.array([4]), 10)
    joins = np.minimum(np.random.default_rng(0).poisson(0.7, 400_000), 4)
    sampled = np.mean([1.5 if k == 0 else bucket_seconds(8 + 8 * k, buckets) for k in range(5)] @
                      (np.bincount(joins, minlength=5) / joins.shape[0]))
    assert abs(drafting[0] - sampled) < 2e-3
    # half the requests draft: half the plain groups' price, the drafting half's joins
    half = model.queue_seconds(4, np.array([8]), np.array([1]), np.array([0.5]), np.array([1.4]), np.array([4]), 10)
    alone = model.queue_seconds(4, np.array([8, 8]), np.array([1, 1]), np.array([0.0, 1.0]), np.array([0.0, 0.7]),
                                np.array([4]), 10)
    assert np.allclose(half, 1.5 + 0.5 * (alone[0] - 1.5) + (alone[1] - 1.5))
    # a group past the largest bucket: the largest bucket's time in proportion to its rows
    bulk = model.queue_seconds(4, np.array([4]), np.array([0]), np.array([0.0]), np.array([0.0]), np.array([20]), 10)
    assert np.allclose(bulk, 1.0 + (bucket_seconds(4 + 160, buckets) - 1.0) / 10)


def test_many_joins_a_step_stay_finite_and_at_most_the_batch():
    """Poisson weights in log space (exp(-lambda) underflows past ~745) and k at most the grid: a
    thousand joins a step at grid 4 cost what 4 chunks a step do."""
    model, buckets = stepped_model()
    many = model.queue_seconds(4, np.array([8, 8]), np.array([1, 1]), np.array([1.0, 1.0]), np.array([1000.0, 4.0]),
                               np.array([4]), 10)
    assert np.isfinite(many).all() and many[0] <= bucket_seconds(8 + 32, buckets) + 1e-9
    assert many[0] > many[1] * 0.99  # 4 joins on every step at most; Poisson(4) sometimes fewer


def test_queue_prices_need_a_measured_chunk_and_mixed_buckets():
    model = RowCostModel()
    model.set_row_costs({(4, 4, 0, False): 1.0, (4, 16, 0, True): 1.2})
    args = (4, np.array([4]), np.array([0]), np.array([0.0]), np.array([1.0]), np.array([4]), 10)
    assert model.queue_seconds(*args) is None  # no chunk seen yet
    model.record_prefill_chunks(24, 3)
    assert model.queue_seconds(*args) is not None
    decode_only = RowCostModel()
    decode_only.set_row_costs({(4, 4, 0, False): 1.0})
    decode_only.record_prefill_chunks(24, 3)
    assert decode_only.queue_seconds(*args) is None  # no mixed bucket timed


S, G, JOINING = 1, 8, 20
SHAPE = EngineShape(max_requests=G, max_model_len=128, block_size_tokens=4, num_speculative_tokens=S,
                    max_tokens_per_step=256)


def queue_policy(rate=0.6, policy_class=GoodputPolicy):
    """A goodput policy at grid 8, S = 1, requests accepting ``rate``; a step with prompt chunks costs
    its decode-only step plus 0.5 (a mixed step's own cost) plus 2 us a chunk row: prompts that join
    together share the 0.5, prompts that join one by one pay it each."""
    policy = policy_class()
    policy.bind(SHAPE)
    decode = {0: 1.0e-3, 1: 1.5e-3}
    policy.cost_model.set_row_costs({(G, G * (1 + d), d, False): s for d, s in decode.items()} | {
        (G, t, d, True): decode[d] + 0.5e-3 + 2e-6 * (t - G * (1 + d)) for d in (0, 1) for t in range(G * (1 + d), 400)})
    for depth, seconds in decode.items():  # measured by the loop (no exploration holds)
        policy.cost_model.record(G, depth, wall_seconds=seconds, gpu_seconds=None)
    policy.cost_model.record_prefill_chunks(16, 1)
    ids = np.arange(G, dtype=np.int64)
    policy.choose(DraftLengthQuery(ids, np.full(G, S), S, G))  # rows for the requests
    for _ in range(40):  # 10 verifies a round, `rate` of them accepted
        accepted = (np.arange(10) < round(10 * rate)).astype(np.int64)
        policy.observe(np.repeat(ids, 10), np.ones(10 * G, np.int64), np.tile(accepted, G))
    return policy, ids


@pytest.mark.parametrize("trial", range(3))
def test_a_batch_in_lockstep_stays_plain_where_a_spread_one_drafts(trial):
    """Equal tokens left: plain decoding's requests finish together and the next ones join in one
    mixed step a period (8 prompts share its cost: ~1.04 ms a step, 7.7 tokens/ms), where drafting
    spreads the finishes (0.64 joins a step, each paying a mixed step's cost: ~1.76 ms, 7.3
    tokens/ms). Spread tokens left: plain pays a mixed step per finish too (~1.21 ms, 6.6 tokens/ms),
    and drafting is worth it."""
    policy, ids = queue_policy()
    rng = np.random.default_rng(trial)
    order = rng.permutation(G)
    lockstep = DraftLengthQuery(ids[order], np.full(G, S), S, G, 8, 100, np.full(G, JOINING), JOINING)
    assert policy.choose(lockstep).tolist() == [0] * G
    spread = DraftLengthQuery(ids[order], np.full(G, S), S, G, 8, 100, JOINING - rng.permutation(G), JOINING)
    assert policy.choose(spread).tolist() == [1] * G
    # unknown or nonsense: priced by the recent chunks (row_seconds), the same for each
    fallbacks = {joining: queue_policy()[0].choose(DraftLengthQuery(ids, np.full(G, S), S, G, 8, 100,
                                                                      np.full(G, JOINING), joining)).tolist()
                 for joining in (None, 0, -4)}
    assert fallbacks[0] == fallbacks[-4] == fallbacks[None]


def test_the_per_request_policy_prices_a_queue_alike():
    """The same lockstep and spread batches for ``PerRequestGoodputPolicy``: its candidate without
    drafts keeps the bulk groups, one with drafts spreads the requests that draft."""
    policy, ids = queue_policy(policy_class=PerRequestGoodputPolicy)
    lockstep = DraftLengthQuery(ids, np.full(G, S), S, G, 8, 100, np.full(G, JOINING), JOINING)
    assert policy.choose(lockstep).tolist() == [0] * G
    policy, ids = queue_policy(policy_class=PerRequestGoodputPolicy)
    spread = DraftLengthQuery(ids, np.full(G, S), S, G, 8, 100, JOINING - np.arange(G), JOINING)
    assert policy.choose(spread).sum() > 0


class Queries(DraftLengthPolicy):
    """Records every query (S each)."""

    def __init__(self):
        super().__init__()
        self.queries = []

    def choose(self, query):
        self.queries.append(query)
        return query.caps


def test_the_controller_tells_the_policy_how_long_joining_requests_stay(mtp_model, torch_twins):  # noqa: F811
    """``joining_tokens``: the mean token budget of the next waiting requests (None once nobody
    waits); ``num_waiting`` and ``tokens_left`` beside it."""
    policy = Queries()
    controller = controller_for(mtp_model, 2, policy=policy, max_requests=2)
    budgets = [6, 6, 3, 5, 4]  # the first two are admitted at once; 3 / 5 / 4 wait
    for index, budget in enumerate(budgets):
        controller.add_request([1 + index, 2, 3], SamplingParams(max_new_tokens=budget))
    while controller.has_unfinished_requests():
        controller.step()
    first = policy.queries[0]
    assert (first.num_waiting, first.joining_tokens) == (3, 4)  # round(mean(3, 5, 4))
    assert first.tokens_left.tolist() == [6, 6]
    assert all((q.joining_tokens is None) == (q.num_waiting == 0) for q in policy.queries)
    assert policy.queries[-1].num_waiting == 0
