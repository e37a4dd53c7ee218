"""rejection_sample: the Triton kernel (interpreter) == its torch twin on random steps (S = 1..3,
decode and prefill rows, padding and masked drafts, empty batch, greedy requests among sampled ones,
top-k / top-p, several tiles), known answers, the exact law of the output (chi-square over seeds)
for a good, a bad (uniform) and a missing (one-hot) q, the acceptance rate 1 - TV(p, q), and
validation errors."""

import math

import pytest
import torch

from mtp_ctrl.triton_ops import reference, rejection_sample, rejection_sampling
from tests.unit.controller_fixtures import chi_square_p_value
from tests.unit.rejection_cases import args_of, make_case


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 16 entries, so small vocabularies take several tiles."""
    monkeypatch.setattr(rejection_sampling, "BLOCK_VOCAB_MAX", 16)


@pytest.mark.parametrize("num_decode,num_other,S,vocab_size,seed,with_q,zeros", [
    (0, 0, 2, 32, 0, True, 0.0), (1, 0, 1, 1, 1, True, 0.0), (0, 3, 2, 20, 2, True, 0.0),
    (4, 2, 1, 50, 3, True, 0.3), (3, 2, 2, 33, 4, False, 0.5), (3, 0, 3, 16, 5, True, 0.0),
    (2, 3, 3, 40, 6, True, 0.8), (3, 1, 2, 64, 7, False, 0.3)])
def test_kernel_matches_twin(small_tiles, num_decode, num_other, S, vocab_size, seed, with_q, zeros):
    case = make_case(num_decode, num_other, S, vocab_size, seed, with_q, zeros)
    got = rejection_sample(*args_of(case))
    assert got.dtype == torch.int64 and got.shape == (num_decode * (S + 1) + num_other,)
    assert torch.equal(got, reference.rejection_sample(*args_of(case)))


def test_kernel_matches_twin_one_tile_half_precision_and_in_place():
    for seed, dtype in [(10, torch.float32), (11, torch.bfloat16), (12, torch.float16)]:
        case = make_case(2, 1, 2, 40, seed, dtype=dtype)
        assert torch.equal(rejection_sample(*args_of(case)), reference.rejection_sample(*args_of(case)))
    case = make_case(2, 1, 2, 20, 13)
    want = reference.rejection_sample(*args_of(case))
    out = case["target_tokens"].clone()
    assert rejection_sample(*args_of(case)[:3], out, *args_of(case)[4:], out=out) is out  # in place over the samples
    assert torch.equal(out, want)
    twin_out = torch.empty(7, dtype=torch.int64)
    assert reference.rejection_sample(*args_of(case), out=twin_out) is twin_out
    assert torch.equal(twin_out, want)


def test_rows_without_a_draft_and_greedy_requests_keep_the_target_token():
    S, case = 2, make_case(6, 3, 2, 30, 14, num_slots=8)
    got = rejection_sample(*args_of(case))
    rows = torch.arange(got.shape[0])
    following = torch.cat([case["input_tokens"][1:], torch.tensor([-1])])
    has_draft = (rows < 6 * (S + 1)) & (rows % (S + 1) < S) & (following >= 0) & (following < 30)
    keep = ~has_draft | (case["temperature"][case["row_slots"]] == 0.0)
    assert keep.any() and (~keep).any()
    assert torch.equal(got[keep], case["target_tokens"][keep])
    # a row with a draft yields the draft (accepted) or a token != the draft (residual)
    assert (~keep & (got != following)).any() and (~keep & (got == following)).any()


def _one_draft_each(logits_p, logits_q, drafts, seeds, positions, temperature=1.0, top_k=0, top_p=1.0):
    """Arguments of a step of decode requests with S = 1, one per draft: request i in slot i,
    rows 2i (tests ``drafts[i]``) and 2i + 1 (its bonus row, keeps -1)."""
    n = drafts.shape[0]
    vocab_size = logits_p.shape[-1]
    input_tokens = torch.stack([torch.full((n,), -1), drafts], 1).reshape(-1)  # [2n]
    return [logits_p.expand(2 * n, vocab_size), None if logits_q is None else logits_q.expand(n, 1, vocab_size),
            input_tokens, torch.full((2 * n,), -1), torch.arange(n).repeat_interleave(2),
            positions.repeat_interleave(2), torch.tensor([n]), 1, torch.full((n,), temperature),
            torch.full((n,), top_k), torch.full((n,), top_p), seeds]


def test_known_answers():
    log = torch.log
    p = log(torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 1.0, 0.0]]))
    q = log(torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]))
    for op in (rejection_sample, reference.rejection_sample):
        got = []
        for row, draft in enumerate((1, 2, 0)):
            args = _one_draft_each(p[row], q[row], torch.tensor([draft]), torch.tensor([row + 1]),
                                   torch.tensor([row + 5]))
            got.append(op(*args)[0].item())
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


@pytest.mark.parametrize("temperature,top_k,top_p,q_kind", [
    (1.0, 0, 1.0, "mtp"), (0.7, 0, 1.0, "mtp"), (1.0, 3, 1.0, "mtp"), (1.0, 0, 0.8, "mtp"), (0.7, 5, 0.75, "mtp"),
    (1.0, 0, 1.0, "uniform"), (0.7, 4, 0.9, "uniform"), (1.0, 0, 1.0, "one_hot"), (0.7, 3, 0.9, "one_hot")])
def test_output_follows_the_target_distribution(temperature, top_k, top_p, q_kind):
    """Drafts drawn from q with the request's own noise (seed, position), as the MTP proposer does;
    the token follows p (filtered like sampling) whatever q is; acceptance rate 1 - TV(p, q)."""
    draws = 20000
    filters = torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p])
    p = reference.sampling_probs(LOGITS_P[None], *filters)[0]
    logits_q = {"mtp": LOGITS_Q, "uniform": torch.zeros(8), "one_hot": None}[q_kind]
    seeds, positions = torch.arange(draws) % 7 + 2**33, torch.arange(draws) // 7 + 100
    if logits_q is None:  # a deterministic drafter: always the same (here unlikely) token
        drafts = torch.full((draws,), int(LOGITS_P.argmin()))
        q = torch.zeros(8).scatter_(0, drafts[:1], 1.0)
    else:
        q = reference.sampling_probs(logits_q[None], *filters)[0]
        drafts = (q.log() + reference.gumbel_noise(seeds, positions, 8)).argmax(-1)
    # the rule on the filtered p and q (what the op computes, cheaper for 20000 draws), draft index 0
    tokens = reference.rejection_rule(p.expand(draws, -1), None if logits_q is None else q.expand(draws, -1), drafts,
                                      torch.full((draws,), -1), torch.full((draws,), temperature), seeds, positions,
                                      torch.zeros(draws, dtype=torch.int64))
    counts = torch.bincount(tokens, minlength=8).double()
    assert counts[p == 0].sum() == 0  # nothing outside the top-k / top-p support
    kept = p > 0
    assert chi_square_p_value(counts[kept], p[kept].double() * draws) > 1e-3  # significance 0.1%, fixed seeds
    accepted = float((tokens == drafts).double().mean())
    want = float(torch.minimum(p, q).sum())
    assert abs(accepted - want) < 5 * math.sqrt(want * (1 - want) / draws) + 1e-9  # 5 standard deviations
    first = slice(0, 4)  # the op (kernel and twin) draws the very same tokens from the logits
    args = _one_draft_each(LOGITS_P, logits_q, drafts[first], seeds[first], positions[first], temperature, top_k, top_p)
    assert torch.equal(reference.rejection_sample(*args)[0::2], tokens[first])
    kernel = rejection_sample(*_one_draft_each(LOGITS_P, logits_q, drafts[first], seeds[first], positions[first],
                                               temperature, top_k, top_p))[0::2]
    assert torch.equal(kernel, tokens[first])


def test_residual_noise_is_independent_of_the_draft_noise():
    """Rejected rows' tokens follow the normalised residual: fails if the residual draw reused the
    draft's noise (the draft's choice would bias it)."""
    p = torch.tensor([0.1, 0.6, 0.1, 0.2])
    q = torch.tensor([0.1, 0.1, 0.7, 0.1])
    draws = 20000
    seeds, positions = torch.arange(draws) + 11, torch.full((draws,), 3)
    drafts = (q.log() + reference.gumbel_noise(seeds, positions, 4)).argmax(-1)
    tokens = reference.rejection_rule(p.expand(draws, -1), q.expand(draws, -1), drafts, torch.full((draws,), -1),
                                      torch.ones(draws), seeds, positions, torch.zeros(draws, dtype=torch.int64))
    rejected = tokens != drafts
    residual = (p - q).clamp(min=0)
    counts = torch.bincount(tokens[rejected], minlength=4).double()
    kept = residual > 0
    assert counts[~kept].sum() == 0
    expected = residual[kept].double() / residual.sum() * float(rejected.sum())
    assert chi_square_p_value(counts[kept], expected) > 1e-3


# ----- validation ---------------------------------------------------------------------------


def test_validation_errors_name_the_argument():
    args = args_of(make_case(2, 1, 2, 10, 20, num_slots=4))  # K = 7, M = 4
    bad = [
        (0, torch.zeros(7, 10, dtype=torch.int64), TypeError, "logits"),
        (0, torch.zeros(7, 0), ValueError, "logits"),
        (1, torch.zeros(4, 2, 9), ValueError, "draft_logits"),
        (1, torch.zeros(4, 3, 10), ValueError, "draft_logits"),
        (2, torch.zeros(6, dtype=torch.int64), ValueError, "input_tokens"),
        (3, torch.zeros(7, dtype=torch.int32), TypeError, "target_tokens"),
        (4, torch.zeros(7), TypeError, "row_slots"),
        (5, torch.zeros(7, 2, dtype=torch.int64)[:, 0], ValueError, "positions"),
        (6, torch.zeros(2, dtype=torch.int64), ValueError, "num_decode"),
        (7, 0, ValueError, "num_speculative_tokens"),
        (7, 2.0, TypeError, "num_speculative_tokens"),
        (8, torch.zeros(4, dtype=torch.int64), TypeError, "temperature"),
        (9, torch.zeros(5, dtype=torch.int64), ValueError, "top_k"),
        (10, torch.zeros(4, dtype=torch.int64), TypeError, "top_p"),
        (11, torch.zeros(4, 1, dtype=torch.int64), ValueError, "seeds"),
    ]
    for index, value, error, name in bad:
        broken = list(args)
        broken[index] = value
        with pytest.raises(error, match=name):
            rejection_sample(*broken)
    with pytest.raises(ValueError, match="out"):
        rejection_sample(*args, out=torch.zeros(8, dtype=torch.int64))
