"""The device half of a step's set-up in one launch (after the new block ids land): grow each
request's KV by its rows, and derive positions, KV slots, sequence lengths and decode tokens.

Letters: G requests in the step's (padded) grid, T packed rows, R table slots, MB blocks per
request, S drafts. Request r of the step holds table slot ``slot_ids[r]`` (its KV fields, block
row, next and draft tokens live there) and owns rows ``[qsl[r], qsl[r + 1])``; decode requests
come first, each with ``1 + s`` rows (its base token and ``s <= S`` drafts: ``1 + V`` each in a
strided step, ``1 + s_r`` in a ragged one; the rows come from ``query_start_loc``). Example, block size 4, S = 1, one decode request in slot 3 at KV
length 6 and one prefill chunk of 3 rows in slot 0 at KV length 0, slot_ids = [3, 0],
qsl = [0, 2, 5], T = 6 (one padding row): positions = [6, 7, 0, 1, 2, 0], the decode rows take
``next_tokens[3]`` and ``draft_tokens[3, 0]``, KV lengths of slots 3 and 0 become 8 and 3,
seq_lens [8, 3], block_table rows [block row 3, block row 0], the padding row's slot is -1.
"""

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import check_int, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._layout_checks import check_contiguous, check_unit_last_stride

BLOCK_ROWS = 64


