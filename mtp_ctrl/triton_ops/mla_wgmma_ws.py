"""The warp-specialized Hopper (sm_90) Gluon kernel of the paged MLA attention for tiles of 64
matrix rows: FlashMLA's first schedule, where one warpgroup's softmax runs beside the other's
value dots.

Same contract, programs, partials and split-K as :mod:`mtp_ctrl.triton_ops.mla_wgmma` (whose
helpers it shares), but the two warpgroups of a program do different work, handing tiles over
through shared memory and mbarriers instead of meeting at barriers:

- the **score warpgroup** (the default partition, 4 warps) loads the query tile (while the value
  warpgroup's first copies are already in flight), then computes each tile's scores for all 64
  tokens at once (``[64, 64]``: one wgmma of N = 64, half the shared-memory reads of two N = 32
  halves, and no row max or sum crossing warpgroups), its softmax, writes the probabilities and
  the accumulator's rescale factors to shared memory, then multiplies the probabilities into its
  half of the ``C`` value dims;
- the **value warpgroup** (a worker partition, 4 warps) issues the cache copies (``cp.async``,
  two buffers, each refilled as soon as both warpgroups are done with it), and multiplies each
  tile's probabilities into the other half of the value dims, while the score warpgroup already
  computes the next tile's scores.

mbarriers (each completes once a use; a waiter's parity is its use count mod 2): ``ready[b]``
(buffer ``b``'s copies landed: every value-warpgroup thread arrives when its copies complete),
``free[b]`` (the score warpgroup is done with buffer ``b``), ``probs_ready`` / ``probs_free`` (the
probabilities and rescale factors of a tile), ``stats_ready`` (the final row max and sum, for the
value warpgroup's half of the output).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import async_copy, mbarrier

from mtp_ctrl.triton_ops.mla_wgmma import (BLOCK_M, BLOCK_N, LATENT_DIM, ROPE_DIM, _barrier,
                                           _load_cache_tile, _softmax_tile, _tile_block_ids, _zero_tail_rows)

PARTITION_WARPS = 4  # each warpgroup; the kernel launches 2 x 4 warps
# registers a value-warpgroup thread (setmaxnreg; at most what the kernel is compiled for)
VALUE_REGISTERS = 232
_BLOCK_M, _BLOCK_N = gl.constexpr(BLOCK_M), gl.constexpr(BLOCK_N)
_LATENT_DIM, _ROPE_DIM = gl.constexpr(LATENT_DIM), gl.constexpr(ROPE_DIM)
_HALF = gl.constexpr(LATENT_DIM // 2)
_WARPS, _VALUE_REGISTERS = gl.constexpr(PARTITION_WARPS), gl.constexpr(VALUE_REGISTERS)
# mbarrier slots
_READY, _FREE, _PROBS_READY = gl.constexpr(0), gl.constexpr(2), gl.constexpr(4)
_PROBS_FREE, _STATS_READY = gl.constexpr(5), gl.constexpr(6)


# one warpgroup's layouts: the cache and query loads (16-byte vectors along the dims), the scores
# [64, 64] (all tokens of a tile), the accumulator's half [64, C / 2]
_LATENT_LOAD = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [PARTITION_WARPS, 1], [1, 0]))
_ROPE_LOAD = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [PARTITION_WARPS, 1], [1, 0]))
_SCORE = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[PARTITION_WARPS, 1],
                                                instr_shape=[16, BLOCK_N, 16]))
_ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[PARTITION_WARPS, 1],
                                              instr_shape=[16, LATENT_DIM // 2, 16]))


@gluon.jit
def _store_half(acc, dims_start, running_max, running_sum, OUTPUT_PTR, PARTIAL_ACC_PTR, PARTIAL_MAX_PTR,
                PARTIAL_SUM_PTR, q_start, q_tile, q_len, head_tile, num_heads, num_tokens, split, num_kv_splits,
                out_stride_t, out_stride_h, WRITE_STATS: gl.constexpr, BLOCK_Q: gl.constexpr,
                BLOCK_H: gl.constexpr, ACC: gl.constexpr):
    """Value dims ``dims_start + [0, C / 2)`` of the tile's rows: the output (one split) or the
    split's partial (and, ``WRITE_STATS``, its row max and sum); ``running_*`` in ``ACC``'s rows."""
    m_acc = gl.arange(0, _BLOCK_M, gl.SliceLayout(1, ACC))
    rows = (q_start + q_tile * BLOCK_Q + m_acc // BLOCK_H).to(gl.int64)
    heads = (head_tile * BLOCK_H + m_acc % BLOCK_H).to(gl.int64)
    row_valid = (m_acc < BLOCK_Q * BLOCK_H) & (q_tile * BLOCK_Q + m_acc // BLOCK_H < q_len) & (heads < num_heads)
    cdims = dims_start + gl.arange(0, _HALF, gl.SliceLayout(0, ACC))
    store_mask = row_valid[:, None] & (cdims < _LATENT_DIM)[None, :]
    if num_kv_splits == 1:
        out = acc / gl.where(running_sum > 0, running_sum, 1.0)[:, None]
        out_ptrs = OUTPUT_PTR + rows[:, None] * out_stride_t + heads[:, None] * out_stride_h + cdims[None, :]
        gl.store(out_ptrs, out.to(OUTPUT_PTR.dtype.element_ty), mask=store_mask)
    else:
        stat_index = (split * num_tokens + rows) * num_heads + heads  # [64] int64
        if WRITE_STATS:
            gl.store(PARTIAL_MAX_PTR + stat_index, running_max, mask=row_valid)
            gl.store(PARTIAL_SUM_PTR + stat_index, running_sum, mask=row_valid)
        gl.store(PARTIAL_ACC_PTR + stat_index[:, None] * _LATENT_DIM + cdims[None, :], acc, mask=store_mask)


@gluon.jit
def _load_query_tile(q_latent_smem, q_rope_smem, QUERY_LATENT_PTR, QUERY_ROPE_PTR, ql_stride_t, ql_stride_h,
                     qr_stride_t, qr_stride_h, q_start, q_tile, q_len, head_tile, num_heads,
                     BLOCK_Q: gl.constexpr, BLOCK_H: gl.constexpr):
    """The program's query tile into shared memory (matrix row m: query row m // BLOCK_H, head
    m % BLOCK_H; rows past the request's or the heads: zeros), half the latent dims at a time."""
    LATENT_LOAD: gl.constexpr = _LATENT_LOAD
    ROPE_LOAD: gl.constexpr = _ROPE_LOAD
    m_load = gl.arange(0, _BLOCK_M, gl.SliceLayout(1, LATENT_LOAD))
    load_rows = (q_start + q_tile * BLOCK_Q + m_load // BLOCK_H).to(gl.int64)
    load_heads = (head_tile * BLOCK_H + m_load % BLOCK_H).to(gl.int64)
    load_valid = (m_load < BLOCK_Q * BLOCK_H) & (q_tile * BLOCK_Q + m_load // BLOCK_H < q_len) \
        & (load_heads < num_heads)
    for half in gl.static_range(2):
        cdims = half * _HALF + gl.arange(0, _HALF, gl.SliceLayout(0, LATENT_LOAD))
        q_half = gl.load(QUERY_LATENT_PTR + load_rows[:, None] * ql_stride_t + load_heads[:, None] * ql_stride_h
                         + cdims[None, :], mask=load_valid[:, None] & (cdims < _LATENT_DIM)[None, :], other=0.0)
        q_latent_smem.slice(half * _HALF, _HALF, dim=1).store(q_half)
    m_rope = gl.arange(0, _BLOCK_M, gl.SliceLayout(1, ROPE_LOAD))
    rope_rows = (q_start + q_tile * BLOCK_Q + m_rope // BLOCK_H).to(gl.int64)
    rope_heads = (head_tile * BLOCK_H + m_rope % BLOCK_H).to(gl.int64)
    rope_valid = (m_rope < BLOCK_Q * BLOCK_H) & (q_tile * BLOCK_Q + m_rope // BLOCK_H < q_len) \
        & (rope_heads < num_heads)
    rdims = gl.arange(0, _ROPE_DIM, gl.SliceLayout(0, ROPE_LOAD))
    q_rope = gl.load(QUERY_ROPE_PTR + rope_rows[:, None] * qr_stride_t + rope_heads[:, None] * qr_stride_h
                     + rdims[None, :], mask=rope_valid[:, None] & (rdims < _ROPE_DIM)[None, :], other=0.0)
    q_rope_smem.store(q_rope)
    hopper.fence_async_shared()  # the stores before the wgmma's reads
    _barrier()  # every warp's part of the tile


@gluon.jit
def _score_partition(q_latent_smem, q_rope_smem, latent_bufs, rope_bufs, probs_smem, rescale_smem, max_smem,
                     sum_smem, bars, positions_base, kv_lo, kv_hi, num_tiles, qk_scale, QUERY_LATENT_PTR,
                     QUERY_ROPE_PTR, ql_stride_t, ql_stride_h, qr_stride_t, qr_stride_h, q_start, q_tile, q_len,
                     head_tile, num_heads, BLOCK_Q: gl.constexpr, BLOCK_H: gl.constexpr):
    """The score warpgroup: the query tile, then per tile the scores, softmax, the probabilities
    handed over, value dims [0, C / 2). Returns its accumulator half, the row max and the row sum
    (its layouts)."""
    _load_query_tile(q_latent_smem, q_rope_smem, QUERY_LATENT_PTR, QUERY_ROPE_PTR, ql_stride_t, ql_stride_h,
                     qr_stride_t, qr_stride_h, q_start, q_tile, q_len, head_tile, num_heads, BLOCK_Q, BLOCK_H)
    LATENT_LOAD: gl.constexpr = _LATENT_LOAD
    ROPE_LOAD: gl.constexpr = _ROPE_LOAD
    SCORE: gl.constexpr = _SCORE
    ACC: gl.constexpr = _ACC
    dtype: gl.constexpr = probs_smem.dtype
    positions = positions_base + gl.arange(0, _BLOCK_M, gl.SliceLayout(1, SCORE)) // BLOCK_H  # [64]
    running_max = gl.full([_BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, SCORE))
    sum_part = gl.zeros([_BLOCK_M, _BLOCK_N], gl.float32, SCORE)
    acc = gl.zeros([_BLOCK_M, _HALF], gl.float32, ACC)
    score_zero = gl.zeros([_BLOCK_M, _BLOCK_N], gl.float32, SCORE)
    for tile in range(0, num_tiles):
        stage = tile % 2
        tile_start = kv_lo + tile * _BLOCK_N
        mbarrier.wait(bars.index(_READY + stage), (tile // 2) & 1)
        hopper.fence_async_shared()  # the copies' writes before the wgmma's reads
        latent = latent_bufs.index(stage)
        scores = hopper.warpgroup_mma(q_latent_smem, latent.permute((1, 0)), score_zero, use_acc=False)
        scores = hopper.warpgroup_mma(q_rope_smem, rope_bufs.index(stage).permute((1, 0)), scores)
        probs, running_max, rescale, sum_part = _softmax_tile(scores, positions, tile_start, kv_hi, running_max,
                                                              sum_part, qk_scale, SCORE)
        # the value warpgroup is done with the last tile's probabilities
        mbarrier.wait(bars.index(_PROBS_FREE), (tile - 1) & 1, pred=tile > 0)
        probs_smem.store(probs.to(dtype))
        rescale_smem.store(rescale)
        hopper.fence_async_shared()
        _barrier()  # every thread's stores before the arrival (one thread arrives)
        mbarrier.arrive(bars.index(_PROBS_READY), count=1)
        acc = acc * gl.convert_layout(rescale, gl.SliceLayout(1, ACC))[:, None]
        acc = hopper.warpgroup_mma(probs_smem, latent.slice(0, _HALF, dim=1), acc)
        _barrier()  # every warp's dots done before the buffer is released
        mbarrier.arrive(bars.index(_FREE + stage), count=1)
    running_sum = gl.sum(sum_part, axis=1)
    max_smem.store(running_max)
    sum_smem.store(running_sum)
    _barrier()
    mbarrier.arrive(bars.index(_STATS_READY), count=1)
    return (acc, gl.convert_layout(running_max, gl.SliceLayout(1, ACC)),
            gl.convert_layout(running_sum, gl.SliceLayout(1, ACC)))


@gluon.jit
def _value_partition(latent_bufs, rope_bufs, probs_smem, rescale_smem, max_smem, sum_smem, bars, CACHE_PTR,
                     block_table_row, kv_lo, kv_hi, num_tiles, block_size_tokens, cache_stride_block,
                     cache_stride_token, OUTPUT_PTR, PARTIAL_ACC_PTR, PARTIAL_MAX_PTR, PARTIAL_SUM_PTR, q_start,
                     q_tile, q_len, head_tile, num_heads, num_tokens, split, num_kv_splits, out_stride_t,
                     out_stride_h, BLOCK_Q: gl.constexpr, BLOCK_H: gl.constexpr):
    """The value warpgroup: the cache copies (both buffers ahead), value dims [C / 2, C), and
    their part of the output."""
    LATENT_LOAD: gl.constexpr = _LATENT_LOAD
    ROPE_LOAD: gl.constexpr = _ROPE_LOAD
    SCORE: gl.constexpr = _SCORE
    ACC: gl.constexpr = _ACC
    acc = gl.zeros([_BLOCK_M, _HALF], gl.float32, ACC)
    for first in gl.static_range(2):  # both buffers' first tiles
        if first < num_tiles:
            block_ids, rope_ids = _tile_block_ids(block_table_row, kv_lo + first * _BLOCK_N, kv_hi,
                                                  block_size_tokens, LATENT_LOAD, ROPE_LOAD)
            _load_cache_tile(latent_bufs.index(first), rope_bufs.index(first), CACHE_PTR, block_ids, rope_ids,
                             kv_lo + first * _BLOCK_N, kv_hi, block_size_tokens, cache_stride_block,
                             cache_stride_token, LATENT_LOAD, ROPE_LOAD)
            async_copy.mbarrier_arrive(bars.index(_READY + first), increment_count=False)
    block_ids, rope_ids = _tile_block_ids(block_table_row, kv_lo + 2 * _BLOCK_N, kv_hi, block_size_tokens,
                                          LATENT_LOAD, ROPE_LOAD)
    for tile in range(0, num_tiles):
        stage = tile % 2
        mbarrier.wait(bars.index(_PROBS_READY), tile & 1)
        hopper.fence_async_shared()
        rescale = rescale_smem.load(gl.SliceLayout(1, ACC))
        acc = acc * rescale[:, None]
        acc = hopper.warpgroup_mma(probs_smem, latent_bufs.index(stage).slice(_HALF, _HALF, dim=1), acc)
        _barrier()  # every warp read the probabilities and the factors, its dots done
        mbarrier.arrive(bars.index(_PROBS_FREE), count=1)
        if tile + 2 < num_tiles:  # refill this buffer once the score warpgroup is done with it
            mbarrier.wait(bars.index(_FREE + stage), (tile // 2) & 1)
            next_start = kv_lo + (tile + 2) * _BLOCK_N
            _load_cache_tile(latent_bufs.index(stage), rope_bufs.index(stage), CACHE_PTR, block_ids, rope_ids,
                             next_start, kv_hi, block_size_tokens, cache_stride_block, cache_stride_token,
                             LATENT_LOAD, ROPE_LOAD)
            async_copy.mbarrier_arrive(bars.index(_READY + stage), increment_count=False)
            block_ids, rope_ids = _tile_block_ids(block_table_row, next_start + _BLOCK_N, kv_hi, block_size_tokens,
                                                  LATENT_LOAD, ROPE_LOAD)
    async_copy.wait_group(0)
    mbarrier.wait(bars.index(_STATS_READY), 0)
    running_max = max_smem.load(gl.SliceLayout(1, ACC))
    running_sum = sum_smem.load(gl.SliceLayout(1, ACC))
    _store_half(acc, _HALF, running_max, running_sum, OUTPUT_PTR, PARTIAL_ACC_PTR, PARTIAL_MAX_PTR, PARTIAL_SUM_PTR,
                q_start, q_tile, q_len, head_tile, num_heads, num_tokens, split, num_kv_splits, out_stride_t,
                out_stride_h, False, BLOCK_Q, BLOCK_H, ACC)


@gluon.jit(do_not_specialize=["num_tokens", "tokens_per_split", "num_head_tiles", "num_kv_splits",
                              "cache_stride_block", "cache_stride_token", "block_size_tokens"])
def _paged_mla_ws_kernel(
    QUERY_LATENT_PTR, QUERY_ROPE_PTR, CACHE_PTR, BLOCK_TABLE_PTR, SEQ_LENS_PTR, QUERY_START_LOC_PTR,
    OUTPUT_PTR, PARTIAL_ACC_PTR, PARTIAL_MAX_PTR, PARTIAL_SUM_PTR,
    qk_scale,  # softmax_scale * log2(e)
    ql_stride_t, ql_stride_h, qr_stride_t, qr_stride_h, out_stride_t, out_stride_h,
    cache_stride_block, cache_stride_token, block_table_stride_b,
    num_tokens, num_heads, block_size_tokens, tokens_per_split, num_head_tiles, num_kv_splits,
    BLOCK_Q: gl.constexpr, BLOCK_H: gl.constexpr, ZERO_BLOCK: gl.constexpr,
):
    """Program (query tile x head tile, split, request), as ``mla_wgmma._paged_mla_wgmma_kernel``'s;
    the module docstring says how its two warpgroups share the work."""
    ACC: gl.constexpr = _ACC
    LATENT_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_N, _LATENT_DIM], gl.bfloat16)
    ROPE_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_N, _ROPE_DIM], gl.bfloat16)
    PROBS_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_M, _BLOCK_N], gl.bfloat16)
    ROWS_SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    dtype: gl.constexpr = CACHE_PTR.dtype.element_ty

    q_tile = gl.program_id(0) // num_head_tiles
    head_tile = gl.program_id(0) % num_head_tiles
    split = gl.program_id(1)
    request = gl.program_id(2)
    if request == gl.num_programs(2) - 1:
        _zero_tail_rows(OUTPUT_PTR, QUERY_START_LOC_PTR, request, split, num_tokens, num_heads, _LATENT_DIM,
                        ZERO_BLOCK, _WARPS)
    q_start = gl.load(QUERY_START_LOC_PTR + request)
    q_len = gl.load(QUERY_START_LOC_PTR + request + 1) - q_start
    seq_len = gl.load(SEQ_LENS_PTR + request)
    tile_kv_end = seq_len - q_len + gl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    kv_lo = split * tokens_per_split
    kv_hi = gl.minimum(kv_lo + tokens_per_split, tile_kv_end)
    # a query tile past the request's rows (or an empty split) runs no tile and stores nothing
    num_tiles = gl.where(q_tile * BLOCK_Q < q_len, gl.maximum(gl.cdiv(kv_hi - kv_lo, _BLOCK_N), 0), 0)
    block_table_row = BLOCK_TABLE_PTR + request.to(gl.int64) * block_table_stride_b

    # the query tile: loaded by the score warpgroup (_load_query_tile) while the value warpgroup
    # already issues the first cache copies
    q_latent_smem = gl.allocate_shared_memory(dtype, [_BLOCK_M, _LATENT_DIM], LATENT_SMEM)
    q_rope_smem = gl.allocate_shared_memory(dtype, [_BLOCK_M, _ROPE_DIM], ROPE_SMEM)
    latent_bufs = gl.allocate_shared_memory(dtype, [2, _BLOCK_N, _LATENT_DIM], LATENT_SMEM)
    rope_bufs = gl.allocate_shared_memory(dtype, [2, _BLOCK_N, _ROPE_DIM], ROPE_SMEM)
    probs_smem = gl.allocate_shared_memory(dtype, [_BLOCK_M, _BLOCK_N], PROBS_SMEM)
    # [64] each: the tile's rescale factors, the final row max, the final row sum
    rescale_smem = gl.allocate_shared_memory(gl.float32, [_BLOCK_M], ROWS_SMEM)
    max_smem = gl.allocate_shared_memory(gl.float32, [_BLOCK_M], ROWS_SMEM)
    sum_smem = gl.allocate_shared_memory(gl.float32, [_BLOCK_M], ROWS_SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [7, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(2):
        mbarrier.init(bars.index(_READY + stage), count=32 * _WARPS)  # every value-warpgroup thread's copies
        mbarrier.init(bars.index(_FREE + stage), count=1)
    mbarrier.init(bars.index(_PROBS_READY), count=1)
    mbarrier.init(bars.index(_PROBS_FREE), count=1)
    mbarrier.init(bars.index(_STATS_READY), count=1)
    hopper.fence_async_shared()  # the barriers' init before the copies' arrivals
    _barrier()

    positions_base = seq_len - q_len + q_tile * BLOCK_Q
    acc, running_max, running_sum = gl.warp_specialize([
        (_score_partition, (q_latent_smem, q_rope_smem, latent_bufs, rope_bufs, probs_smem, rescale_smem, max_smem,
                            sum_smem, bars, positions_base, kv_lo, kv_hi, num_tiles, qk_scale, QUERY_LATENT_PTR,
                            QUERY_ROPE_PTR, ql_stride_t, ql_stride_h, qr_stride_t, qr_stride_h, q_start, q_tile,
                            q_len, head_tile, num_heads, BLOCK_Q, BLOCK_H)),
        (_value_partition, (latent_bufs, rope_bufs, probs_smem, rescale_smem, max_smem, sum_smem, bars, CACHE_PTR,
                            block_table_row, kv_lo, kv_hi, num_tiles, block_size_tokens, cache_stride_block,
                            cache_stride_token, OUTPUT_PTR, PARTIAL_ACC_PTR, PARTIAL_MAX_PTR, PARTIAL_SUM_PTR, q_start,
                            q_tile, q_len, head_tile, num_heads, num_tokens, split, num_kv_splits, out_stride_t,
                            out_stride_h, BLOCK_Q, BLOCK_H)),
    ], [_WARPS], [_VALUE_REGISTERS])
    _store_half(acc, 0, running_max, running_sum, OUTPUT_PTR, PARTIAL_ACC_PTR, PARTIAL_MAX_PTR, PARTIAL_SUM_PTR,
                q_start, q_tile, q_len, head_tile, num_heads, num_tokens, split, num_kv_splits, out_stride_t,
                out_stride_h, True, BLOCK_Q, BLOCK_H, ACC)


def launch_paged_mla_ws(grid, query_latent, query_rope, latent_cache, block_table, seq_lens, query_start_loc,
                        output, partial_acc, partial_max, partial_sum, qk_scale, num_tokens, num_heads,
                        tokens_per_split, num_head_tiles, num_kv_splits, block_q, block_h, zero_block):
    """Launch the kernel over ``grid``, as ``mla_wgmma.launch_paged_mla_wgmma``."""
    _paged_mla_ws_kernel[grid](
        query_latent, query_rope, latent_cache, block_table, seq_lens, query_start_loc,
        output, partial_acc, partial_max, partial_sum, qk_scale,
        query_latent.stride(0), query_latent.stride(1), query_rope.stride(0), query_rope.stride(1),
        output.stride(0), output.stride(1), latent_cache.stride(0), latent_cache.stride(1), block_table.stride(0),
        num_tokens, num_heads, latent_cache.shape[1], tokens_per_split, num_head_tiles, num_kv_splits,
        BLOCK_Q=block_q, BLOCK_H=block_h, ZERO_BLOCK=zero_block, num_warps=PARTITION_WARPS,
    )


__all__ = ["PARTITION_WARPS", "launch_paged_mla_ws"]
