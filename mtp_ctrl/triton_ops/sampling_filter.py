"""The distribution a sampled row draws from, as probabilities: softmax of ``logits / T`` over the
top-k / top-p kept set, with no vocabulary sort. Its passes (:func:`_kept_softmax_terms`) also
give rejection acceptance's ``p`` and ``q`` inside the rejection kernel.

The kept set is the sampler's (:mod:`mtp_ctrl.triton_ops.reference.sampling`, the rule with its
ties and boundaries): ``{z >= threshold}``, where ``threshold`` is the smallest token value ``w``
with ``keep(w)``. One program per row, a loop over tiles of the row:

1. the row max ``m``; under top-k the k-th largest value (the sampler's search,
   :func:`mtp_ctrl.triton_ops.gumbel_sampling._kth_largest`), the top-k threshold ``t_k``;
2. under top-p, the total top-k mass ``Z`` (float64), then a search over the ordered int keys of
   float32 for the smallest key ``t`` in ``[key(t_k), key(m)]`` with ``keep(t)``: each pass counts
   the float64 mass above ``NUM_PIVOTS`` pivots (the first is the interval's low end, itself a
   token value) and the smallest token key above each. ``keep`` only changes at token values, so
   the answer is the smallest token above the last dropped pivot once that token is kept or no
   other token lies below the first kept pivot: rows usually finish in two or three passes, and
   the key interval shrinks ``NUM_PIVOTS``-fold a pass in any case;
3. ``e = exp(z - m)`` over the kept set, summed (float32), and ``e / sum`` written out.

Example: logits ``[[0., 3., 1.]]``, temperature ``[1.]``, top_k ``[2]``, top_p ``[1.]`` ->
``[[0, 0.881, 0.119]]``; top_p ``[0.5]`` instead -> ``[[0, 1, 0]]``.

It equals its twin's filtered softmax up to float rounding (the exp and the summation order), which
can move the kept set only when ``top_p * Z`` lies within rounding of a cumulative mass, as for the
sampler. No host sync: capturable in a CUDA graph.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import FLOAT_DTYPES, INDEX_DTYPES, ValidatedSignatures, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._layout_checks import check_contiguous, check_unit_last_stride
from mtp_ctrl.triton_ops.gumbel_sampling import _kth_largest, _ordered_key, _scaled_tile
from mtp_ctrl.triton_ops.reference.sampling import GREEDY_TEMPERATURE

BLOCK_VOCAB_MAX = 256  # tile of every pass: the pivot passes compare [256, P]
NUM_PIVOTS = 16  # values tested per pass of the top-p search
_NEG_INF = tl.constexpr(float("-inf"))
_NEG_INF_KEY = tl.constexpr(-2139095041)  # ordered key of float32 -inf
_ABOVE_EVERY_KEY = tl.constexpr(2**40)  # larger than any float32's ordered key
_VALIDATED = ValidatedSignatures()  # argument signatures that passed _check_args


@triton.jit
def _top_k_mass(row_ptr, ids, vocab_size, scale, safe_max, threshold_k):
    """``(z, valid, key, e)`` of one tile: ``e = exp(z - m)`` (float32) inside top-k, else 0."""
    z, valid = _scaled_tile(row_ptr, ids, vocab_size, scale)
    e = tl.where(valid & (z >= threshold_k), tl.exp(z - safe_max), 0.0)
    return z, valid, _ordered_key(z), e


@triton.jit
def _kept_softmax_terms(row_ptr, vocab_size, scale, top_k, top_p, NUM_PIVOTS: tl.constexpr,
                        BLOCK_VOCAB: tl.constexpr):
    """``(safe_max, threshold, inverse)`` of one row of logits (passes 1-3 of the module docstring):
    token ``i`` has probability ``exp(z_i - safe_max) * inverse`` if ``z_i >= threshold``, else 0
    (:func:`_kept_probs`). Shared with the rejection kernel, which reads ``p`` and ``q`` this way."""
    lanes = tl.arange(0, BLOCK_VOCAB)
    row_max = tl.full([], _NEG_INF, tl.float32)
    for start in range(0, vocab_size, BLOCK_VOCAB):
        z, _valid = _scaled_tile(row_ptr, start + lanes, vocab_size, scale)
        row_max = tl.maximum(row_max, tl.max(z, 0))
    safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # an all -inf row: no NaN
    threshold = tl.full([], _NEG_INF, tl.float32)  # top-k off: every token is inside top-k
    if (top_k > 0) & (top_k < vocab_size):
        threshold = _kth_largest(row_ptr, vocab_size, scale, top_k, row_max, BLOCK_VOCAB)

    if top_p < 1.0:
        total = tl.full([], 0.0, tl.float64)
        for start in range(0, vocab_size, BLOCK_VOCAB):
            _z, _v, _k, e = _top_k_mass(row_ptr, start + lanes, vocab_size, scale, safe_max, threshold)
            total += tl.sum(e.to(tl.float64), 0)
        limit = top_p.to(tl.float64) * total
        top_key = _ordered_key(row_max)  # keep(t) holds for t >= key(m): the top token is always kept
        low = _ordered_key(threshold)  # the answer, a token key, lies in [low, high]
        high = top_key
        pivot_lanes = tl.arange(0, NUM_PIVOTS).to(tl.int64)
        while low < high:
            pivots = low + ((high - low) * pivot_lanes + NUM_PIVOTS - 1) // NUM_PIVOTS  # [P], pivots[0] = low
            mass_above = tl.zeros([NUM_PIVOTS], dtype=tl.float64)
            next_key = tl.full([NUM_PIVOTS], _ABOVE_EVERY_KEY, tl.int64)  # smallest token key above each pivot
            for start in range(0, vocab_size, BLOCK_VOCAB):
                _z2, valid, key, e = _top_k_mass(row_ptr, start + lanes, vocab_size, scale, safe_max, threshold)
                above = valid[:, None] & (key[:, None] > pivots[None, :])  # [BLOCK_VOCAB, P]
                mass_above += tl.sum(tl.where(above, e.to(tl.float64)[:, None], 0.0), 0)
                next_key = tl.minimum(next_key, tl.min(tl.where(above, key[:, None], _ABOVE_EVERY_KEY), 0))
            keep = (pivots >= top_key) | (mass_above < limit)  # [P], monotone: dropped pivots come first
            high = tl.min(tl.where(keep, pivots, high), 0)
            # the answer is a token above the last dropped pivot (keep changes only at token values)
            low = tl.minimum(tl.max(tl.where(keep, low, next_key), 0), high)
        bits = tl.where(low >= 0, low, low ^ 0x7FFFFFFF).to(tl.int32)
        threshold = bits.to(tl.float32, bitcast=True)

    kept_sum = tl.full([], 0.0, tl.float32)
    for start in range(0, vocab_size, BLOCK_VOCAB):
        _z3, _v3, _k3, e = _top_k_mass(row_ptr, start + lanes, vocab_size, scale, safe_max, threshold)
        kept_sum += tl.sum(e, 0)
    inverse = 1.0 / tl.where(kept_sum > 0.0, kept_sum, 1.0)  # an all -inf row has e = 0 throughout
    return safe_max, threshold, inverse


@triton.jit
def _kept_probs(z, valid, safe_max, threshold, inverse):
    """Probabilities of the tokens ``z`` (a tile, or one token with ``valid`` True) under the
    terms of :func:`_kept_softmax_terms`."""
    return tl.where(valid & (z >= threshold), tl.exp(z - safe_max), 0.0) * inverse


@triton.jit
def _sampling_probs_kernel(
    LOGITS_PTR,  # [R, V] float, unit stride along V
    TEMPERATURE_PTR, TOP_K_PTR, TOP_P_PTR,  # [R] each
    OUT_PTR,  # [R, V] float32, contiguous
    logits_row_stride, vocab_size,
    GREEDY_TEMPERATURE: tl.constexpr, NUM_PIVOTS: tl.constexpr, BLOCK_VOCAB: tl.constexpr,
):
    """One program per row (module docstring)."""
    row = tl.program_id(0)
    row_ptr = LOGITS_PTR + row.to(tl.int64) * logits_row_stride
    out_ptr = OUT_PTR + row.to(tl.int64) * vocab_size
    temperature = tl.load(TEMPERATURE_PTR + row).to(tl.float32)
    scale = tl.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature)  # greedy rows: logits / 1
    top_k = tl.load(TOP_K_PTR + row).to(tl.int64)
    top_p = tl.load(TOP_P_PTR + row).to(tl.float32)
    safe_max, threshold, inverse = _kept_softmax_terms(row_ptr, vocab_size, scale, top_k, top_p, NUM_PIVOTS,
                                                       BLOCK_VOCAB)
    lanes = tl.arange(0, BLOCK_VOCAB)
    for start in range(0, vocab_size, BLOCK_VOCAB):
        ids = start + lanes
        z, valid = _scaled_tile(row_ptr, ids, vocab_size, scale)
        tl.store(out_ptr + ids, _kept_probs(z, valid, safe_max, threshold, inverse), mask=valid)


def _check_args(logits, temperature, top_k, top_p, out):
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, ndim=2)
    num_rows, vocab_size = logits.shape
    if vocab_size < 1:
        raise ValueError(f"logits must have at least one vocabulary entry, got shape {tuple(logits.shape)}")
    check_tensor("temperature", temperature, dtypes=FLOAT_DTYPES, shape=(num_rows,))
    check_tensor("top_k", top_k, dtypes=INDEX_DTYPES, shape=(num_rows,))
    check_tensor("top_p", top_p, dtypes=FLOAT_DTYPES, shape=(num_rows,))
    tensors = dict(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p)
    if out is not None:
        check_tensor("out", out, dtypes=(torch.float32,), shape=(num_rows, vocab_size))
        tensors["out"] = out
    check_same_device(**tensors)
    check_unit_last_stride(logits=logits)
    del tensors["logits"]
    check_contiguous(**tensors)


def sampling_probs(
    logits: torch.Tensor,  # [R, V] float32/float16/bfloat16, unit stride along V
    temperature: torch.Tensor,  # [R] float, below GREEDY_TEMPERATURE (1e-5): T = 1
    top_k: torch.Tensor,  # [R] int, <= 0 or >= V: off
    top_p: torch.Tensor,  # [R] float, >= 1: off
    out: Optional[torch.Tensor] = None,  # [R, V] float32, written in place when given
) -> torch.Tensor:
    """The distribution each row samples from: softmax of ``logits / T`` over the top-k / top-p
    kept set of :func:`sample_tokens` (greedy rows use ``T = 1``). Returns ``out`` (or a new
    tensor), [R, V] float32, zero outside the kept set (an all -inf row gives zeros). No host sync;
    no allocation when ``out`` is given."""
    _VALIDATED.validate(_check_args, logits, temperature, top_k, top_p, out)
    if not use_triton(logits):
        return reference.sampling_probs(logits, temperature, top_k, top_p, out)
    num_rows, vocab_size = logits.shape
    if out is None:
        out = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=logits.device)  # [R, V] float32
    if num_rows > 0:
        block = min(BLOCK_VOCAB_MAX, max(16, triton.next_power_of_2(vocab_size)))
        _sampling_probs_kernel[(num_rows,)](
            logits, temperature, top_k, top_p, out, logits.stride(0), vocab_size,
            GREEDY_TEMPERATURE=GREEDY_TEMPERATURE, NUM_PIVOTS=NUM_PIVOTS, BLOCK_VOCAB=block, num_warps=4,
        )
    return out
