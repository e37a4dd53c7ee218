"""The draft-length policies on their own (host numbers, no model): the goodput rule's choices,
its acceptance estimates, determinism, and bad arguments."""

import numpy as np
import pytest

from mtp_ctrl.controllers.draft_policy import (DraftLengthQuery, FixedDraftLength, GoodputPolicy, RandomDraftLengths,
                                               StepCostModel)
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


@pytest.mark.parametrize("field,value", [("decay", 0.0), ("prior_weight", -1.0), ("optimistic_prior", 1.5)])
def test_bad_goodput_arguments(field, value):
    with pytest.raises(ValueError, match=field):
        GoodputPolicy(**{field: value})
