"""The MTP proposer's per-step draft windows, as two kernels instead of ~90 small torch ops.

Letters: G requests in the step's (padded) grid, T packed rows of the step, Tm window rows (a
bound fixed by the step's shape), S drafts, H hidden size, R + 1 table rows (the last one is the
padding row), Lh token-history length.

In paged mode each MTP depth re-runs, every step, a per-request window of positions ``[w, e)``:
``e`` is the bonus token's position and ``w`` the first position whose entry was not final for
the deepest depth (see :mod:`mtp_ctrl.controllers.mtp_proposer`). :func:`mtp_draft_window` lays
those windows out and gathers their inputs; :func:`mtp_advance_window` then moves each request's
``w`` and keeps the decoder hidden states of its last ``K`` positions (the ring, ``K >= S``) for the
next step. They run as two launches because the second overwrites ring entries the first reads.
A step that skips the windows (no request drafts) only records its tokens and moves the ring
(``move_window_start=False``); the next windowed step's decode windows are wider (catch-up).

Window sizes: a decode request (``r < num_decode``) gets ``2S`` rows, the most its window spans
(``S + V`` when the step verifies V drafts per decode request: ``decode_window_rows``),
right-aligned so that its last row sits at ``e - 1`` (rows before ``w`` are masked: slot -1); a
request with a prompt chunk (``r < num_active``) gets ``first + q - w`` rows, where ``first`` is
the position of its first row this step and ``q`` its chunk length; ``w = 0`` for a prompt's
first chunk. Padding requests get none. Example, S = 2: a decode request with ``e = 12``,
``w = 9``, ``first = 10`` has window positions ``8, 9, 10, 11``; position 8 is masked, 9 takes its
hidden from the ring, 10 and 11 from this step's rows 0 and 1 of the request.
"""

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import INDEX_DTYPES, check_int, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._layout_checks import check_contiguous, check_unit_last_stride

BLOCK_ROWS = 32
BLOCK_HIDDEN = 128


@triton.jit
def _record_step_tokens(STEP_POSITIONS_PTR, STEP_IDS_PTR, NEXT_TOKENS_PTR, HISTORY_PTR, r, query_start, query_end,
                        end, table_row, samples, history_len, history_stride, padding_row, BLOCK_ROWS: tl.constexpr):
    """Request r's token record of one step (both kernels): the step's rows ``[query_start,
    query_end)`` at their positions, then its sampled token at ``end`` (the bonus wins where they
    meet); ``samples`` 0 or 1 (int64: the interpreter cannot mix a scalar condition into a block
    mask): a request that does not sample writes its bonus to ``padding_row``."""
    lanes = tl.arange(0, BLOCK_ROWS)
    bonus_position = tl.minimum(tl.maximum(end, 0), history_len - 1)
    for row_start in range(query_start, query_end, BLOCK_ROWS):
        rows = row_start + lanes
        in_request = rows < query_end
        positions = tl.load(STEP_POSITIONS_PTR + rows, mask=in_request, other=0).to(tl.int64)
        tokens = tl.load(STEP_IDS_PTR + rows, mask=in_request, other=0)
        meets_bonus = (positions + (1 - samples) * history_len) == bonus_position  # never when not sampling
        keep = in_request & (positions >= 0) & (positions < history_len) & ~meets_bonus
        tl.store(HISTORY_PTR + table_row * history_stride + positions, tokens, mask=keep)
    bonus_row = padding_row + samples * (table_row - padding_row)
    tl.store(HISTORY_PTR + bonus_row * history_stride + bonus_position, tl.load(NEXT_TOKENS_PTR + r))


