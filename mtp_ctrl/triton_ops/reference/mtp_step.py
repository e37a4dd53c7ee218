"""Torch twins of the MTP step ops (contract: docs/kernels.md) and of the fused ``verify_and_commit``.

Vectorised over requests, no host sync except where noted. Arguments are validated by the
public ops in :mod:`mtp_ctrl.triton_ops`; these functions assume valid inputs.
Letters: N requests, T packed rows, S drafts per decode request, W = max_released_blocks(S, block_size).
"""

from typing import Optional

import torch

from mtp_ctrl.triton_ops._step_common import (
    ActiveCount,
    StepCommit,
    max_released_blocks,
    release_shape,
)


def _as_rows(tokens: torch.Tensor) -> torch.Tensor:
    return tokens.squeeze(0) if tokens.dim() == 2 else tokens


def verify_speculative_tokens(
    input_tokens, output_tokens, num_decode_requests, num_prefill_requests, num_speculative_tokens
):
    tokens = _as_rows(input_tokens)  # [T]
    stride = num_speculative_tokens + 1
    decode_len = num_decode_requests * stride
    decode_inputs = tokens[:decode_len].reshape(num_decode_requests, stride)  # [Nd, S + 1]
    decode_outputs = output_tokens[:decode_len].reshape(num_decode_requests, stride)  # [Nd, S + 1]
    # draft i (row i + 1) matches when it equals what the target sampled at row i
    draft_matches = decode_inputs[:, 1:] == decode_outputs[:, :-1]  # [Nd, S] bool
    base_row = torch.ones(num_decode_requests, 1, dtype=torch.bool, device=tokens.device)  # [Nd, 1] bool
    decode_accepted = torch.cat([base_row, draft_matches], dim=1).cumprod(dim=1).bool()  # [Nd, S + 1]

    accepted_tokens_mask = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)  # [T]
    accepted_tokens_mask[:decode_len] = decode_accepted.flatten()
    accepted_tokens_mask[decode_len : decode_len + num_prefill_requests] = True

    decode_first_rows = torch.arange(num_decode_requests, device=tokens.device) * stride  # [Nd] int64
    prefill_rows = decode_len + torch.arange(num_prefill_requests, device=tokens.device)  # [Np] int64
    last_one_indices = torch.cat([decode_first_rows + decode_accepted.sum(dim=1) - 1, prefill_rows])  # [N]
    return last_one_indices, accepted_tokens_mask, tokens


def prepare_next_forward_pass(
    num_decode_requests,
    output_tokens,
    required_logit_indices,
    last_one_indices,
    accepted_tokens_mask,
    input_tokens,
    sampled_tokens_buf,
    last_accepted_seq_buf,
    accepted_tokens_per_request,
    accepted_token_counts,
    num_speculative_tokens,
):
    num_requests = last_one_indices.shape[0]
    sampled_tokens_buf[:num_requests] = output_tokens[last_one_indices]
    last_accepted_seq_buf[:num_requests] = required_logit_indices[last_one_indices]

    stride = num_speculative_tokens + 1
    decode_len = num_decode_requests * stride
    drafts = _as_rows(input_tokens)[:decode_len].reshape(num_decode_requests, stride)[:, 1:]  # [Nd, S]
    drafts_accepted = accepted_tokens_mask[:decode_len].reshape(num_decode_requests, stride)[:, 1:]  # [Nd, S]
    accepted_tokens_per_request[:num_decode_requests] = torch.where(drafts_accepted, drafts, -1)
    accepted_token_counts[:num_decode_requests] = drafts_accepted.sum(dim=1)


def _real_requests(num_requests: int, num_active_requests: ActiveCount, device) -> torch.Tensor:
    """[N] bool, True for request slots below the real count (an int or a 1-element tensor)."""
    return torch.arange(num_requests, device=device) < num_active_requests


