"""Causal attention of packed query rows over a paged KV cache (mixed prefill and decode).

Request ``b`` owns query rows ``query_start_loc[b] : query_start_loc[b + 1]`` (``q_b`` rows);
row ``i`` of it sits at position ``seq_lens[b] - q_b + i`` and attends to the request's cached
positions ``0 ..`` its own position, read through ``block_table[b]``.

Kernel layout. One program handles (query tile, request, kv head, kv split). Its tile is
``BLOCK_Q`` query rows x all ``G = Hq / Hkv`` query heads that share the kv head, flattened
into ``BLOCK_M = BLOCK_Q * G`` (padded to a power of two) matrix rows, so a decode request's
``1 + S`` rows and its whole head group read each KV byte once. When some request may hold more
than one tile (prefill chunks; the MTP windows of a step with prefill chunks), the tiles of all
requests are numbered in one row: request ``b`` owns tiles ``query_start_loc[b] // BLOCK_Q + b``
onwards, a program finds its request by binary search, and the grid is ``T // BLOCK_Q + B``
programs, not ``cdiv(max_query_len, BLOCK_Q) x B`` (mostly idle when one prompt joins a batch of
decodes). The KV range is cut into
``num_kv_splits`` pieces (split-K), each program cutting its own tile's real context (read on the
device: a CUDA graph sized for a long ``max_seq_len`` still splits a short context evenly, and a
few prefill rows over a long cached prefix spread over every split). With more than one split,
every program writes an unnormalised partial (running max, sum, accumulator) and a second kernel
combines them, reading every split at once. Softmax runs online over ``BLOCK_N``-token tiles in fp32, in base 2.

At small batch a program is latency-bound (a block-table read, then the K and V reads of one
tile), so the splits go down to one tile each until every SM has two programs, and K and V are
read together. On an H100 that took a 944M GPT's attention at batch 1, 1024 tokens, from 15.6 to
about 6 us per layer, combine included (bench/RESULTS.md, paged attention).
"""

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import (FLOAT_DTYPES, INDEX_DTYPES, ValidatedSignatures, check_int, check_same_device,
                                         check_tensor)
from mtp_ctrl.triton_ops._dispatch import sm_count, use_triton

MAX_HEAD_DIM = 256
_TARGET_BLOCK_M = 64  # matrix rows (query rows x group heads) per program
_MIN_TOKENS_PER_SPLIT = 64  # one BLOCK_N tile: a short split is cheap now that the combine reads splits at once
_MAX_KV_SPLITS = 32
_ZERO_BLOCK = 1024  # output elements per store when the kernel zeroes the padding rows
_COMBINE_TILE_ELEMENTS = 1024  # outputs one combine program holds: [rows, head-dim chunk] fp32
_COMBINE_LOAD_ELEMENTS = 4096  # fp32 partials one combine read takes: [split chunk, rows, head-dim chunk]
_COMBINE_VALIDATED = ValidatedSignatures()
_COMBINE_MAX_DIMS = 128  # a combine program's head-dim chunk (MLA's 512-dim latents take 4)
# MLA's 512-dim rows, where the partials outgrow two small tiles a SM (128 heads x batch 32: 16.8
# MB), are bandwidth-bound: a program then takes whole rows, two of them (an H100: 10.1 us there,
# 2.1 TB/s; main's 128-dim chunks 17.6 us; 8 rows 16.7 us, 8 warps 21.4 us: bench/RESULTS.md, mla8).
_COMBINE_ROW_DIMS = 512
_COMBINE_ROW_TILE_ROWS = 2


@triton.jit
def _tile_rows(QUERY_START_LOC_PTR, request, q_tile, group_size, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr):
    """Map the tile's matrix rows to (packed row, head in group) and their validity.

    Example: G = 2, BLOCK_Q = 2, BLOCK_M = 4, q_tile = 0 -> matrix rows 0..3 are
    (query row 0, head 0), (0, 1), (1, 0), (1, 1) of the request.
    """
    q_start = tl.load(QUERY_START_LOC_PTR + request)
    q_len = tl.load(QUERY_START_LOC_PTR + request + 1) - q_start
    m = tl.arange(0, BLOCK_M)
    row_in_request = q_tile * BLOCK_Q + m // group_size  # [BLOCK_M]
    head_in_group = m % group_size  # [BLOCK_M]
    row_valid = (m < BLOCK_Q * group_size) & (row_in_request < q_len)
    rows = (q_start + row_in_request).to(tl.int64)  # [BLOCK_M] packed query row
    return rows, row_in_request, head_in_group, row_valid, q_len


