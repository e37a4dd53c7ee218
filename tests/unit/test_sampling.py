"""Sampling through triton_ops.sample_tokens: greedy, seeded determinism, top-k/top-p support.

The sampled distribution is tested in test_sampling_law.py, kernel == twin in test_sampling_kernel.py."""

import torch

from mtp_ctrl.triton_ops import sample_tokens
from mtp_ctrl.triton_ops.reference.sampling import filter_top_k_top_p, gumbel_noise


def _rows(num_rows, temperature=1.0, top_k=0, top_p=1.0, seed=7):
    return dict(
        temperature=torch.full((num_rows,), temperature),
        top_k=torch.full((num_rows,), top_k, dtype=torch.int64),
        top_p=torch.full((num_rows,), top_p),
        seeds=torch.full((num_rows,), seed, dtype=torch.int64),
    )


def test_greedy_rows_take_argmax():
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    params = _rows(6, temperature=0.0)
    tokens = sample_tokens(logits, positions=torch.arange(6), **params)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.equal(sample_tokens(logits, positions=torch.arange(6), all_greedy=True, **params), tokens)


def test_mixed_greedy_and_sampled_rows():
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(1))
    params = _rows(4, temperature=1.0)
    params["temperature"][::2] = 0.0
    tokens = sample_tokens(logits, positions=torch.arange(4), **params)
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))


def test_noise_is_a_pure_function_of_seed_position_and_vocab():
    seeds = torch.tensor([3, 3, 4], dtype=torch.int64)
    positions = torch.tensor([10, 11, 10], dtype=torch.int64)
    noise = gumbel_noise(seeds, positions, 50)
    assert torch.isfinite(noise).all()
    # the same (seed, position) pair gives the same noise, in any batch and any row
    again = gumbel_noise(seeds.flip(0), positions.flip(0), 50).flip(0)
    assert torch.equal(noise, again)
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])


def test_seeded_sampling_is_deterministic_and_seed_dependent(torch_twins):
    # the twin's noise (the kernel's bits == the twin's: test_sampling_law.py); 22 interpreted
    # 1000-token rows took a minute
    logits = torch.zeros(1, 1000)
    positions = torch.tensor([5])
    first = sample_tokens(logits, positions=positions, **_rows(1, seed=11))
    assert torch.equal(first, sample_tokens(logits, positions=positions, **_rows(1, seed=11)))
    draws = {int(sample_tokens(logits, positions=positions, **_rows(1, seed=s))) for s in range(20)}
    assert len(draws) > 15  # uniform over 1000 tokens: 20 seeds almost never collide much


def test_top_k_keeps_only_the_k_best():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    kept = filter_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(kept).tolist() == [[False, True, False, True, False]]
    positions = torch.arange(40)
    params = _rows(40, top_k=2)
    tokens = sample_tokens(logits.expand(40, -1), positions=positions, **params)
    assert set(tokens.tolist()) == {1, 3}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # mass before each sorted token: 0, 0.5, 0.8, 0.95 -> top_p 0.79 keeps the first two (top_p 0.8
    # itself is a tie that float32 exp rounds either way, depending on the CPU's vector math)
    kept = filter_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.79]))
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    kept = filter_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.81]))
    assert torch.isfinite(kept).tolist() == [[True, True, True, False]]
    kept = filter_top_k_top_p(logits, torch.tensor([0]), torch.tensor([1e-6]))
    assert torch.isfinite(kept).tolist() == [[True, False, False, False]]


def test_top_p_one_keeps_the_whole_vocabulary():
    # float32 cumsums over a large vocabulary reach 1.0 before the tail; top_p = 1 must not cut it
    logits = torch.randn(2, 150_000, generator=torch.Generator().manual_seed(5)) * 4
    kept = filter_top_k_top_p(logits, torch.zeros(2, dtype=torch.int64), torch.ones(2))
    assert torch.isfinite(kept).all()


def test_noise_of_nearby_keys_is_not_a_permutation():
    # rows whose keys could differ in only a few low bits must still draw independent noise
    positions = torch.arange(64, dtype=torch.int64)
    noise = gumbel_noise(torch.full((64,), 9, dtype=torch.int64), positions, 256)
    sorted_rows = noise.sort(dim=1).values
    assert not any(torch.equal(sorted_rows[i], sorted_rows[j]) for i in range(64) for j in range(i))


def test_tiny_temperature_is_greedy():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(2))
    tokens = sample_tokens(logits, positions=torch.arange(5), **_rows(5, temperature=1e-30))
    assert torch.equal(tokens, logits.argmax(-1))
