"""sampling_probs: the kernel (interpreter) keeps the same top-k / top-p set as the sort-based filter
of the twin (ties, top_k = 1, top_p = 1, -inf, vocabulary and tile boundaries) and gives its softmax;
few pivots; known answers; validation errors."""

import pytest
import torch

from mtp_ctrl.triton_ops import reference, sampling_filter, sampling_probs
from mtp_ctrl.triton_ops.reference.sampling import GREEDY_TEMPERATURE, filter_top_k_top_p
from tests.unit.sampling_cases import make_case, old_filter_top_k_top_p

ARG_ORDER = ("logits", "temperature", "top_k", "top_p")


def _args(case):
    return [case[name] for name in ARG_ORDER]


def _scaled(case):
    """z = logits / T as the rule defines it, [R, V] float32."""
    temperature = case["temperature"].float()
    scale = torch.where(temperature < GREEDY_TEMPERATURE, torch.ones_like(temperature), temperature)
    return case["logits"].float() / scale[:, None]


def _assert_same_filter(case, probs):
    """``probs`` is the softmax over exactly the sort-based filter's kept set."""
    z = _scaled(case)
    kept = torch.isfinite(filter_top_k_top_p(z, case["top_k"], case["top_p"]))  # [R, V] bool
    row_max = z.max(dim=-1, keepdim=True).values
    # exp(z - m) underflows to 0 below about -87: there a kept token's probability is 0 either way
    representable = (z - row_max) > -80.0
    assert torch.equal((probs > 0) & representable, kept & representable)
    assert torch.equal(probs[~kept], torch.zeros_like(probs[~kept]))
    torch.testing.assert_close(probs, reference.sampling_probs(*_args(case)), rtol=1e-5, atol=1e-7)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 16 entries: small vocabularies take several tiles, and some end mid-tile."""
    monkeypatch.setattr(sampling_filter, "BLOCK_VOCAB_MAX", 16)


@pytest.mark.parametrize(
    "num_rows,vocab_size,seed,ties,neg_inf",
    [(0, 16, 0, False, False), (1, 1, 1, False, False), (4, 1, 2, False, True), (6, 3, 3, True, False),
     (12, 16, 4, True, False), (12, 17, 5, False, False), (16, 47, 6, True, True), (12, 100, 7, False, True),
     (8, 64, 8, True, False)],
)
def test_kernel_keeps_the_sort_based_filters_set(small_tiles, num_rows, vocab_size, seed, ties, neg_inf):
    case = make_case(num_rows, vocab_size, seed, ties=ties, neg_inf=neg_inf)
    probs = sampling_probs(*_args(case))
    assert probs.dtype == torch.float32 and probs.shape == (num_rows, vocab_size)
    _assert_same_filter(case, probs)


def test_many_random_rows_with_ties_top_k_one_and_top_p_one(small_tiles):
    """Randomized: 64 rows over several tiles; every row's parameters from the sampler's options
    (top_k 1, 2, V - 1, V, off; top_p 1, 1e-46, 0.3 .. 0.999), half of them with tied values."""
    for seed, ties in [(20, False), (21, True)]:
        case = make_case(32, 50, seed, ties=ties)
        case["top_k"][::5] = 1
        case["top_p"][1::5] = 1.0
        _assert_same_filter(case, sampling_probs(*_args(case)))


def test_new_filter_equals_the_old_cumsum_filter_without_ties():
    """Continuous logits (no exact ties): the kept set is the old sorted-cumsum filter's. Moderate
    temperatures: near-uniform rows (T = 1e30) sit within the old float32 cumsum's rounding of the cut."""
    case = make_case(24, 40, 30)
    case["top_p"] = case["top_p"].clamp(min=1e-6)  # the old code masks whole rows below float32's range
    case["temperature"] = case["temperature"].clamp(0.3, 2.0)
    probs = sampling_probs(*_args(case))
    old_kept = torch.isfinite(old_filter_top_k_top_p(_scaled(case), case["top_k"], case["top_p"]))
    representable = (_scaled(case) - _scaled(case).max(dim=-1, keepdim=True).values) > -80.0
    assert torch.equal((probs > 0) & representable, old_kept & representable)


def test_two_pivots_search_longer_and_agree(monkeypatch):
    """NUM_PIVOTS = 2 halves the key interval a pass: many passes, same kept set."""
    monkeypatch.setattr(sampling_filter, "NUM_PIVOTS", 2)
    case = make_case(16, 70, 40, ties=True)
    _assert_same_filter(case, sampling_probs(*_args(case)))


def test_half_precision_and_out():
    for seed, dtype in [(50, torch.bfloat16), (51, torch.float16)]:
        case = make_case(6, 40, seed, dtype=dtype)
        out = torch.full((6, 40), -1.0)
        assert sampling_probs(*_args(case), out=out) is out
        _assert_same_filter(case, out)


def test_known_answers():
    logits, one = torch.tensor([[0.0, 3.0, 1.0]]), torch.ones(1)
    got = sampling_probs(logits, one, torch.tensor([2]), one)
    torch.testing.assert_close(got, torch.tensor([[0.0, 0.880797, 0.119203]]))
    assert sampling_probs(logits, one, torch.tensor([2]), torch.tensor([0.5])).tolist() == [[0.0, 1.0, 0.0]]
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    for top_p, kept in [(0.79, [1, 1, 0, 0]), (0.81, [1, 1, 1, 0]), (1e-46, [1, 0, 0, 0]), (1.0, [1, 1, 1, 1])]:
        got = sampling_probs(probs.log(), torch.ones(1), torch.tensor([0]), torch.tensor([top_p]))
        assert (got > 0).long().tolist() == [kept]
    # ties at the k-th value are kept; tied top tokens stay together; greedy rows use T = 1
    got = sampling_probs(torch.tensor([[2.0, 1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, -5.0, -5.0]]),
                         torch.tensor([1.0, 0.0]), torch.tensor([2, 3]), torch.tensor([1.0, 0.5]))
    assert (got > 0).long().tolist() == [[1, 1, 1, 0, 1], [1, 1, 1, 0, 0]]
    assert sampling_probs(torch.full((1, 4), float("-inf")), torch.ones(1), torch.tensor([2]),
                          torch.tensor([0.5])).tolist() == [[0.0] * 4]


def _valid_args(num_rows=3, vocab_size=5):
    return dict(logits=torch.zeros(num_rows, vocab_size), temperature=torch.ones(num_rows),
                top_k=torch.zeros(num_rows, dtype=torch.int64), top_p=torch.ones(num_rows))


@pytest.mark.parametrize(
    "name,value,error",
    [("logits", torch.zeros(3, 5, dtype=torch.int64), TypeError), ("logits", torch.zeros(3, 0), ValueError),
     ("temperature", torch.ones(2), ValueError), ("top_k", torch.zeros(3), TypeError),
     ("top_p", torch.ones(3, dtype=torch.int64), TypeError), ("out", torch.zeros(3, 5, dtype=torch.float16), TypeError),
     ("out", torch.zeros(3, 4), ValueError), ("logits", torch.zeros(5, 3).t(), ValueError)],
)
def test_validation_names_the_argument(name, value, error):
    args = _valid_args()
    args[name] = value
    with pytest.raises(error, match=name):
        sampling_probs(**args)
