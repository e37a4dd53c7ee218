"""Per-row and per-request indices of a controller step, one launch each (were ~20 torch ops).

Letters: G requests in the step's (padded) grid, K logits rows (``G * (1 + S)``: decode requests'
``1 + S`` rows first, then one row per other request), T packed rows, S drafts. Counts that only
the device knows in a replayed graph come as ``[1]`` or ``[3]`` int64 tensors.

Request r of the step holds table slot ``slot_ids[r]`` (padding requests: the scratch slot);
per-request state (sampling parameters, a proposer's rows) is indexed by slot.

Example, S = 1, G = 3, two decode requests, one final prefill chunk, slot_ids = [4, 0, 2]:
logits rows 0-3 belong to requests 0, 0, 1, 1, row 4 to request 2, row 5 (unused) is clamped to
request 2, so their slots are [4, 4, 0, 0, 2, 2].
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import check_int, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._layout_checks import check_contiguous

BLOCK = 128


@triton.jit
def _logits_row_requests_kernel(LOGITS_INDICES_PTR, POSITIONS_PTR, NUM_DECODE_PTR, SLOT_IDS_PTR, OUT_SLOTS_PTR,
                                OUT_POSITIONS_PTR, num_rows, num_requests, STRIDE: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    is_row = rows < num_rows
    num_decode = tl.load(NUM_DECODE_PTR + 0 * rows)
    decode_rows = num_decode * STRIDE
    requests = tl.where(rows < decode_rows, rows // STRIDE, rows - decode_rows + num_decode)
    requests = tl.minimum(requests, num_requests - 1)
    tl.store(OUT_SLOTS_PTR + rows, tl.load(SLOT_IDS_PTR + requests, mask=is_row, other=0), mask=is_row)
    packed_rows = tl.load(LOGITS_INDICES_PTR + rows, mask=is_row, other=0)
    tl.store(OUT_POSITIONS_PTR + rows, tl.load(POSITIONS_PTR + packed_rows, mask=is_row, other=0) + 1, mask=is_row)


@triton.jit
def _draft_batch_rows_kernel(QUERY_START_LOC_PTR, SEQ_LENS_PTR, ACCEPTED_PTR, COUNTS_PTR, SLOT_IDS_PTR, OUT_WRITE_ROWS_PTR,
                             OUT_SAMPLES_PTR, OUT_FIRST_PTR, OUT_BONUS_PTR, DRAFT_LENGTHS_PTR, OUT_LENGTH_ROWS_PTR,
                             num_requests, padding_row, S: tl.constexpr, WRITE_LENGTHS: tl.constexpr,
                             BLOCK: tl.constexpr):
    requests = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    is_request = requests < num_requests
    num_active = tl.load(COUNTS_PTR + 0 * requests)
    num_decode = tl.load(COUNTS_PTR + 1 + 0 * requests)
    num_sampling = tl.load(COUNTS_PTR + 2 + 0 * requests)
    query_lengths = (tl.load(QUERY_START_LOC_PTR + requests + 1, mask=is_request, other=0)
                     - tl.load(QUERY_START_LOC_PTR + requests, mask=is_request, other=0)).to(tl.int64)
    seq_lens = tl.load(SEQ_LENS_PTR + requests, mask=is_request, other=0).to(tl.int64)
    accepted = tl.load(ACCEPTED_PTR + requests, mask=is_request, other=0)
    # a decode request ran 1 + s_r rows (its drafts; s_r = S in a strided step): the rejected ones rewind
    rewinds = tl.where(requests < num_decode, query_lengths - 1 - accepted, 0)
    slots = tl.load(SLOT_IDS_PTR + requests, mask=is_request, other=0)
    write_rows = tl.where(requests < num_active, slots, padding_row).to(tl.int64)
    tl.store(OUT_WRITE_ROWS_PTR + requests, write_rows, mask=is_request)
    tl.store(OUT_SAMPLES_PTR + requests, requests < num_sampling, mask=is_request)
    if WRITE_LENGTHS:  # each sampling request's draft length at its table row
        sampling = is_request & (requests < num_sampling)
        tl.store(OUT_LENGTH_ROWS_PTR + write_rows, tl.load(DRAFT_LENGTHS_PTR + requests, mask=sampling, other=0),
                 mask=sampling)
    tl.store(OUT_FIRST_PTR + requests, seq_lens - query_lengths, mask=is_request)
    tl.store(OUT_BONUS_PTR + requests, seq_lens - rewinds, mask=is_request)


def logits_row_requests(
    logits_indices: torch.Tensor,  # [K] int64, packed row of each logits row
    positions: torch.Tensor,  # [T] int64, position of each packed row
    num_decode: torch.Tensor,  # [1] int64, decode requests (the grid's first ones)
    num_speculative_tokens: int,
    num_requests: int,  # G
    slot_ids: torch.Tensor,  # [G] int64, each request's table slot
    out_row_slots: torch.Tensor,  # [K] int64, written: the table slot of each logits row's request
    out_token_positions: torch.Tensor,  # [K] int64, written: where each row's sampled token goes
) -> None:
    """Logits row r belongs to request ``r // (S + 1)`` among the decode rows, else to request
    ``r - num_decode * (S + 1) + num_decode``, clamped to ``G - 1``; ``out_row_slots[r]`` is that
    request's slot, and its token goes at ``positions[logits_indices[r]] + 1`` (module docstring:
    an example)."""
    check_tensor("logits_indices", logits_indices, dtypes=(torch.int64,), ndim=1)
    num_rows = logits_indices.shape[0]
    check_tensor("positions", positions, dtypes=(torch.int64,), ndim=1)
    check_tensor("num_decode", num_decode, dtypes=(torch.int64,), shape=(1,))
    check_int("num_speculative_tokens", num_speculative_tokens, low=0)
    check_int("num_requests", num_requests, low=1)
    check_tensor("slot_ids", slot_ids, dtypes=(torch.int64,), shape=(num_requests,))
    check_tensor("out_row_slots", out_row_slots, dtypes=(torch.int64,), shape=(num_rows,))
    check_tensor("out_token_positions", out_token_positions, dtypes=(torch.int64,), shape=(num_rows,))
    check_same_device(logits_indices=logits_indices, positions=positions, num_decode=num_decode, slot_ids=slot_ids,
                      out_row_slots=out_row_slots, out_token_positions=out_token_positions)
    check_contiguous(logits_indices=logits_indices, positions=positions, slot_ids=slot_ids,
                     out_row_slots=out_row_slots, out_token_positions=out_token_positions)
    if not use_triton(logits_indices):
        reference.logits_row_requests(logits_indices, positions, num_decode, num_speculative_tokens, num_requests,
                                      slot_ids, out_row_slots, out_token_positions)
        return
    if num_rows == 0:
        return
    _logits_row_requests_kernel[(triton.cdiv(num_rows, BLOCK),)](
        logits_indices, positions, num_decode, slot_ids, out_row_slots, out_token_positions, num_rows, num_requests,
        STRIDE=num_speculative_tokens + 1, BLOCK=BLOCK)


def draft_batch_rows(
    query_start_loc: torch.Tensor,  # [G + 1] int32, the step's packed rows of each request
    seq_lens: torch.Tensor,  # [G] int32, KV length of each request after the step's rows
    accepted_counts: torch.Tensor,  # [>= G] int64, accepted drafts (verify's output)
    counts: torch.Tensor,  # [3] int64: real requests, decode requests, sampling requests
    slot_ids: torch.Tensor,  # [G] int64, each request's table slot
    num_speculative_tokens: int,
    padding_row: int,  # the table slot that takes padding requests' writes
    out_write_rows: torch.Tensor,  # [G] int64, written: slot_ids[r] for a real request, else padding_row
    out_samples: torch.Tensor,  # [G] bool, written: the request sampled a token
    out_first_positions: torch.Tensor,  # [G] int64, written: position of its first row this step
    out_bonus_positions: torch.Tensor,  # [G] int64, written: e, the position of its last sampled token
    draft_lengths: Optional[torch.Tensor] = None,  # [>= G] int64, each request's draft length s_r this step
    out_draft_length_rows: Optional[torch.Tensor] = None,  # [R + 1] int64 by table slot, written (sampling requests)
) -> None:
    """The proposer's per-request fields (``DraftBatch``): ``first = seq_len - q`` and
    ``e = seq_len - (q - 1 - accepted)`` for a decode request (its ``q`` rows: the base token and
    the drafts it verified, ``1 + S`` in a strided step, ``1 + s_r`` in a ragged one), ``seq_len``
    for the others. With ``draft_lengths``: ``out_draft_length_rows[slot] = draft_lengths[r]`` for
    each sampling request (r < counts[2]): what the next step's verify masks by (one launch, not a
    ``where`` and an index write)."""
    check_tensor("query_start_loc", query_start_loc, dtypes=(torch.int32,), ndim=1)
    num_requests = query_start_loc.shape[0] - 1
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), shape=(num_requests,))
    check_tensor("accepted_counts", accepted_counts, dtypes=(torch.int64,), ndim=1)
    if accepted_counts.shape[0] < num_requests:
        raise ValueError(f"accepted_counts has {accepted_counts.shape[0]} rows, the grid has {num_requests} requests")
    check_tensor("counts", counts, dtypes=(torch.int64,), shape=(3,))
    check_tensor("slot_ids", slot_ids, dtypes=(torch.int64,), shape=(num_requests,))
    check_int("num_speculative_tokens", num_speculative_tokens, low=0)
    check_int("padding_row", padding_row, low=0)
    for name, tensor, dtype in (("out_write_rows", out_write_rows, torch.int64),
                                ("out_samples", out_samples, torch.bool),
                                ("out_first_positions", out_first_positions, torch.int64),
                                ("out_bonus_positions", out_bonus_positions, torch.int64)):
        check_tensor(name, tensor, dtypes=(dtype,), shape=(num_requests,))
    check_same_device(query_start_loc=query_start_loc, seq_lens=seq_lens, accepted_counts=accepted_counts,
                      counts=counts, slot_ids=slot_ids, out_write_rows=out_write_rows, out_samples=out_samples,
                      out_first_positions=out_first_positions, out_bonus_positions=out_bonus_positions)
    check_contiguous(query_start_loc=query_start_loc, seq_lens=seq_lens, accepted_counts=accepted_counts,
                     counts=counts, slot_ids=slot_ids, out_write_rows=out_write_rows, out_samples=out_samples,
                     out_first_positions=out_first_positions, out_bonus_positions=out_bonus_positions)
    if (draft_lengths is None) != (out_draft_length_rows is None):
        raise ValueError("draft_lengths and out_draft_length_rows go together (both or neither)")
    if draft_lengths is not None:
        check_tensor("draft_lengths", draft_lengths, dtypes=(torch.int64,), ndim=1)
        if draft_lengths.shape[0] < num_requests:
            raise ValueError(f"draft_lengths has {draft_lengths.shape[0]} rows, the grid has {num_requests} requests")
        check_tensor("out_draft_length_rows", out_draft_length_rows, dtypes=(torch.int64,), ndim=1)
        if out_draft_length_rows.shape[0] <= padding_row:
            raise ValueError(f"out_draft_length_rows has {out_draft_length_rows.shape[0]} rows, padding_row is "
                             f"{padding_row}")
        check_same_device(query_start_loc=query_start_loc, draft_lengths=draft_lengths,
                          out_draft_length_rows=out_draft_length_rows)
        check_contiguous(draft_lengths=draft_lengths, out_draft_length_rows=out_draft_length_rows)
    args = (query_start_loc, seq_lens, accepted_counts, counts, slot_ids, num_speculative_tokens, padding_row,
            out_write_rows, out_samples, out_first_positions, out_bonus_positions, draft_lengths, out_draft_length_rows)
    if not use_triton(query_start_loc):
        reference.draft_batch_rows(*args)
        return
    if num_requests == 0:
        return
    write_lengths = draft_lengths is not None
    _draft_batch_rows_kernel[(triton.cdiv(num_requests, BLOCK),)](
        query_start_loc, seq_lens, accepted_counts, counts, slot_ids, out_write_rows, out_samples, out_first_positions,
        out_bonus_positions, draft_lengths if write_lengths else out_write_rows,
        out_draft_length_rows if write_lengths else out_write_rows, num_requests, padding_row,
        S=num_speculative_tokens, WRITE_LENGTHS=write_lengths, BLOCK=BLOCK)
