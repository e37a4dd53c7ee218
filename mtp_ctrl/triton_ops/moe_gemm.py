"""Grouped expert matrix products of a mixture-of-experts layer, sized on the device.

A step's (row, expert) pairs are sorted by expert on the device (``models/moe_inference.py``);
``expert_offsets[e] .. expert_offsets[e + 1]`` are the sorted positions that go through expert
``e``. :func:`grouped_expert_matmul` multiplies every position's input row by its expert's
weight, for all experts in one launch, without reading the per-expert counts on the host:

- ``"triton"``: a fused-MoE kernel in the style of vLLM's. The positions are cut into tiles of
  ``BLOCK_M`` that never straddle two experts (block-aligned segments, computed on the device by
  :func:`expert_blocks`); the grid covers the worst case (``cdiv(P, BLOCK_M) + E`` tiles) and
  tiles past the last segment do nothing. Each tile gathers its input rows (``row_ids``) and reads
  its expert's weight once per column tile.
- ``"grouped_mm"``: torch's grouped GEMM (``torch._grouped_mm``, CUTLASS on Hopper) over the
  gathered rows, with the segment ends as its offsets.
- ``"reference"``: the torch twin (:mod:`mtp_ctrl.triton_ops.reference.moe`), a loop over experts
  of dense products, masked to each expert's segment (correct, E times the work).

Positions past ``expert_offsets[E]`` (pairs routed to another rank's experts) come out as zeros.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import FLOAT_DTYPES, INDEX_DTYPES, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton

BACKENDS = ("triton", "grouped_mm", "reference")


@triton.jit
def _grouped_expert_matmul_kernel(
    ROWS_PTR, WEIGHT_PTR, OUT_PTR, ROW_IDS_PTR, EXPERT_OFFSETS_PTR, BLOCK_EXPERTS_PTR, BLOCK_STARTS_PTR,
    num_cols, depth, rows_stride_t, rows_stride_k, weight_stride_e, weight_stride_n, weight_stride_k, out_stride_p,
    HAS_ROW_IDS: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Tile (block, column tile): ``out[p, n] = rows[row_ids[p]] . weight[expert, n]`` for the
    positions ``p`` of one expert's tile; a tile past the last segment (expert -1) does nothing."""
    block = tl.program_id(0)
    col_tile = tl.program_id(1)
    expert = tl.load(BLOCK_EXPERTS_PTR + block)
    if expert >= 0:
        start = tl.load(BLOCK_STARTS_PTR + block)
        end = tl.load(EXPERT_OFFSETS_PTR + expert + 1)
        positions = start + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        position_mask = positions < end
        if HAS_ROW_IDS:
            rows = tl.load(ROW_IDS_PTR + positions, mask=position_mask, other=0).to(tl.int64)
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
        out_ptrs = OUT_PTR + positions[:, None].to(tl.int64) * out_stride_p + cols[None, :]
        tl.store(out_ptrs, acc.to(OUT_PTR.dtype.element_ty), mask=position_mask[:, None] & col_mask[None, :])


