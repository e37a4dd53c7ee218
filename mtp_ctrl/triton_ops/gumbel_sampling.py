"""One token per logits row in a few Triton kernels: greedy, temperature, top-k, top-p, Gumbel-max.

The rule (ties, boundaries, the always-kept top token) is written once, in
:mod:`mtp_ctrl.triton_ops.reference.sampling`; its torch twin sorts, this kernel does not.
Each row is split into up to ``MAX_CHUNKS`` chunks, one program per (row, chunk) for the passes
over the vocabulary, and one program per row for the tiny combines (partials summed in chunk order,
ties to the first chunk, so the result never depends on the batch or the timing):

1. scan (rows x chunks): per chunk the max z with its first index, and the first argmax of
   ``z + noise`` over every token (tiles that cannot win skip the noise). start (rows): greedy
   token, candidate ``c`` of value ``low``; a row is done if nothing filters or ``low`` is the max.
   Top-k with top-p: the k-th largest value by a single-program search (as before).
2. ``ROUNDS`` x (pass, combine), an open row keeps ``(low, high]`` where ``keep(high)`` holds, the
   best score above ``high`` and the candidate (argmax over a superset of the kept set, value
   ``low``). pass (rows x chunks): counts and float64 exp-mass above ``NUM_PIVOTS`` pivots
   ``low = q_0 <= ... <= high``, and per pivot the Gumbel argmax over ``q_i < z <= high`` (noise only
   for tokens inside the interval). combine: the kept test at every pivot; if ``q_0`` is kept the
   candidate is the token; else with ``q_j`` the last dropped pivot the new candidate is the argmax
   over ``z > q_j``; kept if its value is >= ``q_{j+1}``, else the interval becomes
   ``(value, q_{j+1}]``. Each round shrinks the interval 16-fold; the last combine finishes a row
   still open with the single-program loop (mass pass at two pivots, then a rescan) of before.

The argmax of ``z + noise`` over the kept set is what the twin computes: the kept set is
``{z >= threshold}``, each rejected candidate proves the threshold is above it, and the argmax
over a superset that lands inside the kept set is the argmax over the kept set.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import FLOAT_DTYPES, INDEX_DTYPES, ValidatedSignatures, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._layout_checks import check_bool, check_contiguous, check_unit_last_stride
from mtp_ctrl.triton_ops.reference.sampling import GREEDY_TEMPERATURE

BLOCK_VOCAB_MAX = 1024  # widest tile; the single-program walks (top-k threshold, fallback) use it too
PASS_BLOCK_MAX = 256  # tile of the pivot passes: [256, P] compares per step
NUM_PIVOTS = 16  # values tested per round: each round narrows the open interval 16-fold
ROUNDS = 3  # parallel rounds before the last combine walks a still-open row alone (rare)
MAX_CHUNKS = 64  # programs per row in the parallel passes: chunks of a power-of-two size
_NEG_INF = tl.constexpr(float("-inf"))
# Above every noise value: u <= 1 - 2**-24, so -log(-log(u)) <= 16.64.
_NOISE_BOUND = tl.constexpr(17.0)
_NEG_INF_KEY = tl.constexpr(-2139095041)  # ordered key of float32 -inf
_VALIDATED = ValidatedSignatures()  # argument signatures that passed _check_args


@triton.jit
def _mix32(h):
    """The reference's 32-bit avalanche on uint32 (products wrap mod 2**32, as ``& MASK32`` does)."""
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x2C1B3C6D
    return h ^ (h >> 16)


@triton.jit
def _noise(vocab_ids, key_low, key_high):
    """Gumbel noise of ``vocab_ids`` for one row's 64-bit key (uint32 halves); float32."""
    spread = vocab_ids.to(tl.uint32) * 0x7FEB352D
    bits = _mix32(_mix32(spread ^ key_low) + key_high)
    uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(uniform))


@triton.jit
def _scaled_tile(row_ptr, ids, vocab_size, scale):
    """``(z, valid)`` of one tile: logits / scale in float32, -inf past the row."""
    valid = ids < vocab_size
    x = tl.load(row_ptr + ids, mask=valid, other=float("-inf")).to(tl.float32)
    # IEEE division (``/`` is approximate on NVIDIA), so z is bit-equal to the twin's x / T
    return tl.math.div_rn(x, scale + tl.zeros_like(x)), valid