def rewind_kv_cache(
    accepted_counts,
    prefill_status,
    last_kv_block_offset,
    kv_length_offsets,
    kv_block_counts,
    last_kv_block_id,
    kv_block_ids,
    num_speculative_tokens,
    block_size_tokens,
    num_active_requests=None,
):
    num_requests, max_blocks = kv_block_ids.shape
    width = max_released_blocks(num_speculative_tokens, block_size_tokens)
    device = accepted_counts.device
    real = _real_requests(num_requests, num_requests if num_active_requests is None else num_active_requests, device)

    old_offset = last_kv_block_offset.long()  # [N] offset of the last token in its block
    old_count = kv_block_counts.long()  # [N]
    old_last_id = last_kv_block_id.clone()  # [N]
    rewind = torch.where(prefill_status == 1, 0, num_speculative_tokens - accepted_counts.long())  # [N]
    rewind = torch.where(real, rewind, 0)
    position = old_offset - rewind  # [N] new last token's offset relative to the old last block
    released = (torch.clamp(-position, min=0) + block_size_tokens - 1) // block_size_tokens  # ceil(-position / bs)
    released = torch.minimum(released, old_count.clamp(0, width))  # bounds only inconsistent inputs reach
    released = torch.where(real, released, 0)  # [N] blocks freed
    new_count = old_count - released  # [N]

    # back[r, j]: column of the j-th block counting back from the old last block, j in [0, W]
    back = old_count[:, None] - 1 - torch.arange(width + 1, device=device)  # [N, W + 1]
    back_ids = kv_block_ids.gather(1, back.clamp(0, max_blocks - 1))  # [N, W + 1]
    back_ids = torch.where((back >= 0) & (back < max_blocks), back_ids, 0)
    new_last_back = old_count - 1 - torch.clamp(new_count - 1, min=0)  # [N] in [0, W]
    new_last_id = back_ids.gather(1, new_last_back.clamp(0, width)[:, None]).squeeze(1)  # [N]

    released_cols = torch.arange(width, device=device) < released[:, None]  # [N, W] bool
    blocks_to_release = torch.where(released_cols, back_ids[:, :width], 0).to(last_kv_block_id.dtype)
    blocks_to_release[:, 0] = torch.where(real, old_last_id, 0)  # column 0: the old last block
    remove_mask = released_cols  # padding requests release nothing (released == 0)

    columns = torch.arange(max_blocks, device=device)  # [max_blocks]
    cleared = (columns >= new_count[:, None]) & (columns < old_count[:, None])  # [N, max_blocks] bool
    kv_block_ids.masked_fill_(cleared, -1)
    kv_length_offsets.sub_(rewind.to(kv_length_offsets.dtype))
    last_kv_block_offset.copy_(torch.where(real, torch.remainder(position, block_size_tokens), old_offset))
    kv_block_counts.copy_(new_count)
    last_kv_block_id.copy_(torch.where(released > 0, new_last_id, old_last_id))
    shape = release_shape(num_requests, width)
    return blocks_to_release.reshape(shape), remove_mask.reshape(shape)


def mamba_state_selective_copy(
    intermediate_states, current_states, prefill_status, state_idx, accepted_counts, num_layers
):
    # Boolean selection of the decode requests syncs on a GPU; this is the CPU path.
    decode = prefill_status == 0  # [N] bool
    slots = state_idx[decode].long()  # [Nd]
    accepted = accepted_counts[decode].long()  # [Nd]
    current_states[:num_layers, slots] = intermediate_states[:num_layers, slots, accepted]


def _request_of_packed_row(num_decode_requests, num_prefill_requests, num_speculative_tokens, device):
    """[Nd * (S + 1) + Np] int64: which request owns each packed row."""
    stride = num_speculative_tokens + 1
    decode_rows = torch.arange(num_decode_requests * stride, device=device) // stride
    prefill_rows = num_decode_requests + torch.arange(num_prefill_requests, device=device)
    return torch.cat([decode_rows, prefill_rows])


