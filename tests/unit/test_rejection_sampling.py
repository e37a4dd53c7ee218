"""rejection_sample: the Triton kernel (interpreter) == its torch twin on random cases (padding rows,
empty batch, greedy rows among sampled ones, rows without a draft, top-k/top-p zeros, several
tiles), known answers, the exact law of the output (chi-square over seeds) for a good, a bad
(uniform) and a missing (one-hot) q, the acceptance rate 1 - TV(p, q), and validation errors."""

import math

import pytest
import torch

from mtp_ctrl.triton_ops import reference, rejection_sample, rejection_sampling
from tests.unit.controller_fixtures import chi_square_p_value
from tests.unit.rejection_cases import make_case

ARG_ORDER = ("target_probs", "draft_probs", "draft_tokens", "target_tokens", "temperature", "seeds", "positions",
             "draft_indices")


def _args(case):
    return [case[name] for name in ARG_ORDER]


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 16 entries, so small vocabularies take several tiles."""
    monkeypatch.setattr(rejection_sampling, "BLOCK_VOCAB_MAX", 16)


@pytest.mark.parametrize("num_rows,vocab_size,seed,with_q,zeros", [
    (0, 32, 0, True, 0.0), (1, 1, 1, True, 0.0), (1, 40, 2, False, 0.0), (24, 50, 3, True, 0.3),
    (17, 33, 4, False, 0.5), (40, 16, 5, True, 0.0), (9, 100, 6, True, 0.8), (12, 64, 7, False, 0.3)])
def test_kernel_matches_twin(small_tiles, num_rows, vocab_size, seed, with_q, zeros):
    case = make_case(num_rows, vocab_size, seed, with_q, zeros)
    got = rejection_sample(*_args(case))
    assert got.dtype == torch.int64 and got.shape == (num_rows,)
    assert torch.equal(got, reference.rejection_sample(*_args(case)))


def test_kernel_matches_twin_one_tile_half_precision_and_out():
    for seed, dtype in [(10, torch.float32), (11, torch.bfloat16), (12, torch.float16)]:
        case = make_case(10, 70, seed, dtype=dtype)
        assert torch.equal(rejection_sample(*_args(case)), reference.rejection_sample(*_args(case)))
    case = make_case(6, 20, 13)
    out = torch.full((6,), -5, dtype=torch.int64)
    assert rejection_sample(*_args(case), out=out) is out
    twin_out = torch.empty(6, dtype=torch.int64)
    assert reference.rejection_sample(*_args(case), out=twin_out) is twin_out
    assert torch.equal(out, twin_out)


def test_rows_without_a_draft_and_greedy_rows_keep_the_target_token():
    case = make_case(64, 30, 14)
    got = rejection_sample(*_args(case))
    drafts = case["draft_tokens"]
    keep = (drafts < 0) | (drafts >= 30) | (case["temperature"] == 0.0)
    assert keep.any() and (~keep).any()
    assert torch.equal(got[keep], case["target_tokens"][keep])
    # a row with a draft yields the draft (accepted) or a token != the draft (residual)
    rejected = ~keep & (got != drafts)
    assert rejected.any() and (~keep & (got == drafts)).any()


def test_known_answers():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 1.0, 0.0]])
    q = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    common = dict(target_tokens=torch.tensor([2, 2, 2]), temperature=torch.ones(3), seeds=torch.tensor([1, 2, 3]),
                  positions=torch.tensor([5, 6, 7]), draft_indices=torch.zeros(3, dtype=torch.int64))
    drafts = torch.tensor([1, 2, 0])
    for op in (rejection_sample, reference.rejection_sample):
        got = op(p, q, drafts, **common).tolist()
        assert got[0] == 1  # q == p: always accepted
        assert got[1] in (0, 1, 2)  # accepted with probability 0.5; rejected: 0 or 1 from [0.2, 0.3, 0]
        assert got[2] == 1  # p(d) = 0: rejected, the residual is one-hot at 1


def test_noise_streams_are_distinct_and_reproducible():
    seeds = torch.tensor([0, 5, 2**62, 2**63 - 1])
    for index in range(8):
        indices = torch.full((4,), index)
        accept, residual = reference.stream_seeds(seeds, indices)
        assert (accept >= 0).all() and (residual >= 0).all()
        assert not (accept == seeds).any() and not (residual == seeds).any() and not (accept == residual).any()
        if index:
            assert not (accept == reference.stream_seeds(seeds, indices - 1)[0]).any()
    uniform = reference.stream_uniform(torch.arange(20000), torch.arange(20000) % 7)
    assert 0.0 < float(uniform.min()) and float(uniform.max()) < 1.0
    assert abs(float(uniform.mean()) - 0.5) < 0.01
    noise = reference.gumbel_noise(torch.arange(20000), torch.arange(20000) % 7, 1)[:, 0]
    assert torch.equal(-torch.log(-torch.log(uniform)), noise)  # the uniform under the Gumbel noise at index 0


# ----- the law ------------------------------------------------------------------------------

LOGITS_P = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 0.7, -3.0])  # [8]
LOGITS_Q = torch.tensor([-1.0, 1.5, 0.5, 0.0, 2.0, -0.5, -2.0, 1.0])  # [8], far from p


def _draw(p, q, drafts, seeds, positions, draft_index=1):
    """Rejection samples of one (p, q) pair, one (seed, position) key per draft (the draft's key)."""
    draws = drafts.shape[0]
    return reference.rejection_sample(
        p.expand(draws, -1), None if q is None else q.expand(draws, -1), drafts, torch.full((draws,), -1),
        torch.ones(draws), seeds, positions, torch.full((draws,), draft_index))


@pytest.mark.parametrize("temperature,top_k,top_p,q_kind", [
    (1.0, 0, 1.0, "mtp"), (0.7, 0, 1.0, "mtp"), (1.0, 3, 1.0, "mtp"), (1.0, 0, 0.8, "mtp"), (0.7, 5, 0.75, "mtp"),
    (1.0, 0, 1.0, "uniform"), (0.7, 4, 0.9, "uniform"), (1.0, 0, 1.0, "one_hot"), (0.7, 3, 0.9, "one_hot")])
def test_output_follows_the_target_distribution(temperature, top_k, top_p, q_kind):
    """Drafts drawn from q with the request's own noise (seed, position), as the MTP proposer does;
    the token follows p (filtered like sampling) whatever q is; acceptance rate 1 - TV(p, q)."""
    draws = 20000
    def filtered(logits):
        return reference.sampling_probs(logits[None], torch.tensor([temperature]), torch.tensor([top_k]),
                                        torch.tensor([top_p]))[0]
    p = filtered(LOGITS_P)
    q = {"mtp": filtered(LOGITS_Q), "uniform": torch.full((8,), 1 / 8), "one_hot": None}[q_kind]
    seeds, positions = torch.arange(draws) % 7 + 2**33, torch.arange(draws) // 7 + 100
    if q is None:  # a deterministic drafter: always the same (here unlikely) token
        drafts = torch.full((draws,), int(LOGITS_P.argmin()))
    else:
        drafts = (q.log() + reference.gumbel_noise(seeds, positions, 8)).argmax(-1)
    tokens = _draw(p, q, drafts, seeds, positions)
    counts = torch.bincount(tokens, minlength=8).double()
    assert counts[p == 0].sum() == 0  # nothing outside the top-k / top-p support
    kept = p > 0
    assert chi_square_p_value(counts[kept], p[kept].double() * draws) > 1e-3  # significance 0.1%, fixed seeds
    accepted = float((tokens == drafts).double().mean())
    q_full = torch.zeros(8).scatter_(0, drafts[:1], 1.0) if q is None else q
    want = float(torch.minimum(p, q_full).sum())
    assert abs(accepted - want) < 5 * math.sqrt(want * (1 - want) / draws) + 1e-9  # 5 standard deviations
    first = slice(0, 12)  # the kernel draws the very same tokens
    kernel = rejection_sample(p.expand(12, -1), None if q is None else q.expand(12, -1), drafts[first],
                              torch.full((12,), -1), torch.ones(12), seeds[first], positions[first],
                              torch.ones(12, dtype=torch.int64))
    assert torch.equal(kernel, tokens[first])


def test_residual_noise_is_independent_of_the_draft_noise():
    """Rejected rows' tokens follow the normalised residual: fails if the residual draw reused the
    draft's noise (the draft's choice would bias it)."""
    p = torch.tensor([0.1, 0.6, 0.1, 0.2])
    q = torch.tensor([0.1, 0.1, 0.7, 0.1])
    draws = 20000
    seeds, positions = torch.arange(draws) + 11, torch.full((draws,), 3)
    drafts = (q.log() + reference.gumbel_noise(seeds, positions, 4)).argmax(-1)
    tokens = _draw(p, q, drafts, seeds, positions, draft_index=0)
    rejected = tokens != drafts
    residual = (p - q).clamp(min=0)
    counts = torch.bincount(tokens[rejected], minlength=4).double()
    kept = residual > 0
    assert counts[~kept].sum() == 0
    expected = residual[kept].double() / residual.sum() * float(rejected.sum())
    assert chi_square_p_value(counts[kept], expected) > 1e-3


# ----- validation ---------------------------------------------------------------------------


def test_validation_errors_name_the_argument():
    case = make_case(4, 10, 20)
    args = _args(case)
    bad = [
        (0, torch.zeros(4, 10, dtype=torch.int64), TypeError, "target_probs"),
        (0, torch.zeros(4, 0), ValueError, "target_probs"),
        (1, torch.zeros(4, 9), ValueError, "draft_probs"),
        (2, torch.zeros(3, dtype=torch.int64), ValueError, "draft_tokens"),
        (3, torch.zeros(4, dtype=torch.int32), TypeError, "target_tokens"),
        (4, torch.zeros(4, dtype=torch.int64), TypeError, "temperature"),
        (5, torch.zeros(4, 1, dtype=torch.int64), ValueError, "seeds"),
        (6, torch.zeros(4), TypeError, "positions"),
        (7, torch.zeros(4, 2, dtype=torch.int64)[:, 0], ValueError, "draft_indices"),
    ]
    for index, value, error, name in bad:
        broken = list(args)
        broken[index] = value
        with pytest.raises(error, match=name):
            rejection_sample(*broken)
    with pytest.raises(ValueError, match="out"):
        rejection_sample(*args, out=torch.zeros(5, dtype=torch.int64))
