"""Inputs of a parallel-drafting forward pass: K drafts from one pass (contract: docs/kernels.md)."""

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_int,
    check_same_device,
    check_tensor,
)
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._layout_checks import check_contiguous, check_unit_last_stride
from mtp_ctrl.triton_ops._span_programs import programs_per_span

BLOCK_ROWS = 4
MAX_BLOCK_HIDDEN = 1024


@triton.jit
def _ptd_prepare_inputs_kernel(
    TARGET_TOKEN_IDS_PTR,
    TARGET_POSITIONS_PTR,
    TARGET_HIDDEN_PTR,
    TARGET_SLOT_MAPPING_PTR,
    NEXT_TOKEN_IDS_PTR,
    LAST_TOKEN_INDICES_PTR,
    IN_QUERY_START_LOC_PTR,
    OUT_QUERY_START_LOC_PTR,
    BLOCK_TABLE_PTR,
    MASK_HIDDEN_PTR,
    OUT_INPUT_IDS_PTR,
    OUT_POSITIONS_PTR,
    OUT_HIDDEN_PTR,
    OUT_SLOT_MAPPING_PTR,
    target_hidden_stride,
    block_table_stride,
    blocks_per_request,
    num_requests,
    num_input_rows,
    num_output_rows,
    hidden_size,
    block_size,
    max_model_len,
    mask_token_id,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
):
    """Grid ``(cdiv(T_out, BLOCK_ROWS), hidden programs)``: a tile of output rows per program.

    Each row finds its request by binary search over ``out_query_start_loc`` (``SEARCH_STEPS >=
    log2(R)`` halvings), once per program. Hidden program ``p`` of ``P`` copies hidden tiles
    ``p, p + P, ...`` of the rows; program 0 also writes their tokens, positions and slots.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
    in_output = rows < num_output_rows
    # request = the last r in [0, R) with out_query_start_loc[r] <= row
    low = tl.zeros([BLOCK_ROWS], dtype=tl.int64)
    high = tl.zeros([BLOCK_ROWS], dtype=tl.int64) + num_requests
    for _ in tl.static_range(SEARCH_STEPS):
        middle = (low + high) // 2
        bound = tl.load(OUT_QUERY_START_LOC_PTR + middle, mask=in_output, other=0).to(tl.int64)
        go_right = bound <= rows
        low = tl.where(go_right, middle, low)
        high = tl.where(go_right, high, middle)
    request = low
    first_row = tl.load(OUT_QUERY_START_LOC_PTR).to(tl.int64)
    end_row = tl.load(OUT_QUERY_START_LOC_PTR + num_requests).to(tl.int64)
    is_real = in_output & (rows >= first_row) & (rows < end_row)
    in_start = tl.load(IN_QUERY_START_LOC_PTR + request, mask=is_real, other=0).to(tl.int64)
    out_start = tl.load(OUT_QUERY_START_LOC_PTR + request, mask=is_real, other=0).to(tl.int64)
    last = tl.load(LAST_TOKEN_INDICES_PTR + request, mask=is_real, other=0).to(tl.int64) - in_start
    local = rows - out_start  # row index inside the request's output rows
    is_verified = is_real & (local <= last)
    source = in_start + local  # input row of a verified row
    is_source_row = is_verified & (source >= 0) & (source < num_input_rows)

    if tl.program_id(1) == 0:
        is_draft = is_real & (local > last)
        shifted = tl.load(TARGET_TOKEN_IDS_PTR + source + 1, mask=is_source_row & (local < last), other=0)
        next_token = tl.load(NEXT_TOKEN_IDS_PTR + request, mask=is_real, other=0)
        tokens = tl.where(local < last, shifted.to(tl.int64), next_token.to(tl.int64))
        tokens = tl.where(is_verified, tokens, mask_token_id)
        tl.store(OUT_INPUT_IDS_PTR + rows, tokens.to(OUT_INPUT_IDS_PTR.dtype.element_ty), mask=in_output)

        verified_position = tl.load(TARGET_POSITIONS_PTR + source, mask=is_source_row, other=0).to(tl.int64)
        last_position = tl.load(TARGET_POSITIONS_PTR + in_start + last, mask=is_draft, other=0).to(tl.int64)
        draft_position = last_position + local - last
        overflow = draft_position >= max_model_len
        draft_position = tl.where(overflow, 0, draft_position)
        positions = tl.where(is_verified, verified_position, tl.where(is_draft, draft_position, 0))
        tl.store(OUT_POSITIONS_PTR + rows, positions.to(OUT_POSITIONS_PTR.dtype.element_ty), mask=in_output)

        verified_slot = tl.load(TARGET_SLOT_MAPPING_PTR + source, mask=is_source_row, other=-1).to(tl.int64)
        block_index = tl.minimum(draft_position // block_size, blocks_per_request - 1)
        is_draft_slot = is_draft & ~overflow
        block_id = tl.load(
            BLOCK_TABLE_PTR + request * block_table_stride + block_index, mask=is_draft_slot, other=0
        ).to(tl.int64)
        draft_slot = block_id * block_size + draft_position % block_size
        slots = tl.where(is_verified, verified_slot, tl.where(is_draft_slot, draft_slot, -1))
        tl.store(OUT_SLOT_MAPPING_PTR + rows, slots.to(OUT_SLOT_MAPPING_PTR.dtype.element_ty), mask=in_output)

    hidden_tile = tl.arange(0, BLOCK_HIDDEN)  # [BLOCK_HIDDEN]
    first_column = tl.program_id(1) * BLOCK_HIDDEN
    column_stride = tl.num_programs(1) * BLOCK_HIDDEN
    for column_start in range(first_column, hidden_size, column_stride):
        columns = column_start + hidden_tile
        in_hidden = columns < hidden_size
        target_rows = tl.load(
            TARGET_HIDDEN_PTR + source[:, None] * target_hidden_stride + columns[None, :],
            mask=is_source_row[:, None] & in_hidden[None, :],
        )
        mask_row = tl.load(MASK_HIDDEN_PTR + columns, mask=in_hidden)
        hidden = tl.where(is_verified[:, None], target_rows, mask_row[None, :])
        tl.store(
            OUT_HIDDEN_PTR + rows[:, None] * hidden_size + columns[None, :],
            hidden,
            mask=in_output[:, None] & in_hidden[None, :],
        )


def _check_args(
    target_token_ids,
    target_positions,
    target_hidden,
    target_slot_mapping,
    next_token_ids,
    last_token_indices,
    in_query_start_loc,
    out_query_start_loc,
    block_table,
    block_size,
    max_model_len,
    mask_token_id,
    mask_hidden,
    num_output_rows,
):
    check_tensor("target_token_ids", target_token_ids, dtypes=INDEX_DTYPES, ndim=1)
    num_input_rows = target_token_ids.shape[0]
    check_tensor("target_positions", target_positions, dtypes=INDEX_DTYPES, shape=(num_input_rows,))
    check_tensor("target_hidden", target_hidden, dtypes=FLOAT_DTYPES, shape=(num_input_rows, None))
    hidden_size = target_hidden.shape[1]
    check_tensor("target_slot_mapping", target_slot_mapping, dtypes=INDEX_DTYPES, shape=(num_input_rows,))
    check_tensor("next_token_ids", next_token_ids, dtypes=INDEX_DTYPES, ndim=1)
    num_requests = next_token_ids.shape[0]
    check_tensor("last_token_indices", last_token_indices, dtypes=INDEX_DTYPES, shape=(num_requests,))
    check_tensor("in_query_start_loc", in_query_start_loc, dtypes=INDEX_DTYPES, shape=(num_requests + 1,))
    check_tensor("out_query_start_loc", out_query_start_loc, dtypes=INDEX_DTYPES, shape=(num_requests + 1,))
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    if block_table.shape[0] < num_requests or block_table.shape[1] < 1:
        raise ValueError(
            f"block_table must have at least {num_requests} rows (one per request) and one column, "
            f"got shape {tuple(block_table.shape)}"
        )
    check_int("block_size", block_size, low=1)
    check_int("max_model_len", max_model_len, low=1)
    check_int("mask_token_id", mask_token_id, low=0)
    check_tensor("mask_hidden", mask_hidden, dtypes=(target_hidden.dtype,), shape=(hidden_size,))
    check_int("num_output_rows", num_output_rows, low=0)
    tensors = dict(
        target_token_ids=target_token_ids,
        target_positions=target_positions,
        target_hidden=target_hidden,
        target_slot_mapping=target_slot_mapping,
        next_token_ids=next_token_ids,
        last_token_indices=last_token_indices,
        in_query_start_loc=in_query_start_loc,
        out_query_start_loc=out_query_start_loc,
        block_table=block_table,
        mask_hidden=mask_hidden,
    )
    check_same_device(**tensors)
    vectors = {name: tensors[name] for name in tensors if tensors[name].dim() == 1}
    check_contiguous(**vectors)
    check_unit_last_stride(target_hidden=target_hidden, block_table=block_table)


def ptd_prepare_inputs(
    target_token_ids: torch.Tensor,  # [T_in] int32/int64, tokens of the verified forward pass
    target_positions: torch.Tensor,  # [T_in] int32/int64
    target_hidden: torch.Tensor,  # [T_in, H] float, the target's hidden state per input row
    target_slot_mapping: torch.Tensor,  # [T_in] int32/int64, KV slot per input row
    next_token_ids: torch.Tensor,  # [R] int32/int64, token sampled after each request's last verified row
    last_token_indices: torch.Tensor,  # [R] int32/int64, input row of each request's last verified token
    in_query_start_loc: torch.Tensor,  # [R + 1] int32/int64, request r owns input rows [in[r], in[r + 1])
    out_query_start_loc: torch.Tensor,  # [R + 1] int32/int64, request r owns output rows [out[r], out[r + 1])
    block_table: torch.Tensor,  # [>= R, max_blocks] int32/int64, KV block ids per request
    block_size: int,  # tokens per KV block
    max_model_len: int,
    mask_token_id: int,  # token id of every draft row
    mask_hidden: torch.Tensor,  # [H], dtype of target_hidden, the learned hidden vector of draft rows
    num_output_rows: int,  # T_out >= out_query_start_loc[R]; rows past it are padding
):
    """Build the drafter's rows for parallel drafting: verified rows, then K - 1 draft rows.

    Request ``r`` has output rows ``out_start = out_query_start_loc[r]`` onwards; with
    ``in_start = in_query_start_loc[r]``, ``last = last_token_indices[r] - in_start`` and
    ``local = row - out_start``, a row is verified iff ``local <= last``. Verified rows shift the
    tokens left by one (``target_token_ids[in_start + local + 1]``, and ``next_token_ids[r]`` at
    ``local == last``) and copy position, slot and hidden state of input row ``in_start + local``.
    Draft rows get ``mask_token_id``, ``mask_hidden``, position ``last_position + local - last``
    and its slot from ``block_table``; a draft position ``>= max_model_len`` becomes position 0
    with slot PAD (-1). Rows past ``out_query_start_loc[R]`` (padding) are written like a draft
    row at position 0 with slot PAD, so they are valid inputs that write no KV. The caller sizes
    ``out_query_start_loc`` as ``cumsum(last - in_start + 1 + K - 1)``; each row finds its
    request by binary search, O(log R).

    Example, ``block_size = 8``, ``max_model_len = 23``, ``block_table = [[3, 5, 6], [7, 8, 2]]``,
    inputs ``[a0 a1 a2 | b0 b1]`` at positions ``[10 11 12 | 20 21]``, slots ``[40 41 42 | 60 61]``,
    hidden ``[h0 .. h4]``, ``last_token_indices = [1, 4]`` (row 2 was rejected), next tokens
    ``[A, B]``, ``in_query_start_loc = [0, 3, 5]``, ``out_query_start_loc = [0, 4, 8]``
    (``K - 1 = 2`` draft rows each), ``num_output_rows = 9``, mask token ``M``, mask hidden ``m``::

        input_ids    = [a1 A  M  M  | b1 B  M  M  | M ]
        positions    = [10 11 12 13 | 20 21 22 0  | 0 ]
        slot_mapping = [40 41 44 45 | 60 61 22 -1 | -1]
        hidden       = [h0 h1 m  m  | h3 h4 m  m  | m ]

    Returns ``(input_ids [T_out] (dtype of target_token_ids), positions [T_out] (dtype of
    target_positions), hidden [T_out, H] (dtype of target_hidden), slot_mapping [T_out] int64)``.
    """
    args = (
        target_token_ids,
        target_positions,
        target_hidden,
        target_slot_mapping,
        next_token_ids,
        last_token_indices,
        in_query_start_loc,
        out_query_start_loc,
        block_table,
        block_size,
        max_model_len,
        mask_token_id,
        mask_hidden,
        num_output_rows,
    )
    _check_args(*args)
    if not use_triton(target_token_ids):
        return reference.ptd_prepare_inputs(*args)

    device = target_token_ids.device
    num_requests = next_token_ids.shape[0]
    hidden_size = target_hidden.shape[1]
    input_ids = torch.empty(num_output_rows, dtype=target_token_ids.dtype, device=device)  # [T_out]
    positions = torch.empty(num_output_rows, dtype=target_positions.dtype, device=device)  # [T_out]
    hidden = torch.empty(num_output_rows, hidden_size, dtype=target_hidden.dtype, device=device)  # [T_out, H]
    slot_mapping = torch.empty(num_output_rows, dtype=torch.int64, device=device)  # [T_out]
    if num_output_rows > 0 and hidden_size > 0:
        block_hidden = min(triton.next_power_of_2(hidden_size), MAX_BLOCK_HIDDEN)
        num_row_tiles = triton.cdiv(num_output_rows, BLOCK_ROWS)
        grid = (num_row_tiles, programs_per_span(num_row_tiles, hidden_size, block_hidden))
        _ptd_prepare_inputs_kernel[grid](
            target_token_ids,
            target_positions,
            target_hidden,
            target_slot_mapping,
            next_token_ids,
            last_token_indices,
            in_query_start_loc,
            out_query_start_loc,
            block_table,
            mask_hidden,
            input_ids,
            positions,
            hidden,
            slot_mapping,
            target_hidden.stride(0),
            block_table.stride(0),
            block_table.shape[1],
            num_requests,
            target_token_ids.shape[0],
            num_output_rows,
            hidden_size,
            block_size,
            max_model_len,
            mask_token_id,
            SEARCH_STEPS=max(num_requests.bit_length(), 1),
            BLOCK_ROWS=BLOCK_ROWS,
            BLOCK_HIDDEN=block_hidden,
        )
    return input_ids, positions, hidden, slot_mapping