@triton.jit
def _ordered_key(z):
    """int64 key with the order of float32 ``z`` (-0.0 and +0.0 both map to 0)."""
    bits = z.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(z == 0.0, 0, key)


@triton.jit
def _scan(row_ptr, begin, end, vocab_size, scale, lo, use_noise, key_low, key_high, STRICT: tl.constexpr,
          BLOCK_VOCAB: tl.constexpr):
    """Over the tiles starting in ``[begin, end)``: max, its first index, and (if ``use_noise``) the
    first index of max(z + noise) over the candidates ``z > lo`` (``STRICT``) or ``z >= lo``, with
    that candidate's score and value."""
    lanes = tl.arange(0, BLOCK_VOCAB)
    row_max = tl.full([], _NEG_INF, tl.float32)
    max_idx = tl.full([], 0, tl.int32)
    best = tl.full([], _NEG_INF, tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    best_z = tl.full([], _NEG_INF, tl.float32)
    for start in range(begin, end, BLOCK_VOCAB):
        ids = start + lanes
        z, valid = _scaled_tile(row_ptr, ids, vocab_size, scale)
        tile_max = tl.max(z, 0)
        max_idx = tl.where(tile_max > row_max, start + tl.argmax(z, 0), max_idx)
        row_max = tl.maximum(row_max, tile_max)
        if STRICT:
            is_candidate = valid & (z > lo)
        else:
            is_candidate = valid & (z >= lo)
        candidate_max = tl.max(tl.where(is_candidate, z, float("-inf")), 0)
        if use_noise & (candidate_max + _NOISE_BOUND >= best):
            score = tl.where(is_candidate, z + _noise(ids, key_low, key_high), float("-inf"))
            tile_best = tl.max(score, 0)
            tile_idx = tl.argmax(score, 0)
            tile_z = tl.sum(tl.where(lanes == tile_idx, z, 0.0), 0)
            better = tile_best > best  # earlier tiles win ties: first index
            best_idx = tl.where(better, start + tile_idx, best_idx)
            best_z = tl.where(better, tile_z, best_z)
            best = tl.maximum(best, tile_best)
    return row_max, max_idx, best, best_idx, best_z


@triton.jit
def _kth_largest(row_ptr, vocab_size, scale, k, row_max, BLOCK_VOCAB: tl.constexpr):
    """The k-th largest ``z`` (1 <= k < V): the largest key t with count(key >= t) >= k."""
    lanes = tl.arange(0, BLOCK_VOCAB)
    quarters = tl.arange(0, 4).to(tl.int64) + 1  # [4]
    lo = tl.full([], _NEG_INF_KEY, tl.int64)  # count(key >= lo) = V >= k
    hi = _ordered_key(row_max)  # the answer is <= the max
    while lo < hi:
        pivots = lo + ((hi - lo) * quarters + 3) // 4  # [4] int64, increasing, the last is hi
        counts = tl.zeros([4], dtype=tl.int32)
        for start in range(0, vocab_size, BLOCK_VOCAB):
            z, valid = _scaled_tile(row_ptr, start + lanes, vocab_size, scale)
            above = (_ordered_key(z)[:, None] >= pivots[None, :]) & valid[:, None]  # [BLOCK_VOCAB, 4]
            counts += tl.sum(above.to(tl.int32), 0)
        enough = counts >= k
        lo = tl.maximum(lo, tl.max(tl.where(enough, pivots, lo), 0))
        hi = tl.minimum(hi, tl.min(tl.where(enough, hi, pivots - 1), 0))
    bits = tl.where(lo >= 0, lo, lo ^ 0x7FFFFFFF).to(tl.int32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _masses(row_ptr, vocab_size, scale, safe_max, threshold_k, value, mid, BLOCK_VOCAB: tl.constexpr):
    """Counts and float64 exp-mass (top-k tokens only) above ``value`` and ``mid``, and the total."""
    lanes = tl.arange(0, BLOCK_VOCAB)
    count_value = tl.full([], 0, tl.int32)
    count_mid = tl.full([], 0, tl.int32)
    mass_value = tl.full([], 0.0, tl.float64)
    mass_mid = tl.full([], 0.0, tl.float64)
    total = tl.full([], 0.0, tl.float64)
    for start in range(0, vocab_size, BLOCK_VOCAB):
        z, valid = _scaled_tile(row_ptr, start + lanes, vocab_size, scale)
        mass = tl.where(valid & (z >= threshold_k), tl.exp(z - safe_max), 0.0).to(tl.float64)
        above_value = valid & (z > value)
        above_mid = valid & (z > mid)
        count_value += tl.sum(above_value.to(tl.int32), 0)
        count_mid += tl.sum(above_mid.to(tl.int32), 0)
        mass_value += tl.sum(tl.where(above_value, mass, 0.0), 0)
        mass_mid += tl.sum(tl.where(above_mid, mass, 0.0), 0)
        total += tl.sum(mass, 0)
    return count_value, count_mid, mass_value, mass_mid, total


@triton.jit
def _row_keys(TEMPERATURE_PTR, SEEDS_PTR, POSITIONS_PTR, row, GREEDY_TEMPERATURE: tl.constexpr,
              ALL_GREEDY: tl.constexpr):
    """``(sampled, scale, key_low, key_high)`` of one row: its 64-bit noise key as uint32 halves."""
    if ALL_GREEDY:
        sampled = tl.full([], 0, tl.int1)
        scale = tl.full([], 1.0, tl.float32)
    else:
        temperature = tl.load(TEMPERATURE_PTR + row).to(tl.float32)
        sampled = temperature >= GREEDY_TEMPERATURE
        scale = tl.where(sampled, temperature, 1.0)
    seed = tl.load(SEEDS_PTR + row).to(tl.int64)
    position = tl.load(POSITIONS_PTR + row).to(tl.int64)
    seed_low = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_high = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key_low = _mix32(_mix32(seed_low ^ 0x9E3779B9) ^ (position & 0xFFFFFFFF).to(tl.uint32))
    key_high = _mix32(_mix32(seed_high ^ 0x85EBCA6B) ^ key_low)
    return sampled, scale, key_low, key_high


@triton.jit
def _value(row_ptr, index, scale):
    """``z`` of one token, bit-equal to the tiles' ``z``."""
    return tl.math.div_rn(tl.load(row_ptr + index).to(tl.float32), scale)


@triton.jit
def _store_pivots(PIVOT_PTR, row, low, high, NUM_PIVOTS: tl.constexpr):
    """Pivots ``low = q_0 <= q_1 <= ... <= q_{P-1} <= high``, evenly spaced (non-decreasing even
    where ``high - low`` rounds or overflows)."""
    lanes = tl.arange(0, NUM_PIVOTS)
    spaced = low + (high - low) * (lanes.to(tl.float32) * (1.0 / NUM_PIVOTS))
    pivots = tl.where(lanes == 0, low, tl.minimum(tl.maximum(spaced, low), high))
    tl.store(PIVOT_PTR + row.to(tl.int64) * NUM_PIVOTS + lanes, pivots)


@triton.jit
def _chunk_scan_kernel(
    LOGITS_PTR, TEMPERATURE_PTR, SEEDS_PTR, POSITIONS_PTR,
    SCORE_PTR,  # [R, C, P] float32 workspace: [:, :, 0] the chunk's max z, [:, :, 1] its max z + noise
    INDEX_PTR,  # [R, C, P] int32 workspace: their first indices
    logits_row_stride, vocab_size, num_chunks,
    GREEDY_TEMPERATURE: tl.constexpr, ALL_GREEDY: tl.constexpr, NUM_PIVOTS: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_VOCAB: tl.constexpr,
):
    """Program (row, chunk): max and Gumbel argmax over every token of one chunk."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row_ptr = LOGITS_PTR + row.to(tl.int64) * logits_row_stride
    sampled, scale, key_low, key_high = _row_keys(
        TEMPERATURE_PTR, SEEDS_PTR, POSITIONS_PTR, row, GREEDY_TEMPERATURE, ALL_GREEDY
    )
    begin = chunk * CHUNK
    end = tl.minimum(begin + CHUNK, vocab_size)
    all_tokens = tl.full([], _NEG_INF, tl.float32)
    chunk_max, max_idx, best, best_idx, _last_value = _scan(
        row_ptr, begin, end, vocab_size, scale, all_tokens, sampled, key_low, key_high, False, BLOCK_VOCAB
    )
    slot = (row.to(tl.int64) * num_chunks + chunk) * NUM_PIVOTS
    tl.store(SCORE_PTR + slot, chunk_max)
    tl.store(INDEX_PTR + slot, max_idx)
    tl.store(SCORE_PTR + slot + 1, best)
    tl.store(INDEX_PTR + slot + 1, best_idx)


@triton.jit
def _chunk_winner(SCORE_PTR, INDEX_PTR, row, num_chunks, column, NUM_PIVOTS: tl.constexpr, C_PAD: tl.constexpr):
    """Max over the chunks of one column and its index (the first chunk wins ties: first index)."""
    chunks = tl.arange(0, C_PAD)
    in_row = chunks < num_chunks
    offsets = (row.to(tl.int64) * num_chunks + chunks) * NUM_PIVOTS + column
    scores = tl.load(SCORE_PTR + offsets, mask=in_row, other=float("-inf"))
    winner = tl.argmax(scores, 0)
    index = tl.sum(tl.where(chunks == winner, tl.load(INDEX_PTR + offsets, mask=in_row, other=0), 0), 0)
    return tl.max(scores, 0), index


@triton.jit
def _start_kernel(
    LOGITS_PTR, TEMPERATURE_PTR, TOP_K_PTR, TOP_P_PTR, SEEDS_PTR, POSITIONS_PTR, OUT_PTR,
    SCORE_PTR, INDEX_PTR,  # [R, C, P] float32 / int32: the chunk scan's partials
    STATE_F_PTR,  # [R, 8] float32: low, high, row max, best score above high, top-k threshold
    STATE_I_PTR,  # [R, 4] int32: done, candidate (the token once done), best index above high
    PIVOT_PTR,  # [R, P] float32
    logits_row_stride, vocab_size, num_chunks,
    GREEDY_TEMPERATURE: tl.constexpr, ALL_GREEDY: tl.constexpr, NUM_PIVOTS: tl.constexpr,
    C_PAD: tl.constexpr, BLOCK_VOCAB: tl.constexpr,
):
    """One program per row: greedy token, first candidate, top-k threshold (top-k with top-p only)."""
    row = tl.program_id(0)
    row_ptr = LOGITS_PTR + row.to(tl.int64) * logits_row_stride
    # triton 3.6 types every name once per scope: throwaway results get names of their own
    sampled, scale, _unused_key_low, _unused_key_high = _row_keys(TEMPERATURE_PTR, SEEDS_PTR, POSITIONS_PTR, row,
                                                                  GREEDY_TEMPERATURE, ALL_GREEDY)
    row_max, token = _chunk_winner(SCORE_PTR, INDEX_PTR, row, num_chunks, 0, NUM_PIVOTS, C_PAD)
    done = tl.full([], 1, tl.int32)
    value = row_max
    threshold_k = tl.full([], _NEG_INF, tl.float32)
    if sampled:
        _candidate_score, token = _chunk_winner(SCORE_PTR, INDEX_PTR, row, num_chunks, 1, NUM_PIVOTS, C_PAD)
        value = _value(row_ptr, token, scale)
        top_k = tl.load(TOP_K_PTR + row).to(tl.int64)
        top_p = tl.load(TOP_P_PTR + row).to(tl.float32)
        k_active = (top_k > 0) & (top_k < vocab_size)
        p_active = top_p < 1.0
        if (k_active | p_active) & (value < row_max):  # else the candidate is kept
            done = tl.full([], 0, tl.int32)
            if k_active & p_active:  # top-p needs the top-k mass
                threshold_k = _kth_largest(row_ptr, vocab_size, scale, top_k, row_max, BLOCK_VOCAB)
    tl.store(STATE_F_PTR + row * 8, value)
    tl.store(STATE_F_PTR + row * 8 + 1, row_max)  # keep(row max) holds: the top token is always kept
    tl.store(STATE_F_PTR + row * 8 + 2, row_max)
    tl.store(STATE_F_PTR + row * 8 + 3, float("-inf"))  # no token is above the row max
    tl.store(STATE_F_PTR + row * 8 + 4, threshold_k)
    tl.store(STATE_I_PTR + row * 4, done)
    tl.store(STATE_I_PTR + row * 4 + 1, token)
    tl.store(STATE_I_PTR + row * 4 + 2, 0)
    _store_pivots(PIVOT_PTR, row, value, row_max, NUM_PIVOTS)
    if done != 0:
        tl.store(OUT_PTR + row, token.to(tl.int64))


@triton.jit
def _round_pass_kernel(
    LOGITS_PTR, TEMPERATURE_PTR, SEEDS_PTR, POSITIONS_PTR,
    STATE_F_PTR, STATE_I_PTR, PIVOT_PTR,  # as in _start_kernel
    COUNT_PTR,  # [R, C, P] int32: tokens above each pivot
    MASS_PTR,  # [R, C, P] float64: their exp-mass (top-k tokens only)
    SCORE_PTR, INDEX_PTR,  # [R, C, P] float32 / int32: max z + noise over pivot < z <= high, first index
    TOTAL_PTR,  # [R, C] float64: exp-mass of the chunk's top-k tokens
    logits_row_stride, vocab_size, num_chunks,
    GREEDY_TEMPERATURE: tl.constexpr, NUM_PIVOTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_VOCAB: tl.constexpr,
):
    """Program (row, chunk) of an unfinished row: counts and masses above every pivot, and the
    Gumbel argmax above every pivot among the tokens in ``(low, high]`` (only they need noise)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if tl.load(STATE_I_PTR + row * 4) == 0:
        row_ptr = LOGITS_PTR + row.to(tl.int64) * logits_row_stride
        _row_sampled, scale, key_low, key_high = _row_keys(
            TEMPERATURE_PTR, SEEDS_PTR, POSITIONS_PTR, row, GREEDY_TEMPERATURE, False
        )
        low = tl.load(STATE_F_PTR + row * 8)
        high = tl.load(STATE_F_PTR + row * 8 + 1)
        row_max = tl.load(STATE_F_PTR + row * 8 + 2)
        threshold_k = tl.load(STATE_F_PTR + row * 8 + 4)
        safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        pivot_lanes = tl.arange(0, NUM_PIVOTS)
        pivots = tl.load(PIVOT_PTR + row.to(tl.int64) * NUM_PIVOTS + pivot_lanes)  # [P]
        lanes = tl.arange(0, BLOCK_VOCAB)
        count = tl.zeros([NUM_PIVOTS], dtype=tl.int32)
        mass = tl.zeros([NUM_PIVOTS], dtype=tl.float64)
        best = tl.full([NUM_PIVOTS], _NEG_INF, tl.float32)
        best_idx = tl.zeros([NUM_PIVOTS], dtype=tl.int32)
        count_high = tl.full([], 0, tl.int32)
        mass_high = tl.full([], 0.0, tl.float64)
        total = tl.full([], 0.0, tl.float64)
        begin = chunk * CHUNK
        end = tl.minimum(begin + CHUNK, vocab_size)
        for start in range(begin, end, BLOCK_VOCAB):
            ids = start + lanes
            z, valid = _scaled_tile(row_ptr, ids, vocab_size, scale)
            weight = tl.where(valid & (z >= threshold_k), tl.exp(z - safe_max), 0.0).to(tl.float64)
            total += tl.sum(weight, 0)
            above_high = valid & (z > high)
            count_high += tl.sum(above_high.to(tl.int32), 0)
            mass_high += tl.sum(tl.where(above_high, weight, 0.0), 0)
            inside = valid & (z > low) & (z <= high)
            if tl.max(inside.to(tl.int32), 0) > 0:
                above = inside[:, None] & (z[:, None] > pivots[None, :])  # [BLOCK_VOCAB, P]
                count += tl.sum(above.to(tl.int32), 0)
                mass += tl.sum(tl.where(above, weight[:, None], 0.0), 0)
                scores = tl.where(above, (z + _noise(ids, key_low, key_high))[:, None], float("-inf"))
                tile_best = tl.max(scores, 0)
                better = tile_best > best  # earlier tiles win ties: first index
                best_idx = tl.where(better, start + tl.argmax(scores, 0), best_idx)
                best = tl.maximum(best, tile_best)
        slots = (row.to(tl.int64) * num_chunks + chunk) * NUM_PIVOTS + pivot_lanes
        tl.store(COUNT_PTR + slots, count + count_high)
        tl.store(MASS_PTR + slots, mass + mass_high)
        tl.store(SCORE_PTR + slots, best)
        tl.store(INDEX_PTR + slots, best_idx)
        tl.store(TOTAL_PTR + row.to(tl.int64) * num_chunks + chunk, total)


@triton.jit
def _round_combine_kernel(
    LOGITS_PTR, TEMPERATURE_PTR, TOP_K_PTR, TOP_P_PTR, SEEDS_PTR, POSITIONS_PTR, OUT_PTR,
    STATE_F_PTR, STATE_I_PTR, PIVOT_PTR, COUNT_PTR, MASS_PTR, SCORE_PTR, INDEX_PTR, TOTAL_PTR,
    logits_row_stride, vocab_size, num_chunks,
    GREEDY_TEMPERATURE: tl.constexpr, NUM_PIVOTS: tl.constexpr, C_PAD: tl.constexpr, FINAL: tl.constexpr,
    BLOCK_VOCAB: tl.constexpr,
):
    """One program per unfinished row: sums the chunks' partials in chunk order, tests the pivots,
    and either finishes the row or narrows ``(low, high]`` to one pivot interval (module docstring).
    ``FINAL``: a row still open walks the whole row alone until its candidate is kept."""
    row = tl.program_id(0)
    done = tl.load(STATE_I_PTR + row * 4)
    if done == 0:
        row_ptr = LOGITS_PTR + row.to(tl.int64) * logits_row_stride
        _row_sampled, scale, key_low, key_high = _row_keys(
            TEMPERATURE_PTR, SEEDS_PTR, POSITIONS_PTR, row, GREEDY_TEMPERATURE, False
        )
        low = tl.load(STATE_F_PTR + row * 8)
        high = tl.load(STATE_F_PTR + row * 8 + 1)
        row_max = tl.load(STATE_F_PTR + row * 8 + 2)
        high_score = tl.load(STATE_F_PTR + row * 8 + 3)
        threshold_k = tl.load(STATE_F_PTR + row * 8 + 4)
        candidate = tl.load(STATE_I_PTR + row * 4 + 1)
        high_idx = tl.load(STATE_I_PTR + row * 4 + 2)
        top_k = tl.load(TOP_K_PTR + row).to(tl.int64)
        top_p = tl.load(TOP_P_PTR + row).to(tl.float32)
        k_active = (top_k > 0) & (top_k < vocab_size)
        p_active = top_p < 1.0
        k_limit = tl.where(k_active, top_k, vocab_size + 1)
        chunks = tl.arange(0, C_PAD)
        pivot_lanes = tl.arange(0, NUM_PIVOTS)
        in_row = (chunks < num_chunks)[:, None] & (pivot_lanes < NUM_PIVOTS)[None, :]  # [C_PAD, P]
        offsets = (row.to(tl.int64) * num_chunks + chunks[:, None]) * NUM_PIVOTS + pivot_lanes[None, :]
        count = tl.sum(tl.load(COUNT_PTR + offsets, mask=in_row, other=0), 0)  # [P]
        mass = tl.sum(tl.load(MASS_PTR + offsets, mask=in_row, other=0.0), 0)  # [P] float64
        scores = tl.load(SCORE_PTR + offsets, mask=in_row, other=float("-inf"))  # [C_PAD, P]
        winners = tl.argmax(scores, 0)  # [P], the first chunk wins ties: first index
        best = tl.max(scores, 0)
        indices = tl.load(INDEX_PTR + offsets, mask=in_row, other=0)
        best_idx = tl.sum(tl.where(chunks[:, None] == winners[None, :], indices, 0), 0)  # [P]
        total = tl.sum(tl.load(TOTAL_PTR + row.to(tl.int64) * num_chunks + chunks, mask=chunks < num_chunks,
                               other=0.0), 0)
        pivots = tl.load(PIVOT_PTR + row.to(tl.int64) * NUM_PIVOTS + pivot_lanes)  # [P]
        limit = top_p.to(tl.float64) * total
        keep = (count < k_limit) & ((p_active == 0) | (pivots >= row_max) | (mass < limit))  # monotone
        dropped = tl.sum((keep == 0).to(tl.int32), 0)  # pivots 0 .. dropped - 1 are dropped
        if dropped == 0:  # the candidate (pivot 0) is kept
            done = tl.full([], 1, tl.int32)
        else:
            j = dropped - 1
            band_score = tl.max(tl.where(pivot_lanes == j, best, float("-inf")), 0)
            band_idx = tl.sum(tl.where(pivot_lanes == j, best_idx, 0), 0)
            high_wins = (high_score > band_score) | ((high_score == band_score) & (high_idx < band_idx))
            candidate = tl.where(high_wins, high_idx, band_idx)  # argmax over z > q_j, a superset of kept
            value = _value(row_ptr, candidate, scale)
            next_high = tl.where(j + 1 < NUM_PIVOTS,
                                 tl.max(tl.where(pivot_lanes == j + 1, pivots, float("-inf")), 0), high)
            if value >= next_high:  # keep(next_high) holds, so the candidate is kept
                done = tl.full([], 1, tl.int32)
            else:
                up_score = tl.max(tl.where(pivot_lanes == j + 1, best, float("-inf")), 0)
                up_idx = tl.sum(tl.where(pivot_lanes == j + 1, best_idx, 0), 0)
                up_wins = (up_score > high_score) | ((up_score == high_score) & (up_idx < high_idx))
                high_score = tl.where(up_wins, up_score, high_score)
                high_idx = tl.where(up_wins, up_idx, high_idx)
                low = value
                high = next_high
                _store_pivots(PIVOT_PTR, row, low, high, NUM_PIVOTS)
        if FINAL:
            safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
            value = low
            smallest_kept = high  # keep(high) holds
            while done == 0:
                mid = value * 0.5 + smallest_kept * 0.5
                count_value, count_mid, mass_value, mass_mid, all_mass = _masses(
                    row_ptr, vocab_size, scale, safe_max, threshold_k, value, mid, BLOCK_VOCAB
                )
                all_limit = top_p.to(tl.float64) * all_mass
                keep_value = (count_value < k_limit) & ((p_active == 0) | (value >= row_max) | (mass_value < all_limit))
                keep_mid = (count_mid < k_limit) & ((p_active == 0) | (mid >= row_max) | (mass_mid < all_limit))
                done = keep_value.to(tl.int32)
                lower = tl.where(keep_mid, value, mid)  # every token <= lower is dropped
                smallest_kept = tl.where(keep_mid, mid, smallest_kept)
                if done == 0:
                    _scan_max, _scan_max_index, _scan_best, candidate, value = _scan(
                        row_ptr, 0, vocab_size, vocab_size, scale, lower, keep_value == 0, key_low, key_high, True,
                        BLOCK_VOCAB,
                    )
        tl.store(STATE_F_PTR + row * 8, low)
        tl.store(STATE_F_PTR + row * 8 + 1, high)
        tl.store(STATE_F_PTR + row * 8 + 3, high_score)
        tl.store(STATE_I_PTR + row * 4, done)
        tl.store(STATE_I_PTR + row * 4 + 1, candidate)
        tl.store(STATE_I_PTR + row * 4 + 2, high_idx)
        if done != 0:
            tl.store(OUT_PTR + row, candidate.to(tl.int64))


def _check_args(logits, temperature, top_k, top_p, seeds, positions, all_greedy, out):
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, ndim=2)
    num_rows, vocab_size = logits.shape
    if vocab_size < 1:
        raise ValueError(f"logits must have at least one vocabulary entry, got shape {tuple(logits.shape)}")
    check_tensor("temperature", temperature, dtypes=FLOAT_DTYPES, shape=(num_rows,))
    check_tensor("top_k", top_k, dtypes=INDEX_DTYPES, shape=(num_rows,))
    check_tensor("top_p", top_p, dtypes=FLOAT_DTYPES, shape=(num_rows,))
    check_tensor("seeds", seeds, dtypes=INDEX_DTYPES, shape=(num_rows,))
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, shape=(num_rows,))
    check_bool("all_greedy", all_greedy)
    tensors = dict(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds, positions=positions)
    if out is not None:
        check_tensor("out", out, dtypes=(torch.int64,), shape=(num_rows,))
        tensors["out"] = out
    check_same_device(**tensors)
    check_unit_last_stride(logits=logits)
    del tensors["logits"]
    check_contiguous(**tensors)


