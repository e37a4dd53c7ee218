"""Multi-latent attention (MLA, DeepSeek-V3 family) over a paged latent cache.

The cache holds, per token, the normed compressed key-value latent (``C = kv_lora_rank``) and
the shared roped rotary key (``R = qk_pos_emb_head_dim``): ``[num_blocks, block_size_tokens,
C + R]``, one tensor per layer, instead of K and V per head.

- :func:`rope_and_write_latent_cache`: ropes the rotary key and stores ``[latent | rope key]`` at
  each row's slot (``-1``: no write), and ropes the queries' rotary part, in one launch.
- :func:`paged_mla_attention`: the absorbed attention. Query head ``h`` arrives as
  ``q_latent = q_nope W_UK[h]`` (``[C]``, the key up-projection folded into the query) and its
  roped rotary part (``[R]``); its score against cached token ``n`` is
  ``q_latent . latent_n + q_rope . rope_key_n``, and its output is the softmax-weighted sum of
  the latents (``[C]``; the caller applies the value up-projection after). Every head of a
  request reads the same cache rows, so one program takes many heads (and the ``1 + S`` rows of
  a verify) at once and reads each cached byte once per program. Split-K over the context as in
  :mod:`mtp_ctrl.triton_ops.paged_attn`, whose combine kernel merges the splits. The tiles come
  from a table keyed by the launch's dims (:mod:`mtp_ctrl.triton_ops.mla_tiles`); the programs
  of one (request, split) that hold different head tiles are launched next to each other, so they
  can share the cache rows through L2. Tiles marked ``wgmma`` run the Hopper Gluon kernel of
  :mod:`mtp_ctrl.triton_ops.mla_wgmma` instead (same programs, partials and combine), where
  :func:`wgmma_kernel_applies` holds.

Rows: request ``b`` owns rows ``query_start_loc[b] : query_start_loc[b + 1]``; row ``i`` of it
sits at position ``seq_lens[b] - q_b + i`` and attends causally to the positions up to its own.
"""

import functools
import importlib
import math
import warnings
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import FLOAT_DTYPES, INDEX_DTYPES, check_int, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import interpreter_enabled, sm_count, use_triton
from mtp_ctrl.triton_ops.mla_tiles import MLATiles, kv_split_count, mla_tiles
from mtp_ctrl.triton_ops.paged_attn import check_attention_scalars, combine_kv_splits, request_of_flat_tile

MAX_LATENT_DIM = 1024
MAX_ROPE_DIM = 256
# split-K programs a request at most: enough for one request to cover every SM (the combine reads
# the splits in chunks, so their count does not bound its tile)
MAX_KV_SPLITS = 128
_INT32_MAX = 2**31 - 1
_ZERO_BLOCK = 1024  # output elements per store when the kernel zeroes the padding rows


@triton.jit
def _mla_rope_pairs(PTR, dims, half, mask):
    """``(x[2j + f], x[2j + 1 - f], sign)`` for output dims ``dims`` of megatron's MLA rope,
    where ``j = dims mod half`` and ``f = dims >= half``: ``out = a cos_j + sign b sin_j``."""
    first = dims < half
    pair = tl.where(first, dims, dims - half)
    a = tl.load(PTR + 2 * pair + tl.where(first, 0, 1), mask=mask, other=0.0).to(tl.float32)
    b = tl.load(PTR + 2 * pair + tl.where(first, 1, 0), mask=mask, other=0.0).to(tl.float32)
    return a, b, tl.where(first, -1.0, 1.0), pair