def verify_and_commit(
    input_tokens,
    output_tokens,
    required_logit_indices,
    sampled_tokens_buf,
    last_accepted_seq_buf,
    accepted_tokens_per_request,
    accepted_token_counts,
    last_kv_block_offset,
    kv_length_offsets,
    kv_block_counts,
    last_kv_block_id,
    kv_block_ids,
    num_decode_requests,
    num_prefill_requests,
    num_speculative_tokens,
    block_size_tokens,
    num_active_requests=None,
    out: Optional[StepCommit] = None,
    keep_released_blocks: bool = False,
    decode_count=None,
    request_slots=None,
    query_start_loc=None,
):
    """The three reference ops in a row, on the real requests only (padding slots keep their state).
    ``keep_released_blocks``: the block ids stay in ``kv_block_ids`` and nothing is reported released.
    ``decode_count`` (a 1-element tensor): the decode-request count, ``num_decode_requests`` its bound.
    ``request_slots``: request r's KV state is row ``request_slots[r]`` of the state tensors.
    ``query_start_loc``: a decode request rewinds ``rows - 1 - accepted`` (its packed rows), not ``S - accepted``."""
    num_requests = num_decode_requests + num_prefill_requests
    if request_slots is not None:  # run on the requests' gathered state, then write it back
        slots = request_slots[:num_requests]
        state = (last_kv_block_offset, kv_length_offsets, kv_block_counts, last_kv_block_id, kv_block_ids)
        gathered = [tensor[slots].clone() for tensor in state]  # [N] / [N, MB] each
        result = verify_and_commit(input_tokens, output_tokens, required_logit_indices, sampled_tokens_buf,
                                   last_accepted_seq_buf, accepted_tokens_per_request, accepted_token_counts,
                                   *gathered, num_decode_requests, num_prefill_requests, num_speculative_tokens,
                                   block_size_tokens, num_active_requests, out, keep_released_blocks, decode_count,
                                   query_start_loc=query_start_loc)
        for tensor, rows in zip(state, gathered):  # padding requests left their (shared) slot's rows as they were
            tensor[slots] = rows
        return result
    if decode_count is not None:  # the twin may read it on the host
        num_decode_requests = int(decode_count.reshape(-1)[0])
        num_prefill_requests = num_requests - num_decode_requests
    device = output_tokens.device
    active = num_requests if num_active_requests is None else num_active_requests
    real = _real_requests(num_requests, active, device)  # [N] bool

    last_one_indices, accepted_tokens_mask, tokens = verify_speculative_tokens(
        input_tokens, output_tokens, num_decode_requests, num_prefill_requests, num_speculative_tokens
    )
    caller_buffers = (sampled_tokens_buf, last_accepted_seq_buf, accepted_tokens_per_request, accepted_token_counts)
    before = [buf.clone() for buf in caller_buffers]
    prepare_next_forward_pass(
        num_decode_requests,
        output_tokens,
        required_logit_indices,
        last_one_indices,
        accepted_tokens_mask,
        tokens,
        *caller_buffers,
        num_speculative_tokens,
    )
    for buf, old in zip(caller_buffers, before):  # padding slots keep what the caller had
        rows = min(buf.shape[0], num_requests)
        pad = ~real[:rows].reshape((rows,) + (1,) * (buf.dim() - 1))
        buf[:rows] = torch.where(pad, old[:rows], buf[:rows])

    decode_accepted_counts = torch.zeros(num_requests, dtype=torch.int64, device=device)  # [N]
    decode_accepted_counts[:num_decode_requests] = accepted_token_counts[:num_decode_requests]
    if query_start_loc is not None:  # rewind rows - 1 - accepted = S - (accepted + S + 1 - rows)
        starts = query_start_loc.long()
        rows = (starts[1 : num_requests + 1] - starts[:num_requests])[:num_decode_requests]
        decode_accepted_counts[:num_decode_requests] += num_speculative_tokens + 1 - rows
    is_prefill = (torch.arange(num_requests, device=device) >= num_decode_requests).to(torch.int32)  # [N]
    kept_block_ids = kv_block_ids.clone() if keep_released_blocks else None
    blocks_to_release, remove_mask = rewind_kv_cache(
        decode_accepted_counts,
        is_prefill,
        last_kv_block_offset,
        kv_length_offsets,
        kv_block_counts,
        last_kv_block_id,
        kv_block_ids,
        num_speculative_tokens,
        block_size_tokens,
        active,
    )

    if keep_released_blocks:
        kv_block_ids.copy_(kept_block_ids)
        remove_mask = torch.zeros_like(remove_mask)
    packed = _request_of_packed_row(num_decode_requests, num_prefill_requests, num_speculative_tokens, device)
    accepted_tokens_mask[: packed.shape[0]] &= real[packed]
    result = StepCommit(
        torch.where(real, last_one_indices, -1), accepted_tokens_mask, blocks_to_release, remove_mask
    )
    if out is None:
        return result
    for dst, src in zip(out, result):
        dst.copy_(src)
    return StepCommit(*out)
