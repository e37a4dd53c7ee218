"""A Hopper (sm_90) Gluon kernel of the paged MLA attention for tiles of 64 matrix rows (64 or
128 local heads at one decode row): the FlashMLA work split, which Triton's chained dots cannot
express (RESULTS, "MLA").

Same contract, partial layout and split-K as :func:`mtp_ctrl.triton_ops.paged_mla_attention`'s
Triton kernel (``mla_attention._paged_mla_kernel``), whose launcher calls
:func:`launch_paged_mla_wgmma` where :func:`~mtp_ctrl.triton_ops.mla_attention.wgmma_kernel_applies` says so; the torch twin is the same
(``reference.paged_mla_attention``). One program holds 64 matrix rows (query rows x heads) over
one split of a request's context, 8 warps = two warpgroups:

- the query tile ``[64, C]`` / ``[64, R]`` stays in shared memory for the whole split;
- cached tokens come 64 at a time by ``cp.async`` into two shared buffers (the next tile loads
  while this one is computed), each token row looked up in the block table;
- scores ``[64 rows, 64 tokens]``: each warpgroup computes HALF the tokens (``warps_per_cta =
  [4, 2]``), once; the softmax's row max and sum cross the two warpgroups through shared memory;
- the probabilities go to shared memory as bf16, and each warpgroup multiplies ALL of them into
  its HALF of the ``C`` value dims (``[64, C / 2]`` fp32 a warpgroup: 128 registers a thread).

A cached token thus costs ``C + R`` (scores) + ``C`` (values) multiply-adds a matrix row, the
useful work; Triton's chained-dot layout issues ``2 (C + R) + C`` there.

Two schedules of this program (``ASYNC_DOTS``, from ``MLATiles.schedule``): each dot waited for
where it is issued, or the score dots in flight while the next tile's copies are issued and the
value dots while they are waited for. Both read the block table a tile ahead and keep the row sums
as a ``[64, 64]`` partial reduced after the loop. The warp-specialized schedule is another kernel:
:mod:`mtp_ctrl.triton_ops.mla_wgmma_ws`.

Gluon is imported here, at this module's import: callers import this module lazily (it is only
needed on a CUDA device of compute capability 9.x), so a Triton without Gluon, or a machine
without a GPU, never needs it. The kernel uses only API present in triton 3.6 and 3.9 (the two
names that moved between them are resolved below).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import async_copy

# triton 3.6: async_copy_global_to_shared / thread_barrier; later: async_load / barrier
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

BLOCK_M = 64  # matrix rows a program: one warpgroup's wgmma M
BLOCK_N = 64  # cached tokens a tile
LATENT_DIM = 512  # C: DeepSeek-V3's kv_lora_rank (the value dims: two warpgroups x 256, wgmma's widest N)
ROPE_DIM = 64  # R: DeepSeek-V3's qk_pos_emb_head_dim
NUM_WARPS = 8
# shared memory a program: query 64 x (C + R), two cache tiles 64 x (C + R), probabilities 64 x 64,
# bf16: 224 KiB of the 227 an SM has, so one program an SM
SHARED_BYTES = 2 * (BLOCK_M * (LATENT_DIM + ROPE_DIM) + 2 * BLOCK_N * (LATENT_DIM + ROPE_DIM) + BLOCK_M * BLOCK_N)
# the same, as the kernels read them
_BLOCK_M, _BLOCK_N = gl.constexpr(BLOCK_M), gl.constexpr(BLOCK_N)
_LATENT_DIM, _ROPE_DIM, _NUM_WARPS = gl.constexpr(LATENT_DIM), gl.constexpr(ROPE_DIM), gl.constexpr(NUM_WARPS)


@gluon.jit
def _zero_tail_rows(OUTPUT_PTR, QUERY_START_LOC_PTR, request, split, num_tokens, num_heads,
                    LATENT: gl.constexpr, ZERO_BLOCK: gl.constexpr, WARPS: gl.constexpr):
    """Rows past the last request's are padding: the last request's programs zero them, each a
    share (the output is ``[T, H, C]`` contiguous, not pre-zeroed); ``WARPS`` warps."""
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [WARPS], [0])
    row_elements = num_heads * LATENT
    tail_start = gl.load(QUERY_START_LOC_PTR + request + 1).to(gl.int64) * row_elements
    tail_end = gl.cast(num_tokens, gl.int64) * row_elements
    sharers = gl.num_programs(0) * gl.num_programs(1)
    share = gl.cdiv(tail_end - tail_start, sharers)
    share_start = tail_start + (split * gl.num_programs(0) + gl.program_id(0)) * share
    share_end = gl.minimum(share_start + share, tail_end)
    zeros = gl.zeros([ZERO_BLOCK], gl.float32, layout)  # the store casts to the output's dtype
    for first in range(share_start, share_end, ZERO_BLOCK):
        elements = first + gl.arange(0, ZERO_BLOCK, layout)
        gl.store(OUTPUT_PTR + elements, zeros.to(OUTPUT_PTR.dtype.element_ty), mask=elements < share_end)


@gluon.jit
def _tile_block_ids(block_table_row, tile_start, kv_hi, block_size_tokens,
                    LATENT_LOAD: gl.constexpr, ROPE_LOAD: gl.constexpr):
    """The cache block of each token ``tile_start + [0, BLOCK_N)`` (0 at or past ``kv_hi``), in the
    row layouts of the two copies (``[BLOCK_N]`` int32 each): loaded a tile before its copies are
    issued, so that the copies never wait on the block table."""
    tokens = tile_start + gl.arange(0, _BLOCK_N, gl.SliceLayout(1, LATENT_LOAD))
    block_ids = gl.load(block_table_row + tokens // block_size_tokens, mask=tokens < kv_hi, other=0)
    rope_tokens = tile_start + gl.arange(0, _BLOCK_N, gl.SliceLayout(1, ROPE_LOAD))
    rope_ids = gl.load(block_table_row + rope_tokens // block_size_tokens, mask=rope_tokens < kv_hi, other=0)
    return block_ids, rope_ids


@gluon.jit
def _load_cache_tile(latent_buf, rope_buf, CACHE_PTR, block_ids, rope_ids, tile_start, kv_hi, block_size_tokens,
                     cache_stride_block, cache_stride_token,
                     LATENT_LOAD: gl.constexpr, ROPE_LOAD: gl.constexpr):
    """Start the ``cp.async`` copies of cached tokens ``tile_start + [0, BLOCK_N)`` (their blocks
    ``block_ids`` / ``rope_ids``: :func:`_tile_block_ids`) into ``latent_buf`` ``[BLOCK_N, C]`` and
    ``rope_buf`` ``[BLOCK_N, R]``; tokens at or past ``kv_hi`` are zero-filled (masked)."""
    tokens = tile_start + gl.arange(0, _BLOCK_N, gl.SliceLayout(1, LATENT_LOAD))
    valid = tokens < kv_hi
    # 16-byte aligned rows (the launcher checks the strides): cp.async copies 16-byte vectors
    rows = gl.multiple_of(block_ids.to(gl.int64) * cache_stride_block + (tokens % block_size_tokens).to(gl.int64)
                          * cache_stride_token, 8)
    cdims = gl.arange(0, _LATENT_DIM, gl.SliceLayout(0, LATENT_LOAD))
    latent_ptrs = CACHE_PTR + rows[:, None] + cdims[None, :]
    _async_load(latent_buf, latent_ptrs, mask=valid[:, None] & (cdims < _LATENT_DIM)[None, :])
    rope_tokens = tile_start + gl.arange(0, _BLOCK_N, gl.SliceLayout(1, ROPE_LOAD))
    rope_valid = rope_tokens < kv_hi
    rope_rows = gl.multiple_of(rope_ids.to(gl.int64) * cache_stride_block
                               + (rope_tokens % block_size_tokens).to(gl.int64) * cache_stride_token, 8)
    rdims = gl.arange(0, _ROPE_DIM, gl.SliceLayout(0, ROPE_LOAD))
    rope_ptrs = CACHE_PTR + _LATENT_DIM + rope_rows[:, None] + rdims[None, :]
    _async_load(rope_buf, rope_ptrs, mask=rope_valid[:, None] & (rdims < _ROPE_DIM)[None, :])
    async_copy.commit_group()


@gluon.jit
def _softmax_tile(scores, positions, tile_start, kv_hi, running_max, sum_part, qk_scale, SCORE: gl.constexpr):
    """One tile's online softmax: ``scores`` ``[64, BLOCK_N]`` (fp32, unscaled) masked (causal
    bound ``positions``, the split's end ``kv_hi``) and scaled; returns the probabilities, the new
    row max, the accumulator's rescale factor and the row sums' partial.

    The row sums stay a ``[64, BLOCK_N]`` partial in the score layout, reduced once after the
    loop (a sum across the two warpgroups each tile would cost a shared-memory round trip and a
    barrier); the row max crosses the warpgroups each tile (both halves' probabilities share it)."""
    kv_pos = tile_start + gl.arange(0, _BLOCK_N, gl.SliceLayout(0, SCORE))
    visible = (kv_pos[None, :] <= positions[:, None]) & (kv_pos < kv_hi)[None, :]
    scores = gl.where(visible, scores * qk_scale, float("-inf"))
    new_max = gl.maximum(running_max, gl.max(scores, axis=1))
    safe_max = gl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = gl.exp2(running_max - safe_max)
    probs = gl.exp2(scores - safe_max[:, None])
    sum_part = sum_part * rescale[:, None] + probs
    return probs, new_max, rescale, sum_part


# request/row counts and split sizes vary step to step: one compiled kernel for all of them; the
# cache strides are never 1 (16-byte aligned rows: the launcher checks); a block size of 1 as a
# constant folds the row offsets so that the copies lose their 16-byte alignment hint
@gluon.jit(do_not_specialize=["num_tokens", "tokens_per_split", "num_head_tiles", "num_kv_splits",
                              "cache_stride_block", "cache_stride_token", "block_size_tokens"])
def _paged_mla_wgmma_kernel(
    QUERY_LATENT_PTR, QUERY_ROPE_PTR, CACHE_PTR, BLOCK_TABLE_PTR, SEQ_LENS_PTR, QUERY_START_LOC_PTR,
    OUTPUT_PTR, PARTIAL_ACC_PTR, PARTIAL_MAX_PTR, PARTIAL_SUM_PTR,
    qk_scale,  # softmax_scale * log2(e)
    ql_stride_t, ql_stride_h, qr_stride_t, qr_stride_h, out_stride_t, out_stride_h,
    cache_stride_block, cache_stride_token, block_table_stride_b,
    num_tokens, num_heads, block_size_tokens, tokens_per_split, num_head_tiles, num_kv_splits,
    BLOCK_Q: gl.constexpr, BLOCK_H: gl.constexpr, ZERO_BLOCK: gl.constexpr, ASYNC_DOTS: gl.constexpr,
):
    """Program (query tile x head tile, split, request), as ``_paged_mla_kernel``'s with
    ``BLOCK_M = 64`` (``BLOCK_Q x BLOCK_H <= 64``: matrix rows past it are masked); the module
    docstring says how it computes."""
    # --- layouts (8 warps) ---
    # the cache and query loads: 16-byte vectors along the dims, a warp over 256 dims of one row
    LATENT_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [_NUM_WARPS, 1], [1, 0])
    ROPE_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [_NUM_WARPS, 1], [1, 0])
    # scores [64, 64]: warpgroup w computes tokens [32 w, 32 w + 32) of all 64 rows
    SCORE: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                    instr_shape=[16, _BLOCK_N // 2, 16])
    # accumulator [64, C]: warpgroup w holds dims [C / 2 w, C / 2 (w + 1))
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, _LATENT_DIM // 2, 16])
    LATENT_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_N, _LATENT_DIM], gl.bfloat16)
    ROPE_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_N, _ROPE_DIM], gl.bfloat16)
    PROBS_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_M, _BLOCK_N], gl.bfloat16)
    dtype: gl.constexpr = CACHE_PTR.dtype.element_ty

    q_tile = gl.program_id(0) // num_head_tiles
    head_tile = gl.program_id(0) % num_head_tiles
    split = gl.program_id(1)
    request = gl.program_id(2)
    if request == gl.num_programs(2) - 1:
        _zero_tail_rows(OUTPUT_PTR, QUERY_START_LOC_PTR, request, split, num_tokens, num_heads, _LATENT_DIM,
                        ZERO_BLOCK, _NUM_WARPS)
    q_start = gl.load(QUERY_START_LOC_PTR + request)
    q_len = gl.load(QUERY_START_LOC_PTR + request + 1) - q_start
    if q_tile * BLOCK_Q < q_len:
        seq_len = gl.load(SEQ_LENS_PTR + request)
        # the query tile, once, into shared memory (matrix row m: query row m // BLOCK_H, head m % BLOCK_H)
        m_load = gl.arange(0, _BLOCK_M, gl.SliceLayout(1, LATENT_LOAD))
        load_rows = (q_start + q_tile * BLOCK_Q + m_load // BLOCK_H).to(gl.int64)
        load_heads = (head_tile * BLOCK_H + m_load % BLOCK_H).to(gl.int64)
        load_valid = (m_load < BLOCK_Q * BLOCK_H) & (q_tile * BLOCK_Q + m_load // BLOCK_H < q_len) \
            & (load_heads < num_heads)
        cdims_load = gl.arange(0, _LATENT_DIM, gl.SliceLayout(0, LATENT_LOAD))
        q_latent = gl.load(QUERY_LATENT_PTR + load_rows[:, None] * ql_stride_t + load_heads[:, None] * ql_stride_h
                           + cdims_load[None, :], mask=load_valid[:, None] & (cdims_load < _LATENT_DIM)[None, :],
                           other=0.0)  # [64, C]
        q_latent_smem = gl.allocate_shared_memory(dtype, [_BLOCK_M, _LATENT_DIM], LATENT_SMEM, q_latent)
        m_rope = gl.arange(0, _BLOCK_M, gl.SliceLayout(1, ROPE_LOAD))
        rope_rows = (q_start + q_tile * BLOCK_Q + m_rope // BLOCK_H).to(gl.int64)
        rope_heads = (head_tile * BLOCK_H + m_rope % BLOCK_H).to(gl.int64)
        rope_valid = (m_rope < BLOCK_Q * BLOCK_H) & (q_tile * BLOCK_Q + m_rope // BLOCK_H < q_len) \
            & (rope_heads < num_heads)
        rdims_load = gl.arange(0, _ROPE_DIM, gl.SliceLayout(0, ROPE_LOAD))
        q_rope = gl.load(QUERY_ROPE_PTR + rope_rows[:, None] * qr_stride_t + rope_heads[:, None] * qr_stride_h
                         + rdims_load[None, :], mask=rope_valid[:, None] & (rdims_load < _ROPE_DIM)[None, :],
                         other=0.0)  # [64, R]
        q_rope_smem = gl.allocate_shared_memory(dtype, [_BLOCK_M, _ROPE_DIM], ROPE_SMEM, q_rope)
        latent_bufs = gl.allocate_shared_memory(dtype, [2, _BLOCK_N, _LATENT_DIM], LATENT_SMEM)
        rope_bufs = gl.allocate_shared_memory(dtype, [2, _BLOCK_N, _ROPE_DIM], ROPE_SMEM)
        probs_smem = gl.allocate_shared_memory(dtype, [_BLOCK_M, _BLOCK_N], PROBS_SMEM)

        # each matrix row's position (causal bound) in the score layout's rows
        m_score = gl.arange(0, _BLOCK_M, gl.SliceLayout(1, SCORE))
        positions = seq_len - q_len + q_tile * BLOCK_Q + m_score // BLOCK_H  # [64]
        tile_kv_end = seq_len - q_len + gl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
        kv_lo = split * tokens_per_split
        kv_hi = gl.minimum(kv_lo + tokens_per_split, tile_kv_end)
        num_tiles = gl.cdiv(kv_hi - kv_lo, _BLOCK_N)
        block_table_row = BLOCK_TABLE_PTR + request.to(gl.int64) * block_table_stride_b

        running_max = gl.full([_BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, SCORE))
        sum_part = gl.zeros([_BLOCK_M, _BLOCK_N], gl.float32, SCORE)  # the row sums, reduced after the loop
        acc = gl.zeros([_BLOCK_M, _LATENT_DIM], gl.float32, ACC)
        score_zero = gl.zeros([_BLOCK_M, _BLOCK_N], gl.float32, SCORE)
        block_ids, rope_ids = _tile_block_ids(block_table_row, kv_lo, kv_hi, block_size_tokens, LATENT_LOAD, ROPE_LOAD)
        _load_cache_tile(latent_bufs.index(0), rope_bufs.index(0), CACHE_PTR, block_ids, rope_ids, kv_lo, kv_hi,
                         block_size_tokens, cache_stride_block, cache_stride_token, LATENT_LOAD, ROPE_LOAD)
        # the blocks of the tile whose copies are issued next, always a tile ahead
        block_ids, rope_ids = _tile_block_ids(block_table_row, kv_lo + _BLOCK_N, kv_hi, block_size_tokens,
                                              LATENT_LOAD, ROPE_LOAD)
        if ASYNC_DOTS:
            # the score dots run while the next tile's copies are issued, the value dots while they
            # are waited for: one barrier a tile besides the softmax's
            async_copy.wait_group(0)
            hopper.fence_async_shared()
            _barrier()
            hopper.fence_async_shared()
            for tile in range(0, num_tiles):
                stage = tile % 2
                tile_start = kv_lo + tile * _BLOCK_N
                latent = latent_bufs.index(stage)  # [BLOCK_N, C]
                rope_key = rope_bufs.index(stage)  # [BLOCK_N, R]
                scores = hopper.warpgroup_mma(q_latent_smem, latent.permute((1, 0)), score_zero, use_acc=False,
                                              is_async=True)
                scores = hopper.warpgroup_mma(q_rope_smem, rope_key.permute((1, 0)), scores, is_async=True)
                # the other buffer is free: every warp waited for the last tile's value dots before
                # the barrier that ended the last iteration
                _load_cache_tile(latent_bufs.index(1 - stage), rope_bufs.index(1 - stage), CACHE_PTR, block_ids,
                                 rope_ids, tile_start + _BLOCK_N, kv_hi, block_size_tokens, cache_stride_block,
                                 cache_stride_token, LATENT_LOAD, ROPE_LOAD)
                block_ids, rope_ids = _tile_block_ids(block_table_row, tile_start + 2 * _BLOCK_N, kv_hi,
                                                      block_size_tokens, LATENT_LOAD, ROPE_LOAD)
                scores = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[scores])
                probs, running_max, rescale, sum_part = _softmax_tile(scores, positions, tile_start, kv_hi,
                                                                      running_max, sum_part, qk_scale, SCORE)
                probs_smem.store(probs.to(dtype))
                hopper.fence_async_shared()
                _barrier()  # both warpgroups' halves of the probabilities are stored
                hopper.fence_async_shared()
                acc = acc * gl.convert_layout(rescale, gl.SliceLayout(1, ACC))[:, None]
                acc = hopper.warpgroup_mma(probs_smem, latent, acc, is_async=True)
                async_copy.wait_group(0)  # the next tile's copies (this thread's) landed
                hopper.fence_async_shared()
                acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
                # every warp: this tile's value dots done (its buffer and the probabilities free),
                # the next tile's copies landed
                _barrier()
                hopper.fence_async_shared()
        else:
            for tile in range(0, num_tiles):
                stage = tile % 2
                tile_start = kv_lo + tile * _BLOCK_N
                # every warp is done with the other buffer (last tile's dots) before it is refilled
                _barrier()
                _load_cache_tile(latent_bufs.index(1 - stage), rope_bufs.index(1 - stage), CACHE_PTR, block_ids,
                                 rope_ids, tile_start + _BLOCK_N, kv_hi, block_size_tokens, cache_stride_block,
                                 cache_stride_token, LATENT_LOAD, ROPE_LOAD)
                block_ids, rope_ids = _tile_block_ids(block_table_row, tile_start + 2 * _BLOCK_N, kv_hi,
                                                      block_size_tokens, LATENT_LOAD, ROPE_LOAD)
                async_copy.wait_group(1)  # this tile's copies (this thread's) landed
                # the copies' (generic) writes before the wgmma's (async proxy) reads, every thread's
                hopper.fence_async_shared()
                _barrier()
                hopper.fence_async_shared()
                latent = latent_bufs.index(stage)  # [BLOCK_N, C]
                rope_key = rope_bufs.index(stage)  # [BLOCK_N, R]
                scores = hopper.warpgroup_mma(q_latent_smem, latent.permute((1, 0)), score_zero, use_acc=False)
                scores = hopper.warpgroup_mma(q_rope_smem, rope_key.permute((1, 0)), scores)
                probs, running_max, rescale, sum_part = _softmax_tile(scores, positions, tile_start, kv_hi,
                                                                      running_max, sum_part, qk_scale, SCORE)
                probs_smem.store(probs.to(dtype))
                hopper.fence_async_shared()
                _barrier()  # both warpgroups' halves of the probabilities are stored
                hopper.fence_async_shared()
                acc = acc * gl.convert_layout(rescale, gl.SliceLayout(1, ACC))[:, None]
                acc = hopper.warpgroup_mma(probs_smem, latent, acc)
        async_copy.wait_group(0)
        running_sum = gl.sum(sum_part, axis=1)

        # --- epilogue: rows and dims in the accumulator's layout ---
        m_acc = gl.arange(0, _BLOCK_M, gl.SliceLayout(1, ACC))
        rows = (q_start + q_tile * BLOCK_Q + m_acc // BLOCK_H).to(gl.int64)
        heads = (head_tile * BLOCK_H + m_acc % BLOCK_H).to(gl.int64)
        row_valid = (m_acc < BLOCK_Q * BLOCK_H) & (q_tile * BLOCK_Q + m_acc // BLOCK_H < q_len) \
            & (heads < num_heads)
        cdims = gl.arange(0, _LATENT_DIM, gl.SliceLayout(0, ACC))
        store_mask = row_valid[:, None] & (cdims < _LATENT_DIM)[None, :]
        acc_sum = gl.convert_layout(running_sum, gl.SliceLayout(1, ACC))
        if num_kv_splits == 1:
            out = acc / gl.where(acc_sum > 0, acc_sum, 1.0)[:, None]
            out_ptrs = OUTPUT_PTR + rows[:, None] * out_stride_t + heads[:, None] * out_stride_h + cdims[None, :]
            gl.store(out_ptrs, out.to(OUTPUT_PTR.dtype.element_ty), mask=store_mask)
        else:
            # partials [num_kv_splits, T, H] (+ [C]): paged_attn's combine layout with one kv head
            stat_index = (split * num_tokens + rows) * num_heads + heads  # [64] int64
            gl.store(PARTIAL_MAX_PTR + stat_index, gl.convert_layout(running_max, gl.SliceLayout(1, ACC)),
                     mask=row_valid)
            gl.store(PARTIAL_SUM_PTR + stat_index, acc_sum, mask=row_valid)
            gl.store(PARTIAL_ACC_PTR + stat_index[:, None] * _LATENT_DIM + cdims[None, :], acc, mask=store_mask)


def launch_paged_mla_wgmma(grid, query_latent, query_rope, latent_cache, block_table, seq_lens, query_start_loc,
                           output, partial_acc, partial_max, partial_sum, qk_scale, num_tokens, num_heads,
                           tokens_per_split, num_head_tiles, num_kv_splits, block_q, block_h, zero_block,
                           async_dots=False):
    """Launch the kernel over ``grid`` (``mla_attention.paged_mla_attention`` computed it, the
    split count and the partial buffers, exactly as for its Triton kernel)."""
    _paged_mla_wgmma_kernel[grid](
        query_latent, query_rope, latent_cache, block_table, seq_lens, query_start_loc,
        output, partial_acc, partial_max, partial_sum, qk_scale,
        query_latent.stride(0), query_latent.stride(1), query_rope.stride(0), query_rope.stride(1),
        output.stride(0), output.stride(1), latent_cache.stride(0), latent_cache.stride(1), block_table.stride(0),
        num_tokens, num_heads, latent_cache.shape[1], tokens_per_split, num_head_tiles, num_kv_splits,
        BLOCK_Q=block_q, BLOCK_H=block_h, ZERO_BLOCK=zero_block, ASYNC_DOTS=async_dots, num_warps=NUM_WARPS,
    )


__all__ = ["BLOCK_M", "BLOCK_N", "LATENT_DIM", "ROPE_DIM", "SHARED_BYTES", "launch_paged_mla_wgmma"]
