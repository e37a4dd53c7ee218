"""Seeded random argument tuples for the drafting-input ops (contract: docs/kernels.md).

Shared by tests/unit (CPU, Triton's interpreter) and tests/functional (CUDA). Each ``*_case``
returns the op's positional arguments, built on ``device``, in the op's own argument order.
"""

import torch


def _randint(generator, low, high):
    """One int in ``[low, high]``."""
    return int(torch.randint(low, high + 1, (1,), generator=generator))


def _starts(lengths, dtype=torch.int32):
    """``[0, l0, l0 + l1, ...]``: the packed start of each span, then the total row count."""
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    return torch.tensor(bounds, dtype=dtype)


def eagle_inputs_case(generator, *, num_requests, max_rows, shift, device="cpu", padding_rows=0, lengths=None,
                      num_padding_slots=None):
    """Arguments of ``copy_and_expand_eagle_inputs``: random lengths (unless given), rejected rows, slots."""
    lengths = lengths or [_randint(generator, 1, max_rows) for _ in range(num_requests)]
    rejected = [_randint(generator, 0, length - 1) for length in lengths]
    query_start_loc = _starts(lengths)
    num_rows = int(query_start_loc[-1]) + padding_rows
    query_end_loc = query_start_loc[1:] - 1 - torch.tensor(rejected, dtype=torch.int32)
    first_positions = torch.randint(0, 1000, (num_requests,), generator=generator)
    positions = torch.zeros(num_rows, dtype=torch.int64)
    for request, length in enumerate(lengths):
        start = int(query_start_loc[request])
        positions[start : start + length] = first_positions[request] + torch.arange(length)
    token_ids = torch.randint(0, 50_000, (num_rows,), generator=generator, dtype=torch.int32)
    next_token_ids = torch.randint(0, 50_000, (num_requests,), generator=generator, dtype=torch.int32)
    slots = num_padding_slots or _randint(generator, 1, 4)
    tensors = [token_ids, positions, next_token_ids, query_start_loc, query_end_loc]
    return (*[t.to(device) for t in tensors], 0, 50_001, slots, shift)


def prepare_inputs_padded_case(generator, *, num_requests, max_drafts, device="cpu"):
    """Arguments of ``eagle_prepare_inputs_padded``: some requests without drafts (prefill, padding)."""
    num_drafts = torch.randint(0, max_drafts + 1, (num_requests,), generator=generator)
    valid = (torch.rand(num_requests, generator=generator) * (num_drafts + 2).float()).long()  # 0 .. drafts + 1
    rows = num_drafts + 1
    query_start_loc = _starts(rows.tolist())
    return num_drafts.cumsum(0).to(torch.int32).to(device), valid.to(device), query_start_loc.to(device)


def prepare_next_token_padded_case(generator, *, num_requests, num_sampled, vocab_size, device="cpu"):
    """Arguments of ``eagle_prepare_next_token_padded``: -1 suffixes, tokens >= vocab_size, discards."""
    tokens = torch.randint(0, vocab_size + 3, (num_requests, num_sampled), generator=generator)
    accepted = torch.randint(0, num_sampled + 1, (num_requests, 1), generator=generator)
    tokens = torch.where(torch.arange(num_sampled) < accepted, tokens, torch.full_like(tokens, -1))
    discard = torch.rand(num_requests, generator=generator) < 0.25
    backup = torch.randint(0, vocab_size, (num_requests,), generator=generator)
    return tokens.to(device), discard.to(device), backup.to(device), vocab_size


