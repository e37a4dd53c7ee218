"""Pure-torch twins of the multi-latent attention (MLA) ops: the latent-cache write and the
absorbed paged attention over the latent cache.

Letters: T packed rows, H query heads (local to the rank), C the latent width
(``kv_lora_rank``), R the rotary key width (``qk_pos_emb_head_dim``), B requests.
"""

from typing import Optional

import torch

from mtp_ctrl.triton_ops.reference.attention import paged_attention


def mla_rope(
    rows: torch.Tensor,  # [..., R]: one row per leading index; dim 0 is the row t of cos / sin
    cos: torch.Tensor,  # [T, R / 2] fp32
    sin: torch.Tensor,  # [T, R / 2] fp32
) -> torch.Tensor:  # [..., R], rows' dtype
    """megatron's MLA rotary (``_apply_rotary_pos_emb_bshd`` with ``multi_latent_attention``):
    the pairs ``(x[2j], x[2j+1])`` are first gathered into halves ``[x0 x2 .. | x1 x3 ..]``, then
    rotated as halves, in fp32: ``out[j] = x[2j] cos_j - x[2j+1] sin_j``,
    ``out[j + R/2] = x[2j+1] cos_j + x[2j] sin_j``."""
    x = rows.float()
    even, odd = x[..., 0::2], x[..., 1::2]  # [..., R / 2] each
    shape = (cos.shape[0],) + (1,) * (rows.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1).to(rows.dtype)


def rope_and_write_latent_cache(
    query_rope: torch.Tensor,  # [T, H, R]: the rotary part of each query head, not yet roped
    kv_latent: torch.Tensor,  # [T, C]: the normed compressed key-value latent
    key_rope: torch.Tensor,  # [T, R]: the shared rotary key, not yet roped
    latent_cache: torch.Tensor,  # [num_blocks, block_size_tokens, C + R]
    slot_mapping: torch.Tensor,  # [T] int64; -1 = no write
    cos: torch.Tensor,  # [T, R / 2] fp32 (times megatron's mscale)
    sin: torch.Tensor,  # [T, R / 2] fp32
) -> torch.Tensor:  # [T, H, R] roped query
    """Same contract as :func:`mtp_ctrl.triton_ops.rope_and_write_latent_cache`."""
    block_size_tokens = latent_cache.shape[1]
    written = slot_mapping >= 0  # [T] bool
    slots = slot_mapping[written]  # [W] int64
    rows = torch.cat((kv_latent, mla_rope(key_rope, cos, sin)), dim=-1)  # [T, C + R]
    latent_cache[slots // block_size_tokens, slots % block_size_tokens] = rows[written].to(latent_cache.dtype)
    return mla_rope(query_rope, cos, sin)


def paged_mla_attention(
    query_latent: torch.Tensor,  # [T, H, C]: no-rope query times the key up-projection (absorbed)
    query_rope: torch.Tensor,  # [T, H, R]: roped query
    latent_cache: torch.Tensor,  # [num_blocks, block_size_tokens, C + R]
    block_table: torch.Tensor,  # [B, max_blocks_per_request] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    softmax_scale: float,
    *,
    max_query_len: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    num_kv_splits: Optional[int] = None,
    tiles=None,
) -> torch.Tensor:  # [T, H, C]
    """Same contract as :func:`mtp_ctrl.triton_ops.paged_mla_attention`; ``num_kv_splits`` and
    ``tiles`` (launch shapes) are ignored. It is standard paged attention with one kv head whose key is the cached row
    ``[latent | rope key]`` and whose value is the same row (the output's last R dims dropped)."""
    latent_width = query_latent.shape[-1]
    query = torch.cat((query_latent, query_rope), dim=-1)  # [T, H, C + R]
    cache = latent_cache[:, :, None, :]  # [num_blocks, block_size_tokens, 1, C + R]
    attended = paged_attention(query, cache, cache, block_table, seq_lens, query_start_loc, softmax_scale,
                               max_query_len=max_query_len, max_seq_len=max_seq_len)  # [T, H, C + R]
    return attended[..., :latent_width].contiguous()
