"""Torch twin of :func:`mtp_ctrl.triton_ops.prepare_step_inputs`."""

import torch


def prepare_step_inputs(block_writes, block_ids, query_start_loc, slot_ids, kv_length_offsets, kv_block_counts,
                        last_kv_block_offset, last_kv_block_id, next_tokens, draft_tokens, num_decode,
                        block_size, out_seq_lens, out_positions, out_slot_mapping, input_ids, out_block_table):
    """Twin of :func:`mtp_ctrl.triton_ops.prepare_step_inputs`."""
    block_ids.index_put_((block_writes[0], block_writes[1]), block_writes[2])
    G, T, device = query_start_loc.shape[0] - 1, out_positions.shape[0], out_positions.device
    if G == 0:
        out_positions.zero_()
        out_slot_mapping.fill_(-1)
        return
    slots = slot_ids  # [G] int64: request r's state is at slot slots[r]
    starts = query_start_loc.long()  # [G + 1] int64
    query_lengths = starts[1:] - starts[:-1]  # [G] int64; 0 for padding requests
    first_positions = kv_length_offsets[slots].clone()  # [G] int64
    lengths = first_positions + query_lengths  # [G] int64
    counts = (lengths + block_size - 1) // block_size
    step_block_ids = block_ids[slots]  # [G, MB] int64: the step's block table
    last_ids = step_block_ids.gather(1, (counts - 1).clamp(min=0)[:, None])[:, 0]
    # padding requests may share a slot: they write it the value it holds (no rows, nothing grows)
    kv_length_offsets[slots] = lengths
    kv_block_counts[slots] = counts
    last_kv_block_offset[slots] = torch.remainder(lengths - 1, block_size)
    last_kv_block_id[slots] = torch.where(counts > 0, last_ids, -1)
    out_seq_lens[:G].copy_(torch.where(query_lengths > 0, lengths, 0))
    out_block_table[:G] = step_block_ids

    row_index = torch.arange(T, device=device)  # [T] int64
    row_requests = torch.searchsorted(starts[1:], row_index, right=True).clamp(max=G - 1)
    valid = row_index < starts[-1]  # [T] bool: past the real rows is padding
    positions = torch.where(valid, first_positions[row_requests] + row_index - starts[row_requests], 0)
    block_column = (positions // block_size).clamp(max=block_ids.shape[1] - 1)
    row_block_ids = step_block_ids[row_requests, block_column]  # [T] int64
    out_positions.copy_(positions)
    out_slot_mapping.copy_(torch.where(valid, row_block_ids * block_size + positions % block_size, -1))

    # decode rows (request r < num_decode, its rows from query_start_loc) take the last verified token,
    # then the drafts; other rows keep their token
    row_slot = slots[row_requests]  # [T] int64
    row_in_request = row_index - starts[row_requests]  # [T] int64
    decode_tokens = next_tokens[row_slot]  # [T] int64
    if draft_tokens.shape[1] > 0:
        drafts = draft_tokens[row_slot, (row_in_request - 1).clamp(min=0, max=draft_tokens.shape[1] - 1)]
        decode_tokens = torch.where(row_in_request > 0, drafts, decode_tokens)
    is_decode_row = valid & (row_requests < num_decode.reshape(()))
    input_ids.copy_(torch.where(is_decode_row, decode_tokens, input_ids))
