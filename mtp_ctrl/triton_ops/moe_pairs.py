"""The element-wise steps of an MoE layer around its two grouped expert products, one launch each.

- :func:`scaled_pair_activation`: the experts' activation on fc1's sorted positions (GLU
  ``act(a) * b`` or ``act(x)``) times each position's routing probability (megatron's
  ``per_token_scale``), where torch runs the activation, the GLU product, a gather of the
  probabilities, the product and a cast (5 launches).
- :func:`combine_expert_pairs`: each row's k expert outputs summed in fp32, rounded to the output
  dtype, plus the shared experts' output (torch: a sum, a cast and an add).

Rounding is megatron's unfused path's (``MLP.forward`` with ``per_token_scale``, ``MoELayer``):
the activation rounds to the rows' dtype, then the GLU product, then the scaled product (an fp32
product of the rounded activation and the fp32 probability, rounded once: what torch's
``(x * p).to(dtype)`` gives); the combine rounds its fp32 sum once, then the add of the shared
output. The rounding helpers are layer_glue's (bf16 rounded on the bits, the same by backend).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import FLOAT_DTYPES, check_int, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._layout_checks import check_bool, check_contiguous
from mtp_ctrl.triton_ops.layer_glue import ACTIVATIONS, _activate, _round


@triton.jit
def _scaled_pair_activation_kernel(
    FC1_PTR, PROBS_PTR, SORTED_PAIRS_PTR, OUT_PTR, fc1_stride, out_stride, width,
    GATED: tl.constexpr, ACTIVATION: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """Program (position, column tile): ``round(round(act) * p)`` for one sorted position."""
    position = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = cols < width
    out_dtype = OUT_PTR.dtype.element_ty
    row = FC1_PTR + position * fc1_stride
    result = _activate(tl.load(row + cols, mask=mask, other=0.0).to(tl.float32), ACTIVATION)
    if GATED:  # megatron's glu rounds the activation, then the product
        linear = tl.load(row + width + cols, mask=mask, other=0.0).to(tl.float32)
        result = _round(result, ROUND_BF16, out_dtype) * linear
    result = _round(result, ROUND_BF16, out_dtype)
    scale = tl.load(PROBS_PTR + tl.load(SORTED_PAIRS_PTR + position)).to(tl.float32)
    tl.store(OUT_PTR + position * out_stride + cols, _round(result * scale, ROUND_BF16, out_dtype).to(out_dtype),
             mask=mask)


@triton.jit
def _combine_expert_pairs_kernel(
    PAIRS_PTR, SHARED_PTR, OUT_PTR, hidden, top_k,
    HAS_SHARED: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Program (row, column tile): ``round(round(sum_j pairs[row * k + j]) + shared[row])``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    out_dtype = OUT_PTR.dtype.element_ty
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(top_k):
        total += tl.load(PAIRS_PTR + (row * top_k + j) * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHARED:
        total = _round(total, ROUND_BF16, out_dtype) + tl.load(SHARED_PTR + row * hidden + cols, mask=mask,
                                                               other=0.0).to(tl.float32)
    tl.store(OUT_PTR + row * hidden + cols, _round(total, ROUND_BF16, out_dtype).to(out_dtype), mask=mask)


def scaled_pair_activation(
    fc1: torch.Tensor,  # [P, F] float, or [P, 2F] when gated: fc1's output at each sorted position
    probs: torch.Tensor,  # [T, k] float: routing probabilities, pair t * k + j at flat index t * k + j
    sorted_pairs: torch.Tensor,  # [P] int64: the pair at each sorted position (ExpertSegments.sorted_pairs)
    activation: str,  # layer_glue.ACTIVATIONS: "gelu" (erf), "gelu_tanh", "silu" or "relu"
    gated: bool,
) -> torch.Tensor:  # [P, F] fc1's dtype
    """``act(fc1[p]) * probs.flatten()[sorted_pairs[p]]`` (GLU: ``act(a) * b`` over the halves), with
    megatron's roundings (module docstring).

    Example: fc1 ``[[-1, 2]]``, gated, ``"relu"``, probs ``[[0.5]]``, sorted_pairs ``[0]`` -> ``[[0]]``;
    not gated -> ``[[0, 1]]``.
    """
    check_tensor("fc1", fc1, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("probs", probs, dtypes=FLOAT_DTYPES, ndim=2, device=fc1.device)
    check_tensor("sorted_pairs", sorted_pairs, dtypes=(torch.int64,), shape=(fc1.shape[0],), device=fc1.device)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    check_bool("gated", gated)
    if gated and fc1.shape[1] % 2 != 0:
        raise ValueError(f"gated: fc1's width {fc1.shape[1]} must be even (two halves)")
    if probs.numel() != fc1.shape[0]:
        raise ValueError(f"probs has {probs.numel()} pairs, fc1 {fc1.shape[0]} positions; they must match")
    check_contiguous(probs=probs)
    if fc1.stride(1) != 1:
        raise ValueError("fc1 must have a unit last stride")
    if not use_triton(fc1):
        return reference.scaled_pair_activation(fc1, probs, sorted_pairs, activation, gated)
    num_positions = fc1.shape[0]
    width = fc1.shape[1] // 2 if gated else fc1.shape[1]
    out = torch.empty((num_positions, width), dtype=fc1.dtype, device=fc1.device)  # [P, F]
    if num_positions == 0 or width == 0:
        return out
    block_f = min(1024, triton.next_power_of_2(width))
    _scaled_pair_activation_kernel[(num_positions, triton.cdiv(width, block_f))](
        fc1, probs, sorted_pairs, out, fc1.stride(0), out.stride(0), width,
        GATED=gated, ACTIVATION=ACTIVATIONS.index(activation), ROUND_BF16=fc1.dtype == torch.bfloat16,
        BLOCK_F=block_f, num_warps=4,
    )
    return out


def combine_expert_pairs(
    pairs: torch.Tensor,  # [T * k, H] float: expert outputs in pair order (row t's j-th at t * k + j)
    top_k: int,  # k
    shared: Optional[torch.Tensor],  # [T, H] float or None: the shared experts' output
    out_dtype: torch.dtype,  # the output's dtype (shared's when given)
) -> torch.Tensor:  # [T, H] out_dtype
    """``sum_j pairs[t * k + j]`` in fp32, rounded to ``out_dtype``, plus ``shared[t]`` (rounded).

    Example: pairs ``[[1], [2], [3], [4]]``, k = 2, shared ``[[10], [20]]`` -> ``[[13], [27]]``.
    """
    check_tensor("pairs", pairs, dtypes=FLOAT_DTYPES, ndim=2)
    check_int("top_k", top_k, low=1)
    if pairs.shape[0] % top_k != 0:
        raise ValueError(f"pairs has {pairs.shape[0]} rows, not a multiple of top_k={top_k}")
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype}")
    num_rows, hidden = pairs.shape[0] // top_k, pairs.shape[1]
    if shared is not None:
        check_tensor("shared", shared, dtypes=(out_dtype,), shape=(num_rows, hidden), device=pairs.device)
        check_contiguous(shared=shared)
    check_contiguous(pairs=pairs)
    if not use_triton(pairs):
        return reference.combine_expert_pairs(pairs, top_k, shared, out_dtype)
    out = torch.empty((num_rows, hidden), dtype=out_dtype, device=pairs.device)  # [T, H]
    if num_rows == 0 or hidden == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_expert_pairs_kernel[(num_rows, triton.cdiv(hidden, block_h))](
        pairs, pairs if shared is None else shared, out, hidden, top_k,
        HAS_SHARED=shared is not None, ROUND_BF16=out_dtype == torch.bfloat16, BLOCK_H=block_h, num_warps=4,
    )
    return out