def step_slot_mapping_case(generator, *, batch_size, padding_rows, device="cpu", block_size=None,
                           max_model_len=None):
    """Arguments of ``eagle_step_update_slot_mapping_and_metadata``; some requests overflow."""
    block_size = block_size or _randint(generator, 1, 8)
    max_model_len = max_model_len or _randint(generator, 2, 64)
    max_blocks = -(-max_model_len // block_size)
    positions = torch.randint(0, max_model_len, (batch_size,), generator=generator)
    positions[torch.rand(batch_size, generator=generator) < 0.2] = max_model_len - 1  # these overflow
    block_table = torch.randint(0, 100, (batch_size + 2, max_blocks), generator=generator, dtype=torch.int32)
    seq_lens = (positions + 1).clamp(max=max_model_len).to(torch.int32)
    input_batch_size = batch_size + padding_rows
    out_clamped_positions = torch.full((batch_size,), -7, dtype=torch.int64)
    out_slot_mapping = torch.full((input_batch_size + 2,), -7, dtype=torch.int64)  # 2 rows past the batch
    tensors = [positions, block_table, seq_lens]
    outputs = [out_clamped_positions, out_slot_mapping]
    return (*[t.to(device) for t in tensors], block_size, max_model_len,
            *[t.to(device) for t in outputs], input_batch_size)


def ptd_case(generator, *, num_requests, max_rows, hidden_size, num_drafts, device="cpu",
             dtype=torch.float32, padding_rows=0, lengths=None, block_size=None, max_model_len=None):
    """Arguments of ``ptd_prepare_inputs``: rejected rows, draft positions past max_model_len.

    ``num_output_rows = T_in + R * (K - 1) + padding_rows`` depends on shapes only (as a caller
    sizes it without a host sync): the rows of rejected inputs become padding rows.
    """
    block_size = block_size or _randint(generator, 1, 8)
    max_model_len = max_model_len or _randint(generator, max_rows + 1, max_rows + 24)
    lengths = lengths or [_randint(generator, 1, max_rows) for _ in range(num_requests)]
    accepted = [_randint(generator, 1, length) for length in lengths]
    in_query_start_loc = _starts(lengths)
    out_query_start_loc = _starts([a + num_drafts - 1 for a in accepted])
    num_rows = int(in_query_start_loc[-1])
    positions = torch.zeros(num_rows, dtype=torch.int64)
    for request, length in enumerate(lengths):
        start = int(in_query_start_loc[request])
        first = _randint(generator, 0, max_model_len - length)
        positions[start : start + length] = first + torch.arange(length)
    last_token_indices = in_query_start_loc[:-1] + torch.tensor(accepted, dtype=torch.int32) - 1
    max_blocks = -(-max_model_len // block_size)
    tensors = [
        torch.randint(0, 50_000, (num_rows,), generator=generator),  # target_token_ids
        positions,
        torch.randn(num_rows, hidden_size, generator=generator).to(dtype),  # target_hidden
        torch.randint(0, 10_000, (num_rows,), generator=generator),  # target_slot_mapping
        torch.randint(0, 50_000, (num_requests,), generator=generator),  # next_token_ids
        last_token_indices,
        in_query_start_loc,
        out_query_start_loc,
        torch.randint(0, 500, (num_requests, max_blocks), generator=generator, dtype=torch.int32),
    ]
    mask_hidden = torch.randn(hidden_size, generator=generator).to(dtype)
    num_output_rows = num_rows + num_requests * (num_drafts - 1) + padding_rows
    return (*[t.to(device) for t in tensors], block_size, max_model_len, 50_001, mask_hidden.to(device),
            num_output_rows)


def shift_gather_case(generator, *, num_seqs, max_rows, max_shift, hidden_size=None, device="cpu",
                      dtype=torch.float32, padding_rows=0, lengths=None):
    """Arguments of ``shift_and_gather_cache`` (``hidden_size=None``) or its hidden twin.

    Windows of 0 (padding sequence) to ``max_rows`` rows, shifts 0 .. cached length, and the
    store window of multi-layer EAGLE: the last ``MAX_SHIFT`` rows up to a sampled row.
    """
    lengths = lengths or [_randint(generator, 0, max_rows) for _ in range(num_seqs)]
    query_start_loc = _starts(lengths)
    num_rows = int(query_start_loc[-1]) + padding_rows
    cached_lens = torch.randint(0, max_shift + 1, (num_seqs,), generator=generator)
    shifts = (torch.rand(num_seqs, generator=generator) * (cached_lens + 1).float()).long()  # 0 .. cached_len
    starts = query_start_loc[:-1].long()
    sampled = starts + (torch.rand(num_seqs, generator=generator) * torch.tensor(lengths).float()).long()
    store_starts = torch.maximum(starts, sampled + 1 - max_shift)
    store_lens = (sampled - store_starts + 1).clamp(0, max_shift)
    store_lens = torch.where(torch.tensor(lengths) == 0, torch.zeros_like(store_lens), store_lens)
    if hidden_size is None:
        src = torch.randint(0, 50_000, (num_rows,), generator=generator)
        cached = torch.randint(0, 50_000, (num_seqs, max_shift), generator=generator)
    else:
        src = torch.randn(num_rows, hidden_size, generator=generator).to(dtype)
        cached = torch.randn(num_seqs, max_shift, hidden_size, generator=generator).to(dtype)
    tensors = [src, cached, query_start_loc, shifts, cached_lens, store_starts, store_lens]
    return tuple(t.to(device) for t in tensors)
