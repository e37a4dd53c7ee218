"""Torch twins of :mod:`mtp_ctrl.triton_ops.step_rows`."""

import torch


def logits_row_requests(logits_indices, positions, num_decode, num_speculative_tokens, num_requests, slot_ids,
                        out_row_slots, out_token_positions):
    """Twin of :func:`mtp_ctrl.triton_ops.logits_row_requests`."""
    stride = num_speculative_tokens + 1
    row_index = torch.arange(logits_indices.shape[0], device=logits_indices.device)  # [K] int64
    decode_rows = num_decode * stride
    requests = torch.where(row_index < decode_rows, row_index // stride, row_index - decode_rows + num_decode)
    out_row_slots.copy_(slot_ids[requests.clamp(max=num_requests - 1)])
    out_token_positions.copy_(positions[logits_indices] + 1)


def draft_batch_rows(query_start_loc, seq_lens, accepted_counts, counts, slot_ids, num_speculative_tokens, padding_row,
                     out_write_rows, out_samples, out_first_positions, out_bonus_positions, draft_lengths=None,
                     out_draft_length_rows=None):
    """Twin of :func:`mtp_ctrl.triton_ops.draft_batch_rows`."""
    num_requests = seq_lens.shape[0]
    request_index = torch.arange(num_requests, device=seq_lens.device)  # [G] int64
    num_active, num_decode, num_sampling = counts[0], counts[1], counts[2]
    starts = query_start_loc.long()
    lengths = seq_lens.long()
    query_lengths = starts[1:] - starts[:-1]  # [G] int64: a decode request's 1 + its drafts
    rewinds = torch.where(request_index < num_decode, query_lengths - 1 - accepted_counts[:num_requests], 0)
    out_write_rows.copy_(torch.where(request_index < num_active, slot_ids, padding_row))
    out_samples.copy_(request_index < num_sampling)
    out_first_positions.copy_(lengths - query_lengths)
    out_bonus_positions.copy_(lengths - rewinds)
    if draft_lengths is not None:
        sampling = request_index < num_sampling  # [G] bool
        out_draft_length_rows[out_write_rows[sampling]] = draft_lengths[:num_requests][sampling]
