"""Element-wise glue of a transformer layer, fused: one launch where megatron's local layer runs 2-5.

- :func:`add_bias_residual_norm`: a sublayer's bias add, the residual add and the next sublayer's
  LayerNorm / RMSNorm (megatron: bias add, residual add, norm); returns the new residual and the
  normed rows. Without a norm weight it is the layer's last bias + residual add.
- :func:`bias_activation`: the MLP's fc1 bias add and activation, gated (GLU: ``act(a) * b``) or
  not (megatron: bias add, activation; for GLU also the chunk's multiply).
- :func:`split_qkv_heads`: the QKV projection's bias add and its per-group split into contiguous
  query, key and value heads (megatron: bias add, then a copy of the non-contiguous query view).
- :func:`gated_rms_norm`: the Mamba mixer's gated norm ``rmsnorm(y * silu(gate))`` per group of
  channels, scaled, rounded once to the output dtype (torch: 10 launches with the weight's cast
  and the output's).

Rounding follows megatron's unfused path: every element-wise result is rounded to the input dtype
where megatron rounds it (bias add, residual add, activation, GLU product); a norm runs in fp32 and
rounds once. In fp32 that makes the kernels equal to megatron up to the last bit of the norm's
reduction order and the transcendental functions; the twins in
:mod:`mtp_ctrl.triton_ops.reference.glue` round at the same points.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import FLOAT_DTYPES, check_int, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._layout_checks import check_bool, check_contiguous, check_unit_last_stride

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")  # the codes below index this tuple
_MAX_NORM_WIDTH = 1 << 16  # one program holds a whole row


@triton.jit
def _round(value, ROUND_BF16: tl.constexpr, DTYPE: tl.constexpr):
    """fp32 ``value`` rounded to ``DTYPE`` (to nearest, ties to even), returned as fp32.

    bf16 is rounded by hand on the bits: Triton's interpreter truncates on a bf16 cast where the
    GPU rounds to nearest, and a kernel that must match torch bit for bit cannot differ by backend.
    """
    if ROUND_BF16:
        bits = value.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        result = bits.to(tl.float32, bitcast=True)
    else:
        result = value.to(DTYPE).to(tl.float32)
    return result


@triton.jit
def _add_bias_residual_norm_kernel(
    X_PTR, BIAS_PTR, RESIDUAL_PTR, NORM_WEIGHT_PTR, NORM_BIAS_PTR, RESIDUAL_OUT_PTR, NORMED_OUT_PTR,
    x_stride_t, residual_stride_t, out_stride_t, width, eps,
    HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_NORM_BIAS: tl.constexpr, RMS_NORM: tl.constexpr,
    ROUND_BF16: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """One program per row: residual + round(x + bias), rounded; then its norm in fp32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < width
    out_dtype = RESIDUAL_OUT_PTR.dtype.element_ty
    hidden = tl.load(X_PTR + row * x_stride_t + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(BIAS_PTR + cols, mask=mask, other=0.0).to(tl.float32)
        hidden = _round(hidden + bias, ROUND_BF16, out_dtype)  # megatron's bias add rounds here
    residual = tl.load(RESIDUAL_PTR + row * residual_stride_t + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # every load is issued before the first reduction: their latencies overlap
        norm_weight = tl.load(NORM_WEIGHT_PTR + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM_BIAS:
            norm_bias = tl.load(NORM_BIAS_PTR + cols, mask=mask, other=0.0).to(tl.float32)
    rows = _round(residual + hidden, ROUND_BF16, out_dtype)  # [BLOCK_H] fp32, exact in out_dtype
    tl.store(RESIDUAL_OUT_PTR + row * out_stride_t + cols, rows.to(out_dtype), mask=mask)
    if HAS_NORM:
        if RMS_NORM:
            centred = rows
        else:
            centred = tl.where(mask, rows - tl.sum(rows, axis=0) / width, 0.0)
        variance = tl.sum(centred * centred, axis=0) / width
        normed = centred * (1.0 / tl.sqrt(variance + eps))
        normed = normed * norm_weight
        if HAS_NORM_BIAS:
            normed = normed + norm_bias
        tl.store(NORMED_OUT_PTR + row * out_stride_t + cols, _round(normed, ROUND_BF16, out_dtype).to(out_dtype),
                 mask=mask)


@triton.jit
def _activate(hidden, ACTIVATION: tl.constexpr):
    """fp32 in, fp32 out; ACTIVATION indexes ACTIVATIONS."""
    if ACTIVATION == 0:  # gelu (erf)
        result = 0.5 * hidden * (1.0 + tl.math.erf(hidden * 0.7071067811865476))
    elif ACTIVATION == 1:  # gelu, tanh approximation; tanh(z) = 1 - 2 / (exp(2z) + 1)
        inner = 0.7978845608028654 * (hidden + 0.044715 * hidden * hidden * hidden)
        result = 0.5 * hidden * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
    elif ACTIVATION == 2:  # silu
        result = hidden / (1.0 + tl.exp(-hidden))
    else:  # relu
        result = tl.maximum(hidden, 0.0)
    return result


@triton.jit
def _bias_activation_kernel(
    X_PTR, BIAS_PTR, OUT_PTR, x_stride_t, out_stride_t, width,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """Program (row, tile): output columns ``tile * BLOCK_F ...`` of one row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = cols < width
    out_dtype = OUT_PTR.dtype.element_ty
    x_row = X_PTR + row * x_stride_t
    hidden = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        hidden = _round(hidden + tl.load(BIAS_PTR + cols, mask=mask, other=0.0).to(tl.float32), ROUND_BF16, out_dtype)
    result = _activate(hidden, ACTIVATION)
    if GATED:  # megatron's glu rounds the activation, then the product
        linear = tl.load(x_row + width + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            linear_bias = tl.load(BIAS_PTR + width + cols, mask=mask, other=0.0).to(tl.float32)
            linear = _round(linear + linear_bias, ROUND_BF16, out_dtype)
        result = _round(result, ROUND_BF16, out_dtype) * linear
    tl.store(OUT_PTR + row * out_stride_t + cols, _round(result, ROUND_BF16, out_dtype).to(out_dtype), mask=mask)


@triton.jit
def _split_qkv_heads_kernel(
    MIXED_PTR, BIAS_PTR, QUERY_PTR, KEY_PTR, VALUE_PTR, mixed_stride_t, heads_per_group, head_dim,
    HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (row, kv group g): the group's ``heads_per_group + 2`` heads of the mixed row
    (queries, key, value) plus bias, to query heads ``g * heads_per_group ...``, key g and value g."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    num_groups = tl.num_programs(1).to(tl.int64)
    heads = tl.arange(0, BLOCK_R)  # [BLOCK_R]: head within the group's slice
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < heads_per_group + 2)[:, None] & (dims < head_dim)[None, :]  # [BLOCK_R, BLOCK_D]
    columns = (group * (heads_per_group + 2) + heads)[:, None] * head_dim + dims[None, :]  # int64
    values = tl.load(MIXED_PTR + row * mixed_stride_t + columns, mask=mask, other=0.0)
    if HAS_BIAS:
        bias = tl.load(BIAS_PTR + columns, mask=mask, other=0.0).to(tl.float32)
        out_dtype = QUERY_PTR.dtype.element_ty
        values = _round(values.to(tl.float32) + bias, ROUND_BF16, out_dtype).to(out_dtype)
    is_query = (heads < heads_per_group)[:, None]
    query_head = (group * heads_per_group + heads)[:, None]
    tl.store(QUERY_PTR + (row * num_groups * heads_per_group + query_head) * head_dim + dims[None, :], values,
             mask=mask & is_query)
    kv_offsets = (row * num_groups + group) * head_dim + dims[None, :] + heads[:, None] * 0
    tl.store(KEY_PTR + kv_offsets, values, mask=mask & (heads == heads_per_group)[:, None])
    tl.store(VALUE_PTR + kv_offsets, values, mask=mask & (heads == heads_per_group + 1)[:, None])


@triton.jit
def _gated_rms_norm_kernel(Y_PTR, GATE_PTR, WEIGHT_PTR, OUT_PTR, y_stride, gate_stride, out_stride, group_size, eps,
                           ROUND_BF16: tl.constexpr, BLOCK_G: tl.constexpr):
    """One program per (row, group of channels): the group's gated values, their mean square, the
    scaled result."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_G)
    mask = offsets < group_size
    channels = tl.program_id(1).to(tl.int64) * group_size + offsets  # [BLOCK_G]
    y = tl.load(Y_PTR + row * y_stride + channels, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(GATE_PTR + row * gate_stride + channels, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(WEIGHT_PTR + channels, mask=mask, other=0.0).to(tl.float32)
    gated = y * (gate / (1.0 + tl.exp(-gate)))  # silu; exp overflow gives -0.0
    mean_square = tl.sum(gated * gated, axis=0) / group_size
    out = gated * (1.0 / tl.sqrt(mean_square + eps)) * weight
    tl.store(OUT_PTR + row * out_stride + channels, _round(out, ROUND_BF16, OUT_PTR.dtype.element_ty), mask=mask)


def _check_vector(name, vector, width, dtypes, device):
    if vector is not None:
        check_tensor(name, vector, dtypes=dtypes, shape=(width,), device=device)
        check_contiguous(**{name: vector})


def add_bias_residual_norm(
    x: torch.Tensor,  # [T, H] float: a sublayer's output before its bias
    bias: Optional[torch.Tensor],  # [H], x's dtype, or None
    residual: torch.Tensor,  # [T, H], x's dtype
    norm_weight: Optional[torch.Tensor] = None,  # [H] float, or None: no norm
    norm_bias: Optional[torch.Tensor] = None,  # [H] float, or None (RMSNorm, or LayerNorm without bias)
    eps: float = 1e-5,
    rms_norm: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:  # new residual [T, H], normed [T, H] or None; x's dtype
    """``new_residual = residual + (x + bias)`` and, with ``norm_weight``, the next sublayer's input
    ``LayerNorm(new_residual)`` (``rms_norm=False``: ``(r - mean) / sqrt(var + eps) * w + b``) or
    ``RMSNorm(new_residual)`` (``r / sqrt(mean(r^2) + eps) * w``), in one launch.

    Example, ``H = 2``, fp32, LayerNorm with ``w = [1, 1]``, no biases: ``x = [[1, 2]]``,
    ``residual = [[1, 0]]`` -> new residual ``[[2, 2]]``, normed ``[[0, 0]]``.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    width = x.shape[1]
    check_tensor("residual", residual, dtypes=(x.dtype,), shape=tuple(x.shape), device=x.device)
    _check_vector("bias", bias, width, (x.dtype,), x.device)
    _check_vector("norm_weight", norm_weight, width, FLOAT_DTYPES, x.device)
    _check_vector("norm_bias", norm_bias, width, FLOAT_DTYPES, x.device)
    if norm_weight is None and norm_bias is not None:
        raise ValueError("norm_bias needs norm_weight")
    check_bool("rms_norm", rms_norm)
    if rms_norm and norm_bias is not None:
        raise ValueError("RMSNorm takes no norm_bias")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    check_unit_last_stride(x=x, residual=residual)
    if not 1 <= width <= _MAX_NORM_WIDTH:
        raise ValueError(f"x has width {width}; the kernel takes 1 .. {_MAX_NORM_WIDTH}")
    if not use_triton(x):
        return reference.add_bias_residual_norm(x, bias, residual, norm_weight, norm_bias, eps, rms_norm)
    num_tokens = x.shape[0]
    new_residual = torch.empty((num_tokens, width), dtype=x.dtype, device=x.device)  # [T, H]
    normed = None if norm_weight is None else torch.empty_like(new_residual)  # [T, H]
    if num_tokens == 0:
        return new_residual, normed
    block_h = triton.next_power_of_2(width)
    _add_bias_residual_norm_kernel[(num_tokens,)](
        x, x if bias is None else bias, residual, x if norm_weight is None else norm_weight,
        x if norm_bias is None else norm_bias, new_residual, new_residual if normed is None else normed,
        x.stride(0), residual.stride(0), new_residual.stride(0), width, float(eps),
        HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None, HAS_NORM_BIAS=norm_bias is not None,
        RMS_NORM=rms_norm, ROUND_BF16=x.dtype == torch.bfloat16, BLOCK_H=block_h,
        num_warps=min(16, max(1, block_h // 256)),
    )
    return new_residual, normed


def bias_activation(
    x: torch.Tensor,  # [T, F] float, or [T, 2F] when gated (the activated half first)
    bias: Optional[torch.Tensor],  # [x.shape[1]], x's dtype, or None
    activation: str,  # "gelu" (erf), "gelu_tanh", "silu" or "relu"
    gated: bool = False,
) -> torch.Tensor:  # [T, F], x's dtype
    """``act(x + bias)``, or with ``gated`` megatron's GLU ``act(a + bias_a) * (b + bias_b)`` over the
    two halves ``[a | b]`` of each row, in one launch.

    Example: ``x = [[-1, 2]]``, no bias, ``"relu"`` -> ``[[0, 2]]``; gated -> ``[[0 * 2]] = [[0]]``.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    _check_vector("bias", bias, x.shape[1], (x.dtype,), x.device)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    check_bool("gated", gated)
    if gated and x.shape[1] % 2 != 0:
        raise ValueError(f"gated: x's width {x.shape[1]} must be even (two halves)")
    check_unit_last_stride(x=x)
    if not use_triton(x):
        return reference.bias_activation(x, bias, activation, gated)
    num_tokens = x.shape[0]
    width = x.shape[1] // 2 if gated else x.shape[1]
    out = torch.empty((num_tokens, width), dtype=x.dtype, device=x.device)  # [T, F]
    if num_tokens == 0 or width == 0:
        return out
    block_f = min(1024, triton.next_power_of_2(width))
    _bias_activation_kernel[(num_tokens, triton.cdiv(width, block_f))](
        x, x if bias is None else bias, out, x.stride(0), out.stride(0), width,
        HAS_BIAS=bias is not None, GATED=gated, ACTIVATION=ACTIVATIONS.index(activation),
        ROUND_BF16=x.dtype == torch.bfloat16, BLOCK_F=block_f,
        num_warps=4,
    )
    return out


def gated_rms_norm(
    y: torch.Tensor,  # [T, d] float
    gate: torch.Tensor,  # [T, d] float (the mixer's z)
    weight: torch.Tensor,  # [d] float
    group_size: int,  # channels per group; divides d
    eps: float,
    out_dtype: Optional[torch.dtype] = None,  # default: y's dtype
) -> torch.Tensor:  # [T, d] out_dtype
    """``g = y * silu(gate)``; per group of ``group_size`` channels ``g / sqrt(mean(g^2) + eps)``,
    times ``weight``, in fp32, rounded once to ``out_dtype``: mamba's ``RMSNormGated`` with
    ``norm_before_gate=False``, and the cast megatron's mixer applies after it, in one launch.

    Example: ``y = [[2, 2]]``, ``gate = [[30, 30]]`` (silu ~ 30), one group, ``weight = [1, 1]``,
    ``eps = 0`` -> ``[[1, 1]]``.
    """
    check_tensor("y", y, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("gate", gate, dtypes=FLOAT_DTYPES, shape=tuple(y.shape), device=y.device)
    width = y.shape[1]
    _check_vector("weight", weight, width, FLOAT_DTYPES, y.device)
    check_int("group_size", group_size, low=1, high=_MAX_NORM_WIDTH)
    if width % group_size != 0:
        raise ValueError(f"group_size {group_size} does not divide y's width {width}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    out_dtype = y.dtype if out_dtype is None else out_dtype
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype!r}")
    check_unit_last_stride(y=y, gate=gate)
    if not use_triton(y):
        return reference.gated_rms_norm(y, gate, weight, group_size, eps, out_dtype)
    out = torch.empty(y.shape, dtype=out_dtype, device=y.device)  # [T, d]
    if y.shape[0] == 0 or width == 0:
        return out
    block_g = triton.next_power_of_2(group_size)
    _gated_rms_norm_kernel[(y.shape[0], width // group_size)](
        y, gate, weight, out, y.stride(0), gate.stride(0), out.stride(0), group_size, float(eps),
        ROUND_BF16=out_dtype == torch.bfloat16, BLOCK_G=block_g, num_warps=min(8, max(1, block_g // 256)))
    return out


def check_mixed_qkv(mixed_qkv: torch.Tensor, num_kv_heads: int, head_dim: int) -> int:
    """Check megatron's fused QKV rows ``[T, G * (Q / G + 2) * D]``; returns ``Q / G``."""
    check_tensor("mixed_qkv", mixed_qkv, dtypes=FLOAT_DTYPES, ndim=2)
    check_int("num_kv_heads", num_kv_heads, low=1)
    check_int("head_dim", head_dim, low=1)
    width, group_width = mixed_qkv.shape[1], num_kv_heads * head_dim
    if width % group_width != 0 or width // group_width < 3:
        raise ValueError(f"mixed_qkv's width {width} must be num_kv_heads * (heads_per_group + 2) * head_dim "
                         f"with heads_per_group >= 1 (num_kv_heads={num_kv_heads}, head_dim={head_dim})")
    check_unit_last_stride(mixed_qkv=mixed_qkv)
    return width // group_width - 2


def split_qkv_heads(
    mixed_qkv: torch.Tensor,  # [T, G * (Q / G + 2) * D] float: per kv group, its query heads, key, value
    bias: Optional[torch.Tensor],  # [mixed_qkv.shape[1]], mixed_qkv's dtype, or None
    num_kv_heads: int,
    head_dim: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # query [T, Q, D], key [T, G, D], value [T, G, D]
    """Add the QKV projection's bias and split megatron's grouped layout into contiguous heads.

    megatron's fused QKV row holds, for each kv group g in turn, its ``Q / G`` query heads, then
    its key head, then its value head. Example, ``G = 2``, ``Q = 4``, ``D = 1``: the row
    ``[q0 q1 k0 v0 q2 q3 k1 v1]`` gives query ``[q0 q1 q2 q3]``, key ``[k0 k1]``, value ``[v0 v1]``.
    """
    heads_per_group = check_mixed_qkv(mixed_qkv, num_kv_heads, head_dim)
    _check_vector("bias", bias, mixed_qkv.shape[1], (mixed_qkv.dtype,), mixed_qkv.device)
    if not use_triton(mixed_qkv):
        return reference.split_qkv_heads(mixed_qkv, bias, num_kv_heads, head_dim)
    num_tokens = mixed_qkv.shape[0]
    options = dict(dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    query = torch.empty((num_tokens, num_kv_heads * heads_per_group, head_dim), **options)  # [T, Q, D]
    key = torch.empty((num_tokens, num_kv_heads, head_dim), **options)  # [T, G, D]
    value = torch.empty((num_tokens, num_kv_heads, head_dim), **options)  # [T, G, D]
    if num_tokens == 0:
        return query, key, value
    _split_qkv_heads_kernel[(num_tokens, num_kv_heads)](
        mixed_qkv, mixed_qkv if bias is None else bias, query, key, value, mixed_qkv.stride(0),
        heads_per_group, head_dim, HAS_BIAS=bias is not None, ROUND_BF16=mixed_qkv.dtype == torch.bfloat16,
        BLOCK_R=triton.next_power_of_2(heads_per_group + 2), BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
    )
    return query, key, value