@triton.jit
def _rope_write_latent_kernel(
    QUERY_ROPE_PTR, KV_LATENT_PTR, KEY_ROPE_PTR, LATENT_CACHE_PTR, SLOT_MAPPING_PTR, COS_PTR, SIN_PTR,
    QUERY_OUT_PTR,
    query_stride_t, query_stride_h, latent_stride_t, key_rope_stride_t,
    cache_stride_block, cache_stride_token, cos_stride_t, sin_stride_t, out_stride_t, out_stride_h,
    num_heads, latent_dim, rope_dim, block_size_tokens,
    BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """One program per row: rope + store its cache row, rope its query heads."""
    row = tl.program_id(0).to(tl.int64)
    half = rope_dim // 2
    rdims = tl.arange(0, BLOCK_R)
    rmask = rdims < rope_dim
    slot = tl.load(SLOT_MAPPING_PTR + row).to(tl.int64)
    a, b, sign, pair = _mla_rope_pairs(KEY_ROPE_PTR + row * key_rope_stride_t, rdims, half, rmask)
    cos = tl.load(COS_PTR + row * cos_stride_t + pair, mask=rmask, other=0.0)
    sin = tl.load(SIN_PTR + row * sin_stride_t + pair, mask=rmask, other=0.0)
    cdims = tl.arange(0, BLOCK_C)
    cmask = cdims < latent_dim
    latent = tl.load(KV_LATENT_PTR + row * latent_stride_t + cdims, mask=cmask, other=0.0)
    if slot >= 0:  # -1: a padding row, nothing is stored
        dst = LATENT_CACHE_PTR + slot // block_size_tokens * cache_stride_block \
            + slot % block_size_tokens * cache_stride_token
        cache_dtype = LATENT_CACHE_PTR.dtype.element_ty
        tl.store(dst + cdims, latent.to(cache_dtype), mask=cmask)
        tl.store(dst + latent_dim + rdims, (a * cos + sign * b * sin).to(cache_dtype), mask=rmask)
    heads = tl.arange(0, BLOCK_H)
    qmask = (heads < num_heads)[:, None] & rmask[None, :]  # [BLOCK_H, BLOCK_R]
    query_rows = QUERY_ROPE_PTR + row * query_stride_t + heads[:, None].to(tl.int64) * query_stride_h
    first = (rdims < half)[None, :]
    qa = tl.load(query_rows + (2 * pair + tl.where(rdims < half, 0, 1))[None, :], mask=qmask, other=0.0).to(tl.float32)
    qb = tl.load(query_rows + (2 * pair + tl.where(rdims < half, 1, 0))[None, :], mask=qmask, other=0.0).to(tl.float32)
    roped = qa * cos[None, :] + tl.where(first, -1.0, 1.0) * qb * sin[None, :]
    out_rows = QUERY_OUT_PTR + row * out_stride_t + heads[:, None].to(tl.int64) * out_stride_h
    tl.store(out_rows + rdims[None, :], roped.to(QUERY_OUT_PTR.dtype.element_ty), mask=qmask)


def rope_and_write_latent_cache(
    query_rope: torch.Tensor,  # [T, H, R] float: each query head's rotary part, not yet roped
    kv_latent: torch.Tensor,  # [T, C]: the normed compressed latent
    key_rope: torch.Tensor,  # [T, R]: the shared rotary key, not yet roped
    latent_cache: torch.Tensor,  # [num_blocks, block_size_tokens, C + R]
    slot_mapping: torch.Tensor,  # [T] int64, block_id * block_size_tokens + offset; -1 = no write
    cos: torch.Tensor,  # [T, R / 2] fp32, cos of each row's angles (times megatron's mscale)
    sin: torch.Tensor,  # [T, R / 2] fp32
) -> torch.Tensor:  # [T, H, R] roped query, query_rope's dtype
    """Store ``[kv_latent[t] | rope(key_rope[t])]`` at ``slot_mapping[t]`` of ``latent_cache``
    and return the roped queries; megatron's MLA rope convention (``reference.mla_rope``).

    Example, ``block_size_tokens = 4``, ``slot_mapping = [6, -1]``: row 0 goes to block 1,
    offset 2; row 1 (padding) writes nothing, but its query is still roped.
    """
    check_tensor("query_rope", query_rope, dtypes=FLOAT_DTYPES, ndim=3)
    num_tokens, num_heads, rope_dim = query_rope.shape
    check_tensor("kv_latent", kv_latent, dtypes=FLOAT_DTYPES, ndim=2)
    latent_dim = kv_latent.shape[1]
    check_tensor("key_rope", key_rope, dtypes=FLOAT_DTYPES, shape=(num_tokens, rope_dim))
    check_tensor("latent_cache", latent_cache, dtypes=FLOAT_DTYPES, shape=(None, None, latent_dim + rope_dim))
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(num_tokens,))
    check_tensor("cos", cos, dtypes=(torch.float32,), shape=(num_tokens, rope_dim // 2))
    check_tensor("sin", sin, dtypes=(torch.float32,), shape=(num_tokens, rope_dim // 2))
    if kv_latent.shape[0] != num_tokens:
        raise ValueError(f"kv_latent has {kv_latent.shape[0]} rows, query_rope {num_tokens}")
    if rope_dim % 2 or not 2 <= rope_dim <= MAX_ROPE_DIM or latent_dim > MAX_LATENT_DIM:
        raise ValueError(f"rope dim must be even in [2, {MAX_ROPE_DIM}] and the latent at most {MAX_LATENT_DIM}, "
                         f"got {rope_dim} and {latent_dim}")
    check_same_device(query_rope=query_rope, kv_latent=kv_latent, key_rope=key_rope, latent_cache=latent_cache,
                      slot_mapping=slot_mapping, cos=cos, sin=sin)
    for name, tensor in (("query_rope", query_rope), ("kv_latent", kv_latent), ("key_rope", key_rope),
                         ("latent_cache", latent_cache), ("cos", cos), ("sin", sin)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if not use_triton(query_rope):
        return reference.rope_and_write_latent_cache(query_rope, kv_latent, key_rope, latent_cache, slot_mapping,
                                                     cos, sin)
    roped = torch.empty_like(query_rope)  # [T, H, R]
    if num_tokens == 0:
        return roped
    _rope_write_latent_kernel[(num_tokens,)](
        query_rope, kv_latent, key_rope, latent_cache, slot_mapping, cos, sin, roped,
        query_rope.stride(0), query_rope.stride(1), kv_latent.stride(0), key_rope.stride(0),
        latent_cache.stride(0), latent_cache.stride(1), cos.stride(0), sin.stride(0), roped.stride(0), roped.stride(1),
        num_heads, latent_dim, rope_dim, latent_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_C=triton.next_power_of_2(latent_dim),
        BLOCK_R=triton.next_power_of_2(rope_dim),
    )
    return roped


@triton.jit
def _latent_tile(CACHE_PTR, block_table_row, tile_start, kv_hi, cdims, rdims, cmask, rmask, latent_dim,
                 block_size_tokens, cache_stride_block, cache_stride_token, BLOCK_N: tl.constexpr,
                 FULL_DIMS: tl.constexpr):
    """Cached tokens ``tile_start + [0, BLOCK_N)`` (those before ``kv_hi``; zeros after): their
    latents ``[BLOCK_N, BLOCK_C]`` (the key's latent part and the value) and rope keys
    ``[BLOCK_N, BLOCK_R]``. ``FULL_DIMS``: both dims are their blocks' (no column masks: fewer
    registers for the predicates)."""
    kv_pos = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    kv_valid = kv_pos < kv_hi
    block_ids = tl.load(block_table_row + kv_pos // block_size_tokens, mask=kv_valid, other=0).to(tl.int64)
    token_rows = CACHE_PTR + block_ids * cache_stride_block + (kv_pos % block_size_tokens).to(tl.int64) \
        * cache_stride_token  # [BLOCK_N]
    if FULL_DIMS:
        latent_mask = kv_valid[:, None]
        rope_mask = kv_valid[:, None]
    else:
        latent_mask = kv_valid[:, None] & cmask[None, :]
        rope_mask = kv_valid[:, None] & rmask[None, :]
    latent = tl.load(token_rows[:, None] + cdims[None, :], mask=latent_mask, other=0.0)
    rope_key = tl.load(token_rows[:, None] + latent_dim + rdims[None, :], mask=rope_mask, other=0.0)
    return latent, rope_key


# request/row counts and split sizes vary step to step: one compiled kernel for all of them
@triton.jit(do_not_specialize=["num_tokens", "tokens_per_split", "num_head_tiles", "num_kv_splits"])
def _paged_mla_kernel(
    QUERY_LATENT_PTR, QUERY_ROPE_PTR, CACHE_PTR, BLOCK_TABLE_PTR, SEQ_LENS_PTR, QUERY_START_LOC_PTR,
    OUTPUT_PTR, PARTIAL_ACC_PTR, PARTIAL_MAX_PTR, PARTIAL_SUM_PTR,
    qk_scale,  # softmax_scale * log2(e)
    ql_stride_t, ql_stride_h, qr_stride_t, qr_stride_h, out_stride_t, out_stride_h,
    cache_stride_block, cache_stride_token, block_table_stride_b,
    num_tokens, num_heads, latent_dim, rope_dim, block_size_tokens, tokens_per_split,
    num_head_tiles, num_kv_splits, batch_size,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr, ZERO_BLOCK: tl.constexpr,
    FULL_DIMS: tl.constexpr, FLAT_TILES: tl.constexpr,
):
    """Program (query tile x head tile, split, request): ``BLOCK_Q`` rows x ``BLOCK_H`` heads,
    flattened into ``BLOCK_M`` matrix rows, over one split of the request's context. The tiles
    that read the same cache rows have neighbouring program ids (axis 0), so they run together
    and can share those rows through L2.

    Example: H = 4, BLOCK_H = 4, BLOCK_Q = 2 (a 1 + S = 2 verify): matrix rows 0..7 are
    (row 0, head 0..3), (row 1, head 0..3). ``FLAT_TILES``: axis 0 numbers every request's query
    tiles in one row (``paged_attn``'s flat grid, axis 2 of size 1), for launches where a request
    may hold more than one query tile.
    """
    head_tile = tl.program_id(0) % num_head_tiles
    split = tl.program_id(1)
    if FLAT_TILES:
        flat_tile = tl.program_id(0) // num_head_tiles
        request = request_of_flat_tile(QUERY_START_LOC_PTR, flat_tile, batch_size, BLOCK_Q)
        q_tile = flat_tile - (tl.load(QUERY_START_LOC_PTR + request) // BLOCK_Q + request)
        zeroes_padding = True  # every program a share
    else:
        q_tile = tl.program_id(0) // num_head_tiles
        request = tl.program_id(2)
        zeroes_padding = request == tl.num_programs(2) - 1
    if zeroes_padding:
        # rows past the last request's (padding) belong to no program below: the last request's
        # programs (flat tiles: every program) zero them, each a share (the output is [T, H, C]
        # contiguous, not pre-zeroed)
        row_elements = num_heads * latent_dim
        tail_start = tl.load(QUERY_START_LOC_PTR + batch_size).to(tl.int64) * row_elements
        tail_end = tl.cast(num_tokens, tl.int64) * row_elements
        sharers = tl.num_programs(0) * tl.num_programs(1)
        share = tl.cdiv(tail_end - tail_start, sharers)
        share_start = tail_start + (split * tl.num_programs(0) + tl.program_id(0)) * share
        share_end = tl.minimum(share_start + share, tail_end)
        zeros = tl.zeros([ZERO_BLOCK], dtype=tl.float32)  # the store casts to the output's dtype
        for first in range(share_start, share_end, ZERO_BLOCK):
            elements = first + tl.arange(0, ZERO_BLOCK)
            tl.store(OUTPUT_PTR + elements, zeros, mask=elements < share_end)
    q_start = tl.load(QUERY_START_LOC_PTR + request)
    q_len = tl.load(QUERY_START_LOC_PTR + request + 1) - q_start
    if q_tile * BLOCK_Q < q_len:
        m = tl.arange(0, BLOCK_M)
        row_in_request = q_tile * BLOCK_Q + m // BLOCK_H  # [BLOCK_M]
        heads = (head_tile * BLOCK_H + m % BLOCK_H).to(tl.int64)  # [BLOCK_M]
        row_valid = (m < BLOCK_Q * BLOCK_H) & (row_in_request < q_len) & (heads < num_heads)
        rows = (q_start + row_in_request).to(tl.int64)  # [BLOCK_M] packed query row
        seq_len = tl.load(SEQ_LENS_PTR + request)
        positions = seq_len - q_len + row_in_request  # [BLOCK_M]
        cdims = tl.arange(0, BLOCK_C)
        rdims = tl.arange(0, BLOCK_R)
        cmask = cdims < latent_dim
        rmask = rdims < rope_dim
        q_latent = tl.load(QUERY_LATENT_PTR + rows[:, None] * ql_stride_t + heads[:, None] * ql_stride_h
                           + cdims[None, :], mask=row_valid[:, None] & cmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_C]
        q_rope = tl.load(QUERY_ROPE_PTR + rows[:, None] * qr_stride_t + heads[:, None] * qr_stride_h
                         + rdims[None, :], mask=row_valid[:, None] & rmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
        tile_kv_end = seq_len - q_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
        kv_lo = split * tokens_per_split
        kv_hi = tl.minimum(kv_lo + tokens_per_split, tile_kv_end)
        block_table_row = BLOCK_TABLE_PTR + request.to(tl.int64) * block_table_stride_b
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
        for tile_start in range(kv_lo, kv_hi, BLOCK_N):
            kv_pos = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            kv_valid = kv_pos < kv_hi
            latent, rope_key = _latent_tile(CACHE_PTR, block_table_row, tile_start, kv_hi, cdims, rdims, cmask, rmask,
                                            latent_dim, block_size_tokens, cache_stride_block, cache_stride_token,
                                            BLOCK_N, FULL_DIMS)
            scores = tl.dot(q_latent, tl.trans(latent), input_precision=DOT_PRECISION)
            scores = (scores + tl.dot(q_rope, tl.trans(rope_key), input_precision=DOT_PRECISION)) * qk_scale
            visible = (kv_pos[None, :] <= positions[:, None]) & kv_valid[None, :]  # [BLOCK_M, BLOCK_N]
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp2(running_max - safe_max)
            probs = tl.exp2(scores - safe_max[:, None])
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            acc = acc * rescale[:, None] + tl.dot(probs.to(latent.dtype), latent, input_precision=DOT_PRECISION)
            running_max = new_max
        store_mask = row_valid[:, None] & cmask[None, :]
        if num_kv_splits == 1:
            out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
            out_ptrs = OUTPUT_PTR + rows[:, None] * out_stride_t + heads[:, None] * out_stride_h + cdims[None, :]
            tl.store(out_ptrs, out.to(OUTPUT_PTR.dtype.element_ty), mask=store_mask)
        else:
            # partials [num_kv_splits, T, H] (+ [C]), paged_attn's combine layout with one kv head
            stat_index = (split * num_tokens + rows) * num_heads + heads  # [BLOCK_M] int64
            tl.store(PARTIAL_MAX_PTR + stat_index, running_max, mask=row_valid)
            tl.store(PARTIAL_SUM_PTR + stat_index, running_sum, mask=row_valid)
            tl.store(PARTIAL_ACC_PTR + stat_index[:, None] * latent_dim + cdims[None, :], acc, mask=store_mask)


@functools.lru_cache(maxsize=None)
def _gluon_module(name: str):
    """``mtp_ctrl.triton_ops.<name>`` (``mla_wgmma``: the Gluon kernel; ``mla_wgmma_ws``: its
    warp-specialized schedule), or None where this Triton cannot build it: Gluon is experimental,
    so any failure there leaves the shape to the Triton kernel (or the serial schedule), with a
    warning once."""
    try:
        return importlib.import_module(f"mtp_ctrl.triton_ops.{name}")
    except Exception as error:  # noqa: BLE001
        warnings.warn(f"the Gluon MLA kernel ({name}) is unavailable, the Triton kernel serves its shapes: "
                      f"{type(error).__name__}: {error}", RuntimeWarning, stacklevel=2)
        return None


@functools.lru_cache(maxsize=None)
def _capability_of(device_index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def wgmma_operands_fit(query_latent: torch.Tensor, latent_cache: torch.Tensor, query_rope_dim: int,
                       capability: Tuple[int, int]) -> bool:
    """True when the Gluon kernel can take these operands on a device of compute capability
    ``capability`` (``(major, minor)``): 9.x, Gluon importable, bf16, ``C = 512`` and ``R = 64``,
    cache rows 16-byte aligned (its ``cp.async`` copies 16-byte vectors). Host metadata only."""
    if capability[0] != 9 or query_latent.dtype != torch.bfloat16:
        return False
    if query_latent.shape[-1] != 512 or query_rope_dim != 64:
        return False
    if latent_cache.data_ptr() % 16 or latent_cache.stride(0) % 8 or latent_cache.stride(1) % 8:
        return False
    return _gluon_module("mla_wgmma") is not None


def wgmma_kernel_applies(query_latent: torch.Tensor, latent_cache: torch.Tensor, query_rope_dim: int) -> bool:
    """True when tiles with ``wgmma`` run the Gluon kernel here: CUDA tensors, no interpreter,
    and :func:`wgmma_operands_fit` on their device (no sync: the capability is cached)."""
    if not query_latent.is_cuda or interpreter_enabled():
        return False
    index = query_latent.device.index
    capability = _capability_of(index if index is not None else torch.cuda.current_device())
    return wgmma_operands_fit(query_latent, latent_cache, query_rope_dim, capability)


def _check_attention_args(query_latent, query_rope, latent_cache, block_table, seq_lens, query_start_loc,
                          softmax_scale, max_query_len, max_seq_len, num_kv_splits, tiles):
    check_tensor("query_latent", query_latent, dtypes=FLOAT_DTYPES, ndim=3)
    num_tokens, num_heads, latent_dim = query_latent.shape
    check_tensor("query_rope", query_rope, dtypes=(query_latent.dtype,), shape=(num_tokens, num_heads, None))
    rope_dim = query_rope.shape[2]
    check_tensor("latent_cache", latent_cache, dtypes=(query_latent.dtype,), shape=(None, None, latent_dim + rope_dim))
    if latent_cache.shape[1] < 1:
        raise ValueError(f"latent_cache needs block_size_tokens >= 1 (dim 1), got shape {tuple(latent_cache.shape)}")
    if not 1 <= latent_dim <= MAX_LATENT_DIM or not 1 <= rope_dim <= MAX_ROPE_DIM:
        raise ValueError(f"latent dim must be in [1, {MAX_LATENT_DIM}] and rope dim in [1, {MAX_ROPE_DIM}], "
                         f"got {latent_dim} and {rope_dim}")
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    batch_size = block_table.shape[0]
    if batch_size > 0 and block_table.shape[1] < 1:
        raise ValueError(f"block_table needs at least one block column, got shape {tuple(block_table.shape)}")
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(batch_size,))
    check_tensor("query_start_loc", query_start_loc, dtypes=INDEX_DTYPES, shape=(batch_size + 1,))
    check_same_device(query_latent=query_latent, query_rope=query_rope, latent_cache=latent_cache,
                      block_table=block_table, seq_lens=seq_lens, query_start_loc=query_start_loc)
    for name, tensor in (("query_latent", query_latent), ("query_rope", query_rope), ("latent_cache", latent_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    check_attention_scalars(softmax_scale, max_query_len, max_seq_len, None)
    if num_kv_splits is not None:
        check_int("num_kv_splits", num_kv_splits, low=1, high=MAX_KV_SPLITS)
    if tiles is not None and not isinstance(tiles, MLATiles):
        raise TypeError(f"tiles must be an MLATiles or None, got {type(tiles).__name__}")


def paged_mla_attention(
    query_latent: torch.Tensor,  # [T, H, C] float: no-rope query times the key up-projection
    query_rope: torch.Tensor,  # [T, H, R], same dtype: the roped rotary query
    latent_cache: torch.Tensor,  # [num_blocks, block_size_tokens, C + R], same dtype
    block_table: torch.Tensor,  # [B, max_blocks_per_request] int32
    seq_lens: torch.Tensor,  # [B] int32, context length incl. this step's rows
    query_start_loc: torch.Tensor,  # [B + 1] int32
    softmax_scale: float,
    *,
    max_query_len: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    num_kv_splits: Optional[int] = None,
    tiles: Optional[MLATiles] = None,
) -> torch.Tensor:  # [T, H, C], query_latent's dtype: softmax-weighted latents
    """Causal absorbed MLA attention of packed rows over the paged latent cache (module docstring).

    Rows past ``query_start_loc[B]`` and rows of requests with no query rows are zeros.
    ``max_query_len`` / ``max_seq_len`` bound the rows per request and the context (Python ints,
    no host sync); ``num_kv_splits`` (at most ``MAX_KV_SPLITS``) overrides the split-K count
    (default: from the SM count and the tiles); ``tiles`` overrides the table's tiles
    (:func:`mtp_ctrl.triton_ops.mla_tiles.mla_tiles` of H, B, the context bound and the rows bound).
    Tiles with ``wgmma`` run the Gluon kernel where :func:`wgmma_kernel_applies`, else the Triton
    kernel with the table's Triton tiles for the launch.
    """
    _check_attention_args(query_latent, query_rope, latent_cache, block_table, seq_lens, query_start_loc,
                          softmax_scale, max_query_len, max_seq_len, num_kv_splits, tiles)
    if not use_triton(query_latent):
        return reference.paged_mla_attention(query_latent, query_rope, latent_cache, block_table, seq_lens,
                                             query_start_loc, softmax_scale, max_query_len=max_query_len,
                                             max_seq_len=max_seq_len, num_kv_splits=num_kv_splits, tiles=tiles)
    num_tokens, num_heads, latent_dim = query_latent.shape
    rope_dim = query_rope.shape[2]
    block_size_tokens, batch_size = latent_cache.shape[1], block_table.shape[0]
    query_rows_bound = num_tokens if max_query_len is None else min(max_query_len, num_tokens)
    if num_tokens == 0 or batch_size == 0 or query_rows_bound == 0:
        return torch.zeros((num_tokens, num_heads, latent_dim), dtype=query_latent.dtype, device=query_latent.device)
    # every row is written by the kernels (padding rows as zeros by the last request's programs)
    output = torch.empty((num_tokens, num_heads, latent_dim), dtype=query_latent.dtype, device=query_latent.device)
    kv_token_bound = block_table.shape[1] * block_size_tokens if max_seq_len is None else max_seq_len
    if tiles is None:
        tiles = mla_tiles(num_heads, batch_size, kv_token_bound, query_rows_bound)
    if tiles.wgmma and not wgmma_kernel_applies(query_latent, latent_cache, rope_dim):
        tiles = mla_tiles(num_heads, batch_size, kv_token_bound, query_rows_bound, gluon=False)
    block_h = min(triton.next_power_of_2(num_heads), tiles.block_m)
    block_q = min(triton.next_power_of_2(query_rows_bound), max(1, tiles.block_m // block_h))
    block_m = max(16, block_q * block_h)
    block_n = tiles.block_n
    latent_block, rope_block = max(16, triton.next_power_of_2(latent_dim)), max(16, triton.next_power_of_2(rope_dim))
    num_head_tiles = triton.cdiv(num_heads, block_h)
    num_q_tiles = triton.cdiv(query_rows_bound, block_q)
    # a request of several query tiles (prefill chunks, a mixed step's MTP windows): the Triton
    # kernel's flat grid (paged_attn's), one program a tile of the packed rows plus one a request
    flat_tiles = num_q_tiles > 1 and not tiles.wgmma
    tile_rows = num_tokens // block_q + batch_size if flat_tiles else num_q_tiles * batch_size
    if num_kv_splits is None:
        num_kv_splits = 1
        if query_latent.is_cuda:
            programs_per_split = tile_rows * num_head_tiles
            num_kv_splits = kv_split_count(tiles, sm_count(query_latent.device), programs_per_split, kv_token_bound,
                                           MAX_KV_SPLITS)
    if num_kv_splits == 1:
        tokens_per_split = _INT32_MAX
        partial_acc = partial_max = partial_sum = output  # unused by the kernel
    else:
        tokens_per_split = triton.cdiv(triton.cdiv(max(kv_token_bound, 1), num_kv_splits), block_n) * block_n
        partial_acc = torch.empty((num_kv_splits, num_tokens, num_heads, latent_dim), dtype=torch.float32,
                                  device=query_latent.device)
        partial_max = torch.empty((num_kv_splits, num_tokens, num_heads), dtype=torch.float32, device=query_latent.device)
        partial_sum = torch.empty_like(partial_max)
    grid = (tile_rows * num_head_tiles, num_kv_splits, 1) if flat_tiles else \
        (num_q_tiles * num_head_tiles, num_kv_splits, batch_size)
    qk_scale = softmax_scale * math.log2(math.e)
    if tiles.wgmma:
        launch = _gluon_module("mla_wgmma").launch_paged_mla_wgmma
        options = dict(async_dots=tiles.schedule == "async")
        if tiles.schedule == "warp_specialized" and _gluon_module("mla_wgmma_ws") is not None:
            launch, options = _gluon_module("mla_wgmma_ws").launch_paged_mla_ws, {}
        launch(grid, query_latent, query_rope, latent_cache, block_table, seq_lens, query_start_loc,
               output, partial_acc, partial_max, partial_sum, qk_scale, num_tokens, num_heads, tokens_per_split,
               num_head_tiles, num_kv_splits, block_q, block_h, _ZERO_BLOCK, **options)
    else:
        _paged_mla_kernel[grid](
            query_latent, query_rope, latent_cache, block_table, seq_lens, query_start_loc,
            output, partial_acc, partial_max, partial_sum, qk_scale,
            query_latent.stride(0), query_latent.stride(1), query_rope.stride(0), query_rope.stride(1),
            output.stride(0), output.stride(1), latent_cache.stride(0), latent_cache.stride(1), block_table.stride(0),
            num_tokens, num_heads, latent_dim, rope_dim, block_size_tokens, tokens_per_split,
            num_head_tiles, num_kv_splits, batch_size,
            BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_C=latent_block, BLOCK_R=rope_block,
            DOT_PRECISION="ieee" if query_latent.dtype == torch.float32 else "tf32", ZERO_BLOCK=_ZERO_BLOCK,
            FULL_DIMS=latent_block == latent_dim and rope_block == rope_dim, FLAT_TILES=flat_tiles,
            num_warps=tiles.num_warps if query_latent.is_cuda else 4,
            num_stages=tiles.num_stages if query_latent.is_cuda else 1,
            **({"maxnreg": tiles.max_registers} if tiles.max_registers and query_latent.is_cuda else {}),
        )
    if num_kv_splits > 1:
        # paged_attn's combine reads our partial layout ([splits, T, H] by query head, [C] dims)
        combine_kv_splits(partial_acc, partial_max, partial_sum, query_start_loc, output)
    return output
