"""sample_tokens: the Triton kernel (interpreter) == its torch twin, == the old sort-based sampler
on rows without ties, the always-kept top token, known answers and validation errors."""

import pytest
import torch

from mtp_ctrl.triton_ops import gumbel_sampling, reference, sample_tokens
from tests.unit.sampling_cases import make_case, old_sample_tokens

ARG_ORDER = ("logits", "temperature", "top_k", "top_p", "seeds", "positions")


def _args(case):
    return [case[name] for name in ARG_ORDER]


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 32 entries, so small vocabularies take several tiles (and tile skipping runs)."""
    monkeypatch.setattr(gumbel_sampling, "BLOCK_VOCAB_MAX", 32)


@pytest.mark.parametrize(
    "num_rows,vocab_size,seed,ties,neg_inf",
    [(0, 64, 0, False, False), (1, 1, 1, False, False), (4, 1, 2, False, True), (1, 64, 3, False, False),
     (6, 3, 4, True, False), (12, 100, 5, False, False), (8, 257, 6, True, False), (12, 64, 7, False, True),
     (4, 512, 8, False, False), (20, 33, 9, True, True)],
)
def test_kernel_matches_twin(small_tiles, num_rows, vocab_size, seed, ties, neg_inf):
    case = make_case(num_rows, vocab_size, seed, ties=ties, neg_inf=neg_inf)
    got = sample_tokens(*_args(case))
    assert got.dtype == torch.int64 and got.shape == (num_rows,)
    assert torch.equal(got, reference.sample_tokens(*_args(case)))


def test_kernel_matches_twin_one_tile_and_half_precision():
    for seed, dtype in [(10, torch.float32), (11, torch.bfloat16), (12, torch.float16)]:
        case = make_case(4, 300, seed, dtype=dtype)
        assert torch.equal(sample_tokens(*_args(case)), reference.sample_tokens(*_args(case)))


def test_all_greedy_and_out(small_tiles):
    case = make_case(7, 90, 13)
    out = torch.full((7,), -5, dtype=torch.int64)
    result = sample_tokens(*_args(case), all_greedy=True, out=out)
    assert result is out and torch.equal(out, case["logits"].argmax(-1))
    twin_out = torch.empty(7, dtype=torch.int64)
    reference.sample_tokens(*_args(case), False, twin_out)
    assert torch.equal(sample_tokens(*_args(case), out=out), twin_out)


def test_new_sampler_equals_old_sort_based_sampler():
    """Without exact ties (continuous random logits) the threshold rule equals the old sorted cumsum."""
    for seed in range(3):
        case = make_case(600, 64, 100 + seed)
        case["top_p"] = case["top_p"].clamp(min=1e-6)  # the old code masks whole rows below float32's range
        assert torch.equal(reference.sample_tokens(*_args(case)), old_sample_tokens(*_args(case)))
    case = make_case(24, 128, 104)
    case["top_p"] = case["top_p"].clamp(min=1e-6)
    assert torch.equal(sample_tokens(*_args(case)), old_sample_tokens(*_args(case)))


def test_tiny_top_p_samples_greedily():
    """Issue 17 item 2. Fails on the old code: top_p = 1e-46 is 0.0 in float32, the old filter
    masked every token and argmax returned token 0 for every row."""
    gen = torch.Generator().manual_seed(14)
    logits = torch.randn(12, 50, generator=gen) * 2  # [12, 50], no ties
    params = dict(temperature=torch.full((12,), 0.8), top_k=torch.zeros(12, dtype=torch.int64),
                  top_p=torch.full((12,), 1e-46), seeds=torch.arange(12) * 7, positions=torch.arange(12) + 3)
    want = logits.argmax(-1)
    assert (want != 0).any()
    assert torch.equal(sample_tokens(logits, **params), want)
    assert torch.equal(reference.sample_tokens(logits, **params), want)


def test_known_answers_of_the_rule():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    for top_p, kept in [(0.79, [1, 1, 0, 0]), (0.81, [1, 1, 1, 0]), (1e-46, [1, 0, 0, 0]), (1.0, [1, 1, 1, 1])]:
        got = reference.filter_top_k_top_p(logits, torch.tensor([0]), torch.tensor([top_p]))
        assert torch.isfinite(got).long().tolist() == [kept]
    # top-k keeps ties at the k-th value; top-p is taken over the top-k mass (1/3 each here)
    ties = torch.tensor([[2.0, 1.0, 1.0, 0.0, 1.0]])
    got = reference.filter_top_k_top_p(ties, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(got).long().tolist() == [[1, 1, 1, 0, 1]]
    got = reference.filter_top_k_top_p(torch.tensor([[1.0, 1.0, 1.0, -5.0]]), torch.tensor([3]), torch.tensor([0.5]))
    assert torch.isfinite(got).long().tolist() == [[1, 1, 1, 0]]  # tied top tokens stay together
    # tokens drawn under top-k = 2 are the two best, under tiny top-p the best
    many = logits.expand(40, -1)
    params = dict(temperature=torch.ones(40), top_k=torch.full((40,), 2), top_p=torch.ones(40),
                  seeds=torch.arange(40), positions=torch.zeros(40, dtype=torch.int64))
    assert set(sample_tokens(many, **params).tolist()) == {0, 1}


def _valid_args(num_rows=3, vocab_size=5):
    return dict(logits=torch.zeros(num_rows, vocab_size), temperature=torch.ones(num_rows),
                top_k=torch.zeros(num_rows, dtype=torch.int64), top_p=torch.ones(num_rows),
                seeds=torch.zeros(num_rows, dtype=torch.int64), positions=torch.zeros(num_rows, dtype=torch.int64))


@pytest.mark.parametrize(
    "name,value,error",
    [("logits", torch.zeros(3, 5, dtype=torch.int64), TypeError), ("logits", torch.zeros(3, 0), ValueError),
     ("logits", torch.zeros(15), ValueError), ("temperature", torch.ones(2), ValueError),
     ("top_k", torch.zeros(3), TypeError), ("top_p", torch.ones(3, dtype=torch.int64), TypeError),
     ("seeds", torch.zeros(4, dtype=torch.int64), ValueError), ("positions", [0, 0, 0], TypeError),
     ("all_greedy", 1, TypeError), ("out", torch.zeros(3, dtype=torch.int32), TypeError),
     ("out", torch.zeros(2, dtype=torch.int64), ValueError), ("logits", torch.zeros(5, 3).t(), ValueError)],
)
def test_validation_names_the_argument(name, value, error):
    args = _valid_args()
    args[name] = value
    with pytest.raises(error, match=name):
        sample_tokens(**args)


@pytest.mark.parametrize("rounds,pivots", [(1, 2), (2, 4)])
def test_few_pivot_rounds_and_the_fallback_walk_match_twin(monkeypatch, rounds, pivots):
    """Coarse rounds: (1, 2) leaves 7 of 16 rows open for the last combine's single-program walk;
    (2, 4) narrows twice over tied values."""
    monkeypatch.setattr(gumbel_sampling, "ROUNDS", rounds)
    monkeypatch.setattr(gumbel_sampling, "NUM_PIVOTS", pivots)
    case = make_case(16, 200, 15 + rounds, ties=rounds == 2)
    assert torch.equal(sample_tokens(*_args(case)), reference.sample_tokens(*_args(case)))
