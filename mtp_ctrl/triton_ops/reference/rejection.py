"""Torch twin of the rejection-sampling kernel (speculative sampling: Leviathan et al., Chen et al.).

:func:`rejection_sample` works on a step's logits rows: ``K`` rows, the first
``num_decode * (S + 1)`` of them decode requests' (row ``b + k``, ``k <= S``, of a request whose
rows start at ``b``), the rest without a draft. Row ``r`` of depth ``k = r % (S + 1)`` inside the
decode rows with ``k < S`` is compared with the draft ``d = input_tokens[r + 1]`` (``d_{k+1}``);
its request sits in table slot ``s = row_slots[r]``, whose temperature, top-k, top-p and seed are
``temperature[s]`` etc. Then ``p`` is :func:`sampling_probs` of ``logits[r]`` and ``q`` the same
of ``draft_logits[s, k]`` (the drafter's logits of that draft, filtered by the same rule), and the
token is :func:`rejection_rule` of them with draft index ``k``.

:func:`rejection_rule`, row k of ``K`` (vocabulary ``V``), with the target's distribution
``p = target_probs[k]``, the draft's ``q = draft_probs[k]`` (or one-hot at the draft when
``draft_probs`` is None) and the draft ``d = draft_tokens[k]``:

- No draft (``d`` outside ``[0, V)``, e.g. -1) or a greedy row (``temperature < GREEDY_TEMPERATURE``):
  the token is ``target_tokens[k]`` (the target's ordinary sample, argmax for greedy rows).
- Else, with ``u`` the accept stream's uniform at (seed, position, draft index), float32 in (0, 1):
  accept iff ``u * q(d) < p(d)`` (float32), i.e. with probability ``min(1, p(d) / q(d))``; the
  token is then ``d``.
- Rejected: a Gumbel-max draw (the residual stream's noise ``g``) from the residual
  ``w = max(0, p - q)`` with ``w(d) = 0``: the first index of ``max(log w_i + g_i)`` over ``w_i > 0``.
  If no ``w_i`` is positive (only float rounding can cause it: a rejection implies
  ``p(d) < q(d)``, so some other token has ``p > q``), the same draw from ``p`` without ``d``;
  if that is empty too, ``target_tokens[k]``.

So a rejected row never yields ``d``, and a row's token is distributed as ``p`` whatever ``q``
and ``d`` are, as long as ``d`` was drawn from ``q`` independently of the two streams below
(for one-hot ``q``, for any ``d`` independent of them): ``P(x) = q(x) min(1, p(x)/q(x)) +
(1 - sum_y min(p(y), q(y))) w(x) / sum w = p(x)``.

Noise streams: a request's draft is drawn with ``gumbel_noise(seed, position)`` (the target's
own noise); the accept uniform and the residual noise use :func:`stream_seeds`, derived seeds
that differ from the request's seed and from each other in both 32-bit halves, mixed with the
draft index. All are pure functions of (seed, position, draft index): a run is reproducible.
"""

from typing import Optional, Tuple

import torch

from mtp_ctrl.triton_ops.reference.sampling import (
    _KEY_SALT_HIGH,
    _KEY_SALT_LOW,
    _MASK32,
    _MULTIPLIER_A,
    _MULTIPLIER_B,
    GREEDY_TEMPERATURE,
    _mix32,
    gumbel_noise,
    sampling_probs,
)

_NEG_INF = float("-inf")
# Per stream (accept, residual): the salts XOR-ed into the seed's low and high halves. The high
# half keeps 31 bits, so a derived seed of a seed in [0, 2**63) stays in [0, 2**63).
ACCEPT_SALTS = (0x5BD1E995, 0x1B873593)
RESIDUAL_SALTS = (0xCC9E2D51, 0x68E31DA4)