def expert_blocks(expert_offsets: torch.Tensor, num_positions: int, block_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Cut every expert's segment of sorted positions into tiles of ``block_rows`` (on the device).

    Returns ``(block_experts, block_starts)``, both ``[cdiv(P, block_rows) + E]`` int64 (the worst
    case: every segment may end in a partial tile): the expert of tile ``b`` (-1 past the last
    segment) and its first sorted position. Example, offsets ``[0, 3, 3, 7]`` (E = 3, P = 7),
    ``block_rows = 2``: experts ``[0, 0, 2, 2, -1, -1, -1]``, starts ``[0, 2, 3, 5, ...]``.
    """
    num_experts = expert_offsets.shape[0] - 1
    num_blocks = triton.cdiv(num_positions, block_rows) + num_experts
    counts = expert_offsets[1:] - expert_offsets[:-1]  # [E]
    tiles = (counts + block_rows - 1) // block_rows  # [E]
    tile_ends = torch.cumsum(tiles, 0)  # [E] inclusive
    block = torch.arange(num_blocks, device=expert_offsets.device)  # [NB]
    expert = torch.searchsorted(tile_ends, block, right=True)  # [NB] in [0, E]; E: past the last segment
    clamped = expert.clamp(max=num_experts - 1)
    starts = expert_offsets[clamped] + (block - (tile_ends - tiles)[clamped]) * block_rows  # [NB]
    return torch.where(expert < num_experts, expert, -1), starts


def _tile_rows(num_positions: int, num_experts: int) -> int:
    """Rows per tile: small tiles while the average segment is short (decode: each expert's weight
    is read about once whatever the tile), large ones when segments are long (fewer weight reads)."""
    average = num_positions / max(num_experts, 1)
    return 16 if average <= 16 else (32 if average <= 48 else 64)


def _check_args(rows, weight, expert_offsets, row_ids, backend):
    check_tensor("rows", rows, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("weight", weight, dtypes=(rows.dtype,), shape=(None, None, rows.shape[1]), device=rows.device)
    check_tensor("expert_offsets", expert_offsets, dtypes=(torch.int64,), shape=(weight.shape[0] + 1,),
                 device=rows.device)
    if row_ids is not None:
        check_tensor("row_ids", row_ids, dtypes=INDEX_DTYPES, ndim=1, device=rows.device)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def grouped_expert_matmul(
    rows: torch.Tensor,  # [R, K] float: input rows
    weight: torch.Tensor,  # [E, N, K] same dtype, any strides: expert e's weight as a linear layer's [out, in]
    expert_offsets: torch.Tensor,  # [E + 1] int64: expert e owns sorted positions [offsets[e], offsets[e + 1])
    row_ids: Optional[torch.Tensor] = None,  # [P] int32/int64: the row of ``rows`` each position reads (None: row p)
    backend: str = "triton",
) -> torch.Tensor:  # [P, N] rows.dtype: position p times its expert's weight; zeros past offsets[E]
    """``out[p] = rows[row_ids[p]] @ weight[e].T`` for every sorted position ``p`` of expert ``e``.

    P is ``row_ids.shape[0]`` (or R). Segments must be in order (``offsets`` non-decreasing,
    ``offsets[0] == 0``, ``offsets[E] <= P``): the router's sort guarantees it; the values are not
    read on the host. Accumulation is fp32, rounded once to the rows' dtype.

    >>> offsets = torch.tensor([0, 1, 1, 3])         # E = 3: position 0 -> expert 0, 1 and 2 -> expert 2
    >>> grouped_expert_matmul(x, w, offsets, row_ids=torch.tensor([4, 0, 4]))
    ... # [x[4] @ w[0].T, x[0] @ w[2].T, x[4] @ w[2].T]
    """
    _check_args(rows, weight, expert_offsets, row_ids, backend)
    if backend == "reference" or (backend == "triton" and not use_triton(rows)):
        return reference.grouped_expert_matmul(rows, weight, expert_offsets, row_ids)
    if backend == "grouped_mm":
        return _grouped_mm(rows, weight, expert_offsets, row_ids)
    num_positions = rows.shape[0] if row_ids is None else row_ids.shape[0]
    num_experts, num_cols, depth = weight.shape
    out = torch.zeros((num_positions, num_cols), dtype=rows.dtype, device=rows.device)  # [P, N]
    if num_positions == 0 or num_cols == 0:
        return out
    block_m = _tile_rows(num_positions, num_experts)
    block_n = 64 if num_cols >= 64 else 32
    block_k = 64 if depth >= 64 else max(16, triton.next_power_of_2(depth))
    block_experts, block_starts = expert_blocks(expert_offsets, num_positions, block_m)
    grid = (block_experts.shape[0], triton.cdiv(num_cols, block_n))
    _grouped_expert_matmul_kernel[grid](
        rows, weight, out, row_ids if row_ids is not None else expert_offsets, expert_offsets, block_experts,
        block_starts, num_cols, depth, rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1),
        weight.stride(2), out.stride(0),
        HAS_ROW_IDS=row_ids is not None, FP32_DOT=rows.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return out


def _grouped_mm(rows, weight, expert_offsets, row_ids):
    """torch's grouped GEMM: gathered rows ``[P, K]`` x ``weight^T`` ``[E, K, N]`` with the segment
    ends as offsets; positions past ``offsets[E]`` are set to zero (grouped_mm leaves them unset)."""
    gathered = rows if row_ids is None else rows.index_select(0, row_ids)  # [P, K]
    ends = expert_offsets[1:].to(torch.int32)  # [E]
    out = torch._grouped_mm(gathered, weight.transpose(1, 2), offs=ends)  # [P, N]
    positions = torch.arange(out.shape[0], device=out.device)  # [P]
    return torch.where((positions < expert_offsets[-1])[:, None], out, 0)
