"""One token per logits row in one Triton kernel: greedy, temperature, top-k, top-p, Gumbel-max.

The rule (ties, boundaries, the always-kept top token) is written once, in
:mod:`mtp_ctrl.triton_ops.reference.sampling`; its torch twin sorts, this kernel does not.
One program per row loops over the vocabulary in tiles of ``BLOCK_VOCAB``:

1. scan: row max and greedy argmax, and for sampled rows the first candidate
   ``c = argmax(z + noise)`` over every token. A tile whose best value plus the largest possible
   noise (< 17) is below the running best cannot win: its noise is not computed.
2. top-k with top-p only: the k-th largest value by a 4-way search on the float's ordered
   32-bit key (count passes, at most 17), then a new candidate inside top-k if needed.
3. while the candidate's value ``v`` is not kept: one pass counts tokens and sums exp-mass above
   ``v`` and above a second pivot ``mid`` between ``v`` and the smallest value known to be kept;
   everything at or below the larger rejected pivot is dropped, and a scan over the remaining
   tokens draws the next candidate. The candidate is a draw from the remaining mass, so this
   usually ends after one mass pass; the second pivot halves the search interval every round.

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

BLOCK_VOCAB_MAX = 2048
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
def _scan(row_ptr, vocab_size, scale, lo, use_noise, key_low, key_high, STRICT: tl.constexpr,
          BLOCK_VOCAB: tl.constexpr):
    """Row max, its first index, and (if ``use_noise``) the first index of max(z + noise) over the
    candidates ``z > lo`` (``STRICT``) or ``z >= lo``, with that candidate's score and value."""
    lanes = tl.arange(0, BLOCK_VOCAB)
    row_max = tl.full([], _NEG_INF, tl.float32)
    max_idx = tl.full([], 0, tl.int32)
    best = tl.full([], _NEG_INF, tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    best_z = tl.full([], _NEG_INF, tl.float32)
    for start in range(0, vocab_size, BLOCK_VOCAB):
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
    return row_max, max_idx, best_idx, best_z


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
def _sample_tokens_kernel(
    LOGITS_PTR,  # [R, V] float, unit stride along V
    TEMPERATURE_PTR,  # [R] float
    TOP_K_PTR,  # [R] int
    TOP_P_PTR,  # [R] float
    SEEDS_PTR,  # [R] int
    POSITIONS_PTR,  # [R] int
    OUT_PTR,  # [R] int64
    logits_row_stride,
    vocab_size,
    GREEDY_TEMPERATURE: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
    BLOCK_VOCAB: tl.constexpr,
):
    """One program per row."""
    row = tl.program_id(0)
    row_ptr = LOGITS_PTR + row.to(tl.int64) * logits_row_stride
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
    all_tokens = tl.full([], _NEG_INF, tl.float32)
    row_max, token, candidate, value = _scan(
        row_ptr, vocab_size, scale, all_tokens, sampled, key_low, key_high, False, BLOCK_VOCAB
    )
    if sampled:
        top_k = tl.load(TOP_K_PTR + row).to(tl.int64)
        top_p = tl.load(TOP_P_PTR + row).to(tl.float32)
        k_active = (top_k > 0) & (top_k < vocab_size)
        p_active = top_p < 1.0
        safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        threshold_k = tl.full([], _NEG_INF, tl.float32)
        if k_active & p_active:  # top-p needs the top-k mass
            threshold_k = _kth_largest(row_ptr, vocab_size, scale, top_k, row_max, BLOCK_VOCAB)
            if value < threshold_k:
                _, _, candidate, value = _scan(
                    row_ptr, vocab_size, scale, threshold_k, sampled, key_low, key_high, False, BLOCK_VOCAB
                )
        k_limit = tl.where(k_active, top_k, vocab_size + 1)
        kept_value_known = tl.full([], 1, tl.int32)
        if k_active | p_active:
            kept_value_known = tl.full([], 0, tl.int32)
        smallest_kept = row_max  # the top token is always kept
        while kept_value_known == 0:
            mid = value * 0.5 + smallest_kept * 0.5
            count_value, count_mid, mass_value, mass_mid, total = _masses(
                row_ptr, vocab_size, scale, safe_max, threshold_k, value, mid, BLOCK_VOCAB
            )
            limit = top_p.to(tl.float64) * total
            keep_value = (count_value < k_limit) & ((p_active == 0) | (value >= row_max) | (mass_value < limit))
            keep_mid = (count_mid < k_limit) & ((p_active == 0) | (mid >= row_max) | (mass_mid < limit))
            kept_value_known = keep_value.to(tl.int32)
            lower = tl.where(keep_mid, value, mid)  # every token <= lower is dropped
            smallest_kept = tl.where(keep_mid, mid, smallest_kept)
            if kept_value_known == 0:
                _, _, candidate, value = _scan(
                    row_ptr, vocab_size, scale, lower, sampled, key_low, key_high, True, BLOCK_VOCAB
                )
        token = candidate
    tl.store(OUT_PTR + row, token.to(tl.int64))


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
        block_vocab = min(BLOCK_VOCAB_MAX, max(16, triton.next_power_of_2(vocab_size)))
        _sample_tokens_kernel[(num_rows,)](
            logits, temperature, top_k, top_p, seeds, positions, out,
            logits.stride(0), vocab_size,
            GREEDY_TEMPERATURE=GREEDY_TEMPERATURE,
            ALL_GREEDY=all_greedy,
            BLOCK_VOCAB=block_vocab,
            num_warps=8 if block_vocab >= 1024 else 4,
        )
    return out