def sample_tokens(
    logits: torch.Tensor,  # [R, V] float32/float16/bfloat16, unit stride along V
    temperature: torch.Tensor,  # [R] float, below GREEDY_TEMPERATURE (1e-5): greedy row
    top_k: torch.Tensor,  # [R] int, <= 0 or >= V: off
    top_p: torch.Tensor,  # [R] float, >= 1: off
    seeds: torch.Tensor,  # [R] int, the request's seed
    positions: torch.Tensor,  # [R] int, the position the sampled token will occupy
    all_greedy: bool = False,
    out: Optional[torch.Tensor] = None,  # [R] int64, written in place when given
) -> torch.Tensor:
    """One token per row: greedy, or Gumbel-max over the top-k / top-p kept set of logits / T.

    The rule, with its ties and boundaries, is in :mod:`mtp_ctrl.triton_ops.reference.sampling`.
    ``all_greedy`` is a host-side flag (from the requests' parameters, not tensor values) that
    skips the sampling work when no row samples. No host sync, no allocation when ``out`` is
    given: capturable in a CUDA graph. Returns ``out`` (or a new tensor), [R] int64.

    Example: logits ``[[0., 3., 1.]]``, temperature ``[0.]`` -> ``[1]``; with temperature
    ``[1.]`` and top_p ``[1e-46]`` -> ``[1]`` as well (the top token is always kept).
    """
    _VALIDATED.validate(_check_args, logits, temperature, top_k, top_p, seeds, positions, all_greedy, out)
    if not use_triton(logits):
        return reference.sample_tokens(logits, temperature, top_k, top_p, seeds, positions, all_greedy, out)
    num_rows, vocab_size = logits.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)  # [R] int64
    if num_rows > 0:
        _launch(logits, temperature, top_k, top_p, seeds, positions, all_greedy, out)
    return out


