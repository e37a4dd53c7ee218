"""Token sampling with no host sync: greedy, temperature, top-k, top-p, per-request seeds.

Sampling is Gumbel-max with counter-based noise: the noise for vocabulary entry v when sampling
the token at position p of a request with seed s is a fixed hash of (s, p, v). So a token depends
only on the logits, the seed and its position, never on the batch, the step, or how many drafts
were verified with it. Two consequences:

- Speculative decoding reproduces plain decoding exactly for the same seeds (the target's sample
  at position p is the same draw in both), so acceptance by exact match is lossless, and each
  sampled token follows softmax(logits / temperature) restricted by top-k/top-p.
- Every tensor-parallel rank computes the same tokens from the same (gathered) logits; no
  broadcast is needed.

Example: argmax(logits / T + G) with G ~ Gumbel(0, 1) i.i.d. is a draw from softmax(logits / T).
"""

import torch

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31, so a product of one with a 32-bit value fits in int64.
_MULTIPLIER_A = 0x7FEB352D
_MULTIPLIER_B = 0x2C1B3C6D
_NEG_INF = float("-inf")
# Temperatures below this sample greedily: logits / T would overflow float32 long before T = 0.
GREEDY_TEMPERATURE = 1e-5


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """Avalanche a tensor of 32-bit values held in int64 (every result stays in [0, 2**32))."""
    h = h ^ (h >> 16)
    h = (h * _MULTIPLIER_A) & _MASK32
    h = h ^ (h >> 15)
    h = (h * _MULTIPLIER_B) & _MASK32
    return h ^ (h >> 16)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counter-based Gumbel(0, 1) noise.

    seeds: [R] int64 (>= 0), positions: [R] int64 -> [R, vocab_size] float32, a pure function of
    (seed, position, vocabulary index). Each row gets a 64-bit key (two mixed 32-bit halves);
    the vocabulary index enters through an odd multiplier and both halves, so two rows' noise
    vectors are never a permutation of each other when their keys differ.
    """
    seeds, positions = seeds.to(torch.int64), positions.to(torch.int64)
    key_low = _mix32(_mix32((seeds & _MASK32) ^ 0x9E3779B9) ^ (positions & _MASK32))  # [R] int64
    key_high = _mix32(_mix32(((seeds >> 32) & _MASK32) ^ 0x85EBCA6B) ^ key_low)  # [R] int64
    vocab_ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)  # [V] int64
    spread = (vocab_ids * _MULTIPLIER_A) & _MASK32  # [V] int64, a bijection of the index
    bits = _mix32((_mix32(spread[None, :] ^ key_low[:, None]) + key_high[:, None]) & _MASK32)  # [R, V] int64
    # 23 random bits: (k + 0.5) / 2**23 stays strictly inside (0, 1) in float32, so the log is finite
    uniform = ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))  # [R, V] float32
    return -torch.log(-torch.log(uniform))


def filter_top_k_top_p(scaled_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf.

    scaled_logits: [R, V] float32 (already divided by temperature); top_k: [R] int64 (0 = off);
    top_p: [R] float32 in (0, 1] (1 = off). Ties at the k-th value are all kept. The nucleus is
    the smallest prefix of the sorted distribution whose mass reaches top_p.
    """
    vocab_size = scaled_logits.shape[-1]
    sorted_logits, sorted_ids = scaled_logits.sort(dim=-1, descending=True)  # [R, V] each
    k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), torch.full_like(top_k, vocab_size))
    kth_value = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [R, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, _NEG_INF)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [R, V] mass of better tokens
    # top_p == 1 keeps everything (float32 cumsums can reach 1 before the tail)
    outside_nucleus = (mass_before >= top_p.unsqueeze(1)) & (top_p.unsqueeze(1) < 1.0)
    sorted_logits = sorted_logits.masked_fill(outside_nucleus, _NEG_INF)
    return torch.full_like(scaled_logits, _NEG_INF).scatter(1, sorted_ids, sorted_logits)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    all_greedy: bool = False,
) -> torch.Tensor:
    """Sample one token per row.

    logits: [R, V] float; temperature: [R] float32 (below GREEDY_TEMPERATURE = greedy row); top_k: [R] int64;
    top_p: [R] float32; seeds: [R] int64; positions: [R] int64, the position the sampled token
    will occupy. all_greedy: a host-side flag (from the requests' SamplingParams, not from tensor
    values) that skips the sampling path when no row samples. Returns [R] int64.
    """
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)  # [R] int64
    if all_greedy:
        return greedy_tokens
    is_greedy = temperature < GREEDY_TEMPERATURE
    safe_temperature = torch.where(is_greedy, torch.ones_like(temperature), temperature)
    scaled = filter_top_k_top_p(logits / safe_temperature.unsqueeze(1), top_k, top_p)
    sampled_tokens = (scaled + gumbel_noise(seeds, positions, logits.shape[-1])).argmax(dim=-1)
    return torch.where(is_greedy, greedy_tokens, sampled_tokens)
