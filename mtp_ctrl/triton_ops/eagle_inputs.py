"""Expand the target model's packed rows into the drafter's input rows (contract: docs/kernels.md)."""

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import INDEX_DTYPES, check_int, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._layout_checks import check_bool, check_contiguous
from mtp_ctrl.triton_ops._span_programs import programs_per_span

BLOCK_ROWS = 128


@triton.jit
def _copy_and_expand_eagle_inputs_kernel(
    TARGET_TOKEN_IDS_PTR,
    TARGET_POSITIONS_PTR,
    NEXT_TOKEN_IDS_PTR,
    QUERY_START_LOC_PTR,
    QUERY_END_LOC_PTR,
    OUT_INPUT_IDS_PTR,
    OUT_POSITIONS_PTR,
    OUT_IS_REJECTED_PTR,
    OUT_IS_MASKED_PTR,
    OUT_NEW_TOKEN_INDICES_PTR,
    OUT_HIDDEN_STATE_MAPPING_PTR,
    num_requests,
    num_input_rows,
    num_output_rows,
    padding_token_id,
    parallel_drafting_token_id,
    num_padding_slots,
    INPUT_OFFSET: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """Grid ``(R + 1, programs per request)``.

    Program ``(r < R, p)`` writes row blocks ``p, p + P, ...`` of request ``r``'s output rows;
    program ``(R, p)`` writes the tail: output rows past the last request, which correspond to
    input rows past ``query_start_loc[R]`` (CUDA-graph padding) and become rejected rows.
    ``INPUT_OFFSET`` is 1 in shift mode (the first input row of a request is dropped), else 0.
    """
    request = tl.program_id(0)
    first_block = tl.program_id(1).to(tl.int64) * BLOCK_ROWS
    row_stride = tl.num_programs(1).to(tl.int64) * BLOCK_ROWS
    offsets = tl.arange(0, BLOCK_ROWS)
    rows_added = num_padding_slots - INPUT_OFFSET  # output rows minus input rows, per request
    if request < num_requests:
        in_start = tl.load(QUERY_START_LOC_PTR + request).to(tl.int64)
        in_next = tl.load(QUERY_START_LOC_PTR + request + 1).to(tl.int64)
        in_end = tl.load(QUERY_END_LOC_PTR + request).to(tl.int64)  # last valid (not rejected) input row
        out_start = in_start + request.to(tl.int64) * rows_added
        num_valid = in_end - in_start + 1 - INPUT_OFFSET
        num_out = in_next - in_start + rows_added
        first_position = tl.load(TARGET_POSITIONS_PTR + in_start).to(tl.int64)
        bonus_token = tl.load(NEXT_TOKEN_IDS_PTR + request).to(tl.int64)
        for block_start in range(first_block, num_out, row_stride):
            j = block_start + offsets  # [BLOCK_ROWS] row index inside the request's output rows
            in_bounds = j < num_out
            is_valid = j < num_valid
            is_bonus = j == num_valid
            is_masked = (j > num_valid) & (j < num_valid + num_padding_slots)
            is_rejected = j >= num_valid + num_padding_slots
            tokens = tl.load(
                TARGET_TOKEN_IDS_PTR + in_start + INPUT_OFFSET + j, mask=in_bounds & is_valid, other=0
            ).to(tl.int64)
            tokens = tl.where(is_bonus, bonus_token, tokens)
            tokens = tl.where(is_masked, parallel_drafting_token_id, tokens)
            tokens = tl.where(is_rejected, padding_token_id, tokens)
            positions = tl.where(is_rejected, 0, first_position + j)
            out_rows = out_start + j
            tl.store(OUT_INPUT_IDS_PTR + out_rows, tokens.to(OUT_INPUT_IDS_PTR.dtype.element_ty), mask=in_bounds)
            tl.store(OUT_POSITIONS_PTR + out_rows, positions.to(OUT_POSITIONS_PTR.dtype.element_ty), mask=in_bounds)
            tl.store(OUT_IS_REJECTED_PTR + out_rows, is_rejected, mask=in_bounds)
            tl.store(OUT_IS_MASKED_PTR + out_rows, is_masked, mask=in_bounds)
            is_new_token = in_bounds & (j >= num_valid) & (j < num_valid + num_padding_slots)
            new_token_slot = request * num_padding_slots + (j - num_valid)
            tl.store(OUT_NEW_TOKEN_INDICES_PTR + new_token_slot, out_rows, mask=is_new_token)
            if INPUT_OFFSET == 1:
                tl.store(OUT_HIDDEN_STATE_MAPPING_PTR + in_start + j, out_rows, mask=j < in_next - in_start)
    else:
        tail_in_start = tl.load(QUERY_START_LOC_PTR + num_requests).to(tl.int64)
        tail_out_start = tail_in_start + num_requests * rows_added
        for block_start in range(first_block, num_output_rows - tail_out_start, row_stride):
            j = block_start + offsets
            out_rows = tail_out_start + j
            in_bounds = out_rows < num_output_rows
            padding_tokens = (tl.zeros_like(j) + padding_token_id).to(OUT_INPUT_IDS_PTR.dtype.element_ty)
            tl.store(OUT_INPUT_IDS_PTR + out_rows, padding_tokens, mask=in_bounds)
            zero_positions = tl.zeros_like(j).to(OUT_POSITIONS_PTR.dtype.element_ty)
            tl.store(OUT_POSITIONS_PTR + out_rows, zero_positions, mask=in_bounds)
            tl.store(OUT_IS_REJECTED_PTR + out_rows, j >= 0, mask=in_bounds)
            tl.store(OUT_IS_MASKED_PTR + out_rows, j < 0, mask=in_bounds)
            if INPUT_OFFSET == 1:
                in_rows = tail_in_start + j
                tl.store(OUT_HIDDEN_STATE_MAPPING_PTR + in_rows, out_rows, mask=in_rows < num_input_rows)


def _check_args(
    target_token_ids,
    target_positions,
    next_token_ids,
    query_start_loc,
    query_end_loc,
    padding_token_id,
    parallel_drafting_token_id,
    num_padding_slots_per_request,
    shift_input_ids,
):
    check_tensor("target_token_ids", target_token_ids, dtypes=INDEX_DTYPES, ndim=1)
    num_input_rows = target_token_ids.shape[0]
    check_tensor("target_positions", target_positions, dtypes=INDEX_DTYPES, shape=(num_input_rows,))
    check_tensor("next_token_ids", next_token_ids, dtypes=INDEX_DTYPES, ndim=1)
    num_requests = next_token_ids.shape[0]
    check_tensor("query_start_loc", query_start_loc, dtypes=INDEX_DTYPES, shape=(num_requests + 1,))
    check_tensor("query_end_loc", query_end_loc, dtypes=INDEX_DTYPES, shape=(num_requests,))
    check_int("padding_token_id", padding_token_id, low=0)
    check_int("parallel_drafting_token_id", parallel_drafting_token_id, low=0)
    check_int("num_padding_slots_per_request", num_padding_slots_per_request, low=1)
    check_bool("shift_input_ids", shift_input_ids)
    check_same_device(
        target_token_ids=target_token_ids,
        target_positions=target_positions,
        next_token_ids=next_token_ids,
        query_start_loc=query_start_loc,
        query_end_loc=query_end_loc,
    )
    check_contiguous(
        target_token_ids=target_token_ids,
        target_positions=target_positions,
        next_token_ids=next_token_ids,
        query_start_loc=query_start_loc,
        query_end_loc=query_end_loc,
    )


def copy_and_expand_eagle_inputs(
    target_token_ids: torch.Tensor,  # [T_in] int32/int64, the target's packed input tokens
    target_positions: torch.Tensor,  # [T_in] int32/int64
    next_token_ids: torch.Tensor,  # [R] int32/int64, the bonus token sampled for each request
    query_start_loc: torch.Tensor,  # [R + 1] int32/int64, request r owns input rows [qsl[r], qsl[r + 1])
    query_end_loc: torch.Tensor,  # [R] int32/int64, last valid input row of each request
    padding_token_id: int,
    parallel_drafting_token_id: int,
    num_padding_slots_per_request: int,  # P >= 1: the bonus row plus P - 1 parallel-draft rows
    shift_input_ids: bool,
):
    """Lay out the drafter's input rows from the target's rows, one request after another.

    Request ``r`` reads input rows ``start = qsl[r]`` to ``next = qsl[r + 1]``, of which rows
    ``end + 1 .. next - 1`` (``end = query_end_loc[r]``) were rejected by verification. Its output
    rows start at ``out_start = start + r * (P - shift)`` and are, in order: the valid tokens
    (shift mode drops each request's first input token), the bonus token ``next_token_ids[r]``,
    ``P - 1`` parallel-draft rows (``parallel_drafting_token_id``) and one padding row per
    rejected input row (``padding_token_id``, position 0). Positions count up from the request's
    first input position. ``query_start_loc[0]`` must be 0 and ``start <= end < next``.

    Example, shift mode, ``P = 2``, two requests with input tokens ``[a0 a1 a2 | b0 b1 b2]``,
    positions ``[5 6 7 | 9 10 11]``, ``query_end_loc = [2, 4]`` (request 1's last row rejected),
    ``next_token_ids = [A, B]``, draft id ``D``, padding id ``0``::

        out_input_ids    = [a1 a2 A D | b1 B D 0]     out_positions = [5 6 7 8 | 9 10 11 0]
        is_rejected_mask = [0  0  0 0 | 0  0 0 1]     is_masked_mask = [0 0 0 1 | 0 0 1 0]
        new_token_indices = [2 3 5 6]                 hidden_state_mapping = [0 1 2 | 4 5 6]

    Returns ``(out_input_ids [T_out] (dtype of target_token_ids), out_positions [T_out] (dtype of
    target_positions), out_is_rejected_token_mask [T_out] bool, out_is_masked_token_mask [T_out]
    bool, out_new_token_indices [R * P] int64, out_hidden_state_mapping)`` with
    ``T_out = T_in + R * (P - shift)``. ``out_hidden_state_mapping`` is ``[T_in] int64`` in shift
    mode (input row ``k`` -> its output row, to scatter the target's hidden states) and ``None``
    otherwise. Input rows past ``query_start_loc[R]`` (CUDA-graph padding) map to the output
    rows past the last request, which are written as rejected rows. To pad the batch itself,
    append requests of one row each: they produce ``P`` harmless rows.
    """
    _check_args(
        target_token_ids,
        target_positions,
        next_token_ids,
        query_start_loc,
        query_end_loc,
        padding_token_id,
        parallel_drafting_token_id,
        num_padding_slots_per_request,
        shift_input_ids,
    )
    args = (
        target_token_ids,
        target_positions,
        next_token_ids,
        query_start_loc,
        query_end_loc,
        padding_token_id,
        parallel_drafting_token_id,
        num_padding_slots_per_request,
        shift_input_ids,
    )
    if not use_triton(target_token_ids):
        return reference.copy_and_expand_eagle_inputs(*args)

    device = target_token_ids.device
    num_requests = next_token_ids.shape[0]
    num_input_rows = target_token_ids.shape[0]
    slots = num_padding_slots_per_request
    input_offset = int(shift_input_ids)
    num_output_rows = num_input_rows + num_requests * (slots - input_offset)
    out_input_ids = torch.empty(num_output_rows, dtype=target_token_ids.dtype, device=device)  # [T_out]
    out_positions = torch.empty(num_output_rows, dtype=target_positions.dtype, device=device)  # [T_out]
    out_is_rejected = torch.empty(num_output_rows, dtype=torch.bool, device=device)  # [T_out]
    out_is_masked = torch.empty(num_output_rows, dtype=torch.bool, device=device)  # [T_out]
    out_new_token_indices = torch.empty(num_requests * slots, dtype=torch.int64, device=device)  # [R * P]
    out_hidden_state_mapping = (
        torch.empty(num_input_rows, dtype=torch.int64, device=device) if shift_input_ids else None
    )  # [T_in] int64 or None
    if num_output_rows > 0:
        programs = programs_per_span(num_requests + 1, num_input_rows + slots, BLOCK_ROWS)
        _copy_and_expand_eagle_inputs_kernel[(num_requests + 1, programs)](
            target_token_ids,
            target_positions,
            next_token_ids,
            query_start_loc,
            query_end_loc,
            out_input_ids,
            out_positions,
            out_is_rejected,
            out_is_masked,
            out_new_token_indices,
            out_hidden_state_mapping if shift_input_ids else out_new_token_indices,
            num_requests,
            num_input_rows,
            num_output_rows,
            padding_token_id,
            parallel_drafting_token_id,
            slots,
            INPUT_OFFSET=input_offset,
            BLOCK_ROWS=BLOCK_ROWS,
        )
    return (
        out_input_ids,
        out_positions,
        out_is_rejected,
        out_is_masked,
        out_new_token_indices,
        out_hidden_state_mapping,
    )