def _launch(logits, temperature, top_k, top_p, seeds, positions, all_greedy, out):
    """Scan, start, then ``ROUNDS`` x (pass, combine): fixed grids, no host sync (graph-capturable)."""
    num_rows, vocab_size = logits.shape
    chunk = max(16, triton.next_power_of_2(triton.cdiv(vocab_size, MAX_CHUNKS)))
    num_chunks = triton.cdiv(vocab_size, chunk)
    c_pad = max(2, triton.next_power_of_2(num_chunks))
    scan_block = min(BLOCK_VOCAB_MAX, chunk)
    pass_block = min(PASS_BLOCK_MAX, BLOCK_VOCAB_MAX, chunk)
    row_block = min(BLOCK_VOCAB_MAX, max(16, triton.next_power_of_2(vocab_size)))  # single-program walks
    pivots_n = NUM_PIVOTS
    # one workspace, carved up: float64 parts first so every part stays aligned
    partials = num_rows * num_chunks * pivots_n
    sizes = [(torch.float64, partials), (torch.float64, num_rows * num_chunks), (torch.float32, partials),
             (torch.int32, partials), (torch.int32, partials), (torch.float32, num_rows * 8),
             (torch.int32, num_rows * 4), (torch.float32, num_rows * pivots_n)]
    workspace = torch.empty(sum(n * d.itemsize for d, n in sizes), dtype=torch.uint8, device=out.device)
    parts, offset = [], 0
    for dtype, n in sizes:
        parts.append(workspace[offset:offset + n * dtype.itemsize].view(dtype))
        offset += n * dtype.itemsize
    mass, total, score, index, count, state_f, state_i, pivots = parts
    # mass / count / score / index: [R, C, P]; total: [R, C]; state_f: [R, 8]; state_i: [R, 4]; pivots: [R, P]
    common = dict(GREEDY_TEMPERATURE=GREEDY_TEMPERATURE, NUM_PIVOTS=pivots_n, num_warps=4)
    _chunk_scan_kernel[(num_rows, num_chunks)](
        logits, temperature, seeds, positions, score, index, logits.stride(0), vocab_size, num_chunks,
        ALL_GREEDY=all_greedy, CHUNK=chunk, BLOCK_VOCAB=scan_block, **common,
    )
    _start_kernel[(num_rows,)](
        logits, temperature, top_k, top_p, seeds, positions, out, score, index, state_f, state_i, pivots,
        logits.stride(0), vocab_size, num_chunks,
        ALL_GREEDY=all_greedy, C_PAD=c_pad, BLOCK_VOCAB=row_block, **common,
    )
    if all_greedy:
        return
    for round_ in range(ROUNDS):
        _round_pass_kernel[(num_rows, num_chunks)](
            logits, temperature, seeds, positions, state_f, state_i, pivots, count, mass, score, index, total,
            logits.stride(0), vocab_size, num_chunks, CHUNK=chunk, BLOCK_VOCAB=pass_block, **common,
        )
        _round_combine_kernel[(num_rows,)](
            logits, temperature, top_k, top_p, seeds, positions, out,
            state_f, state_i, pivots, count, mass, score, index, total,
            logits.stride(0), vocab_size, num_chunks,
            C_PAD=c_pad, FINAL=round_ == ROUNDS - 1, BLOCK_VOCAB=row_block, **common,
        )
