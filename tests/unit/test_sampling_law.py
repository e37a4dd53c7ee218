"""The law of sampled tokens (issue 15 item 4): chi-square against softmax(logits / T) with top-k and
top-p applied, independent noise across seeds and positions, and batch invariance of the kernel."""

import math

import pytest
import torch

from mtp_ctrl.triton_ops import reference, sample_tokens
from tests.unit.sampling_cases import make_case

LOGITS = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 0.7, -3.0])  # [8]


def _expected_law(logits, temperature, top_k, top_p):
    """softmax(logits / T) over the top-k / top-p kept set, in float64, written independently."""
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    if 0 < top_k < len(order):
        order = order[:top_k]
    probs_k = probs[order] / probs[order].sum()
    kept, mass = [], 0.0
    for token, prob in zip(order, probs_k.tolist()):
        if mass >= top_p and kept:
            break
        kept.append(token)
        mass += prob
    law = torch.zeros_like(probs)
    law[kept] = probs[kept] / probs[kept].sum()
    return law


def _chi_square_p_value(counts, expected):
    """Upper tail of the chi-square statistic (Wilson-Hilferty normal approximation)."""
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = len(counts) - 1
    if dof == 0:
        return 1.0
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


# top_p values sit away from every cumulative mass of the kept distribution, so rounding cannot move them
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 0, 1.0), (1.5, 0, 1.0), (1.0, 3, 1.0),
                                                     (1.0, 0, 0.8), (0.7, 5, 0.75), (2.0, 4, 0.9)])
def test_sampled_frequencies_follow_the_filtered_softmax(temperature, top_k, top_p):
    draws = 20000  # one (seed, position) key per draw
    params = dict(temperature=torch.full((draws,), temperature), top_k=torch.full((draws,), top_k),
                  top_p=torch.full((draws,), top_p), seeds=torch.arange(draws) % 5 + 2**33,
                  positions=torch.arange(draws) // 5)
    tokens = reference.sample_tokens(LOGITS.expand(draws, -1), **params)
    law = _expected_law(LOGITS, temperature, top_k, top_p)
    counts = torch.bincount(tokens, minlength=len(LOGITS)).double()
    assert counts[law == 0].sum() == 0  # nothing outside the kept set
    kept = law > 0
    assert _chi_square_p_value(counts[kept], law[kept] * draws) > 1e-3  # significance 0.1%, fixed seeds
    # the kernel draws the very same tokens (its law is the twin's)
    first = slice(0, 24)
    kernel_tokens = sample_tokens(LOGITS.expand(24, -1), **{name: value[first] for name, value in params.items()})
    assert torch.equal(kernel_tokens, tokens[first])


def test_noise_is_uncorrelated_across_seeds_and_positions():
    vocab_size = 8192
    keys = [(7, 100), (7, 101), (8, 100), (7 + 2**32, 100), (2**40 + 7, 100), (0, 0), (0, 1), (1, 0)]
    seeds = torch.tensor([seed for seed, _ in keys])
    positions = torch.tensor([position for _, position in keys])
    noise = reference.gumbel_noise(seeds, positions, vocab_size).double()  # [8, V]
    correlation = torch.corrcoef(noise)
    off_diagonal = correlation[~torch.eye(len(keys), dtype=torch.bool)]
    assert off_diagonal.abs().max() < 0.06  # 1 / sqrt(V) = 0.011 is one standard deviation
    # each row is Gumbel(0, 1): mean = Euler's gamma, variance = pi^2 / 6
    assert (noise.mean(1) - 0.5772).abs().max() < 0.05
    assert (noise.var(1) - math.pi**2 / 6).abs().max() < 0.1


def test_kernel_noise_bits_equal_the_twin():
    # with flat logits the token is the argmax of the noise alone: the kernel's hash == the twin's
    num_rows = 24
    params = dict(temperature=torch.ones(num_rows), top_k=torch.zeros(num_rows, dtype=torch.int64),
                  top_p=torch.ones(num_rows), seeds=torch.arange(num_rows) * (2**31 + 3),
                  positions=torch.arange(num_rows) * 977)
    logits = torch.zeros(num_rows, 200)
    want = reference.gumbel_noise(params["seeds"], params["positions"], 200).argmax(-1)
    assert torch.equal(sample_tokens(logits, **params), want)
    assert len(set(want.tolist())) > 20  # distinct keys draw (nearly) distinct tokens


def test_kernel_tokens_are_batch_invariant():
    case = make_case(10, 96, 21)
    names = ("logits", "temperature", "top_k", "top_p", "seeds", "positions")
    tokens = sample_tokens(*[case[name] for name in names])
    order = torch.randperm(10, generator=torch.Generator().manual_seed(3))
    permuted = sample_tokens(*[case[name][order] for name in names])
    assert torch.equal(permuted, tokens[order])
    alone = torch.cat([sample_tokens(*[case[name][i:i + 1] for name in names]) for i in range(0, 10, 3)])
    assert torch.equal(alone, tokens[0:10:3])
    other = make_case(6, 96, 22)
    mixed = sample_tokens(*[torch.cat([other[name][:3], case[name], other[name][3:]]) for name in names])
    assert torch.equal(mixed[3:13], tokens)
