"""Advance every request by one drafted token: position, KV slot and sequence length (contract: docs/kernels.md)."""

from typing import Optional

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import INDEX_DTYPES, check_int, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._layout_checks import check_contiguous, check_unit_last_stride

BLOCK_ROWS = 128


@triton.jit
def _eagle_step_slot_mapping_kernel(
    POSITIONS_PTR,
    BLOCK_TABLE_PTR,
    SEQ_LENS_PTR,
    OUT_CLAMPED_POSITIONS_PTR,
    OUT_SLOT_MAPPING_PTR,
    block_table_stride,
    blocks_per_request,
    batch_size,
    input_batch_size,
    block_size,
    max_model_len,
    BLOCK_ROWS: tl.constexpr,
):
    """One program per ``BLOCK_ROWS`` rows of the padded batch; rows ``>= batch_size`` get slot PAD."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
    is_real = rows < batch_size
    is_padding = (rows >= batch_size) & (rows < input_batch_size)
    next_position = tl.load(POSITIONS_PTR + rows, mask=is_real, other=0).to(tl.int64) + 1
    overflow = next_position >= max_model_len
    clamped = tl.where(overflow, 0, next_position)
    block_index = tl.minimum(clamped // block_size, blocks_per_request - 1)
    block_id = tl.load(
        BLOCK_TABLE_PTR + rows.to(tl.int64) * block_table_stride + block_index, mask=is_real, other=0
    ).to(tl.int64)
    slot = tl.where(overflow, -1, block_id * block_size + clamped % block_size)
    seq_len = tl.load(SEQ_LENS_PTR + rows, mask=is_real, other=0).to(tl.int64)
    new_seq_len = tl.where(overflow, 1, tl.minimum(seq_len + 1, max_model_len))
    tl.store(OUT_CLAMPED_POSITIONS_PTR + rows, clamped.to(OUT_CLAMPED_POSITIONS_PTR.dtype.element_ty), mask=is_real)
    tl.store(SEQ_LENS_PTR + rows, new_seq_len.to(SEQ_LENS_PTR.dtype.element_ty), mask=is_real)
    slot = tl.where(is_padding, -1, slot)
    tl.store(OUT_SLOT_MAPPING_PTR + rows, slot.to(OUT_SLOT_MAPPING_PTR.dtype.element_ty), mask=is_real | is_padding)


def _check_args(
    positions_1d,
    block_table,
    seq_lens,
    block_size,
    max_model_len,
    out_clamped_positions,
    out_slot_mapping,
    input_batch_size,
):
    check_tensor("positions_1d", positions_1d, dtypes=INDEX_DTYPES, ndim=1)
    batch_size = positions_1d.shape[0]
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    if block_table.shape[0] < batch_size or block_table.shape[1] < 1:
        raise ValueError(
            f"block_table must have at least {batch_size} rows (one per request) and one column, "
            f"got shape {tuple(block_table.shape)}"
        )
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, shape=(batch_size,))
    check_int("block_size", block_size, low=1)
    check_int("max_model_len", max_model_len, low=1)
    check_tensor("out_clamped_positions", out_clamped_positions, dtypes=INDEX_DTYPES, shape=(batch_size,))
    check_tensor("out_slot_mapping", out_slot_mapping, dtypes=INDEX_DTYPES, ndim=1)
    check_int("input_batch_size", input_batch_size, low=batch_size)
    if out_slot_mapping.shape[0] < input_batch_size:
        raise ValueError(
            f"out_slot_mapping has {out_slot_mapping.shape[0]} rows, needs input_batch_size = {input_batch_size}"
        )
    check_same_device(
        positions_1d=positions_1d,
        block_table=block_table,
        seq_lens=seq_lens,
        out_clamped_positions=out_clamped_positions,
        out_slot_mapping=out_slot_mapping,
    )
    check_contiguous(
        positions_1d=positions_1d,
        seq_lens=seq_lens,
        out_clamped_positions=out_clamped_positions,
        out_slot_mapping=out_slot_mapping,
    )
    check_unit_last_stride(block_table=block_table)


def eagle_step_update_slot_mapping_and_metadata(
    positions_1d: torch.Tensor,  # [B] int32/int64, each request's current (last drafted) position
    block_table: torch.Tensor,  # [>= B, max_blocks] int32/int64, KV block ids per request
    seq_lens: torch.Tensor,  # [B] int32/int64, updated in place
    block_size: int,  # tokens per KV block
    max_model_len: int,
    out_clamped_positions: torch.Tensor,  # [B] int32/int64, written
    out_slot_mapping: torch.Tensor,  # [>= input_batch_size] int32/int64, written
    input_batch_size: Optional[int] = None,  # B plus CUDA-graph padding rows; default B
) -> None:
    """Move each request to its next position for one autoregressive draft step, in place.

    Row ``i < B``: ``p = positions_1d[i] + 1``. If ``p >= max_model_len`` the request has run out
    of room: clamped position 0, slot PAD (-1, no KV write), ``seq_lens[i] = 1``. Otherwise the
    clamped position is ``p``, the slot ``block_table[i, min(p // block_size, max_blocks - 1)]
    * block_size + p % block_size`` and ``seq_lens[i] = min(seq_lens[i] + 1, max_model_len)``.
    Padding rows ``B <= i < input_batch_size`` only get slot PAD.

    Example, ``block_size = 4``, ``max_model_len = 10``, ``block_table = [[7, 3, 5], [2, 8, 0]]``,
    ``positions_1d = [4, 9]``, ``seq_lens = [5, 10]``, ``input_batch_size = 3``
    -> ``out_clamped_positions = [5, 0]``, ``out_slot_mapping = [13, -1, -1]``, ``seq_lens = [6, 1]``.
    """
    batch_size = positions_1d.shape[0] if isinstance(positions_1d, torch.Tensor) else 0
    if input_batch_size is None:
        input_batch_size = batch_size
    _check_args(
        positions_1d,
        block_table,
        seq_lens,
        block_size,
        max_model_len,
        out_clamped_positions,
        out_slot_mapping,
        input_batch_size,
    )
    if not use_triton(positions_1d):
        reference.eagle_step_update_slot_mapping_and_metadata(
            positions_1d,
            block_table,
            seq_lens,
            block_size,
            max_model_len,
            out_clamped_positions,
            out_slot_mapping,
            input_batch_size,
        )
        return
    if input_batch_size == 0:
        return
    _eagle_step_slot_mapping_kernel[(triton.cdiv(input_batch_size, BLOCK_ROWS),)](
        positions_1d,
        block_table,
        seq_lens,
        out_clamped_positions,
        out_slot_mapping,
        block_table.stride(0),
        block_table.shape[1],
        batch_size,
        input_batch_size,
        block_size,
        max_model_len,
        BLOCK_ROWS=BLOCK_ROWS,
    )
