"""Torch twin of the sampling kernel: greedy, temperature, top-k, top-p and counter-based Gumbel noise.

The rule both implementations follow (row r, ``V`` vocabulary entries, logits ``x`` in float32):

- Greedy row (``temperature < GREEDY_TEMPERATURE``): the first index of ``max(x)``.
- Sampled row: ``z = x / temperature`` (float32 division), ``m = max(z)``, and for a value ``w``
  ``count_gt(w) = #{i: z_i > w}``, ``e_i = exp(z_i - m)`` (float32) for tokens inside top-k, else 0,
  ``mass_gt(w) = sum of e_i over z_i > w`` and ``Z = sum of all e_i`` (both summed in float64).
  A token of value ``w`` is kept iff
    top-k: ``top_k <= 0`` or ``top_k >= V`` or ``count_gt(w) < top_k`` (so every token >= the
    k-th largest value is kept: ties at the k-th value are all kept), and
    top-p: ``top_p >= 1`` or ``w >= m`` or ``mass_gt(w) < top_p * Z`` (computed in float64).
  Top-p is applied to the distribution renormalised over top-k. Both tests are monotone in ``w``,
  so the kept set is ``{z >= threshold}``: tied tokens are kept or dropped together, and the top
  token (``w == m``) is always kept, however small ``top_p`` is (a ``top_p`` below the smallest
  float32 does not mask the whole row). The token is the first index of
  ``max(z_i + gumbel_noise_i)`` over the kept tokens.

``gumbel_noise`` is a pure function of (seed, position, vocabulary id), so a token depends only on
its logits row, the row's parameters, its seed and its position: never on the batch.
Implementations differ only in float rounding (exp, log, summation order), which can change a
token only when ``top_p * Z`` lies within rounding of a cumulative mass or two noisy scores tie
within an ulp. Logits are finite or -inf (NaN and +inf give an unspecified token); a row that is
all -inf gives token 0.
"""

from typing import Optional

import torch

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31, so a product of one with a 32-bit value fits in int64.
_MULTIPLIER_A = 0x7FEB352D
_MULTIPLIER_B = 0x2C1B3C6D
_KEY_SALT_LOW = 0x9E3779B9
_KEY_SALT_HIGH = 0x85EBCA6B
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
    key_low = _mix32(_mix32((seeds & _MASK32) ^ _KEY_SALT_LOW) ^ (positions & _MASK32))  # [R] int64
    key_high = _mix32(_mix32(((seeds >> 32) & _MASK32) ^ _KEY_SALT_HIGH) ^ key_low)  # [R] int64
    vocab_ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)  # [V] int64
    spread = (vocab_ids * _MULTIPLIER_A) & _MASK32  # [V] int64, a bijection of the index
    bits = _mix32((_mix32(spread[None, :] ^ key_low[:, None]) + key_high[:, None]) & _MASK32)  # [R, V] int64
    # 23 random bits: (k + 0.5) / 2**23 stays strictly inside (0, 1) in float32, so the log is finite
    uniform = ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))  # [R, V] float32
    return -torch.log(-torch.log(uniform))


def filter_top_k_top_p(scaled_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``scaled_logits`` with every token outside the kept set (module docstring) set to -inf.

    scaled_logits: [R, V] float32 (already divided by temperature); top_k: [R] int (<= 0 or >= V:
    off); top_p: [R] float (>= 1: off). Returns [R, V] float32.

    Example: probabilities [0.5, 0.3, 0.15, 0.05] as logits: top_p = 0.79 keeps the first two
    (mass of better tokens 0 and 0.5 < 0.79); top_p = 1e-46 keeps only the first.
    """
    z = scaled_logits.float()  # [R, V] float32
    num_rows, vocab_size = z.shape
    if num_rows == 0:
        return z.clone()
    top_k, top_p = top_k.to(torch.int64), top_p.to(torch.float32)
    ascending = z.sort(dim=-1).values  # [R, V] float32
    # tokens strictly greater than each token's value
    count_gt = vocab_size - torch.searchsorted(ascending, z.contiguous(), right=True)  # [R, V] int64
    k_active = (top_k > 0) & (top_k < vocab_size)  # [R] bool
    in_top_k = ~k_active[:, None] | (count_gt < top_k[:, None])  # [R, V] bool
    row_max = ascending[:, -1:]  # [R, 1]
    safe_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)  # -inf rows: no NaN
    mass = torch.where(in_top_k, torch.exp(z - safe_max), torch.zeros_like(z))  # [R, V] float32
    # mass sorted by value, descending: the first count_gt entries are exactly the tokens above
    descending_mass = mass.gather(1, z.argsort(dim=-1, descending=True)).double()  # [R, V] float64
    prefix = torch.cat([descending_mass.new_zeros(num_rows, 1), descending_mass.cumsum(dim=-1)], dim=1)
    mass_gt = prefix.gather(1, count_gt)  # [R, V] float64
    total = prefix[:, -1:]  # [R, 1] float64
    p_off = (top_p >= 1.0)[:, None]  # [R, 1] bool
    in_top_p = p_off | (z >= row_max) | (mass_gt < top_p.double()[:, None] * total)  # [R, V] bool
    return torch.where(in_top_k & in_top_p, z, torch.full_like(z, _NEG_INF))


def sampling_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The distribution each row samples from: softmax of ``logits / T`` over the kept set of
    :func:`filter_top_k_top_p` (greedy rows use ``T = 1``). Shapes as in the public op; returns
    ``out`` (or a new tensor), [R, V] float32, zero outside the kept set (an all -inf row: zeros)."""
    temperature = temperature.float()  # [R] float32
    scale = torch.where(temperature < GREEDY_TEMPERATURE, torch.ones_like(temperature), temperature)  # [R]
    kept = filter_top_k_top_p(logits.float() / scale[:, None], top_k, top_p)  # [R, V] float32
    probs = kept.softmax(dim=-1).nan_to_num_(0.0)  # [R, V] float32
    if out is None:
        return probs
    out.copy_(probs)
    return out


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    all_greedy: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One token per row (rule in the module docstring). Shapes as in the public op; returns ``out``
    (or a new tensor), [R] int64."""
    x = logits.float()  # [R, V] float32
    temperature = temperature.float()  # [R] float32
    tokens = x.argmax(dim=-1) if x.shape[0] > 0 else x.new_zeros(0, dtype=torch.int64)  # [R] int64
    if not all_greedy and x.shape[0] > 0:
        is_greedy = temperature < GREEDY_TEMPERATURE  # [R] bool
        scale = torch.where(is_greedy, torch.ones_like(temperature), temperature)  # [R] float32
        kept = filter_top_k_top_p(x / scale[:, None], top_k, top_p)  # [R, V] float32
        sampled = (kept + gumbel_noise(seeds, positions, x.shape[1])).argmax(dim=-1)  # [R] int64
        tokens = torch.where(is_greedy, tokens, sampled)
    if out is None:
        return tokens
    out.copy_(tokens)
    return out