@triton.jit
def _prepare_step_inputs_kernel(
    BLOCK_IDS_PTR, QUERY_START_LOC_PTR, SLOT_IDS_PTR, KV_LENGTHS_PTR, KV_BLOCK_COUNTS_PTR, LAST_OFFSET_PTR, LAST_BLOCK_ID_PTR,
    NEXT_TOKENS_PTR, DRAFT_TOKENS_PTR, NUM_DECODE_PTR, OUT_SEQ_LENS_PTR, OUT_POSITIONS_PTR, OUT_SLOTS_PTR,
    INPUT_IDS_PTR, OUT_BLOCK_TABLE_PTR, num_requests, num_rows, block_size, blocks_per_request, block_ids_stride,
    draft_stride, out_block_table_stride, BLOCK_ROWS: tl.constexpr,
):
    """Program ``r < G``: request r (its state at table slot ``slot_ids[r]``); program G: the
    padding rows past the last request."""
    r = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_ROWS)
    if r < num_requests:
        slot = tl.load(SLOT_IDS_PTR + r)
        query_start = tl.load(QUERY_START_LOC_PTR + r).to(tl.int64)
        query_end = tl.load(QUERY_START_LOC_PTR + r + 1).to(tl.int64)
        first = tl.load(KV_LENGTHS_PTR + slot)
        tl.debug_barrier()  # every thread has read the old length before one of them overwrites it
        length = first + query_end - query_start
        count = (length + block_size - 1) // block_size
        tl.store(KV_LENGTHS_PTR + slot, length)
        tl.store(KV_BLOCK_COUNTS_PTR + slot, count)
        tl.store(LAST_OFFSET_PTR + slot, ((length - 1) % block_size + block_size) % block_size)  # torch.remainder
        row_base = BLOCK_IDS_PTR + slot * block_ids_stride
        last_id = tl.load(row_base + tl.maximum(count - 1, 0))
        tl.store(LAST_BLOCK_ID_PTR + slot, tl.where(count > 0, last_id, -1))
        tl.store(OUT_SEQ_LENS_PTR + r, tl.where(query_end > query_start, length, 0).to(tl.int32))
        table_row = OUT_BLOCK_TABLE_PTR + r.to(tl.int64) * out_block_table_stride
        for column_start in range(0, blocks_per_request, BLOCK_ROWS):  # the step's block table row r
            columns = column_start + lanes
            in_row = columns < blocks_per_request
            tl.store(table_row + columns, tl.load(row_base + columns, mask=in_row, other=-1), mask=in_row)
        num_decode = tl.load(NUM_DECODE_PTR)
        for row_start in range(query_start, query_end, BLOCK_ROWS):
            rows = row_start + lanes
            in_request = rows < query_end
            positions = first + rows - query_start
            columns = tl.minimum(positions // block_size, blocks_per_request - 1)
            block_ids = tl.load(row_base + columns, mask=in_request, other=0)
            tl.store(OUT_POSITIONS_PTR + rows, positions, mask=in_request)
            tl.store(OUT_SLOTS_PTR + rows, block_ids * block_size + positions % block_size, mask=in_request)
            # a decode request's rows: the last verified token, then its drafts
            is_decode = in_request & (r + 0 * lanes < num_decode)  # a decode request's rows (from query_start_loc)
            in_row = rows - query_start
            base_token = tl.load(NEXT_TOKENS_PTR + slot + 0 * rows, mask=is_decode & (in_row == 0), other=0)
            draft = tl.load(DRAFT_TOKENS_PTR + slot * draft_stride + tl.maximum(in_row - 1, 0),
                            mask=is_decode & (in_row > 0), other=0)
            tl.store(INPUT_IDS_PTR + rows, tl.where(in_row == 0, base_token, draft), mask=is_decode)
    else:
        padding_start = tl.load(QUERY_START_LOC_PTR + num_requests).to(tl.int64)
        for row_start in range(padding_start, num_rows, BLOCK_ROWS):
            rows = row_start + lanes
            is_row = rows < num_rows
            tl.store(OUT_POSITIONS_PTR + rows, 0 * rows, mask=is_row)
            tl.store(OUT_SLOTS_PTR + rows, -1 + 0 * rows, mask=is_row)


def prepare_step_inputs(
    block_writes: torch.Tensor,  # [3, k] int64: table slot, column, block id (unused entries: the scratch slot)
    block_ids: torch.Tensor,  # [R + 1, MB] int64, the device block table by slot, with its scratch slot (updated)
    query_start_loc: torch.Tensor,  # [G + 1] int32, rows of each request
    slot_ids: torch.Tensor,  # [G] int64, each request's table slot (padding: the scratch slot)
    kv_length_offsets: torch.Tensor,  # [R + 1] int64 by slot, grown by each request's rows
    kv_block_counts: torch.Tensor,  # [R + 1] int64 by slot, written
    last_kv_block_offset: torch.Tensor,  # [R + 1] int64 by slot, written
    last_kv_block_id: torch.Tensor,  # [R + 1] int64 by slot, written
    next_tokens: torch.Tensor,  # [R + 1] int64 by slot, each request's last verified token
    draft_tokens: torch.Tensor,  # [R + 1, S] int64 by slot, each request's drafts
    num_decode: torch.Tensor,  # [1] int64, decode requests (the grid's first ones)
    block_size: int,
    out_seq_lens: torch.Tensor,  # [>= G] int32, written: KV length after the step, 0 without rows
    out_positions: torch.Tensor,  # [T] int64, written (0 on padding rows)
    out_slot_mapping: torch.Tensor,  # [T] int64, written (-1 on padding rows)
    input_ids: torch.Tensor,  # [T] int64, decode rows written; prefill and padding rows kept
    out_block_table: torch.Tensor,  # [>= G, MB] int64, written: row r = block row of slot_ids[r]
) -> None:
    """Apply the block writes, then for each request r in slot ``s = slot_ids[r]`` with ``q`` rows
    at KV length ``L``: KV length ``L + q`` (block count, last block offset and id follow, all at
    slot s), ``seq_lens[r] = L + q`` (0 when ``q == 0``), the step's ``out_block_table[r]`` = block
    row s, row i at position ``L + i`` with its KV slot from that block row; a decode request's
    rows take ``next_tokens[s]`` then ``draft_tokens[s, :]`` (module docstring: an example). Slot
    values are not checked (that needs a sync); padding requests may share the scratch slot."""
    check_tensor("block_writes", block_writes, dtypes=(torch.int64,), shape=(3, None))
    check_tensor("block_ids", block_ids, dtypes=(torch.int64,), ndim=2)
    check_tensor("query_start_loc", query_start_loc, dtypes=(torch.int32,), ndim=1)
    num_requests = query_start_loc.shape[0] - 1
    if num_requests < 0:
        raise ValueError("query_start_loc must have at least one entry")
    check_tensor("slot_ids", slot_ids, dtypes=(torch.int64,), shape=(num_requests,))
    num_slots = block_ids.shape[0]
    for name, tensor in (("kv_length_offsets", kv_length_offsets), ("kv_block_counts", kv_block_counts),
                         ("last_kv_block_offset", last_kv_block_offset), ("last_kv_block_id", last_kv_block_id),
                         ("next_tokens", next_tokens)):
        check_tensor(name, tensor, dtypes=(torch.int64,), shape=(num_slots,))
    check_tensor("draft_tokens", draft_tokens, dtypes=(torch.int64,), ndim=2)
    if draft_tokens.shape[0] != num_slots:
        raise ValueError(f"draft_tokens has {draft_tokens.shape[0]} rows, block_ids {num_slots} slots")
    check_tensor("out_block_table", out_block_table, dtypes=(torch.int64,), ndim=2)
    if out_block_table.shape[0] < num_requests or out_block_table.shape[1] != block_ids.shape[1]:
        raise ValueError(f"out_block_table has shape {tuple(out_block_table.shape)}, need [>= {num_requests}, "
                         f"{block_ids.shape[1]}]")
    check_tensor("num_decode", num_decode, dtypes=(torch.int64,), shape=(1,))
    check_int("block_size", block_size, low=1)
    check_tensor("out_seq_lens", out_seq_lens, dtypes=(torch.int32,), ndim=1)
    if out_seq_lens.shape[0] < num_requests:
        raise ValueError(f"out_seq_lens has {out_seq_lens.shape[0]} rows, the grid has {num_requests} requests")
    check_tensor("out_positions", out_positions, dtypes=(torch.int64,), ndim=1)
    num_rows = out_positions.shape[0]
    check_tensor("out_slot_mapping", out_slot_mapping, dtypes=(torch.int64,), shape=(num_rows,))
    check_tensor("input_ids", input_ids, dtypes=(torch.int64,), shape=(num_rows,))
    check_same_device(block_writes=block_writes, block_ids=block_ids, query_start_loc=query_start_loc,
                      slot_ids=slot_ids, out_block_table=out_block_table, kv_length_offsets=kv_length_offsets,
                      next_tokens=next_tokens, draft_tokens=draft_tokens,
                      num_decode=num_decode, out_seq_lens=out_seq_lens, out_positions=out_positions,
                      out_slot_mapping=out_slot_mapping, input_ids=input_ids)
    check_contiguous(query_start_loc=query_start_loc, slot_ids=slot_ids, kv_length_offsets=kv_length_offsets,
                     kv_block_counts=kv_block_counts, last_kv_block_offset=last_kv_block_offset,
                     last_kv_block_id=last_kv_block_id, next_tokens=next_tokens, out_seq_lens=out_seq_lens,
                     out_positions=out_positions, out_slot_mapping=out_slot_mapping, input_ids=input_ids)
    check_unit_last_stride(block_ids=block_ids, draft_tokens=draft_tokens, out_block_table=out_block_table)
    args = (block_writes, block_ids, query_start_loc, slot_ids, kv_length_offsets, kv_block_counts,
            last_kv_block_offset, last_kv_block_id, next_tokens, draft_tokens, num_decode, block_size, out_seq_lens,
            out_positions, out_slot_mapping, input_ids, out_block_table)
    if not use_triton(query_start_loc):
        reference.prepare_step_inputs(*args)
        return
    # the new blocks first: the kernel's programs read rows that other writes may touch
    block_ids.index_put_((block_writes[0], block_writes[1]), block_writes[2])
    _prepare_step_inputs_kernel[(num_requests + 1,)](
        block_ids, query_start_loc, slot_ids, kv_length_offsets, kv_block_counts, last_kv_block_offset,
        last_kv_block_id, next_tokens, draft_tokens, num_decode, out_seq_lens, out_positions, out_slot_mapping,
        input_ids, out_block_table, num_requests, num_rows, block_size, block_ids.shape[1], block_ids.stride(0),
        draft_tokens.stride(0), out_block_table.stride(0), BLOCK_ROWS=BLOCK_ROWS,
    )
