"""Pure-torch twins of the drafting-input ops (contract: docs/kernels.md).

Same names, arguments and results as the public ops in :mod:`mtp_ctrl.triton_ops`; the public
ops' docstrings hold the contracts and worked examples. Every function is vectorised over rows
(``torch.searchsorted`` finds a row's request), with no Python loop over requests. Arguments are
assumed valid: the public ops validate them once before dispatching here.
"""

import dataclasses

import torch

PAD_SLOT = -1


def _owner_of_rows(row_bounds: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Index of the span holding each row; spans are ``[row_bounds[r], row_bounds[r + 1])``.

    Example: ``row_bounds = [0, 3, 3, 5]``, ``rows = [0, 2, 3, 4, 5]`` -> ``[0, 0, 2, 2, 3]``;
    an empty span (request 1) owns no row, and a row past the last span gets ``R = 3``.
    """
    return torch.searchsorted(row_bounds[1:].to(torch.int64).contiguous(), rows, right=True)


def copy_and_expand_eagle_inputs(
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
    device = target_token_ids.device
    num_requests = next_token_ids.shape[0]
    num_input_rows = target_token_ids.shape[0]
    slots = num_padding_slots_per_request
    shift = int(shift_input_ids)
    rows_added = slots - shift  # output rows per request minus input rows per request
    num_output_rows = num_input_rows + num_requests * rows_added

    # Per-request values get one extra entry, R, for the tail: output rows past the last request.
    starts = query_start_loc.to(torch.int64)  # [R + 1]
    out_bounds = starts + rows_added * torch.arange(num_requests + 1, device=device)  # [R + 1]
    num_valid = torch.cat([query_end_loc.to(torch.int64) - starts[:-1] + 1 - shift, starts.new_zeros(1)])  # [R + 1]
    bonus = torch.cat([next_token_ids.to(torch.int64), starts.new_zeros(1)])  # [R + 1]
    last_input_row = max(num_input_rows - 1, 0)

    out_rows = torch.arange(num_output_rows, device=device)  # [T_out] int64
    request = _owner_of_rows(out_bounds, out_rows)  # [T_out] in [0, R]
    is_tail = request == num_requests
    j = out_rows - out_bounds[request]  # [T_out] row index inside its request
    owner_valid = num_valid[request]  # [T_out]
    is_valid = ~is_tail & (j < owner_valid)
    is_bonus = ~is_tail & (j == owner_valid)
    is_masked = ~is_tail & (j > owner_valid) & (j < owner_valid + slots)
    is_rejected = is_tail | (j >= owner_valid + slots)

    copied = target_token_ids[(starts[request] + shift + j).clamp(0, last_input_row)].to(torch.int64)
    input_ids = torch.full_like(out_rows, padding_token_id)
    input_ids = torch.where(is_valid, copied, input_ids)
    input_ids = torch.where(is_bonus, bonus[request], input_ids)
    input_ids = torch.where(is_masked, torch.full_like(out_rows, parallel_drafting_token_id), input_ids)
    first_position = target_positions[starts[request].clamp(max=last_input_row)].to(torch.int64)
    positions = torch.where(is_rejected, torch.zeros_like(out_rows), first_position + j)

    # [R, P]: the bonus row and the P - 1 parallel-draft rows of every request
    new_token_indices = (out_bounds[:-1] + num_valid[:-1])[:, None] + torch.arange(slots, device=device)
    hidden_state_mapping = None
    if shift_input_ids:
        in_rows = torch.arange(num_input_rows, device=device)  # [T_in] int64
        hidden_state_mapping = in_rows + rows_added * _owner_of_rows(query_start_loc, in_rows)
    return (
        input_ids.to(target_token_ids.dtype),
        positions.to(target_positions.dtype),
        is_rejected,
        is_masked,
        new_token_indices.reshape(-1),
        hidden_state_mapping,
    )


def eagle_prepare_inputs_padded(cu_num_draft_tokens, valid_sampled_tokens_count, query_start_loc):
    cumulative = cu_num_draft_tokens.to(torch.int64)  # [R]
    num_draft = torch.diff(cumulative, prepend=cumulative.new_zeros(1))  # [R]
    num_rejected = num_draft + 1 - valid_sampled_tokens_count.to(torch.int64)
    num_rejected = torch.where(num_draft > 0, num_rejected, torch.zeros_like(num_rejected))
    token_indices_to_sample = query_start_loc[1:].to(torch.int64) - 1 - num_rejected
    return token_indices_to_sample, num_rejected


def eagle_prepare_next_token_padded(sampled_token_ids, discard_request_mask, backup_next_token_ids, vocab_size):
    tokens = sampled_token_ids.to(torch.int64)  # [R, S + 1]
    is_valid = (tokens >= 0) & (tokens < vocab_size)  # [R, S + 1]
    valid_count = is_valid.sum(dim=1)  # [R] int64
    columns = torch.arange(tokens.shape[1], device=tokens.device)
    last_valid = torch.where(is_valid, columns, -1).amax(dim=1, keepdim=True).clamp(min=0)  # [R, 1]
    last_token = tokens.gather(1, last_valid).squeeze(1)  # [R]
    use_backup = discard_request_mask | (valid_count == 0)
    next_token_ids = torch.where(use_backup, backup_next_token_ids.to(torch.int64), last_token)
    valid_count = torch.where(discard_request_mask, torch.zeros_like(valid_count), valid_count)
    return next_token_ids.to(sampled_token_ids.dtype), valid_count


def eagle_step_update_slot_mapping_and_metadata(
    positions_1d,
    block_table,
    seq_lens,
    block_size,
    max_model_len,
    out_clamped_positions,
    out_slot_mapping,
    input_batch_size=None,
):
    batch_size = positions_1d.shape[0]
    if input_batch_size is None:
        input_batch_size = batch_size
    next_position = positions_1d.to(torch.int64) + 1  # [B]
    overflow = next_position >= max_model_len
    clamped = torch.where(overflow, torch.zeros_like(next_position), next_position)
    block_index = (clamped // block_size).clamp(max=block_table.shape[1] - 1)  # [B]
    block_ids = block_table[torch.arange(batch_size, device=block_table.device), block_index].to(torch.int64)
    slots = block_ids * block_size + clamped % block_size
    slots = torch.where(overflow, torch.full_like(slots, PAD_SLOT), slots)
    grown = (seq_lens.to(torch.int64) + 1).clamp(max=max_model_len)
    new_seq_lens = torch.where(overflow, torch.ones_like(grown), grown)
    seq_lens.copy_(new_seq_lens)
    out_clamped_positions.copy_(clamped)
    out_slot_mapping[:batch_size] = slots.to(out_slot_mapping.dtype)
    out_slot_mapping[batch_size:input_batch_size] = PAD_SLOT


def _positions_of_rows(query_start_loc, seq_lens, num_rows):
    """[num_rows] int64: row ``k`` of request ``b`` sits at ``seq_lens[b] - query_len[b] + k``, padding rows at 0."""
    rows = torch.arange(num_rows, device=query_start_loc.device)  # [T] int64
    batch_size = seq_lens.shape[0]
    if batch_size == 0:
        return torch.zeros_like(rows)
    starts = query_start_loc.to(torch.int64)  # [B + 1]
    request = _owner_of_rows(starts, rows).clamp(max=batch_size - 1)  # [T]
    first_positions = seq_lens.to(torch.int64) - (starts[1:] - starts[:-1])  # [B]
    positions = first_positions[request] + rows - starts[request]
    return torch.where(rows < starts[-1], positions, torch.zeros_like(rows))


def extend_all_queries_by_n(metadata, n, new_slot_mapping, new_positions=None):
    batch_size = metadata.seq_lens.shape[0]
    query_start_loc = metadata.query_start_loc  # [B + 1]
    steps = torch.arange(batch_size + 1, device=query_start_loc.device, dtype=query_start_loc.dtype)
    new_query_start_loc = query_start_loc + n * steps
    new_seq_lens = metadata.seq_lens + n
    if new_positions is None:
        new_positions = _positions_of_rows(new_query_start_loc, new_seq_lens, new_slot_mapping.shape[0])
    return dataclasses.replace(
        metadata,
        query_start_loc=new_query_start_loc,
        seq_lens=new_seq_lens,
        slot_mapping=new_slot_mapping,
        positions=new_positions.to(metadata.positions.dtype),
        num_actual_tokens=metadata.num_actual_tokens + batch_size * n,
        max_query_len=metadata.max_query_len + n,
        max_seq_len=metadata.max_seq_len + n,
    )


def ptd_prepare_inputs(
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
    device = target_token_ids.device
    num_requests = next_token_ids.shape[0]
    last_input_row = max(target_token_ids.shape[0] - 1, 0)
    rows = torch.arange(num_output_rows, device=device)  # [T_out] int64
    if num_requests == 0:  # every row is padding: a draft-like row at position 0 that writes no KV
        return (
            torch.full_like(rows, mask_token_id).to(target_token_ids.dtype),
            torch.zeros_like(rows).to(target_positions.dtype),
            mask_hidden[None, :].expand(num_output_rows, -1).clone(),
            torch.full_like(rows, PAD_SLOT),
        )
    out_bounds = out_query_start_loc.to(torch.int64)  # [R + 1]
    request = _owner_of_rows(out_bounds, rows).clamp(max=num_requests - 1)  # [T_out]
    is_real = (rows >= out_bounds[0]) & (rows < out_bounds[-1])
    in_start = in_query_start_loc[request].to(torch.int64)
    out_start = out_bounds[request]
    last = last_token_indices[request].to(torch.int64) - in_start  # local index of the last verified row
    next_tokens = next_token_ids[request].to(torch.int64)
    local = rows - out_start
    is_verified = is_real & (local <= last)
    is_draft = is_real & (local > last)
    source = (in_start + local).clamp(0, last_input_row)  # verified rows read their own input row

    shifted = target_token_ids[(source + 1).clamp(max=last_input_row)].to(torch.int64)
    input_ids = torch.where(local < last, shifted, next_tokens)
    input_ids = torch.where(is_verified, input_ids, torch.full_like(rows, mask_token_id))

    last_position = target_positions[(in_start + last).clamp(0, last_input_row)].to(torch.int64)
    draft_position = last_position + local - last
    overflow = draft_position >= max_model_len
    draft_position = torch.where(overflow, torch.zeros_like(rows), draft_position)
    positions = torch.where(is_verified, target_positions[source].to(torch.int64), torch.zeros_like(rows))
    positions = torch.where(is_draft, draft_position, positions)

    block_index = (draft_position // block_size).clamp(max=block_table.shape[1] - 1)
    draft_slot = block_table[request, block_index].to(torch.int64) * block_size + draft_position % block_size
    slots = torch.full_like(rows, PAD_SLOT)
    slots = torch.where(is_verified, target_slot_mapping[source].to(torch.int64), slots)
    slots = torch.where(is_draft & ~overflow, draft_slot, slots)

    hidden = torch.where(is_verified[:, None], target_hidden[source], mask_hidden[None, :])
    return input_ids.to(target_token_ids.dtype), positions.to(target_positions.dtype), hidden, slots


def _shift_and_gather_rows(src, cached, query_start_loc, shifts, cached_lens, store_starts, store_lens):
    """``src [T, W]``, ``cached [N, MAX_SHIFT, W]`` -> ``(dst [T, W], new_cached [N, MAX_SHIFT, W])``."""
    num_rows = src.shape[0]
    num_seqs, max_shift = cached.shape[0], cached.shape[1]
    if num_seqs == 0:
        return src.clone(), cached.clone()
    starts = query_start_loc[:-1].to(torch.int64)  # [N]
    shifts = shifts.to(torch.int64)
    cached_lens = cached_lens.to(torch.int64)
    last_row = max(num_rows - 1, 0)
    readable_src = src if num_rows else src.new_zeros((1, src.shape[1]))  # gather needs a row to clamp to

    def shifted_values(seq, index):
        """Value of window row ``index`` of sequence ``seq`` after the shift (same shapes)."""
        from_cache = index < shifts[seq]
        cache_row = (cached_lens[seq] - shifts[seq] + index).clamp(0, max_shift - 1)
        src_row = (starts[seq] + index - shifts[seq]).clamp(0, last_row)
        return torch.where(from_cache[..., None], cached[seq, cache_row], readable_src[src_row])

    rows = torch.arange(num_rows, device=src.device)  # [T]
    seq = _owner_of_rows(query_start_loc, rows)  # [T]; N for rows past the last window
    in_window = seq < num_seqs
    seq = seq.clamp(max=num_seqs - 1)
    dst = torch.where(in_window[:, None], shifted_values(seq, rows - starts[seq]), src)

    seq_ids = torch.arange(num_seqs, device=src.device)[:, None]  # [N, 1]
    kept = torch.arange(max_shift, device=src.device)[None, :]  # [1, MAX_SHIFT]
    window_index = store_starts.to(torch.int64)[:, None] + kept - starts[:, None]  # [N, MAX_SHIFT]
    stored = shifted_values(seq_ids.expand_as(window_index), window_index)
    is_stored = kept < store_lens.to(torch.int64)[:, None]
    new_cached = torch.where(is_stored[..., None], stored, torch.zeros_like(stored))
    return dst, new_cached


def shift_and_gather_cache(src, cached, query_start_loc, shifts, cached_lens, store_starts, store_lens):
    dst, new_cached = _shift_and_gather_rows(
        src[:, None], cached[:, :, None], query_start_loc, shifts, cached_lens, store_starts, store_lens
    )
    return dst[:, 0], new_cached[:, :, 0]


def shift_and_gather_cache_hidden(src, cached, query_start_loc, shifts, cached_lens, store_starts, store_lens):
    return _shift_and_gather_rows(src, cached, query_start_loc, shifts, cached_lens, store_starts, store_lens)
