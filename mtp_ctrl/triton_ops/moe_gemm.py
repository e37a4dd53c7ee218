"""Expert dispatch and grouped expert products of a mixture-of-experts layer, sized on the device.

:func:`align_expert_pairs` sorts a step's ``T x k`` (row, expert) pairs by local expert (stable;
pairs of another rank's experts go last) and cuts every expert's segment into tiles of
``block_rows`` positions that never straddle two experts (vLLM's block-aligned segments), in three
launches (per-chunk bucket counts; one program for the chunks' bases, the offsets and the tiles;
per-chunk placement), or one when the pairs fit one chunk (decode): nothing is read on the host,
every size depends on T alone.

:func:`grouped_expert_matmul` multiplies every sorted position's input row by its expert's
weight, all experts in one launch:

- ``"triton"``: a fused-MoE kernel in the style of vLLM's. The grid covers the worst case
  (``cdiv(P, block_rows) + E`` tiles x column tiles); tiles past the last segment do nothing.
  Each tile gathers its input rows and reads its expert's weight once per column tile, and can
  scatter its results straight to pair order (no permutation pass).
- ``"grouped_mm"``: torch's grouped GEMM (``torch._grouped_mm``: CUTLASS on Hopper) over the
  gathered rows, with the segment ends as its offsets. Its CUDA kernel takes bf16; fp32 on CUDA
  falls back to a host loop that cannot be captured, so other dtypes run the Triton kernel.
- ``"reference"``: the torch twin (:mod:`mtp_ctrl.triton_ops.reference.moe`), a loop over experts
  of dense products, each kept on its segment (E times the work; no host sync either).

Positions past ``expert_offsets[E]`` (pairs routed to another rank's experts) come out as zeros;
with ``all_experts_local`` (no such pairs: every position is written) the output is not zero-filled
first.
"""

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import FLOAT_DTYPES, check_int, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._layout_checks import check_bool
from mtp_ctrl.triton_ops._moe_common import ExpertSegments

BACKENDS = ("triton", "grouped_mm", "reference")


@triton.jit
def _bucket_of(EXPERT_IDS_PTR, pairs, num_pairs, first_expert, num_experts):
    """Bucket of each pair: its local expert, ``num_experts`` for another rank's, -1 past the end."""
    ids = tl.load(EXPERT_IDS_PTR + pairs, mask=pairs < num_pairs, other=0) - first_expert
    bucket = tl.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    return tl.where(pairs < num_pairs, bucket, -1)


@triton.jit
def _chunk_bucket_counts_kernel(
    EXPERT_IDS_PTR, CHUNK_COUNTS_PTR, num_pairs, first_expert, num_experts,
    BLOCK_P: tl.constexpr, E_PAD: tl.constexpr,
):
    """Program c: how many of pairs ``[c * BLOCK_P, + BLOCK_P)`` fall in each bucket."""
    chunk = tl.program_id(0)
    buckets = tl.arange(0, E_PAD)
    bucket = _bucket_of(EXPERT_IDS_PTR, chunk * BLOCK_P + tl.arange(0, BLOCK_P), num_pairs, first_expert, num_experts)
    counts = tl.sum((bucket[:, None] == buckets[None, :]).to(tl.int32), axis=0)  # [E_PAD]
    tl.store(CHUNK_COUNTS_PTR + chunk * E_PAD + buckets, counts)


@triton.jit
def _segment_layout_kernel(
    CHUNK_COUNTS_PTR, CHUNK_BASES_PTR, OFFSETS_PTR, BLOCK_EXPERTS_PTR, BLOCK_STARTS_PTR,
    num_chunks, num_experts, num_blocks, max_tiles,
    BLOCK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr, E_PAD: tl.constexpr,
):
    """One program: each chunk's first position per bucket (its bucket's start + the pairs of that
    bucket in earlier chunks), the bucket offsets, and every tile's expert and first position."""
    buckets = tl.arange(0, E_PAD)  # [E_PAD]
    running = tl.zeros((E_PAD,), dtype=tl.int32)  # pairs per bucket in the chunks so far
    for c0 in range(0, num_chunks, BLOCK_C):
        chunks = c0 + tl.arange(0, BLOCK_C)
        tile = tl.load(CHUNK_COUNTS_PTR + chunks[:, None] * E_PAD + buckets[None, :],
                       mask=(chunks < num_chunks)[:, None], other=0)  # [BLOCK_C, E_PAD]
        before = running[None, :] + tl.cumsum(tile, axis=0) - tile  # same-bucket pairs in earlier chunks
        tl.store(CHUNK_BASES_PTR + chunks[:, None] * E_PAD + buckets[None, :], before,
                 mask=(chunks < num_chunks)[:, None])
        running += tl.sum(tile, axis=0)
    _store_layout(running, OFFSETS_PTR, BLOCK_EXPERTS_PTR, BLOCK_STARTS_PTR, num_experts, num_blocks, max_tiles,
                  BLOCK_ROWS, BLOCK_B, E_PAD)