@triton.jit
def _mtp_draft_window_kernel(
    QUERY_START_LOC_PTR, FIRST_PTR, ENDS_PTR, WRITE_ROWS_PTR, SAMPLES_PTR, NUM_DECODE_PTR, NUM_ACTIVE_PTR,
    STEP_POSITIONS_PTR, STEP_IDS_PTR, NEXT_TOKENS_PTR, STEP_HIDDEN_PTR, BLOCK_TABLE_PTR, WINDOW_STARTS_PTR,
    HISTORY_PTR, RING_PTR,
    OUT_WQSL_PTR, OUT_POSITIONS_PTR, OUT_SLOTS_PTR, OUT_HISTORY_ROWS_PTR, OUT_HIDDEN_PTR,
    num_requests, num_step_rows, num_window_rows, hidden_size, history_len, blocks_per_request, block_size,
    padding_row, step_hidden_stride, block_table_stride, history_stride, ring_stride_row, ring_stride_slot,
    out_hidden_stride, decode_window_rows, ring_slots,
    S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_HIDDEN: tl.constexpr,
):
    """Program ``r < G``: request r's token record and window rows; program G: the padding rows
    past every window."""
    r = tl.program_id(0)
    # every request's window size, for this program's offset (G is small: each program sums them)
    requests = tl.arange(0, BLOCK_G)
    is_request = requests < num_requests
    starts_all = tl.load(QUERY_START_LOC_PTR + requests, mask=is_request, other=0).to(tl.int64)
    ends_all = tl.load(QUERY_START_LOC_PTR + requests + 1, mask=is_request, other=0).to(tl.int64)
    first_all = tl.load(FIRST_PTR + requests, mask=is_request, other=0)
    rows_all = tl.load(WRITE_ROWS_PTR + requests, mask=is_request, other=0)
    stored_w = tl.load(WINDOW_STARTS_PTR + rows_all, mask=is_request, other=0)
    w_all = tl.where(first_all == 0, 0, stored_w)
    num_decode = tl.load(NUM_DECODE_PTR)
    num_active = tl.load(NUM_ACTIVE_PTR)
    sizes = tl.where(requests < num_decode, decode_window_rows,
                     tl.where(requests < num_active, first_all + ends_all - starts_all - w_all, 0))
    sizes = tl.where(is_request, sizes, 0)
    total = tl.sum(sizes, axis=0)
    lanes = tl.arange(0, BLOCK_ROWS)
    columns = tl.arange(0, BLOCK_HIDDEN)
    if r < num_requests:
        window_offset = tl.sum(tl.where(requests < r, sizes, 0), axis=0)
        size = tl.sum(tl.where(requests == r, sizes, 0), axis=0)
        w = tl.sum(tl.where(requests == r, w_all, 0), axis=0)
        query_start = tl.load(QUERY_START_LOC_PTR + r).to(tl.int64)
        query_end = tl.load(QUERY_START_LOC_PTR + r + 1).to(tl.int64)
        first = tl.load(FIRST_PTR + r)
        end = tl.load(ENDS_PTR + r)
        table_row = tl.load(WRITE_ROWS_PTR + r)
        samples = tl.load(SAMPLES_PTR + r).to(tl.int64)  # 0 or 1
        # 1. this step's tokens in the request's record
        _record_step_tokens(STEP_POSITIONS_PTR, STEP_IDS_PTR, NEXT_TOKENS_PTR, HISTORY_PTR, r, query_start, query_end,
                            end, table_row, samples, history_len, history_stride, padding_row, BLOCK_ROWS)
        # 2. its window rows
        for local_start in range(0, size, BLOCK_ROWS):
            local = local_start + lanes
            window_rows = window_offset + local
            in_window = (local < size) & (window_rows < num_window_rows)
            positions = end - 1 - (size - 1 - local)
            valid = positions >= w
            safe_positions = tl.maximum(positions, 0)
            block_index = tl.minimum(safe_positions // block_size, blocks_per_request - 1)
            block_ids = tl.load(BLOCK_TABLE_PTR + r.to(tl.int64) * block_table_stride + block_index,
                                mask=in_window & valid, other=0).to(tl.int64)
            slots = tl.where(valid, block_ids * block_size + safe_positions % block_size, -1)
            tl.store(OUT_POSITIONS_PTR + window_rows, positions, mask=in_window)
            tl.store(OUT_SLOTS_PTR + window_rows, slots, mask=in_window)
            tl.store(OUT_HISTORY_ROWS_PTR + window_rows, table_row + 0 * local, mask=in_window)
            from_step = positions >= first
            step_rows = tl.minimum(tl.maximum(query_start + positions - first, 0), tl.maximum(num_step_rows - 1, 0))
            ring_index = safe_positions % ring_slots
            for column_start in range(0, hidden_size, BLOCK_HIDDEN):
                cols = column_start + columns
                col_ok = cols < hidden_size
                step_mask = (in_window & from_step)[:, None] & col_ok[None, :]
                ring_mask = (in_window & ~from_step)[:, None] & col_ok[None, :]
                from_rows = tl.load(STEP_HIDDEN_PTR + step_rows[:, None] * step_hidden_stride + cols[None, :],
                                    mask=step_mask, other=0.0)
                from_ring = tl.load(RING_PTR + table_row * ring_stride_row + ring_index[:, None] * ring_stride_slot
                                    + cols[None, :], mask=ring_mask, other=0.0)
                values = tl.where(from_step[:, None], from_rows, from_ring)
                tl.store(OUT_HIDDEN_PTR + window_rows[:, None] * out_hidden_stride + cols[None, :],
                         values.to(OUT_HIDDEN_PTR.dtype.element_ty), mask=in_window[:, None] & col_ok[None, :])
        tl.store(OUT_WQSL_PTR + r + 1, window_offset + size)
    else:  # rows past every window: padding (no KV write, hidden 0)
        tl.store(OUT_WQSL_PTR, total * 0)
        for row_start in range(total, num_window_rows, BLOCK_ROWS):
            window_rows = row_start + lanes
            is_row = window_rows < num_window_rows
            tl.store(OUT_POSITIONS_PTR + window_rows, -1 + 0 * window_rows, mask=is_row)
            tl.store(OUT_SLOTS_PTR + window_rows, -1 + 0 * window_rows, mask=is_row)
            tl.store(OUT_HISTORY_ROWS_PTR + window_rows, padding_row + 0 * window_rows, mask=is_row)
            for column_start in range(0, hidden_size, BLOCK_HIDDEN):
                cols = column_start + columns
                zeros = tl.zeros((BLOCK_ROWS, BLOCK_HIDDEN), dtype=OUT_HIDDEN_PTR.dtype.element_ty)
                tl.store(OUT_HIDDEN_PTR + window_rows[:, None] * out_hidden_stride + cols[None, :], zeros,
                         mask=is_row[:, None] & (cols < hidden_size)[None, :])


@triton.jit
def _mtp_advance_window_kernel(
    FIRST_PTR, ENDS_PTR, WRITE_ROWS_PTR, SAMPLES_PTR, QUERY_START_LOC_PTR, STEP_HIDDEN_PTR, WINDOW_STARTS_PTR,
    RING_PTR, STEP_POSITIONS_PTR, STEP_IDS_PTR, NEXT_TOKENS_PTR, HISTORY_PTR,
    num_step_rows, hidden_size, step_hidden_stride, ring_stride_row, ring_stride_slot, ring_slots,
    history_len, history_stride, padding_row,
    S: tl.constexpr, MOVE_WINDOW_START: tl.constexpr, RECORD_TOKENS: tl.constexpr, BLOCK_RING: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_HIDDEN: tl.constexpr,
):
    """Program r: request r's next window start and the ring of its last K positions' hidden;
    with RECORD_TOKENS first its token record (``_record_step_tokens``, as ``_mtp_draft_window_kernel``'s
    part 1: a step that runs no window needs nothing else of that kernel)."""
    r = tl.program_id(0)
    first = tl.load(FIRST_PTR + r)
    end = tl.load(ENDS_PTR + r)
    table_row = tl.load(WRITE_ROWS_PTR + r)
    samples = (tl.load(SAMPLES_PTR + r) != 0).to(tl.int64)
    query_start = tl.load(QUERY_START_LOC_PTR + r).to(tl.int64)
    if RECORD_TOKENS:
        query_end = tl.load(QUERY_START_LOC_PTR + r + 1).to(tl.int64)
        _record_step_tokens(STEP_POSITIONS_PTR, STEP_IDS_PTR, NEXT_TOKENS_PTR, HISTORY_PTR, r, query_start, query_end,
                            end, table_row, samples, history_len, history_stride, padding_row, BLOCK_ROWS)
    if MOVE_WINDOW_START:
        tl.store(WINDOW_STARTS_PTR + table_row, tl.maximum(tl.minimum(end, end + samples - S), 0))
    offsets = tl.arange(0, BLOCK_RING)
    positions = end - ring_slots + offsets
    valid = (offsets < ring_slots) & (positions >= first) & (positions >= 0)
    step_rows = tl.minimum(tl.maximum(query_start + positions - first, 0), tl.maximum(num_step_rows - 1, 0))
    slots = tl.maximum(positions, 0) % ring_slots
    columns = tl.arange(0, BLOCK_HIDDEN)
    for column_start in range(0, hidden_size, BLOCK_HIDDEN):
        cols = column_start + columns
        mask = valid[:, None] & (cols < hidden_size)[None, :]
        values = tl.load(STEP_HIDDEN_PTR + step_rows[:, None] * step_hidden_stride + cols[None, :], mask=mask)
        tl.store(RING_PTR + table_row * ring_stride_row + slots[:, None] * ring_stride_slot + cols[None, :],
                 values.to(RING_PTR.dtype.element_ty), mask=mask)


class TokenRecord(NamedTuple):
    """What :func:`mtp_advance_window` needs to record a step's tokens (``mtp_draft_window``'s
    arguments of the same names)."""

    step_positions: torch.Tensor  # [T] int64, positions of the step's rows
    step_input_ids: torch.Tensor  # [T] int64, tokens of the step's rows
    next_tokens: torch.Tensor  # [>= G] int64, each request's bonus token
    token_history: torch.Tensor  # [R + 1, Lh] int64, written: tokens by position
    padding_row: int  # the table row that takes the bonus writes of requests that did not sample


def _check_record(record, num_requests: int, num_rows: int, window_starts, first_positions) -> None:
    if not isinstance(record, TokenRecord):
        raise TypeError(f"record must be a TokenRecord, got {type(record).__name__}")
    check_tensor("step_positions", record.step_positions, dtypes=(torch.int64,), shape=(num_rows,))
    check_tensor("step_input_ids", record.step_input_ids, dtypes=(torch.int64,), shape=(num_rows,))
    check_tensor("next_tokens", record.next_tokens, dtypes=(torch.int64,), ndim=1)
    if record.next_tokens.shape[0] < num_requests:
        raise ValueError(f"next_tokens needs at least {num_requests} rows, got {record.next_tokens.shape[0]}")
    check_tensor("token_history", record.token_history, dtypes=(torch.int64,), shape=(window_starts.shape[0], None))
    check_int("padding_row", record.padding_row, low=0, high=window_starts.shape[0] - 1)
    check_same_device(first_positions=first_positions, step_positions=record.step_positions,
                      step_input_ids=record.step_input_ids, next_tokens=record.next_tokens,
                      token_history=record.token_history)
    check_contiguous(step_positions=record.step_positions, step_input_ids=record.step_input_ids,
                     next_tokens=record.next_tokens, token_history=record.token_history)


def _check_common(first_positions, bonus_positions, write_rows, samples, query_start_loc, step_hidden,
                  window_starts, hidden_ring, num_speculative_tokens):
    check_tensor("first_positions", first_positions, dtypes=(torch.int64,), ndim=1)
    num_requests = first_positions.shape[0]
    check_tensor("bonus_positions", bonus_positions, dtypes=(torch.int64,), shape=(num_requests,))
    check_tensor("write_rows", write_rows, dtypes=(torch.int64,), shape=(num_requests,))
    check_tensor("samples", samples, dtypes=(torch.bool,), shape=(num_requests,))
    check_tensor("query_start_loc", query_start_loc, dtypes=INDEX_DTYPES, shape=(num_requests + 1,))
    check_tensor("step_hidden", step_hidden, ndim=2)
    check_tensor("window_starts", window_starts, dtypes=(torch.int64,), ndim=1)
    S = check_int("num_speculative_tokens", num_speculative_tokens, low=1)
    check_tensor("hidden_ring", hidden_ring, shape=(window_starts.shape[0], None, step_hidden.shape[1]))
    if hidden_ring.shape[1] < S:
        raise ValueError(f"hidden_ring needs at least num_speculative_tokens ({S}) slots a row, got {hidden_ring.shape[1]}")
    check_same_device(first_positions=first_positions, bonus_positions=bonus_positions, write_rows=write_rows,
                      samples=samples, query_start_loc=query_start_loc, step_hidden=step_hidden,
                      window_starts=window_starts, hidden_ring=hidden_ring)
    check_contiguous(first_positions=first_positions, bonus_positions=bonus_positions, write_rows=write_rows,
                     samples=samples, query_start_loc=query_start_loc, window_starts=window_starts)
    check_unit_last_stride(step_hidden=step_hidden, hidden_ring=hidden_ring)
    return num_requests


def mtp_draft_window(
    query_start_loc: torch.Tensor,  # [G + 1] int32/int64, the step's packed rows of each request
    first_positions: torch.Tensor,  # [G] int64, position of each request's first row this step
    bonus_positions: torch.Tensor,  # [G] int64, e: the bonus token's position
    write_rows: torch.Tensor,  # [G] int64, each request's table row (the padding row for padding requests)
    samples: torch.Tensor,  # [G] bool, the request sampled a token this step (decode or final chunk)
    num_decode: torch.Tensor,  # [1] int64, decode requests (rows [0, num_decode))
    num_active: torch.Tensor,  # [1] int64, real requests (rows [0, num_active))
    step_positions: torch.Tensor,  # [T] int64, positions of the step's rows
    step_input_ids: torch.Tensor,  # [T] int64, tokens of the step's rows
    next_tokens: torch.Tensor,  # [>= G] int64, each request's bonus token
    step_hidden: torch.Tensor,  # [T, H], the decoder's output rows
    block_table: torch.Tensor,  # [>= G, MB] int32/int64, KV blocks of each request
    window_starts: torch.Tensor,  # [R + 1] int64, read: each table row's w
    token_history: torch.Tensor,  # [R + 1, Lh] int64, written: tokens by position
    hidden_ring: torch.Tensor,  # [R + 1, K, H], K >= S, read: decoder hidden of the last K positions (p at p % K)
    num_speculative_tokens: int,
    block_size: int,  # tokens per KV block
    padding_row: int,  # the table row that takes writes of padding requests
    out_window_query_start_loc: torch.Tensor,  # [G + 1] int32/int64, written: window rows per request
    out_positions: torch.Tensor,  # [Tm] int64, written: window row positions (-1: padding row)
    out_slot_mapping: torch.Tensor,  # [Tm] int64, written: KV slots (-1: masked, no write)
    out_history_rows: torch.Tensor,  # [Tm] int64, written: table row of each window row
    out_hidden: torch.Tensor,  # [Tm, H], written: depth 0's input hidden (0 on padding rows)
    decode_window_rows: Optional[int] = None,  # rows of each decode request's window (default 2S)
) -> None:
    """Record the step's verified tokens and lay out every request's draft window (module docstring).

    ``decode_window_rows``: a decode request's window size, ``2S`` by default (the most a window
    spans); a step whose decode requests verify V drafts each needs only ``S + V`` (w is at most
    ``S - 1`` positions before the step's first row, e at most ``1 + V`` after it); a catch-up step
    after skipped windows (w left up to ``m`` more positions behind) ``S + V + m``, at most
    ``S + K`` (the ring must hold every position in ``[w, first)``).

    Token history: each of the step's rows writes its token at its position in its request's row,
    then each request writes its bonus token at ``e`` (clamped to ``[0, Lh)``) in its row if it
    ``samples``, else in ``padding_row``. Window rows ``[wqsl[r], wqsl[r + 1])`` of request r hold
    positions ``e - size .. e - 1``; a row is masked (slot -1) when its position is below ``w``. Its
    hidden comes from the step's row at that position when the position is ``>= first``, else from
    ``hidden_ring[row, position % K]``. Rows past the last window are padding. Tm must hold every
    window (the caller's bound).
    """
    num_requests = _check_common(first_positions, bonus_positions, write_rows, samples, query_start_loc,
                                 step_hidden, window_starts, hidden_ring, num_speculative_tokens)
    num_rows = step_hidden.shape[0]
    check_tensor("num_decode", num_decode, dtypes=(torch.int64,), shape=(1,))
    check_tensor("num_active", num_active, dtypes=(torch.int64,), shape=(1,))
    check_tensor("step_positions", step_positions, dtypes=(torch.int64,), shape=(num_rows,))
    check_tensor("step_input_ids", step_input_ids, dtypes=(torch.int64,), shape=(num_rows,))
    check_tensor("next_tokens", next_tokens, dtypes=(torch.int64,), ndim=1)
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    check_tensor("token_history", token_history, dtypes=(torch.int64,), shape=(window_starts.shape[0], None))
    check_tensor("out_window_query_start_loc", out_window_query_start_loc, dtypes=INDEX_DTYPES,
                 shape=(num_requests + 1,))
    check_tensor("out_positions", out_positions, dtypes=(torch.int64,), ndim=1)
    num_window_rows = out_positions.shape[0]
    for name, tensor in (("out_slot_mapping", out_slot_mapping), ("out_history_rows", out_history_rows)):
        check_tensor(name, tensor, dtypes=(torch.int64,), shape=(num_window_rows,))
    check_tensor("out_hidden", out_hidden, dtypes=(step_hidden.dtype,), shape=(num_window_rows, step_hidden.shape[1]))
    if next_tokens.shape[0] < num_requests or block_table.shape[0] < num_requests:
        raise ValueError(f"next_tokens and block_table need at least {num_requests} rows, got "
                         f"{next_tokens.shape[0]} and {block_table.shape[0]}")
    check_int("block_size", block_size, low=1)
    check_int("padding_row", padding_row, low=0, high=window_starts.shape[0] - 1)
    check_same_device(first_positions=first_positions, num_decode=num_decode, num_active=num_active,
                      step_positions=step_positions, step_input_ids=step_input_ids, next_tokens=next_tokens,
                      block_table=block_table, token_history=token_history, out_positions=out_positions,
                      out_window_query_start_loc=out_window_query_start_loc, out_slot_mapping=out_slot_mapping,
                      out_history_rows=out_history_rows, out_hidden=out_hidden)
    check_contiguous(step_positions=step_positions, step_input_ids=step_input_ids, next_tokens=next_tokens,
                     token_history=token_history, out_window_query_start_loc=out_window_query_start_loc,
                     out_positions=out_positions, out_slot_mapping=out_slot_mapping,
                     out_history_rows=out_history_rows, out_hidden=out_hidden)
    check_unit_last_stride(block_table=block_table)
    if decode_window_rows is None:
        decode_window_rows = 2 * num_speculative_tokens
    check_int("decode_window_rows", decode_window_rows, low=num_speculative_tokens,
              high=num_speculative_tokens + hidden_ring.shape[1])
    args = (query_start_loc, first_positions, bonus_positions, write_rows, samples, num_decode, num_active,
            step_positions, step_input_ids, next_tokens, step_hidden, block_table, window_starts, token_history,
            hidden_ring, num_speculative_tokens, block_size, padding_row, out_window_query_start_loc,
            out_positions, out_slot_mapping, out_history_rows, out_hidden, decode_window_rows)
    if not use_triton(first_positions):
        reference.mtp_draft_window(*args)
        return
    _mtp_draft_window_kernel[(num_requests + 1,)](
        query_start_loc, first_positions, bonus_positions, write_rows, samples, num_decode, num_active,
        step_positions, step_input_ids, next_tokens, step_hidden, block_table, window_starts, token_history,
        hidden_ring, out_window_query_start_loc, out_positions, out_slot_mapping, out_history_rows, out_hidden,
        num_requests, num_rows, num_window_rows, step_hidden.shape[1], token_history.shape[1], block_table.shape[1],
        block_size, padding_row, step_hidden.stride(0), block_table.stride(0), token_history.stride(0),
        hidden_ring.stride(0), hidden_ring.stride(1), out_hidden.stride(0), decode_window_rows, hidden_ring.shape[1],
        S=num_speculative_tokens, BLOCK_G=triton.next_power_of_2(max(num_requests, 1)), BLOCK_ROWS=BLOCK_ROWS,
        BLOCK_HIDDEN=min(BLOCK_HIDDEN, triton.next_power_of_2(step_hidden.shape[1])),
    )


def mtp_advance_window(
    first_positions: torch.Tensor,  # [G] int64
    bonus_positions: torch.Tensor,  # [G] int64, e
    write_rows: torch.Tensor,  # [G] int64, table rows (the padding row for padding requests)
    samples: torch.Tensor,  # [G] bool
    query_start_loc: torch.Tensor,  # [G + 1] int32/int64, the step's packed rows of each request
    step_hidden: torch.Tensor,  # [T, H], the decoder's output rows
    window_starts: torch.Tensor,  # [R + 1] int64, written: the next step's w (unless not move_window_start)
    hidden_ring: torch.Tensor,  # [R + 1, K, H], K >= S, written: hidden of the last K positions (p at p % K)
    num_speculative_tokens: int,
    move_window_start: bool = True,
    record: Optional[TokenRecord] = None,
) -> None:
    """After drafting: ``w = max(0, min(e, e + samples - S))`` (the tokens known at ``e`` are the
    verified ones plus the bonus of a request that sampled), and for each position ``p`` in
    ``[e - K, e)`` with ``p >= max(first, 0)``: ``hidden_ring[row, p % K] = step_hidden[row of p]``.
    ``move_window_start=False`` (a step that skipped the windows): w stays where the depths' caches
    stopped being final, only the ring moves on (the next windowed step catches up from w).
    ``record`` (:class:`TokenRecord`): also record the step's tokens as :func:`mtp_draft_window`
    does (its token history paragraph), in the same launch: a step that runs no window."""
    num_requests = _check_common(first_positions, bonus_positions, write_rows, samples, query_start_loc,
                                 step_hidden, window_starts, hidden_ring, num_speculative_tokens)
    if not isinstance(move_window_start, bool):
        raise TypeError(f"move_window_start must be a bool, got {type(move_window_start).__name__}")
    if record is not None:
        _check_record(record, num_requests, step_hidden.shape[0], window_starts, first_positions)
    if not use_triton(first_positions):
        reference.mtp_advance_window(first_positions, bonus_positions, write_rows, samples, query_start_loc,
                                     step_hidden, window_starts, hidden_ring, num_speculative_tokens,
                                     move_window_start, record)
        return
    if num_requests == 0:
        return
    history = record.token_history if record is not None else window_starts  # unread without RECORD_TOKENS
    _mtp_advance_window_kernel[(num_requests,)](
        first_positions, bonus_positions, write_rows, samples, query_start_loc, step_hidden, window_starts,
        hidden_ring, *((record.step_positions, record.step_input_ids, record.next_tokens, history) if record
                       else (window_starts,) * 4),
        step_hidden.shape[0], step_hidden.shape[1], step_hidden.stride(0), hidden_ring.stride(0),
        hidden_ring.stride(1), hidden_ring.shape[1], history.shape[-1], history.stride(0),
        record.padding_row if record else 0, S=num_speculative_tokens, MOVE_WINDOW_START=move_window_start,
        RECORD_TOKENS=record is not None, BLOCK_RING=triton.next_power_of_2(hidden_ring.shape[1]),
        BLOCK_ROWS=BLOCK_ROWS, BLOCK_HIDDEN=min(BLOCK_HIDDEN, triton.next_power_of_2(step_hidden.shape[1])),
    )
