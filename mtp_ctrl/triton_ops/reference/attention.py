"""Pure-torch twins of the paged KV-cache write and paged attention ops.

No loop over requests: the query rows of every request are padded to the batch's longest
query, the request's KV is gathered through its block table, and one masked softmax in fp32
covers the whole batch.
"""

from typing import Optional

import torch

from mtp_ctrl.triton_ops.reference.glue import split_qkv_heads


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size_tokens, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size_tokens, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1 = skip
) -> None:
    block_size_tokens = key_cache.shape[1]
    written = slot_mapping >= 0  # [T] bool
    slots = slot_mapping[written]  # [W] int64
    block_ids, offsets = slots // block_size_tokens, slots % block_size_tokens
    key_cache[block_ids, offsets] = key[written]
    value_cache[block_ids, offsets] = value[written]


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size_tokens, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size_tokens, Hkv, D]
    block_table: torch.Tensor,  # [B, max_blocks_per_request] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    softmax_scale: float,
    *,
    max_query_len: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    num_kv_splits: Optional[int] = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Same contract as :func:`mtp_ctrl.triton_ops.paged_attention`; ``num_kv_splits`` is ignored.

    Padded layout example: ``query_start_loc = [0, 3, 4]`` gives ``q_lens = [3, 1]``, padded to
    ``Q = 3`` columns; ``rows = [[0, 1, 2], [3, 4, 5]]`` of which ``[[T, T, T], [T, F, F]]``
    are real.
    """
    num_tokens, num_query_heads, _ = query.shape
    batch_size, max_blocks = block_table.shape
    block_size_tokens, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    output = torch.zeros_like(query)  # [T, Hq, D]
    query_starts = query_start_loc[:-1].long()  # [B]
    q_lens = query_start_loc[1:].long() - query_starts  # [B]
    if num_tokens == 0 or batch_size == 0:
        return output
    padded_q = int(q_lens.max()) if max_query_len is None else min(max_query_len, num_tokens)
    if padded_q == 0:
        return output
    kv_blocks = max_blocks
    if max_seq_len is not None:
        kv_blocks = min(max_blocks, max(1, -(-max_seq_len // block_size_tokens)))
    block_ids = block_table[:, :kv_blocks].long().clamp(min=0)  # [B, kv_blocks]; unused ids are masked below
    keys = key_cache[block_ids].flatten(1, 2).float()  # [B, N, Hkv, D]
    values = value_cache[block_ids].flatten(1, 2).float()  # [B, N, Hkv, D]
    group_size = num_query_heads // num_kv_heads
    keys = keys.repeat_interleave(group_size, dim=2)  # [B, N, Hq, D]
    values = values.repeat_interleave(group_size, dim=2)  # [B, N, Hq, D]

    query_index = torch.arange(padded_q, device=query.device)  # [Q]
    row_valid = query_index[None, :] < q_lens[:, None]  # [B, Q] bool
    rows = (query_starts[:, None] + query_index[None, :]).clamp(max=num_tokens - 1)  # [B, Q] int64
    positions = seq_lens.long()[:, None] - q_lens[:, None] + query_index[None, :]  # [B, Q] int64
    kv_positions = torch.arange(keys.shape[1], device=query.device)  # [N]
    visible = (kv_positions[None, None, :] <= positions[:, :, None]) & row_valid[:, :, None]  # [B, Q, N]

    queries = query[rows].float()  # [B, Q, Hq, D]
    scores = torch.einsum("bqhd,bnhd->bhqn", queries, keys) * softmax_scale  # [B, Hq, Q, N] fp32
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(visible[:, None], probs, 0.0)  # fully masked (padding) rows give NaN: zero them
    attended = torch.einsum("bhqn,bnhd->bqhd", probs, values)  # [B, Q, Hq, D] fp32
    output[rows[row_valid]] = attended[row_valid].to(query.dtype)
    return output


def _rope(
    rows: torch.Tensor,  # [T, H, D]
    cos: torch.Tensor,  # [T, R / 2] fp32
    sin: torch.Tensor,  # [T, R / 2] fp32
    rotary_interleaved: bool,
) -> torch.Tensor:  # [T, H, D], rows' dtype
    """megatron's rotary (halves or interleaved pairs) on the first ``R`` dims, in fp32."""
    rotary_dim = 2 * cos.shape[1]
    rotated, passed = rows.float()[..., :rotary_dim], rows[..., rotary_dim:]  # [T, H, R] fp32, [T, H, D - R]
    if rotary_interleaved:
        cos_full = cos.repeat_interleave(2, dim=-1)  # [T, R]: c0 c0 c1 c1 ...
        sin_full = sin.repeat_interleave(2, dim=-1)
        partner = torch.stack((-rotated[..., 1::2], rotated[..., 0::2]), dim=-1).flatten(-2)  # -x1 x0 -x3 x2 ...
    else:
        cos_full = torch.cat((cos, cos), dim=-1)  # [T, R]: c0 c1 ... c0 c1 ...
        sin_full = torch.cat((sin, sin), dim=-1)
        first, second = rotated.chunk(2, dim=-1)
        partner = torch.cat((-second, first), dim=-1)
    roped = rotated * cos_full[:, None] + partner * sin_full[:, None]  # [T, H, R] fp32
    return torch.cat((roped.to(rows.dtype), passed), dim=-1)


def rope_and_write_kv_cache(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size_tokens, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size_tokens, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1 = no write
    cos: Optional[torch.Tensor],  # [T, R / 2] fp32 or None
    sin: Optional[torch.Tensor],  # [T, R / 2] fp32 or None
    rotary_interleaved: bool = False,
) -> torch.Tensor:  # [T, Hq, D]
    """Same contract as :func:`mtp_ctrl.triton_ops.rope_and_write_kv_cache`."""
    if cos is None:
        write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
        return query
    write_kv_cache(_rope(key, cos, sin, rotary_interleaved), value, key_cache, value_cache, slot_mapping)
    return _rope(query, cos, sin, rotary_interleaved)


def rope_and_write_kv_cache_mixed(
    mixed_qkv: torch.Tensor,  # [T, G * (Q / G + 2) * D]
    bias: Optional[torch.Tensor],  # [mixed_qkv.shape[1]] or None
    num_kv_heads: int,
    head_dim: int,
    key_cache: torch.Tensor,  # [num_blocks, block_size_tokens, G, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size_tokens, G, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1 = no write
    cos: Optional[torch.Tensor],  # [T, R / 2] fp32 or None
    sin: Optional[torch.Tensor],  # [T, R / 2] fp32 or None
    rotary_interleaved: bool = False,
) -> torch.Tensor:  # [T, Q, D]
    """Same contract as :func:`mtp_ctrl.triton_ops.rope_and_write_kv_cache_mixed`: the split, then the rope."""
    query, key, value = split_qkv_heads(mixed_qkv, bias, num_kv_heads, head_dim)
    return rope_and_write_kv_cache(query, key, value, key_cache, value_cache, slot_mapping, cos, sin,
                                   rotary_interleaved)