@triton.jit
def request_of_flat_tile(QUERY_START_LOC_PTR, flat_tile, batch_size, BLOCK_Q: tl.constexpr):
    """The request whose query tiles hold flat tile ``flat_tile``: request ``b``'s tiles are flat
    tiles ``query_start_loc[b] // BLOCK_Q + b ..`` (non-decreasing in ``b``, at least
    ``cdiv(q_b, BLOCK_Q)`` of them), so a binary search over ``query_start_loc`` finds it."""
    low = tl.zeros((), dtype=tl.int32)
    high = low + batch_size - 1
    while low < high:
        middle = (low + high + 1) // 2
        starts_before = (tl.load(QUERY_START_LOC_PTR + middle) // BLOCK_Q + middle) <= flat_tile
        low = tl.where(starts_before, middle, low)
        high = tl.where(starts_before, high, middle - 1)
    return low


@triton.jit
def _paged_attention_kernel(
    QUERY_PTR,
    KEY_CACHE_PTR,
    VALUE_CACHE_PTR,
    BLOCK_TABLE_PTR,
    SEQ_LENS_PTR,
    QUERY_START_LOC_PTR,
    OUTPUT_PTR,
    PARTIAL_ACC_PTR,
    PARTIAL_MAX_PTR,
    PARTIAL_SUM_PTR,
    qk_scale,  # softmax_scale * log2(e)
    query_stride_t,
    query_stride_h,
    output_stride_t,
    output_stride_h,
    key_cache_stride_block,
    key_cache_stride_token,
    key_cache_stride_h,
    value_cache_stride_block,
    value_cache_stride_token,
    value_cache_stride_h,
    block_table_stride_b,
    num_tokens,
    num_query_heads,
    block_size_tokens,
    head_dim,
    group_size,
    batch_size,
    num_q_tiles,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ZERO_BLOCK: tl.constexpr,
    FLAT_TILES: tl.constexpr,
):
    if FLAT_TILES:  # grid (num_tokens // BLOCK_Q + batch_size, 1, ...): every request's tiles in one row
        flat_tile = tl.program_id(0)
        request = request_of_flat_tile(QUERY_START_LOC_PTR, flat_tile, batch_size, BLOCK_Q)
        q_tile = flat_tile - (tl.load(QUERY_START_LOC_PTR + request) // BLOCK_Q + request)
        zeroes_padding, zero_share, zero_shares = tl.program_id(2) == 0, flat_tile, tl.num_programs(0)
    else:  # grid (num_q_tiles, batch_size, ...)
        q_tile = tl.program_id(0)
        request = tl.program_id(1)
        zeroes_padding = (request == batch_size - 1) & (tl.program_id(2) == 0)
        zero_share, zero_shares = q_tile, num_q_tiles
    if zeroes_padding:
        # rows past the last request's (padding) belong to no program below: some first programs
        # zero them, each a share (the output is [T, Hq, D] contiguous, not pre-zeroed)
        row_elements = num_query_heads * head_dim
        tail_start = tl.load(QUERY_START_LOC_PTR + batch_size).to(tl.int64) * row_elements
        tail_end = tl.cast(num_tokens, tl.int64) * row_elements
        share = tl.cdiv(tail_end - tail_start, zero_shares)
        share_start = tail_start + zero_share * share
        share_end = tl.minimum(share_start + share, tail_end)
        zeros = tl.zeros([ZERO_BLOCK], dtype=tl.float32)  # the store casts to the output's dtype
        for first in range(share_start, share_end, ZERO_BLOCK):
            elements = first + tl.arange(0, ZERO_BLOCK)
            tl.store(OUTPUT_PTR + elements, zeros, mask=elements < share_end)
    kv_head = tl.program_id(2) // NUM_KV_SPLITS
    split = tl.program_id(2) % NUM_KV_SPLITS
    rows, row_in_request, head_in_group, row_valid, q_len = _tile_rows(
        QUERY_START_LOC_PTR, request, q_tile, group_size, BLOCK_Q, BLOCK_M
    )
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(SEQ_LENS_PTR + request)
        positions = seq_len - q_len + row_in_request  # [BLOCK_M] token position of each matrix row
        query_heads = (kv_head * group_size + head_in_group).to(tl.int64)  # [BLOCK_M]
        dims = tl.arange(0, BLOCK_D)
        dim_valid = dims < head_dim
        query = tl.load(
            QUERY_PTR + rows[:, None] * query_stride_t + query_heads[:, None] * query_stride_h + dims[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]

        # The tile's last row sees positions < tile_kv_end; this split covers [kv_lo, kv_hi). The
        # splits cut this tile's own context (read on the device), not a bound such as
        # max_model_len: a graph sized for 16k tokens replayed at a 2k context gives each split
        # 1/NUM_KV_SPLITS of the 2k, not 2k in one split and nothing in the rest.
        tile_kv_end = seq_len - q_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
        split_tokens = tl.cdiv(tl.cdiv(tile_kv_end, NUM_KV_SPLITS), BLOCK_N) * BLOCK_N  # whole tiles
        kv_lo = split * split_tokens
        kv_hi = tl.minimum(kv_lo + split_tokens, tile_kv_end)
        key_base = KEY_CACHE_PTR + kv_head.to(tl.int64) * key_cache_stride_h
        value_base = VALUE_CACHE_PTR + kv_head.to(tl.int64) * value_cache_stride_h
        block_table_row = BLOCK_TABLE_PTR + request.to(tl.int64) * block_table_stride_b

        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for tile_start in range(kv_lo, kv_hi, BLOCK_N):
            kv_pos = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            kv_valid = kv_pos < kv_hi
            block_ids = tl.load(block_table_row + kv_pos // block_size_tokens, mask=kv_valid, other=0).to(tl.int64)
            offsets = (kv_pos % block_size_tokens).to(tl.int64)
            kv_mask = kv_valid[:, None] & dim_valid[None, :]
            # K and V are loaded together, rows along the contiguous head dim: both reads are in
            # flight at once (a decode tile is latency-bound, not bandwidth-bound)
            key = tl.load(key_base + (block_ids * key_cache_stride_block + offsets * key_cache_stride_token)[:, None]
                          + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            value = tl.load(value_base + (block_ids * value_cache_stride_block + offsets * value_cache_stride_token)[:, None]
                            + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            scores = tl.dot(query, tl.trans(key), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
            visible = (kv_pos[None, :] <= positions[:, None]) & kv_valid[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows that saw nothing yet
            rescale = tl.exp2(running_max - safe_max)
            probs = tl.exp2(scores - safe_max[:, None])
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            acc = acc * rescale[:, None] + tl.dot(probs.to(value.dtype), value, input_precision=DOT_PRECISION)
            running_max = new_max

        store_mask = row_valid[:, None] & dim_valid[None, :]
        if NUM_KV_SPLITS == 1:
            out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
            out_ptrs = OUTPUT_PTR + rows[:, None] * output_stride_t + query_heads[:, None] * output_stride_h
            tl.store(out_ptrs + dims[None, :], out.to(OUTPUT_PTR.dtype.element_ty), mask=store_mask)
        else:
            # partials: [NUM_KV_SPLITS, T, Hq] (+ [D] for the accumulator), contiguous fp32
            stat_index = (split * num_tokens + rows) * num_query_heads + query_heads  # [BLOCK_M] int64
            tl.store(PARTIAL_MAX_PTR + stat_index, running_max, mask=row_valid)
            tl.store(PARTIAL_SUM_PTR + stat_index, running_sum, mask=row_valid)
            tl.store(PARTIAL_ACC_PTR + stat_index[:, None] * head_dim + dims[None, :], acc, mask=store_mask)


@triton.jit
def _combine_kv_splits_kernel(
    PARTIAL_ACC_PTR,
    PARTIAL_MAX_PTR,
    PARTIAL_SUM_PTR,
    QUERY_START_LOC_PTR,
    OUTPUT_PTR,
    output_stride_t,
    output_stride_h,
    num_tokens,
    num_query_heads,
    head_dim,
    batch_size,
    num_kv_splits,
    BLOCK_R: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
):
    """Merge the split partials of ``BLOCK_R`` (token, query head) rows x ``BLOCK_DC`` dims into
    the output. The splits are read ``SPLIT_CHUNK`` at a time (``[SPLIT_CHUNK, BLOCK_R, BLOCK_DC]``,
    one read in flight per chunk rather than per split) and merged online: a running max and sum
    across chunks, the accumulator rescaled when the max grows. Rows past ``query_start_loc[B]``
    (padding, zeroed by the attention kernel) are left alone."""
    dims = tl.program_id(1) * BLOCK_DC + tl.arange(0, BLOCK_DC)  # [BLOCK_DC]
    valid_rows = tl.load(QUERY_START_LOC_PTR + batch_size).to(tl.int64) * num_query_heads
    first_row = tl.program_id(0).to(tl.int64) * BLOCK_R
    if first_row < valid_rows:
        stat_rows = first_row + tl.arange(0, BLOCK_R)  # [BLOCK_R] int64: token * Hq + query head
        row_valid = stat_rows < valid_rows
        dim_valid = dims < head_dim
        split_stride = tl.cast(num_tokens, tl.int64) * num_query_heads  # rows of one split's partials
        running_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_DC], tl.float32)
        for first_split in range(0, num_kv_splits, SPLIT_CHUNK):
            splits = first_split + tl.arange(0, SPLIT_CHUNK)  # [SPLIT_CHUNK]
            stat_mask = (splits < num_kv_splits)[:, None] & row_valid[None, :]  # [SPLIT_CHUNK, BLOCK_R]
            stat_index = splits[:, None].to(tl.int64) * split_stride + stat_rows[None, :]
            split_max = tl.load(PARTIAL_MAX_PTR + stat_index, mask=stat_mask, other=float("-inf"))
            split_sum = tl.load(PARTIAL_SUM_PTR + stat_index, mask=stat_mask, other=0.0)
            split_acc = tl.load(PARTIAL_ACC_PTR + stat_index[:, :, None] * head_dim + dims[None, None, :],
                                mask=stat_mask[:, :, None] & dim_valid[None, None, :], other=0.0)
            new_max = tl.maximum(running_max, tl.max(split_max, axis=0))  # [BLOCK_R]
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows no split saw anything for yet
            rescale = tl.exp2(running_max - safe_max)  # 0 while nothing was seen
            weight = tl.exp2(split_max - safe_max[None, :])  # [SPLIT_CHUNK, BLOCK_R], 0 for empty splits
            running_sum = running_sum * rescale + tl.sum(split_sum * weight, axis=0)
            acc = acc * rescale[:, None] + tl.sum(split_acc * weight[:, :, None], axis=0)
            running_max = new_max
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
        tokens = stat_rows // num_query_heads
        heads = stat_rows % num_query_heads
        out_ptrs = OUTPUT_PTR + tokens[:, None] * output_stride_t + heads[:, None] * output_stride_h + dims[None, :]
        tl.store(out_ptrs, out.to(OUTPUT_PTR.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


def combine_kv_splits(
    partial_acc: torch.Tensor,  # [splits, T, H, D] fp32, unnormalised split accumulators
    partial_max: torch.Tensor,  # [splits, T, H] fp32, each split's running max (base 2)
    partial_sum: torch.Tensor,  # [splits, T, H] fp32, each split's running sum
    query_start_loc: torch.Tensor,  # [B + 1] int32: rows past query_start_loc[B] are not written
    output: torch.Tensor,  # [T, H, D], written in place; its last dim contiguous
) -> None:
    """Merge split-K partials into ``output`` (paged attention's and MLA's second kernel).

    Programs take ``(token, head)`` rows and head-dim chunks, independent of how the attention
    tiled its rows, so the tile is chosen for the combine alone (``combine_tile``): small tiles,
    two programs a SM, where the combine is latency-bound; whole 512-dim rows (MLA's latents)
    where its partials outgrow that wave and it is bandwidth-bound.
    The partials are indexed as contiguous tensors; ``output`` by its strides.
    """
    _COMBINE_VALIDATED.validate(_check_combine_args, partial_acc, partial_max, partial_sum, query_start_loc, output)
    for name, tensor in (("partial_acc", partial_acc), ("partial_max", partial_max), ("partial_sum", partial_sum)):
        if not tensor.is_contiguous():  # strides: not part of a cached signature
            raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")
    if output.stride(2) != 1:
        raise ValueError(f"output's last dim must be contiguous, got strides {output.stride()}")
    num_kv_splits, num_tokens, num_heads, head_dim = partial_acc.shape
    wanted_programs = 2 * sm_count(output.device) if output.is_cuda else None
    tile = combine_tile(num_kv_splits, num_tokens * num_heads, head_dim, wanted_programs)
    launch_combine(partial_acc, partial_max, partial_sum, query_start_loc, output, *tile)


def combine_tile(num_kv_splits: int, num_rows: int, head_dim: int, wanted_programs: Optional[int]):
    """The combine's tile ``(BLOCK_R, BLOCK_DC, SPLIT_CHUNK, num_warps)`` for ``num_rows`` (token,
    head) rows of ``head_dim`` dims: as many programs as ``wanted_programs`` (two a SM) while the
    rows allow, at most ``_COMBINE_TILE_ELEMENTS`` outputs a program; 512-dim rows past one such
    wave take whole rows, ``_COMBINE_ROW_TILE_ROWS`` a program. ``wanted_programs`` None: the
    interpreter (few large programs, its cost is per program)."""
    block_d = triton.next_power_of_2(head_dim)
    block_dc = min(block_d, _COMBINE_MAX_DIMS)
    if wanted_programs is None:
        block_r = max(1, _COMBINE_TILE_ELEMENTS // block_dc)
    elif block_d == _COMBINE_ROW_DIMS and num_rows * block_d >= 2 * wanted_programs * _COMBINE_TILE_ELEMENTS:
        block_r, block_dc = _COMBINE_ROW_TILE_ROWS, block_d
    else:
        rows_per_program = max(1, num_rows * (block_d // block_dc) // wanted_programs)
        block_r = min(1 << (rows_per_program.bit_length() - 1), max(1, _COMBINE_TILE_ELEMENTS // block_dc))
    split_chunk = min(triton.next_power_of_2(num_kv_splits), max(1, _COMBINE_LOAD_ELEMENTS // (block_r * block_dc)))
    return block_r, block_dc, split_chunk, 4


def launch_combine(partial_acc, partial_max, partial_sum, query_start_loc, output, block_r: int, block_dc: int,
                   split_chunk: int, num_warps: int = 4) -> None:
    """Launch the combine kernel with a given tile (``combine_tile``'s; the benchmark sweeps others).
    The arguments are ``combine_kv_splits``'s, unchecked."""
    num_kv_splits, num_tokens, num_heads, head_dim = partial_acc.shape
    grid = (triton.cdiv(num_tokens * num_heads, block_r), triton.cdiv(triton.next_power_of_2(head_dim), block_dc))
    _combine_kv_splits_kernel[grid](
        partial_acc, partial_max, partial_sum, query_start_loc, output,
        output.stride(0), output.stride(1),
        num_tokens, num_heads, head_dim, query_start_loc.shape[0] - 1, num_kv_splits,
        BLOCK_R=block_r, BLOCK_DC=block_dc, SPLIT_CHUNK=split_chunk, num_warps=num_warps,
    )


def _check_combine_args(partial_acc, partial_max, partial_sum, query_start_loc, output) -> None:
    check_tensor("partial_acc", partial_acc, dtypes=(torch.float32,), ndim=4)
    num_kv_splits, num_tokens, num_heads, head_dim = partial_acc.shape
    if num_kv_splits < 1:
        raise ValueError(f"partial_acc must hold >= 1 split on dim 0, got shape {tuple(partial_acc.shape)}")
    check_tensor("partial_max", partial_max, dtypes=(torch.float32,), shape=(num_kv_splits, num_tokens, num_heads))
    check_tensor("partial_sum", partial_sum, dtypes=(torch.float32,), shape=(num_kv_splits, num_tokens, num_heads))
    check_tensor("query_start_loc", query_start_loc, dtypes=INDEX_DTYPES, ndim=1)
    if query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc must hold B + 1 >= 1 offsets")
    check_tensor("output", output, dtypes=FLOAT_DTYPES, shape=(num_tokens, num_heads, head_dim))
    check_same_device(output=output, partial_acc=partial_acc, partial_max=partial_max, partial_sum=partial_sum,
                      query_start_loc=query_start_loc)


def check_attention_scalars(softmax_scale, max_query_len, max_seq_len, num_kv_splits) -> None:
    """The scalar arguments of the paged attention ops (standard and MLA): metadata only."""
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be a positive float, got {softmax_scale!r}")
    if max_query_len is not None:
        check_int("max_query_len", max_query_len, low=0)
    if max_seq_len is not None:
        check_int("max_seq_len", max_seq_len, low=0)
    if num_kv_splits is not None:
        check_int("num_kv_splits", num_kv_splits, low=1, high=_MAX_KV_SPLITS)


def _check_args(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, softmax_scale,
                max_query_len, max_seq_len, num_kv_splits):
    check_tensor("query", query, dtypes=FLOAT_DTYPES, ndim=3)
    num_query_heads, head_dim = query.shape[1], query.shape[2]
    check_tensor("key_cache", key_cache, dtypes=(query.dtype,), shape=(None, None, None, head_dim))
    check_tensor("value_cache", value_cache, dtypes=(query.dtype,), shape=tuple(key_cache.shape))
    if key_cache.shape[1] < 1:
        raise ValueError(f"key_cache needs block_size_tokens >= 1 (dim 1), got shape {tuple(key_cache.shape)}")
    num_kv_heads = key_cache.shape[2]
    if num_kv_heads == 0 or num_query_heads % num_kv_heads != 0:
        raise ValueError(
            f"query has {num_query_heads} heads, not a multiple of key_cache's {num_kv_heads} kv heads"
        )
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"query head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    batch_size = block_table.shape[0]
    if batch_size > 0 and block_table.shape[1] < 1:
        raise ValueError(f"block_table needs at least one block column, got shape {tuple(block_table.shape)}")
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(batch_size,))
    check_tensor("query_start_loc", query_start_loc, dtypes=INDEX_DTYPES, shape=(batch_size + 1,))
    check_same_device(query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table,
                      seq_lens=seq_lens, query_start_loc=query_start_loc)
    for name, tensor in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    check_attention_scalars(softmax_scale, max_query_len, max_seq_len, num_kv_splits)


def _num_warps(device, num_programs):
    """8 warps while the grid leaves SMs idle (each program then hides its read latency better),
    4 once every SM has work (measured on an H100: bench/RESULTS.md, paged attention)."""
    if device.type != "cuda":
        return 4
    return 8 if num_programs < sm_count(device) else 4


def _choose_num_kv_splits(device, programs_per_split, kv_token_bound, block_n):
    """Enough splits to give every SM two programs, each split at least _MIN_TOKENS_PER_SPLIT long."""
    if device.type != "cuda":
        return 1
    wanted = triton.cdiv(2 * sm_count(device), max(programs_per_split, 1))
    longest = max(1, triton.cdiv(kv_token_bound, max(_MIN_TOKENS_PER_SPLIT, block_n)))
    return max(1, min(wanted, longest, _MAX_KV_SPLITS))


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D] float
    key_cache: torch.Tensor,  # [num_blocks, block_size_tokens, Hkv, D], query's dtype
    value_cache: torch.Tensor,  # [num_blocks, block_size_tokens, Hkv, D], query's dtype
    block_table: torch.Tensor,  # [B, max_blocks_per_request] int32, KV block ids
    seq_lens: torch.Tensor,  # [B] int32, context length incl. this step's rows
    query_start_loc: torch.Tensor,  # [B + 1] int32, prefix sum of query rows per request
    softmax_scale: float,
    *,
    max_query_len: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    num_kv_splits: Optional[int] = None,
) -> torch.Tensor:  # [T, Hq, D], query's dtype
    """Causal paged attention; returns a new ``[T, Hq, D]`` tensor.

    Example, ``block_size_tokens = 2``, one request with ``block_table[0] = [5, 3]``,
    ``seq_lens = [3]``, ``query_start_loc = [0, 2]``: rows 0 and 1 sit at positions 1 and 2;
    row 0 attends to positions 0..1 (block 5, offsets 0..1), row 1 to 0..2 (plus block 3,
    offset 0). Query head ``h`` reads kv head ``h // (Hq // Hkv)``.

    Rows past ``query_start_loc[B]`` (and every row of a request with no query rows, a padding
    request) are zeros in the output. ``max_query_len`` and ``max_seq_len`` are optional Python
    ints bounding ``q_b`` and ``seq_lens`` (``AttentionMetadata`` has both): they size the grid
    and the split-K count without a host sync, and must not be below the real maxima (each
    program then splits its own context, read on the device).
    ``num_kv_splits`` overrides the split-K count (default: chosen from the SM count on CUDA).
    """
    _check_args(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, softmax_scale,
                max_query_len, max_seq_len, num_kv_splits)
    if not use_triton(query):
        return reference.paged_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                                          softmax_scale, max_query_len=max_query_len, max_seq_len=max_seq_len,
                                          num_kv_splits=num_kv_splits)
    num_tokens, num_query_heads, head_dim = query.shape
    block_size_tokens, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    batch_size = block_table.shape[0]
    if batch_size > 0 and block_table.shape[1] < 1:
        raise ValueError(f"block_table needs at least one block column, got shape {tuple(block_table.shape)}")
    query_rows_bound = num_tokens if max_query_len is None else min(max_query_len, num_tokens)
    if num_tokens == 0 or batch_size == 0 or query_rows_bound == 0:
        return torch.zeros((num_tokens, num_query_heads, head_dim), dtype=query.dtype, device=query.device)
    # every row is written by the kernel (padding rows as zeros): no separate zero fill
    output = torch.empty((num_tokens, num_query_heads, head_dim), dtype=query.dtype, device=query.device)
    kv_token_bound = block_table.shape[1] * block_size_tokens if max_seq_len is None else max_seq_len

    group_size = num_query_heads // num_kv_heads
    block_q = min(triton.next_power_of_2(query_rows_bound), max(1, _TARGET_BLOCK_M // triton.next_power_of_2(group_size)))
    block_m = max(16, triton.next_power_of_2(block_q * group_size))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if block_d <= 128 else 32
    num_q_tiles = triton.cdiv(query_rows_bound, block_q)
    # Rows beyond one tile a request (prefill chunks, a mixed step's MTP windows): a (q tile, request)
    # grid would launch num_q_tiles programs for every request, decode ones included, nearly all with
    # nothing to do; the flat grid launches one a tile of the packed rows, plus one a request.
    flat_tiles = num_q_tiles > 1
    tile_programs = (num_tokens // block_q + batch_size, 1) if flat_tiles else (num_q_tiles, batch_size)
    if num_kv_splits is None:
        num_kv_splits = _choose_num_kv_splits(query.device, tile_programs[0] * tile_programs[1] * num_kv_heads,
                                              kv_token_bound, block_n)

    if num_kv_splits > 1:
        partial_acc = torch.empty((num_kv_splits, num_tokens, num_query_heads, head_dim), dtype=torch.float32, device=query.device)
        partial_max = torch.empty((num_kv_splits, num_tokens, num_query_heads), dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)  # [splits, T, Hq] fp32
    else:
        partial_acc = partial_max = partial_sum = output  # unused by the kernel
    _paged_attention_kernel[(*tile_programs, num_kv_heads * num_kv_splits)](
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        output, partial_acc, partial_max, partial_sum,
        softmax_scale * math.log2(math.e),
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        num_tokens, num_query_heads, block_size_tokens, head_dim, group_size,
        batch_size, num_q_tiles,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        NUM_KV_SPLITS=num_kv_splits, ZERO_BLOCK=_ZERO_BLOCK, FLAT_TILES=flat_tiles,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=_num_warps(query.device, tile_programs[0] * tile_programs[1] * num_kv_heads * num_kv_splits),
    )
    if num_kv_splits > 1:
        combine_kv_splits(partial_acc, partial_max, partial_sum, query_start_loc, output)
    return output
