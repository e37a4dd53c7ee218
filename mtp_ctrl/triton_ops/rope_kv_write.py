"""Rotary embedding of this step's queries and keys fused with the paged KV-cache write.

One launch per attention layer replaces megatron's rotary (several small kernels each for q and
k) and the separate cache write: program ``(t, g)`` ropes kv head ``g`` of row ``t``, stores it
and the row's value at ``slot_mapping[t]`` (``-1`` = padding: no write), and ropes the query
heads of that kv head's group into a new query tensor.

Rotary convention (megatron-core's ``_apply_rotary_pos_emb_bshd``): with ``R = 2 * cos.shape[1]``
rotated dims (``R < D`` for a partial rotary, ``rotary_percent < 1``), dim ``d < R`` becomes
``x[d] * cos[j] + sign * x[p] * sin[j]`` and dims ``d >= R`` pass through, where

- halves (``rotary_interleaved=False``): ``j = d mod R/2``, ``p = d + R/2`` with sign ``-1`` in
  the first half, ``p = d - R/2`` with sign ``+1`` in the second;
- interleaved (``rotary_interleaved=True``): ``j = d // 2``, ``p = d ^ 1`` (the other dim of the
  pair), sign ``-1`` on even ``d`` and ``+1`` on odd ``d``.

The arithmetic is fp32 (inputs up-cast, one rounding at the store).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import FLOAT_DTYPES, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._layout_checks import check_bool, check_unit_last_stride
from mtp_ctrl.triton_ops.layer_glue import _check_vector, _round, check_mixed_qkv


@triton.jit
def _rope_write_kv_cache_kernel(
    QUERY_PTR,
    KEY_PTR,
    VALUE_PTR,
    QUERY_BIAS_PTR,
    KEY_BIAS_PTR,
    VALUE_BIAS_PTR,
    QUERY_OUT_PTR,
    KEY_CACHE_PTR,
    VALUE_CACHE_PTR,
    SLOT_MAPPING_PTR,
    COS_PTR,
    SIN_PTR,
    query_stride_t,
    query_stride_g,
    query_stride_h,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    query_bias_stride_g,
    query_bias_stride_h,
    key_bias_stride_h,
    value_bias_stride_h,
    query_out_stride_t,
    query_out_stride_h,
    key_cache_stride_block,
    key_cache_stride_token,
    key_cache_stride_h,
    value_cache_stride_block,
    value_cache_stride_token,
    value_cache_stride_h,
    cos_stride_t,
    sin_stride_t,
    block_size_tokens,
    group_size,
    head_dim,
    rotary_dim,
    HAS_ROTARY: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (row, kv head): (bias +) rope + store the key, (bias +) store the value,
    (bias +) rope the query group. Query head ``i`` of kv group ``g`` is read at
    ``g * query_stride_g + i * query_stride_h``: contiguous heads, or megatron's fused QKV row."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    dim_mask = dims < head_dim
    if HAS_ROTARY:
        half = rotary_dim // 2
        rotated = dims < rotary_dim
        if INTERLEAVED:
            is_even = (dims % 2) == 0
            partner = tl.where(is_even, dims + 1, dims - 1)
            freq_index = dims // 2
            sign = tl.where(is_even, -1.0, 1.0)
        else:
            first_half = dims < half
            partner = tl.where(first_half, dims + half, dims - half)
            freq_index = tl.where(first_half, dims, dims - half)
            sign = tl.where(first_half, -1.0, 1.0)
        partner = tl.where(rotated, partner, dims)  # pass-through dims read themselves (times sin = 0)
        freq_index = tl.where(rotated, freq_index, 0)
        cos = tl.load(COS_PTR + row * cos_stride_t + freq_index, mask=rotated, other=1.0).to(tl.float32)
        sin = tl.load(SIN_PTR + row * sin_stride_t + freq_index, mask=rotated, other=0.0).to(tl.float32) * sign

    # Every load is issued before any arithmetic and without a branch: a decode launch is a few
    # hundred bytes per program, so its time is the latency of dependent loads, not bandwidth.
    slot = tl.load(SLOT_MAPPING_PTR + row).to(tl.int64)  # -1: a padding row, nothing is stored
    group = tl.arange(0, BLOCK_G)  # [BLOCK_G]: query heads kv_head * group_size + group read this kv head
    query_mask = (group < group_size)[:, None] & dim_mask[None, :]  # [BLOCK_G, BLOCK_D]
    query_rows = QUERY_PTR + row * query_stride_t + kv_head * query_stride_g + group[:, None] * query_stride_h
    query = tl.load(query_rows + dims[None, :], mask=query_mask, other=0.0).to(tl.float32)
    key_row = KEY_PTR + row * key_stride_t + kv_head * key_stride_h
    key = tl.load(key_row + dims, mask=dim_mask, other=0.0).to(tl.float32)
    value = tl.load(VALUE_PTR + row * value_stride_t + kv_head * value_stride_h + dims, mask=dim_mask,
                    other=0.0).to(tl.float32)
    if HAS_ROTARY:
        query_partner = tl.load(query_rows + partner[None, :], mask=query_mask, other=0.0).to(tl.float32)
        key_partner = tl.load(key_row + partner, mask=dim_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:  # the bias add rounds to the input dtype first, as megatron's separate add does
        in_dtype = KEY_PTR.dtype.element_ty
        query_bias = QUERY_BIAS_PTR + kv_head * query_bias_stride_g + group[:, None] * query_bias_stride_h
        key_bias = KEY_BIAS_PTR + kv_head * key_bias_stride_h
        query = _round(query + tl.load(query_bias + dims[None, :], mask=query_mask, other=0.0).to(tl.float32),
                       ROUND_BF16, in_dtype)
        key = _round(key + tl.load(key_bias + dims, mask=dim_mask, other=0.0).to(tl.float32), ROUND_BF16, in_dtype)
        value = _round(value + tl.load(VALUE_BIAS_PTR + kv_head * value_bias_stride_h + dims, mask=dim_mask,
                                       other=0.0).to(tl.float32), ROUND_BF16, in_dtype)
        if HAS_ROTARY:
            query_partner = _round(query_partner + tl.load(query_bias + partner[None, :], mask=query_mask,
                                                           other=0.0).to(tl.float32), ROUND_BF16, in_dtype)
            key_partner = _round(key_partner + tl.load(key_bias + partner, mask=dim_mask, other=0.0).to(tl.float32),
                                 ROUND_BF16, in_dtype)
    if HAS_ROTARY:
        query = query * cos[None, :] + query_partner * sin[None, :]  # [BLOCK_G, BLOCK_D] fp32
        key = key * cos + key_partner * sin  # [BLOCK_D] fp32

    cache_mask = dim_mask & ((dims * 0 + slot) >= 0)  # [BLOCK_D]
    safe_slot = tl.maximum(slot, 0)
    block_id = safe_slot // block_size_tokens
    offset = safe_slot % block_size_tokens
    key_dst = KEY_CACHE_PTR + block_id * key_cache_stride_block + offset * key_cache_stride_token \
        + kv_head * key_cache_stride_h
    value_dst = VALUE_CACHE_PTR + block_id * value_cache_stride_block + offset * value_cache_stride_token \
        + kv_head * value_cache_stride_h
    tl.store(key_dst + dims, key.to(KEY_CACHE_PTR.dtype.element_ty), mask=cache_mask)
    tl.store(value_dst + dims, value.to(VALUE_CACHE_PTR.dtype.element_ty), mask=cache_mask)
    heads = kv_head * group_size + group  # [BLOCK_G] int64
    out_rows = QUERY_OUT_PTR + row * query_out_stride_t + heads[:, None] * query_out_stride_h
    tl.store(out_rows + dims[None, :], query.to(QUERY_OUT_PTR.dtype.element_ty), mask=query_mask)


def _check_args(query, key, value, key_cache, value_cache, slot_mapping, cos, sin, rotary_interleaved):
    check_tensor("query", query, dtypes=FLOAT_DTYPES, ndim=3)
    num_tokens, num_query_heads, head_dim = query.shape
    check_tensor("key", key, dtypes=(query.dtype,), shape=(num_tokens, None, head_dim))
    num_kv_heads = key.shape[1]
    if num_kv_heads == 0 or num_query_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_query_heads}) must be a positive multiple of key heads ({num_kv_heads})")
    check_tensor("value", value, dtypes=(query.dtype,), shape=(num_tokens, num_kv_heads, head_dim))
    check_tensor("key_cache", key_cache, dtypes=(query.dtype,), shape=(None, None, num_kv_heads, head_dim))
    check_tensor("value_cache", value_cache, dtypes=(query.dtype,), shape=tuple(key_cache.shape))
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(num_tokens,))
    check_bool("rotary_interleaved", rotary_interleaved)
    tensors = dict(query=query, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                   slot_mapping=slot_mapping)
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin must both be given (rotary) or both be None (no rotary)")
    if cos is not None:
        check_tensor("cos", cos, dtypes=(torch.float32,), shape=(num_tokens, None))
        if not 1 <= cos.shape[1] <= head_dim // 2:
            raise ValueError(f"cos has {cos.shape[1]} frequencies: the rotary dim 2 * {cos.shape[1]} must lie "
                             f"in [2, head_dim = {head_dim}]")
        check_tensor("sin", sin, dtypes=(torch.float32,), shape=tuple(cos.shape))
        tensors.update(cos=cos, sin=sin)
    check_same_device(**tensors)
    check_unit_last_stride(query=query, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                           **({} if cos is None else dict(cos=cos, sin=sin)))


def rope_and_write_kv_cache(
    query: torch.Tensor,  # [T, Hq, D] float
    key: torch.Tensor,  # [T, Hkv, D], query's dtype; Hq % Hkv == 0
    value: torch.Tensor,  # [T, Hkv, D], query's dtype
    key_cache: torch.Tensor,  # [num_blocks, block_size_tokens, Hkv, D], query's dtype
    value_cache: torch.Tensor,  # [num_blocks, block_size_tokens, Hkv, D], query's dtype
    slot_mapping: torch.Tensor,  # [T] int64, block_id * block_size_tokens + offset; -1 = no write
    cos: Optional[torch.Tensor],  # [T, R / 2] fp32, cos of each row's rotary angles; None = no rotary
    sin: Optional[torch.Tensor],  # [T, R / 2] fp32
    rotary_interleaved: bool = False,
) -> torch.Tensor:  # [T, Hq, D], query's dtype: the roped query (``query`` itself without rotary)
    """Rope ``query`` and ``key`` at each row's angles, store the roped key and ``value`` at
    ``slot_mapping`` in the caches (in place), return the roped query as a new tensor.

    ``cos[t, j] = cos(position_t * inv_freq_j)`` (times megatron's mscale, if any); the rotated
    dims are ``R = 2 * cos.shape[1] <= D`` (see the module docstring for the pairing). With
    ``cos = sin = None`` (a model without rotary, or a layer that skips it) only the cache write
    runs and ``query`` is returned as is.

    Example, ``D = 4``, ``R = 4``, halves, one row at angle ``a`` (``cos = [[cos a, cos a']]``):
    ``key[0, 0] = [x0, x1, x2, x3]`` is stored as ``[x0 c - x2 s, x1 c' - x3 s', x2 c + x0 s,
    x3 c' + x1 s']`` at slot ``slot_mapping[0]``, unless that slot is -1.
    Slot values are not range-checked (a host sync); an out-of-range slot is the caller's bug.
    """
    _check_args(query, key, value, key_cache, value_cache, slot_mapping, cos, sin, rotary_interleaved)
    if not use_triton(query):
        return reference.rope_and_write_kv_cache(query, key, value, key_cache, value_cache, slot_mapping, cos, sin,
                                                 rotary_interleaved)
    if cos is None:
        from mtp_ctrl.triton_ops.kv_cache_write import write_kv_cache

        write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
        return query
    group_size = query.shape[1] // key.shape[1]
    return _launch(query, group_size * query.stride(1), query.stride(1), key, value, None, key_cache, value_cache,
                   slot_mapping, cos, sin, rotary_interleaved)


def rope_and_write_kv_cache_mixed(
    mixed_qkv: torch.Tensor,  # [T, G * (Q / G + 2) * D] float: per kv group, its query heads, key, value
    bias: Optional[torch.Tensor],  # [mixed_qkv.shape[1]], mixed_qkv's dtype, or None
    num_kv_heads: int,
    head_dim: int,
    key_cache: torch.Tensor,  # [num_blocks, block_size_tokens, G, D], mixed_qkv's dtype
    value_cache: torch.Tensor,  # [num_blocks, block_size_tokens, G, D], mixed_qkv's dtype
    slot_mapping: torch.Tensor,  # [T] int64; -1 = no write
    cos: Optional[torch.Tensor],  # [T, R / 2] fp32; None = no rotary
    sin: Optional[torch.Tensor],  # [T, R / 2] fp32
    rotary_interleaved: bool = False,
) -> torch.Tensor:  # [T, Q, D], mixed_qkv's dtype: the (biased, roped) query
    """:func:`rope_and_write_kv_cache` straight from megatron's fused QKV projection row, with its
    bias: the same result as :func:`split_qkv_heads` followed by :func:`rope_and_write_kv_cache`,
    in one launch and without the split copies (the kernel reads the grouped row in place)."""
    heads_per_group = check_mixed_qkv(mixed_qkv, num_kv_heads, head_dim)
    _check_vector("bias", bias, mixed_qkv.shape[1], (mixed_qkv.dtype,), mixed_qkv.device)
    num_tokens = mixed_qkv.shape[0]
    grouped = mixed_qkv.view(num_tokens, num_kv_heads, heads_per_group + 2, head_dim)  # [T, G, Q/G + 2, D]
    key, value = grouped[:, :, heads_per_group], grouped[:, :, heads_per_group + 1]  # [T, G, D] views
    # the query heads are no single [T, Q, D] view; the checks see each group's first head
    _check_args(grouped[:, :, 0], key, value, key_cache, value_cache, slot_mapping, cos, sin, rotary_interleaved)
    if not use_triton(mixed_qkv):
        return reference.rope_and_write_kv_cache_mixed(mixed_qkv, bias, num_kv_heads, head_dim, key_cache,
                                                       value_cache, slot_mapping, cos, sin, rotary_interleaved)
    return _launch(grouped[:, :, 0], grouped.stride(1), grouped.stride(2), key, value, bias, key_cache, value_cache,
                   slot_mapping, cos, sin, rotary_interleaved, num_query_heads=num_kv_heads * heads_per_group)


def _launch(query, query_stride_g, query_stride_h, key, value, bias, key_cache, value_cache, slot_mapping, cos, sin,
            rotary_interleaved, num_query_heads=None):
    """Run the kernel; query head ``i`` of group ``g`` sits at ``query[t] + g * query_stride_g +
    i * query_stride_h``. ``bias``: megatron's fused QKV bias (``[G * (Q / G + 2) * D]``) or None."""
    num_tokens, num_kv_heads, head_dim = key.shape
    num_query_heads = query.shape[1] if num_query_heads is None else num_query_heads
    group_size = num_query_heads // num_kv_heads
    query_out = torch.empty((num_tokens, num_query_heads, head_dim), dtype=key.dtype, device=key.device)  # [T, Q, D]
    if num_tokens == 0:
        return query_out
    if bias is not None:
        grouped_bias = bias.view(num_kv_heads, group_size + 2, head_dim)  # [G, Q/G + 2, D]
        biases = (grouped_bias, grouped_bias[:, group_size], grouped_bias[:, group_size + 1])
        bias_strides = (grouped_bias.stride(0), grouped_bias.stride(1), grouped_bias.stride(0), grouped_bias.stride(0))
    else:
        biases, bias_strides = (query, query, query), (0, 0, 0, 0)  # unused
    block_g = triton.next_power_of_2(group_size)
    block_d = triton.next_power_of_2(head_dim)
    _rope_write_kv_cache_kernel[(num_tokens, num_kv_heads)](
        query, key, value, *biases, query_out, key_cache, value_cache, slot_mapping,
        query if cos is None else cos, query if sin is None else sin,
        query.stride(0), query_stride_g, query_stride_h, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *bias_strides, query_out.stride(0), query_out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        0 if cos is None else cos.stride(0), 0 if sin is None else sin.stride(0),
        key_cache.shape[1], group_size, head_dim, 0 if cos is None else 2 * cos.shape[1],
        HAS_ROTARY=cos is not None, HAS_BIAS=bias is not None, ROUND_BF16=key.dtype == torch.bfloat16,
        INTERLEAVED=rotary_interleaved, BLOCK_G=block_g, BLOCK_D=block_d,
        num_warps=4 if block_g * block_d >= 1024 else 2,
    )
    return query_out
