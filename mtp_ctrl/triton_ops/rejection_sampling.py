"""Rejection sampling of verified drafts in one Triton kernel: accept with min(1, p/q), else a draw
from the residual max(0, p - q).

The rule (noise streams, the float32 accept test, the residual and its fallback, ties) is written
once, in :mod:`mtp_ctrl.triton_ops.reference.rejection`. One program per logits row of a step,
reading everything it needs where it lies (no gather or index op before it):

- the row's depth ``k = row % (S + 1)``; a row inside the first ``num_decode * (S + 1)`` with
  ``k < S`` holds a draft: ``d = input_tokens[row + 1]`` (``d_{k+1}``). Other rows, rows whose
  draft is outside ``[0, V)`` (masked: -1) and greedy rows keep their sample (one load, one store);
- the request's parameters by its table slot (``row_slots[row]``): temperature, top-k, top-p, seed;
  the two noise streams' seeds derived from it and ``k`` in the kernel;
- ``p(d)`` and ``q(d)``: the filtered softmax of the target's logits row and of the drafter's
  recorded logits ``draft_logits[slot, k]`` (the sampler's kept set by a threshold search:
  :func:`mtp_ctrl.triton_ops.sampling_filter._kept_softmax_terms`, a few passes over each row);
- a rejected row walks its vocabulary once more in ``BLOCK_VOCAB`` tiles, keeping the first Gumbel
  argmax of the residual and of the fallback.

The token a row yields is what exact-match verification then compares with the draft: with
``out[b + k]`` the token of row ``b + k`` and ``d_{k+1}`` the draft in row ``b + k + 1``, an
accepted draft gives ``out[b + k] == d_{k+1}`` and a rejected one a token that differs from it,
so ``verify_and_commit`` keeps exactly the accepted prefix and the residual token after it.

Example, S = 2, one decode request in slot 5 (rows 0..2, input tokens ``[t, 7, 9]``) and one
prefill row: row 0 tests draft 7 at depth 0, row 1 draft 9 at depth 1, rows 2 (the bonus row) and
3 keep their samples.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import (FLOAT_DTYPES, INDEX_DTYPES, ValidatedSignatures, check_int, check_same_device,
                                         check_tensor)
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._layout_checks import check_contiguous, check_unit_last_stride
from mtp_ctrl.triton_ops.gumbel_sampling import _mix32, _noise, _scaled_tile, _value
from mtp_ctrl.triton_ops.reference.rejection import ACCEPT_SALTS, RESIDUAL_SALTS
from mtp_ctrl.triton_ops.reference.sampling import _MULTIPLIER_A, _MULTIPLIER_B, GREEDY_TEMPERATURE
from mtp_ctrl.triton_ops.sampling_filter import NUM_PIVOTS, _kept_probs, _kept_softmax_terms

BLOCK_VOCAB_MAX = 256  # tile of the filter's pivot passes ([256, P] compares) and of the residual walk
_NEG_INF = tl.constexpr(float("-inf"))
_MULTIPLIER_A_C = tl.constexpr(_MULTIPLIER_A)
_MULTIPLIER_B_C = tl.constexpr(_MULTIPLIER_B)
_ACCEPT_SALT_LOW, _ACCEPT_SALT_HIGH = tl.constexpr(ACCEPT_SALTS[0]), tl.constexpr(ACCEPT_SALTS[1])
_RESIDUAL_SALT_LOW, _RESIDUAL_SALT_HIGH = tl.constexpr(RESIDUAL_SALTS[0]), tl.constexpr(RESIDUAL_SALTS[1])
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
def _stream_seed(seed, draft_index, SALT_LOW: tl.constexpr, SALT_HIGH: tl.constexpr):
    """One noise stream's derived seed, as ``reference.rejection.stream_seeds`` (int64; the draft
    index is below 2**32, so the products stay below 2**63)."""
    low = (SALT_LOW + draft_index * _MULTIPLIER_B_C) & 0xFFFFFFFF
    high = (SALT_HIGH + draft_index * _MULTIPLIER_A_C) & 0x7FFFFFFF
    return seed ^ ((high << 32) | low)


@triton.jit
def _rejection_sample_kernel(
    LOGITS_PTR,  # [K, V] float, the target's logits per row, unit stride along V
    DRAFT_LOGITS_PTR,  # [M, S, V] float, the drafter's logits by slot and depth (unused without HAS_Q)
    INPUT_TOKENS_PTR,  # [K] int, the rows' input tokens: row r + 1 of a decode holds the draft row r tests
    TARGET_PTR,  # [K] int64, the target's ordinary sample per row
    SLOTS_PTR,  # [K] int, the table slot of each row's request
    POSITIONS_PTR,  # [K] int, the position the row's token will occupy
    NUM_DECODE_PTR,  # [1] int, decode requests (their S + 1 rows come first)
    TEMPERATURE_PTR, TOP_K_PTR, TOP_P_PTR, SEEDS_PTR,  # [M] each, by slot
    OUT_PTR,  # [K] int64 (may be TARGET_PTR)
    logits_row_stride, q_slot_stride, q_depth_stride, vocab_size, num_rows, num_speculative_tokens,
    GREEDY_TEMPERATURE: tl.constexpr, HAS_Q: tl.constexpr, NUM_PIVOTS: tl.constexpr, BLOCK_VOCAB: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    token = tl.load(TARGET_PTR + row).to(tl.int64)
    stride = num_speculative_tokens + 1
    depth = row % stride  # k: this row's draft is d_{k+1}
    has_draft = (row < tl.load(NUM_DECODE_PTR).to(tl.int64) * stride) & (depth < num_speculative_tokens)
    draft = tl.load(INPUT_TOKENS_PTR + row + 1, mask=has_draft & (row + 1 < num_rows), other=-1).to(tl.int64)
    if has_draft & (draft >= 0) & (draft < vocab_size):
        slot = tl.load(SLOTS_PTR + row).to(tl.int64)
        temperature = tl.load(TEMPERATURE_PTR + slot).to(tl.float32)
        if temperature >= GREEDY_TEMPERATURE:
            top_k = tl.load(TOP_K_PTR + slot).to(tl.int64)
            top_p = tl.load(TOP_P_PTR + slot).to(tl.float32)
            seed = tl.load(SEEDS_PTR + slot).to(tl.int64)
            position = tl.load(POSITIONS_PTR + row).to(tl.int64)
            p_row = LOGITS_PTR + row * logits_row_stride
            q_row = DRAFT_LOGITS_PTR + slot * q_slot_stride + depth * q_depth_stride
            p_max, p_threshold, p_inverse = _kept_softmax_terms(p_row, vocab_size, temperature, top_k, top_p,
                                                                NUM_PIVOTS, BLOCK_VOCAB)
            valid_draft = tl.full([], 1, tl.int1)
            p_draft = _kept_probs(_value(p_row, draft, temperature), valid_draft, p_max, p_threshold, p_inverse)
            if HAS_Q:
                q_max, q_threshold, q_inverse = _kept_softmax_terms(q_row, vocab_size, temperature, top_k, top_p,
                                                                    NUM_PIVOTS, BLOCK_VOCAB)
                q_draft = _kept_probs(_value(q_row, draft, temperature), valid_draft, q_max, q_threshold,
                                      q_inverse)
            else:
                q_max, q_threshold, q_inverse = p_max, p_threshold, p_inverse  # unused: q is one-hot
                q_draft = tl.full([], 1.0, tl.float32)
            accept_seed = _stream_seed(seed, depth, _ACCEPT_SALT_LOW, _ACCEPT_SALT_HIGH)
            accept_low, accept_high = _stream_keys(accept_seed, position)
            bits = _mix32(_mix32(accept_low) + accept_high)  # vocabulary index 0 spreads to 0
            uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            if uniform * q_draft < p_draft:
                token = draft
            else:
                residual_seed = _stream_seed(seed, depth, _RESIDUAL_SALT_LOW, _RESIDUAL_SALT_HIGH)
                key_low, key_high = _stream_keys(residual_seed, position)
                lanes = tl.arange(0, BLOCK_VOCAB)
                best = tl.full([], _NEG_INF, tl.float32)
                best_idx = tl.full([], 0, tl.int64)
                fallback = tl.full([], _NEG_INF, tl.float32)
                fallback_idx = tl.full([], 0, tl.int64)
                for start in range(0, vocab_size, BLOCK_VOCAB):
                    ids = start + lanes
                    z, valid = _scaled_tile(p_row, ids, vocab_size, temperature)
                    p = _kept_probs(z, valid, p_max, p_threshold, p_inverse)
                    if HAS_Q:
                        z_q, _valid_q = _scaled_tile(q_row, ids, vocab_size, temperature)
                        q = _kept_probs(z_q, valid, q_max, q_threshold, q_inverse)
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


def _check_args(logits, draft_logits, input_tokens, target_tokens, row_slots, positions, num_decode,
                num_speculative_tokens, temperature, top_k, top_p, seeds, out):
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, ndim=2)
    num_rows, vocab_size = logits.shape
    if vocab_size < 1:
        raise ValueError(f"logits must have at least one vocabulary entry, got shape {tuple(logits.shape)}")
    S = check_int("num_speculative_tokens", num_speculative_tokens, low=1)
    check_tensor("temperature", temperature, dtypes=FLOAT_DTYPES, ndim=1)
    num_slots = temperature.shape[0]
    matrices = dict(logits=logits)
    if draft_logits is not None:
        check_tensor("draft_logits", draft_logits, dtypes=FLOAT_DTYPES, shape=(num_slots, S, vocab_size))
        matrices["draft_logits"] = draft_logits
    vectors = {}
    for name, value, dtypes in (("input_tokens", input_tokens, INDEX_DTYPES),
                                ("target_tokens", target_tokens, (torch.int64,)),
                                ("row_slots", row_slots, INDEX_DTYPES), ("positions", positions, INDEX_DTYPES)):
        check_tensor(name, value, dtypes=dtypes, shape=(num_rows,))
        vectors[name] = value
    check_tensor("num_decode", num_decode, dtypes=INDEX_DTYPES, shape=(1,))
    for name, value, dtypes in (("top_k", top_k, INDEX_DTYPES), ("top_p", top_p, FLOAT_DTYPES),
                                ("seeds", seeds, INDEX_DTYPES)):
        check_tensor(name, value, dtypes=dtypes, shape=(num_slots,))
        vectors[name] = value
    vectors.update(num_decode=num_decode, temperature=temperature)
    if out is not None:
        check_tensor("out", out, dtypes=(torch.int64,), shape=(num_rows,))
        vectors["out"] = out
    check_same_device(**matrices, **vectors)
    check_unit_last_stride(**matrices)
    check_contiguous(**vectors)


def rejection_sample(
    logits: torch.Tensor,  # [K, V] float, the target's logits of a step's sampling rows (unit stride along V)
    draft_logits: Optional[torch.Tensor],  # [M, S, V] float, the drafter's logits by slot and depth; None: one-hot q
    input_tokens: torch.Tensor,  # [K] int, the rows' input tokens (a decode's row b + k + 1 holds d_{k+1}; -1: none)
    target_tokens: torch.Tensor,  # [K] int64, the target's ordinary sample (kept where there is no draft)
    row_slots: torch.Tensor,  # [K] int, the table slot of each row's request (indexes the [M] rows)
    positions: torch.Tensor,  # [K] int, the position the row's token will occupy
    num_decode: torch.Tensor,  # [1] int on the device: decode requests, whose S + 1 rows come first
    num_speculative_tokens: int,  # S >= 1
    temperature: torch.Tensor,  # [M] float by slot; below GREEDY_TEMPERATURE (1e-5): greedy (keeps target_tokens)
    top_k: torch.Tensor,  # [M] int by slot
    top_p: torch.Tensor,  # [M] float by slot
    seeds: torch.Tensor,  # [M] int by slot, the request's seed
    out: Optional[torch.Tensor] = None,  # [K] int64, written in place when given (may be target_tokens)
) -> torch.Tensor:
    """One token per logits row: at a decode request's draft rows (module docstring) the draft with
    probability ``min(1, p(d) / q(d))``, else a draw from the normalised residual ``max(0, p - q)``
    (so never the draft); ``p`` and ``q`` are the request's filtered softmax (temperature, top-k,
    top-p) of ``logits`` and ``draft_logits[slot, k]``. Other rows and greedy rows keep
    ``target_tokens``. The rule is in :mod:`mtp_ctrl.triton_ops.reference.rejection`.

    One launch, no host sync, no allocation when ``out`` is given: capturable in a CUDA graph.
    Returns ``out`` (or a new tensor), [K] int64.

    Example (S = 1, one decode request in slot 0, T = 1): logits ``[[0, 0], [..]]`` (``p = [0.5,
    0.5]``), draft logits ``[[[0, -inf]]]`` (``q = [1, 0]``), input tokens ``[t, 0]``: row 0 keeps
    draft 0 with probability 0.5, else yields 1; row 1 (the bonus row) keeps its sample.
    """
    _VALIDATED.validate(_check_args, logits, draft_logits, input_tokens, target_tokens, row_slots, positions,
                        num_decode, num_speculative_tokens, temperature, top_k, top_p, seeds, out)
    if not use_triton(logits):
        return reference.rejection_sample(logits, draft_logits, input_tokens, target_tokens, row_slots, positions,
                                          num_decode, num_speculative_tokens, temperature, top_k, top_p, seeds, out)
    num_rows, vocab_size = logits.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)  # [K] int64
    if num_rows == 0:
        return out
    has_q = draft_logits is not None
    q = draft_logits if has_q else logits  # a valid pointer; not read without HAS_Q
    q_slot_stride, q_depth_stride = (draft_logits.stride(0), draft_logits.stride(1)) if has_q else (0, 0)
    _rejection_sample_kernel[(num_rows,)](
        logits, q, input_tokens, target_tokens, row_slots, positions, num_decode, temperature, top_k, top_p, seeds,
        out, logits.stride(0), q_slot_stride, q_depth_stride, vocab_size, num_rows, num_speculative_tokens,
        GREEDY_TEMPERATURE=GREEDY_TEMPERATURE, HAS_Q=has_q, NUM_PIVOTS=NUM_PIVOTS,
        BLOCK_VOCAB=min(BLOCK_VOCAB_MAX, max(16, triton.next_power_of_2(vocab_size))), num_warps=4,
    )
    return out
