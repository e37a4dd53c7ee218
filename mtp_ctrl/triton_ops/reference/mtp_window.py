"""Torch twins of the MTP draft-window ops (:mod:`mtp_ctrl.triton_ops.mtp_window`)."""

import torch


def _window_layout(query_start_loc, first_positions, write_rows, num_decode, num_active, window_starts,
                   decode_window_rows):
    """Per request: w (its first window position) and its window row count."""
    num_requests = first_positions.shape[0]
    device = first_positions.device
    request_index = torch.arange(num_requests, device=device)
    starts = query_start_loc.long()
    query_lengths = starts[1:] - starts[:-1]  # [G] int64
    window_start = torch.where(first_positions == 0, 0, window_starts[write_rows])  # [G] int64
    sizes = torch.where(request_index < num_decode, decode_window_rows,
                        torch.where(request_index < num_active, first_positions + query_lengths - window_start, 0))
    return window_start, sizes


def mtp_draft_window(
    query_start_loc, first_positions, bonus_positions, write_rows, samples, num_decode, num_active,
    step_positions, step_input_ids, next_tokens, step_hidden, block_table, window_starts, token_history,
    hidden_ring, num_speculative_tokens, block_size, padding_row,
    out_window_query_start_loc, out_positions, out_slot_mapping, out_history_rows, out_hidden,
    decode_window_rows=None,
):
    """Twin of :func:`mtp_ctrl.triton_ops.mtp_draft_window`."""
    G, T = first_positions.shape[0], step_positions.shape[0]
    Tm, S = out_positions.shape[0], num_speculative_tokens
    device = first_positions.device
    if G == 0:  # nothing to record; every window row is padding
        out_window_query_start_loc.zero_()
        out_positions.fill_(-1)
        out_slot_mapping.fill_(-1)
        out_history_rows.fill_(padding_row)
        out_hidden.zero_()
        return
    num_decode, num_active = num_decode.reshape(()), num_active.reshape(())
    ends, first = bonus_positions, first_positions
    starts = query_start_loc.long()
    # 1. this step's rows at their positions, then each request's bonus token at e
    _record_tokens(query_start_loc, bonus_positions, write_rows, samples, step_positions, step_input_ids,
                   next_tokens, token_history, padding_row)
    # 2. the windows
    decode_window_rows = 2 * S if decode_window_rows is None else decode_window_rows
    window_start, sizes = _window_layout(query_start_loc, first, write_rows, num_decode, num_active, window_starts,
                                         decode_window_rows)
    window_query_start_loc = torch.zeros(G + 1, dtype=torch.int64, device=device)
    torch.cumsum(sizes, 0, out=window_query_start_loc[1:])
    out_window_query_start_loc.copy_(window_query_start_loc)
    window_index = torch.arange(Tm, device=device)
    rows = torch.searchsorted(window_query_start_loc[1:], window_index, right=True).clamp(max=G - 1)
    in_window = window_index < window_query_start_loc[G]
    from_end = window_query_start_loc[1:][rows] - 1 - window_index
    positions = torch.where(in_window, ends[rows] - 1 - from_end, -1)  # [Tm] int64
    valid = in_window & (positions >= window_start[rows])
    safe_positions = positions.clamp(min=0)
    block_ids = block_table[rows, (safe_positions // block_size).clamp(max=block_table.shape[1] - 1)].long()
    out_positions.copy_(positions)
    out_slot_mapping.copy_(torch.where(valid, block_ids * block_size + safe_positions % block_size, -1))
    history_rows = torch.where(in_window, write_rows[rows], padding_row)
    out_history_rows.copy_(history_rows)
    # depth 0's hidden: this step's decoder rows for positions >= first, the ring before that
    from_step = positions >= first[rows]
    step_rows = (starts[:-1][rows] + positions - first[rows]).clamp(0, max(T - 1, 0))
    ring_hidden = hidden_ring[history_rows, safe_positions % hidden_ring.shape[1]]  # [Tm, H]
    hidden = torch.where(from_step[:, None], step_hidden[step_rows], ring_hidden) if T > 0 else ring_hidden
    out_hidden.copy_(torch.where(in_window[:, None], hidden, 0))


def _record_tokens(query_start_loc, bonus_positions, write_rows, samples, step_positions, step_input_ids,
                   next_tokens, token_history, padding_row):
    """The step's rows' tokens at their positions, then each request's bonus token at e (its own row
    if it sampled, else ``padding_row``)."""
    G, T, history_len = bonus_positions.shape[0], step_positions.shape[0], token_history.shape[1]
    starts = query_start_loc.long()
    row_index = torch.arange(T, device=bonus_positions.device)
    row_requests = torch.searchsorted(starts[1:], row_index, right=True).clamp(max=G - 1)
    real_rows = (row_index < starts[G]) & (step_positions >= 0) & (step_positions < history_len)
    token_history[write_rows[row_requests][real_rows], step_positions[real_rows]] = step_input_ids[real_rows]
    bonus_rows = torch.where(samples, write_rows, padding_row)
    token_history[bonus_rows, bonus_positions.clamp(0, history_len - 1)] = next_tokens[:G]


def mtp_advance_window(first_positions, bonus_positions, write_rows, samples, query_start_loc, step_hidden,
                       window_starts, hidden_ring, num_speculative_tokens, move_window_start=True, record=None):
    """Twin of :func:`mtp_ctrl.triton_ops.mtp_advance_window`."""
    G, T, S, K = first_positions.shape[0], step_hidden.shape[0], num_speculative_tokens, hidden_ring.shape[1]
    if G == 0:
        return
    if record is not None:
        _record_tokens(query_start_loc, bonus_positions, write_rows, samples, record.step_positions,
                       record.step_input_ids, record.next_tokens, record.token_history, record.padding_row)
    ends, first, device = bonus_positions, first_positions, first_positions.device
    if move_window_start:
        window_starts[write_rows] = torch.minimum(ends, ends + samples.long() - S).clamp(min=0)
    positions = ends[:, None] - K + torch.arange(K, device=device)[None, :]  # [G, K]
    valid = (positions >= first[:, None]) & (positions >= 0)
    step_rows = (query_start_loc[:-1].long()[:, None] + positions - first[:, None]).clamp(0, max(T - 1, 0))
    slots = positions.clamp(min=0) % K
    table_rows = write_rows[:, None].expand(-1, K)
    old = hidden_ring[table_rows, slots]  # [G, K, H]
    new = step_hidden[step_rows] if T > 0 else old
    hidden_ring[table_rows, slots] = torch.where(valid[..., None], new, old)