@triton.jit
def _store_layout(counts, OFFSETS_PTR, BLOCK_EXPERTS_PTR, BLOCK_STARTS_PTR, num_experts, num_blocks, max_tiles,
                  BLOCK_ROWS: tl.constexpr, BLOCK_B: tl.constexpr, E_PAD: tl.constexpr):
    """From the pairs per bucket ``counts`` [E_PAD]: the bucket offsets, and every tile's expert and
    first position; returns each bucket's first position [E_PAD]. Expert-major: pass j writes each
    expert's j-th tile (``max_tiles`` >= any expert's tile count passes; 1 at decode), then the
    tiles past the last segment get expert -1."""
    buckets = tl.arange(0, E_PAD)
    starts = tl.cumsum(counts, axis=0) - counts  # [E_PAD] exclusive: each bucket's first position
    tl.store(OFFSETS_PTR + buckets, starts.to(tl.int64), mask=buckets <= num_experts)
    tiles = tl.where(buckets < num_experts, (counts + BLOCK_ROWS - 1) // BLOCK_ROWS, 0)  # [E_PAD]
    tile_starts = tl.cumsum(tiles, axis=0) - tiles
    for j in range(max_tiles):
        has = j < tiles
        tl.store(BLOCK_EXPERTS_PTR + tile_starts + j, buckets.to(tl.int64), mask=has)
        tl.store(BLOCK_STARTS_PTR + tile_starts + j, (starts + j * BLOCK_ROWS).to(tl.int64), mask=has)
    used = tl.sum(tiles, axis=0)
    for b0 in range(0, num_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        past = (blocks >= used) & (blocks < num_blocks)
        tl.store(BLOCK_EXPERTS_PTR + blocks, tl.full((BLOCK_B,), -1, tl.int64), mask=past)
        tl.store(BLOCK_STARTS_PTR + blocks, tl.zeros((BLOCK_B,), tl.int64), mask=past)
    return starts


@triton.jit
def _align_one_chunk_kernel(
    EXPERT_IDS_PTR, OFFSETS_PTR, BLOCK_EXPERTS_PTR, BLOCK_STARTS_PTR, SORTED_PAIRS_PTR, SORTED_ROWS_PTR,
    num_pairs, top_k, first_expert, num_experts, num_blocks, max_tiles,
    BLOCK_ROWS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr, E_PAD: tl.constexpr,
):
    """One program, all pairs in one chunk (decode): the three kernels' work in one launch."""
    buckets = tl.arange(0, E_PAD)
    pairs = tl.arange(0, BLOCK_P)
    bucket = _bucket_of(EXPERT_IDS_PTR, pairs, num_pairs, first_expert, num_experts)
    onehot = (bucket[:, None] == buckets[None, :]).to(tl.int32)  # [BLOCK_P, E_PAD]
    starts = _store_layout(tl.sum(onehot, axis=0), OFFSETS_PTR, BLOCK_EXPERTS_PTR, BLOCK_STARTS_PTR, num_experts,
                           num_blocks, max_tiles, BLOCK_ROWS, BLOCK_B, E_PAD)
    position = tl.sum(onehot * (starts[None, :] + tl.cumsum(onehot, axis=0) - onehot), axis=1)  # [BLOCK_P]
    valid = pairs < num_pairs
    tl.store(SORTED_PAIRS_PTR + position, pairs.to(tl.int64), mask=valid)
    tl.store(SORTED_ROWS_PTR + position, (pairs // top_k).to(tl.int64), mask=valid)


@triton.jit
def _place_pairs_kernel(
    EXPERT_IDS_PTR, CHUNK_BASES_PTR, OFFSETS_PTR, SORTED_PAIRS_PTR, SORTED_ROWS_PTR,
    num_pairs, top_k, first_expert, num_experts,
    BLOCK_P: tl.constexpr, E_PAD: tl.constexpr,
):
    """Program c: each pair of the chunk goes to its bucket's start + the same-bucket pairs of
    earlier chunks + those before it in this chunk (a stable sort)."""
    chunk = tl.program_id(0)
    buckets = tl.arange(0, E_PAD)
    pairs = chunk * BLOCK_P + tl.arange(0, BLOCK_P)
    bucket = _bucket_of(EXPERT_IDS_PTR, pairs, num_pairs, first_expert, num_experts)
    onehot = (bucket[:, None] == buckets[None, :]).to(tl.int32)  # [BLOCK_P, E_PAD]
    starts = tl.load(OFFSETS_PTR + buckets, mask=buckets <= num_experts, other=0).to(tl.int32)
    bases = tl.load(CHUNK_BASES_PTR + chunk * E_PAD + buckets) + starts  # [E_PAD]
    position = tl.sum(onehot * (bases[None, :] + tl.cumsum(onehot, axis=0) - onehot), axis=1)  # [BLOCK_P]
    valid = pairs < num_pairs
    tl.store(SORTED_PAIRS_PTR + position, pairs.to(tl.int64), mask=valid)
    tl.store(SORTED_ROWS_PTR + position, (pairs // top_k).to(tl.int64), mask=valid)


@triton.jit
def _grouped_expert_matmul_kernel(
    ROWS_PTR, WEIGHT_PTR, OUT_PTR, SORTED_ROWS_PTR, SORTED_PAIRS_PTR, EXPERT_OFFSETS_PTR, BLOCK_EXPERTS_PTR,
    BLOCK_STARTS_PTR, num_cols, depth, rows_stride_t, rows_stride_k, weight_stride_e, weight_stride_n,
    weight_stride_k, out_stride_p,
    GATHER_ROWS: tl.constexpr, SCATTER_PAIRS: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Tile (block, column tile): ``out[pair(p), n] = rows[row(p)] . weight[expert, n]`` for the
    positions ``p`` of one expert's tile; a tile past the last segment (expert -1) does nothing."""
    block = tl.program_id(0)
    col_tile = tl.program_id(1)
    expert = tl.load(BLOCK_EXPERTS_PTR + block)
    if expert >= 0:
        start = tl.load(BLOCK_STARTS_PTR + block)
        end = tl.load(EXPERT_OFFSETS_PTR + expert + 1)
        positions = start + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        position_mask = positions < end
        if GATHER_ROWS:
            rows = tl.load(SORTED_ROWS_PTR + positions, mask=position_mask, other=0).to(tl.int64)
        else:
            rows = positions.to(tl.int64)
        cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        col_mask = cols < num_cols
        weight_base = WEIGHT_PTR + expert.to(tl.int64) * weight_stride_e
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, depth, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            k_mask = ks < depth
            a = tl.load(ROWS_PTR + rows[:, None] * rows_stride_t + ks[None, :] * rows_stride_k,
                        mask=position_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(weight_base + cols[None, :].to(tl.int64) * weight_stride_n + ks[:, None] * weight_stride_k,
                        mask=k_mask[:, None] & col_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
            if FP32_DOT:
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        if SCATTER_PAIRS:
            out_rows = tl.load(SORTED_PAIRS_PTR + positions, mask=position_mask, other=0).to(tl.int64)
        else:
            out_rows = positions.to(tl.int64)
        out_ptrs = OUT_PTR + out_rows[:, None] * out_stride_p + cols[None, :]
        tl.store(out_ptrs, acc.to(OUT_PTR.dtype.element_ty), mask=position_mask[:, None] & col_mask[None, :])


def block_rows_for(num_pairs: int, num_experts: int) -> int:
    """Positions per tile for ``num_pairs`` pairs over ``num_experts`` local experts: small tiles
    while the average segment is short (decode: each expert's weight is read about once whatever
    the tile), larger ones when segments are long (fewer re-reads of each weight)."""
    average = num_pairs / max(num_experts, 1)
    return 16 if average <= 16 else (32 if average <= 48 else 64)


def align_expert_pairs(
    expert_ids: torch.Tensor,  # [T, k] int64: each row's global expert ids
    first_expert: int,  # global id of this rank's local expert 0
    num_experts: int,  # E, local experts
    block_rows: int,  # positions per tile (block_rows_for)
) -> ExpertSegments:
    """Sort the ``T * k`` pairs by local expert (stable) and tile the segments, on the device
    (:class:`~mtp_ctrl.triton_ops._moe_common.ExpertSegments` has a worked example)."""
    check_tensor("expert_ids", expert_ids, dtypes=(torch.int64,), ndim=2)
    check_int("first_expert", first_expert, low=0)
    check_int("num_experts", num_experts, low=1)
    check_int("block_rows", block_rows, low=1)
    if not use_triton(expert_ids):
        return reference.align_expert_pairs(expert_ids, first_expert, num_experts, block_rows)
    num_pairs = expert_ids.numel()
    num_blocks = triton.cdiv(num_pairs, block_rows) + num_experts
    device = expert_ids.device
    e_pad = triton.next_power_of_2(num_experts + 1)
    block_p = max(16, min(64, 8192 // e_pad))
    num_chunks = max(1, triton.cdiv(num_pairs, block_p))
    ids = expert_ids.contiguous()
    sorted_pairs = torch.empty(num_pairs, dtype=torch.int64, device=device)
    sorted_rows = torch.empty(num_pairs, dtype=torch.int64, device=device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=device)
    block_experts = torch.empty(num_blocks, dtype=torch.int64, device=device)
    block_starts = torch.empty(num_blocks, dtype=torch.int64, device=device)
    top_k = max(expert_ids.shape[1], 1)
    max_tiles = triton.cdiv(num_pairs, block_rows)  # no expert has more tiles
    if num_chunks == 1:  # decode: one launch
        _align_one_chunk_kernel[(1,)](ids, offsets, block_experts, block_starts, sorted_pairs, sorted_rows,
                                      num_pairs, top_k, first_expert, num_experts, num_blocks, max_tiles,
                                      BLOCK_ROWS=block_rows,
                                      BLOCK_P=max(16, triton.next_power_of_2(num_pairs)), BLOCK_B=block_p,
                                      E_PAD=e_pad, num_warps=4)
        return ExpertSegments(sorted_pairs, sorted_rows, offsets, block_experts, block_starts, block_rows)
    chunk_counts = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=device)  # [C, E_PAD]
    chunk_bases = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=device)  # [C, E_PAD]
    _chunk_bucket_counts_kernel[(num_chunks,)](ids, chunk_counts, num_pairs, first_expert, num_experts,
                                               BLOCK_P=block_p, E_PAD=e_pad, num_warps=4)
    _segment_layout_kernel[(1,)](chunk_counts, chunk_bases, offsets, block_experts, block_starts, num_chunks,
                                 num_experts, num_blocks, max_tiles, BLOCK_ROWS=block_rows, BLOCK_C=16, BLOCK_B=block_p,
                                 E_PAD=e_pad, num_warps=4)
    _place_pairs_kernel[(num_chunks,)](ids, chunk_bases, offsets, sorted_pairs, sorted_rows, num_pairs,
                                       top_k, first_expert, num_experts,
                                       BLOCK_P=block_p, E_PAD=e_pad, num_warps=4)
    return ExpertSegments(sorted_pairs, sorted_rows, offsets, block_experts, block_starts, block_rows)


def _check_matmul_args(rows, weight, segments, gather_rows, scatter_pairs, backend):
    check_tensor("rows", rows, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("weight", weight, dtypes=(rows.dtype,), shape=(None, None, rows.shape[1]), device=rows.device)
    if not isinstance(segments, ExpertSegments):
        raise TypeError(f"segments must be an ExpertSegments (align_expert_pairs), got {type(segments).__name__}")
    check_tensor("segments.expert_offsets", segments.expert_offsets, dtypes=(torch.int64,),
                 shape=(weight.shape[0] + 1,), device=rows.device)
    if not gather_rows and rows.shape[0] != segments.sorted_pairs.shape[0]:
        raise ValueError(f"rows has {rows.shape[0]} rows; without gather_rows it needs one per sorted position "
                         f"({segments.sorted_pairs.shape[0]})")
    for name, flag in (("gather_rows", gather_rows), ("scatter_pairs", scatter_pairs)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def grouped_expert_matmul(
    rows: torch.Tensor,  # [R, K] float: input rows
    weight: torch.Tensor,  # [E, N, K] same dtype, any strides: expert e's weight as a linear layer's [out, in]
    segments: ExpertSegments,  # from align_expert_pairs
    gather_rows: bool = True,  # position p reads rows[segments.sorted_rows[p]] (else rows[p]: R == P)
    scatter_pairs: bool = False,  # position p writes out[segments.sorted_pairs[p]] (pair order; else out[p])
    backend: str = "triton",
    all_experts_local: bool = False,  # every pair's expert is in weight: every row of out is written, no zero fill
) -> torch.Tensor:  # [P, N] rows.dtype; zeros where the pair's expert is another rank's
    """``rows[in(p)] @ weight[e].T`` for every sorted position ``p`` of local expert ``e``, fp32
    accumulation rounded once to the rows' dtype (module docstring).

    >>> segments = align_expert_pairs(torch.tensor([[2, 0], [2, 1]]), 0, 3, 2)  # sorted pairs [1, 3, 0, 2]
    >>> grouped_expert_matmul(x, w, segments, scatter_pairs=True)
    ... # [x[0] @ w[2].T, x[0] @ w[0].T, x[1] @ w[2].T, x[1] @ w[1].T]: row t's j-th expert at t * 2 + j
    """
    _check_matmul_args(rows, weight, segments, gather_rows, scatter_pairs, backend)
    check_bool("all_experts_local", all_experts_local)
    if backend == "reference" or (backend == "triton" and not use_triton(rows)):
        return reference.grouped_expert_matmul(rows, weight, segments, gather_rows, scatter_pairs)
    if backend == "grouped_mm" and (not rows.is_cuda or rows.dtype == torch.bfloat16):
        return _grouped_mm(rows, weight, segments, gather_rows, scatter_pairs)
    num_positions = segments.sorted_pairs.shape[0]
    num_experts, num_cols, depth = weight.shape
    allocate = torch.empty if all_experts_local else torch.zeros  # a zero fill is one more launch
    out = allocate((num_positions, num_cols), dtype=rows.dtype, device=rows.device)  # [P, N]
    if num_positions == 0 or num_cols == 0:
        return out
    block_n = 64 if num_cols >= 64 else 32
    block_k = 64 if depth >= 64 else max(16, triton.next_power_of_2(depth))
    grid = (segments.block_experts.shape[0], triton.cdiv(num_cols, block_n))
    _grouped_expert_matmul_kernel[grid](
        rows, weight, out, segments.sorted_rows, segments.sorted_pairs, segments.expert_offsets,
        segments.block_experts, segments.block_starts, num_cols, depth, rows.stride(0), rows.stride(1),
        weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0),
        GATHER_ROWS=gather_rows, SCATTER_PAIRS=scatter_pairs, FP32_DOT=rows.dtype == torch.float32,
        BLOCK_M=segments.block_rows, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return out


def _grouped_mm(rows, weight, segments, gather_rows, scatter_pairs):
    """torch's grouped GEMM: gathered rows ``[P, K]`` x ``weight^T`` ``[E, K, N]`` with the segment
    ends as offsets; positions past ``offsets[E]`` are set to zero (grouped_mm leaves them unset)."""
    gathered = rows.index_select(0, segments.sorted_rows) if gather_rows else rows  # [P, K]
    ends = segments.expert_offsets[1:].to(torch.int32)  # [E]
    out = torch._grouped_mm(gathered, weight.transpose(1, 2), offs=ends)  # [P, N]
    positions = torch.arange(out.shape[0], device=out.device)  # [P]
    out = torch.where((positions < segments.expert_offsets[-1])[:, None], out, 0)
    return torch.zeros_like(out).index_copy_(0, segments.sorted_pairs, out) if scatter_pairs else out