def stream_seeds(seeds: torch.Tensor, draft_indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(accept_seeds, residual_seeds)``: [K] int64 each, the keys of the two noise streams.

    ``derived = seed ^ (((salt_high + i * A) & 0x7FFFFFFF) << 32 | ((salt_low + i * B) & 0xFFFFFFFF))``
    for draft index ``i`` (taken mod 2**32). Both halves change, so ``gumbel_noise``'s two key
    halves differ from the draft's; the two streams' tweaks differ for every index.
    """
    seeds = seeds.to(torch.int64)
    index = draft_indices.to(torch.int64) & _MASK32  # [K] int64 < 2**32: products stay below 2**63
    result = []
    for salt_low, salt_high in (ACCEPT_SALTS, RESIDUAL_SALTS):
        low = (salt_low + index * _MULTIPLIER_B) & _MASK32
        high = (salt_high + index * _MULTIPLIER_A) & 0x7FFFFFFF
        result.append(seeds ^ ((high << 32) | low))
    return result[0], result[1]


def stream_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[K] float32 in (0, 1): the uniform under ``gumbel_noise(seeds, positions, V)[:, 0]``
    (vocabulary index 0), ``(k + 0.5) / 2**23`` for 23 hashed bits ``k``."""
    seeds, positions = seeds.to(torch.int64), positions.to(torch.int64)
    key_low = _mix32(_mix32((seeds & _MASK32) ^ _KEY_SALT_LOW) ^ (positions & _MASK32))  # [K] int64
    key_high = _mix32(_mix32(((seeds >> 32) & _MASK32) ^ _KEY_SALT_HIGH) ^ key_low)  # [K] int64
    bits = _mix32((_mix32(key_low) + key_high) & _MASK32)  # vocabulary index 0 spreads to 0
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def rejection_sample(
    logits: torch.Tensor,
    draft_logits: Optional[torch.Tensor],
    input_tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    row_slots: torch.Tensor,
    positions: torch.Tensor,
    num_decode: torch.Tensor,
    num_speculative_tokens: int,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One token per logits row (module docstring). Shapes as in the public op; returns ``out``
    (or a new tensor), [K] int64. With ``out`` given it may be ``target_tokens`` itself."""
    num_rows, S = logits.shape[0], num_speculative_tokens
    stride = S + 1
    row_index = torch.arange(num_rows, device=logits.device)  # [K] int64
    depth = row_index % stride  # [K] int64: a decode row's draft is d_{depth + 1}
    has_draft = (row_index < num_decode.to(torch.int64) * stride) & (depth < S)  # [K] bool
    following = input_tokens.to(torch.int64)[(row_index + 1).clamp(max=max(num_rows - 1, 0))]  # [K] int64
    drafts = torch.where(has_draft, following, torch.full_like(following, -1))  # [K] int64
    slots = row_slots.to(torch.int64)  # [K] int64
    params = temperature[slots], top_k[slots], top_p[slots]  # [K] each
    p = sampling_probs(logits, *params)  # [K, V] float32
    q = None
    if draft_logits is not None:
        q = sampling_probs(draft_logits[slots, depth.clamp(max=max(S - 1, 0))], *params)  # [K, V] float32
    return rejection_rule(p, q, drafts, target_tokens, params[0], seeds[slots], positions, depth, out)


def rejection_rule(
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    draft_tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    draft_indices: torch.Tensor,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One token per row (the rule in the module docstring): ``target_probs`` ``[K, V]`` float,
    ``draft_probs`` ``[K, V]`` float or None (one-hot at the draft), ``draft_tokens`` ``[K]`` int
    (outside ``[0, V)``: no draft), ``target_tokens`` ``[K]`` int64, ``temperature`` ``[K]`` float,
    ``seeds``, ``positions``, ``draft_indices`` ``[K]`` int. Returns ``out`` (or a new tensor),
    [K] int64."""
    p = target_probs.float()  # [K, V] float32
    num_rows, vocab_size = p.shape
    drafts = draft_tokens.to(torch.int64)  # [K] int64
    tokens = target_tokens.to(torch.int64)  # [K] int64
    if num_rows > 0:
        has_draft = (drafts >= 0) & (drafts < vocab_size) & (temperature.float() >= GREEDY_TEMPERATURE)  # [K] bool
        safe_drafts = torch.where(has_draft, drafts, torch.zeros_like(drafts))  # [K] int64
        vocab_ids = torch.arange(vocab_size, device=p.device)  # [V] int64
        is_draft = vocab_ids[None, :] == safe_drafts[:, None]  # [K, V] bool
        q = is_draft.float() if draft_probs is None else draft_probs.float()  # [K, V] float32
        p_draft = p.gather(1, safe_drafts[:, None])[:, 0]  # [K] float32
        q_draft = q.gather(1, safe_drafts[:, None])[:, 0]  # [K] float32
        accept_seeds, residual_seeds = stream_seeds(seeds, draft_indices)
        accepted = stream_uniform(accept_seeds, positions) * q_draft < p_draft  # [K] bool
        noise = gumbel_noise(residual_seeds, positions, vocab_size)  # [K, V] float32
        residual = p - q  # [K, V] float32
        others = ~is_draft
        neg_inf = torch.full_like(p, _NEG_INF)
        ones = torch.ones_like(p)
        positive = others & (residual > 0)  # [K, V] bool
        residual_score = torch.where(positive, torch.log(torch.where(positive, residual, ones)) + noise, neg_inf)
        positive = others & (p > 0)
        fallback_score = torch.where(positive, torch.log(torch.where(positive, p, ones)) + noise, neg_inf)
        resampled = torch.where(
            residual_score.max(1).values > _NEG_INF, residual_score.argmax(1),
            torch.where(fallback_score.max(1).values > _NEG_INF, fallback_score.argmax(1), tokens))  # [K] int64
        tokens = torch.where(has_draft, torch.where(accepted, drafts, resampled), tokens)
    if out is None:
        return tokens.clone()
    out.copy_(tokens)
    return out
