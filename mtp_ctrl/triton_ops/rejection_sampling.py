"""Rejection sampling of verified drafts in one Triton kernel: accept with min(1, p/q), else a draw
from the residual max(0, p - q).

The rule (noise streams, the float32 accept test, the residual and its fallback, ties) is written
once, in :mod:`mtp_ctrl.triton_ops.reference.rejection`. One program per row: rows without a draft,
greedy rows and accepted rows read a few scalars; a rejected row walks its vocabulary once in
``BLOCK_VOCAB`` tiles, keeping the first Gumbel argmax of the residual and of the fallback.

The token a row yields is what exact-match verification then compares with the draft: with
``out[b + k]`` the token of row ``b + k`` and ``d_{k+1}`` the draft in row ``b + k + 1``, an
accepted draft gives ``out[b + k] == d_{k+1}`` and a rejected one a token that differs from it,
so ``verify_and_commit`` keeps exactly the accepted prefix and the residual token after it.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import FLOAT_DTYPES, INDEX_DTYPES, ValidatedSignatures, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._layout_checks import check_contiguous, check_unit_last_stride
from mtp_ctrl.triton_ops.gumbel_sampling import _mix32, _noise
from mtp_ctrl.triton_ops.reference.rejection import stream_seeds
from mtp_ctrl.triton_ops.reference.sampling import GREEDY_TEMPERATURE

BLOCK_VOCAB_MAX = 1024
_NEG_INF = tl.constexpr(float("-inf"))
_VALIDATED = ValidatedSignatures()  # argument signatures that passed _check_args


@triton.jit
def _stream_keys(seed, position):
    """The 64-bit noise key (uint32 halves) of one (derived seed, position), as in ``gumbel_noise``."""
    seed_low = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_high = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key_low = _mix32(_mix32(seed_low ^ 0x9E3779B9) ^ (position & 0xFFFFFFFF).to(tl.uint32))
    key_high = _mix32(_mix32(seed_high ^ 0x85EBCA6B) ^ key_low)
    return key_low, key_high


@triton.jit
def _rejection_sample_kernel(
    P_PTR,  # [K, V] float, the target's distribution per row
    Q_PTR,  # [K, V] float, the draft's distribution per row (unused without HAS_Q)
    DRAFT_PTR,  # [K] int, the draft this row's token is compared with (outside [0, V): none)
    TARGET_PTR,  # [K] int64, the target's ordinary sample per row
    TEMPERATURE_PTR,  # [K] float
    ACCEPT_SEED_PTR,  # [K] int64, the accept stream's seed
    RESIDUAL_SEED_PTR,  # [K] int64, the residual stream's seed
    POSITIONS_PTR,  # [K] int, the position the row's token will occupy
    OUT_PTR,  # [K] int64
    p_row_stride, q_row_stride, vocab_size,
    GREEDY_TEMPERATURE: tl.constexpr, HAS_Q: tl.constexpr, BLOCK_VOCAB: tl.constexpr,
):
    row = tl.program_id(0)
    token = tl.load(TARGET_PTR + row).to(tl.int64)
    draft = tl.load(DRAFT_PTR + row).to(tl.int64)
    temperature = tl.load(TEMPERATURE_PTR + row).to(tl.float32)
    if (draft >= 0) & (draft < vocab_size) & (temperature >= GREEDY_TEMPERATURE):
        p_row = P_PTR + row.to(tl.int64) * p_row_stride
        q_row = Q_PTR + row.to(tl.int64) * q_row_stride
        position = tl.load(POSITIONS_PTR + row).to(tl.int64)
        p_draft = tl.load(p_row + draft).to(tl.float32)
        if HAS_Q:
            q_draft = tl.load(q_row + draft).to(tl.float32)
        else:
            q_draft = tl.full([], 1.0, tl.float32)
        accept_low, accept_high = _stream_keys(tl.load(ACCEPT_SEED_PTR + row).to(tl.int64), position)
        bits = _mix32(_mix32(accept_low) + accept_high)  # vocabulary index 0 spreads to 0
        uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        if uniform * q_draft < p_draft:
            token = draft
        else:
            key_low, key_high = _stream_keys(tl.load(RESIDUAL_SEED_PTR + row).to(tl.int64), position)
            lanes = tl.arange(0, BLOCK_VOCAB)
            best = tl.full([], _NEG_INF, tl.float32)
            best_idx = tl.full([], 0, tl.int64)
            fallback = tl.full([], _NEG_INF, tl.float32)
            fallback_idx = tl.full([], 0, tl.int64)
            for start in range(0, vocab_size, BLOCK_VOCAB):
                ids = start + lanes
                valid = ids < vocab_size
                p = tl.load(p_row + ids, mask=valid, other=0.0).to(tl.float32)
                if HAS_Q:
                    q = tl.load(q_row + ids, mask=valid, other=0.0).to(tl.float32)
                else:
                    q = tl.where(ids == draft, 1.0, 0.0)
                others = valid & (ids != draft)
                residual = p - q
                noise = _noise(ids, key_low, key_high)
                positive = others & (residual > 0.0)  # log of 1.0 where masked: no NaN, no warning
                score = tl.where(positive, tl.log(tl.where(positive, residual, 1.0)) + noise, float("-inf"))
                tile_best = tl.max(score, 0)
                better = tile_best > best  # earlier tiles win ties: first index
                best_idx = tl.where(better, start + tl.argmax(score, 0).to(tl.int64), best_idx)
                best = tl.maximum(best, tile_best)
                positive = others & (p > 0.0)
                score = tl.where(positive, tl.log(tl.where(positive, p, 1.0)) + noise, float("-inf"))
                tile_best = tl.max(score, 0)
                better = tile_best > fallback
                fallback_idx = tl.where(better, start + tl.argmax(score, 0).to(tl.int64), fallback_idx)
                fallback = tl.maximum(fallback, tile_best)
            token = tl.where(best > _NEG_INF, best_idx, tl.where(fallback > _NEG_INF, fallback_idx, token))
    tl.store(OUT_PTR + row, token)


def _check_args(target_probs, draft_probs, draft_tokens, target_tokens, temperature, seeds, positions,
                draft_indices, out):
    check_tensor("target_probs", target_probs, dtypes=FLOAT_DTYPES, ndim=2)
    num_rows, vocab_size = target_probs.shape
    if vocab_size < 1:
        raise ValueError(f"target_probs must have at least one vocabulary entry, got shape {tuple(target_probs.shape)}")
    tensors = dict(target_probs=target_probs)
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, dtypes=FLOAT_DTYPES, shape=(num_rows, vocab_size))
        tensors["draft_probs"] = draft_probs
    check_tensor("draft_tokens", draft_tokens, dtypes=INDEX_DTYPES, shape=(num_rows,))
    check_tensor("target_tokens", target_tokens, dtypes=(torch.int64,), shape=(num_rows,))
    check_tensor("temperature", temperature, dtypes=FLOAT_DTYPES, shape=(num_rows,))
    check_tensor("seeds", seeds, dtypes=INDEX_DTYPES, shape=(num_rows,))
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, shape=(num_rows,))
    check_tensor("draft_indices", draft_indices, dtypes=INDEX_DTYPES, shape=(num_rows,))
    vectors = dict(draft_tokens=draft_tokens, target_tokens=target_tokens, temperature=temperature, seeds=seeds,
                   positions=positions, draft_indices=draft_indices)
    if out is not None:
        check_tensor("out", out, dtypes=(torch.int64,), shape=(num_rows,))
        vectors["out"] = out
    check_same_device(**tensors, **vectors)
    check_unit_last_stride(**tensors)
    check_contiguous(**vectors)


def rejection_sample(
    target_probs: torch.Tensor,  # [K, V] float, p: the target's (filtered, normalised) distribution per row
    draft_probs: Optional[torch.Tensor],  # [K, V] float, q: the draft's; None: the draft is one-hot (deterministic)
    draft_tokens: torch.Tensor,  # [K] int, the draft compared with this row's token; outside [0, V): none
    target_tokens: torch.Tensor,  # [K] int64, the target's ordinary sample (kept where there is no draft)
    temperature: torch.Tensor,  # [K] float, below GREEDY_TEMPERATURE (1e-5): greedy row (keeps target_tokens)
    seeds: torch.Tensor,  # [K] int, the request's seed
    positions: torch.Tensor,  # [K] int, the position the row's token will occupy
    draft_indices: torch.Tensor,  # [K] int, the draft's depth (0 for the first draft)
    out: Optional[torch.Tensor] = None,  # [K] int64, written in place when given
) -> torch.Tensor:
    """One token per row: the draft with probability ``min(1, p(d) / q(d))``, else a draw from the
    normalised residual ``max(0, p - q)`` (so never the draft); rows without a draft and greedy
    rows keep ``target_tokens``. The rule is in :mod:`mtp_ctrl.triton_ops.reference.rejection`.

    No host sync, no allocation beyond two ``[K]`` seed vectors (and ``out`` if not given):
    capturable in a CUDA graph. Returns ``out`` (or a new tensor), [K] int64.

    Example: ``p = [[0.5, 0.5]]``, ``q = [[1.0, 0.0]]``, draft 0: accepted with probability 0.5;
    rejected, the residual is ``[0, 0.5]`` and the token is 1. With ``q = [[0.5, 0.5]]`` the draft
    is always accepted.
    """
    _VALIDATED.validate(_check_args, target_probs, draft_probs, draft_tokens, target_tokens, temperature, seeds,
                        positions, draft_indices, out)
    if not use_triton(target_probs):
        return reference.rejection_sample(target_probs, draft_probs, draft_tokens, target_tokens, temperature, seeds,
                                          positions, draft_indices, out)
    num_rows, vocab_size = target_probs.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=target_probs.device)  # [K] int64
    if num_rows == 0:
        return out
    accept_seeds, residual_seeds = stream_seeds(seeds, draft_indices)  # [K] int64 each
    has_q = draft_probs is not None
    q = draft_probs if has_q else target_probs  # a valid pointer; not read without HAS_Q
    _rejection_sample_kernel[(num_rows,)](
        target_probs, q, draft_tokens, target_tokens, temperature, accept_seeds, residual_seeds, positions, out,
        target_probs.stride(0), q.stride(0), vocab_size,
        GREEDY_TEMPERATURE=GREEDY_TEMPERATURE, HAS_Q=has_q,
        BLOCK_VOCAB=min(BLOCK_VOCAB_MAX, max(16, triton.next_power_of_2(vocab_size))), num_warps=4,
    )
    return out
