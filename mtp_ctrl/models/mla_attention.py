"""Multi-latent attention (DeepSeek-V3 family) over mtp_ctrl's paged latent cache.

:class:`PagedMLASelfAttention` is megatron's ``MLASelfAttention`` (same submodules, parameter
names and TP sharding, so megatron checkpoints load unchanged). Inside a paged forward it runs
megatron's projections and norms itself, then hands the rows to :class:`PagedMLACoreAttention`
(the ``core_attention`` slot), which:

1. ropes the shared rotary key and the queries' rotary part at each row's position and stores
   ``[normed latent | roped key]`` (``kv_lora_rank + qk_pos_emb_head_dim`` values a token, one
   ``[num_blocks, block_size_tokens, C + R]`` tensor per layer) at the row's slot
   (:func:`mtp_ctrl.triton_ops.rope_and_write_latent_cache`);
2. attends, either
   - absorbed (decode and verify: at most ``absorb_max_query_len`` rows a request): the no-rope
     query is multiplied by the key up-projection once (``[T, H, C]``), scores are taken against
     the cached latents plus the rope key, and the value up-projection is applied after the
     weighted sum (:func:`mtp_ctrl.triton_ops.paged_mla_attention`); or
   - decompressed (steps with longer prefill chunks, while the temporary K/V stays under
     ``DECOMPRESS_MAX_BYTES``): the batch's cached latents go through ``linear_kv_up_proj`` to
     per-head K/V in a temporary paged layout, and the standard paged kernel attends
     (:func:`mtp_ctrl.triton_ops.paged_attention`).

Rotary: megatron's MLA builds its own ``RotaryEmbedding`` / ``YarnRotaryEmbedding``, whose
tables need CUDA and positions ``0..s-1``. While this layer is built those names resolve to
:class:`LatentRotary`, the same frequencies (and YaRN ``mscale``) on any device and at any
positions; it holds no parameters, so state dicts do not change. The runner takes the step's
cos / sin from it once per forward (:meth:`LatentRotary.tables`).

Tensor parallelism as megatron: heads split over the ranks; the down projections are gathered,
so every rank holds (and caches) the whole latent.
"""

import contextlib
import math
from typing import Optional

import torch
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_find_correction_range,
    _yarn_get_concentration_factor,
    _yarn_linear_ramp_mask,
)
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from mtp_ctrl.models.forward_context import RotaryTables, current_paged_forward, in_paged_forward
from mtp_ctrl.models.tp_gather import gather_last_dim_over_tp
from mtp_ctrl.triton_ops import paged_attention, paged_mla_attention, rope_and_write_latent_cache

# decode and verify rows (1 + S a request) attend in latent space; longer prefill chunks decompress,
# unless the temporary K/V of the batch's context would pass this many bytes (then absorbed too)
DEFAULT_ABSORB_MAX_QUERY_LEN = 64  # H100, bench_mla.py section 2: absorbed wins to 64 rows, decompressed from 256
DECOMPRESS_MAX_BYTES = 1 << 30


class LatentRotary(torch.nn.Module):
    """megatron's MLA rotary frequencies (plain or YaRN) as a device-following buffer.

    Built in place of megatron's ``RotaryEmbedding(qk_pos_emb_head_dim, rotary_percent=..,
    rotary_base=.., cp_group=..)`` or ``YarnRotaryEmbedding(qk_pos_emb_head_dim, rotary_base=..,
    scaling_factor=.., original_max_position_embeddings=.., beta_fast=.., beta_slow=.., mscale=..,
    mscale_all_dim=.., cp_group=..)``; ``forward`` returns what megatron's would (``[s, 1, 1, R]``
    angles, with the YaRN ``mscale`` for YaRN), so megatron's own MLA forward still runs.
    """

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_base: float = 10000.0, *,
                 yarn: bool = False, scaling_factor: float = 1.0, original_max_position_embeddings: int = 4096,
                 beta_fast: float = 32.0, beta_slow: float = 1.0, mscale: float = 1.0, mscale_all_dim: float = 0.0,
                 cp_group=None, **unused):
        super().__init__()
        self.yarn = yarn
        dim = kv_channels if yarn or rotary_percent >= 1.0 else int(kv_channels * rotary_percent)
        exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim  # [R / 2]
        inv_freq = 1.0 / (rotary_base ** exponents)  # [R / 2] fp32
        self.mscale = 1.0
        if yarn:  # megatron's YarnRotaryEmbedding.get_emb
            low, high = _yarn_find_correction_range(beta_fast, beta_slow, dim, rotary_base,
                                                    original_max_position_embeddings, True)
            extrapolated = 1.0 - _yarn_linear_ramp_mask(low, high, dim // 2, device=inv_freq.device).float()  # the default device (a `with torch.device` block builds on it)
            inv_freq = inv_freq / scaling_factor * (1 - extrapolated) + inv_freq * extrapolated
            self.mscale = float(_yarn_get_concentration_factor(scaling_factor, mscale, mscale_all_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def angles(self, positions: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, R / 2] fp32
        return torch.outer(positions.to(self.inv_freq.device, torch.float32), self.inv_freq)

    def tables(self, positions: torch.Tensor) -> RotaryTables:  # positions [T] int64
        angles = self.angles(positions)  # [T, R / 2] fp32
        cos, sin = torch.cos(angles), torch.sin(angles)
        if self.mscale != 1.0:
            cos, sin = cos * self.mscale, sin * self.mscale
        return RotaryTables(cos=cos, sin=sin)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        angles = self.angles(torch.arange(offset, offset + max_seq_len, device=self.inv_freq.device))
        emb = torch.cat((angles, angles), dim=-1)[:, None, None, :]  # [s, 1, 1, R]
        return (emb, self.mscale) if self.yarn else emb

    def get_rotary_seq_len(self, inference_context, transformer, transformer_input, transformer_config,
                           packed_seq_params=None) -> int:
        return transformer_input.size(0)  # megatron's training path: the whole [s, b, h] input


@contextlib.contextmanager
def _latent_rotary_in_mla():
    """While inside, megatron's MLA module builds :class:`LatentRotary` for either rotary kind.
    Without Transformer Engine, megatron 0.16's MLA still sets ``HAVE_TE`` (its TE extension module
    imports, with ``TELinear = None``) and then fails on ``isinstance(.., TELinear)``: cleared too."""
    module = multi_latent_attention
    saved = module.RotaryEmbedding, module.YarnRotaryEmbedding, module.HAVE_TE
    module.RotaryEmbedding = lambda *args, **kwargs: LatentRotary(*args, **kwargs)
    module.YarnRotaryEmbedding = lambda *args, **kwargs: LatentRotary(*args, yarn=True, **kwargs)
    module.HAVE_TE = module.HAVE_TE and isinstance(module.TELinear, type)
    try:
        yield
    finally:
        module.RotaryEmbedding, module.YarnRotaryEmbedding, module.HAVE_TE = saved


class PagedMLACoreAttention(MegatronModule):
    """The ``core_attention`` slot of :class:`PagedMLASelfAttention`: owns the layer's index into
    ``kv_caches`` (:func:`mtp_ctrl.models.layer_specs.assign_kv_layer_indices`) and the attention
    over the latent cache (module docstring)."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 cp_comm_type=None, softmax_scale: Optional[float] = None, k_channels=None, v_channels=None,
                 pg_collection=None):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(f"PagedMLACoreAttention supports self attention only, got {attention_type!r}")
        if config.context_parallel_size != 1:
            raise ValueError("PagedMLACoreAttention does not support context parallelism (context_parallel_size != 1)")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.kv_layer_index: Optional[int] = None
        self.latent_dim = config.kv_lora_rank + config.qk_pos_emb_head_dim
        self.absorb_max_query_len = DEFAULT_ABSORB_MAX_QUERY_LEN

    def forward(self, *args, **kwargs):
        raise RuntimeError("PagedMLACoreAttention runs through PagedMLASelfAttention inside a paged forward")

    def layer_cache(self, num_rows: int):
        """This forward's context and this layer's latent cache, checked against ``num_rows`` rows."""
        forward = current_paged_forward()
        if self.kv_layer_index is None:
            raise RuntimeError(f"layer {self.layer_number}: kv_layer_index is unset; build the model with "
                               "mtp_ctrl.models.build_gpt_model or call assign_kv_layer_indices(model)")
        if self.kv_layer_index >= len(forward.kv_caches):
            raise ValueError(f"kv_caches has {len(forward.kv_caches)} layers, this attention uses index "
                             f"{self.kv_layer_index}")
        cache = forward.kv_caches[self.kv_layer_index]
        if not isinstance(cache, torch.Tensor) or cache.dim() != 3 or cache.shape[2] != self.latent_dim:
            got = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
            raise ValueError(f"kv_caches[{self.kv_layer_index}] is {got}, expected an MLA latent cache "
                             f"[num_blocks, block_size_tokens, {self.latent_dim}] (LatentKVCacheSpec)")
        if forward.metadata.num_tokens != num_rows:
            raise ValueError(f"metadata has {forward.metadata.num_tokens} rows, the forward has {num_rows}")
        if forward.rotary is None:
            raise RuntimeError("an MLA layer needs the forward's rotary tables; run it through PagedGPTRunner")
        return forward, cache

    def attend(
        self,
        query_nope: torch.Tensor,  # [T, H_local, Dqk]
        query_rope: torch.Tensor,  # [T, H_local, R], not yet roped
        kv_latent: torch.Tensor,  # [T, C], normed
        key_rope: torch.Tensor,  # [T, R], not yet roped
        kv_up_weight: torch.Tensor,  # [H_local, Dqk + Dv, C]: linear_kv_up_proj's weight by head
        kv_up_proj,  # linear_kv_up_proj: [N, C] -> ([N, H_local * (Dqk + Dv)], bias)
    ) -> torch.Tensor:  # [T, H_local * Dv]
        forward, cache = self.layer_cache(query_nope.shape[0])
        metadata = forward.metadata
        roped_query = rope_and_write_latent_cache(query_rope, kv_latent, key_rope, cache, metadata.slot_mapping,
                                                  forward.rotary.cos, forward.rotary.sin)  # [T, H, R]
        if metadata.max_query_len <= self.absorb_max_query_len or \
                decompressed_bytes(query_nope, roped_query, cache, metadata, kv_up_weight) > DECOMPRESS_MAX_BYTES:
            return absorbed_mla_attention(query_nope, roped_query, cache, metadata, kv_up_weight, self.softmax_scale)
        return decompressed_mla_attention(query_nope, roped_query, cache, metadata, kv_up_proj,
                                          kv_up_weight.shape[1] - query_nope.shape[-1], self.softmax_scale)


def absorbed_mla_attention(
    query_nope: torch.Tensor,  # [T, H, Dqk]
    roped_query: torch.Tensor,  # [T, H, R]
    cache: torch.Tensor,  # [num_blocks, block_size_tokens, C + R]
    metadata,  # AttentionMetadata of the rows
    kv_up_weight: torch.Tensor,  # [H, Dqk + Dv, C]
    softmax_scale: float,
) -> torch.Tensor:  # [T, H * Dv]
    """Attention in latent space: ``q_nope W_UK`` once per row and head, the paged MLA kernel over
    the cached latents, then ``W_UV`` on the weighted latent sum."""
    qk_head_dim = query_nope.shape[-1]
    up_k, up_v = kv_up_weight[:, :qk_head_dim], kv_up_weight[:, qk_head_dim:]  # [H, Dqk, C], [H, Dv, C]
    query_latent = torch.bmm(query_nope.transpose(0, 1), up_k).transpose(0, 1).contiguous()  # [T, H, C]
    attended = paged_mla_attention(
        query_latent, roped_query, cache, metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
        softmax_scale, max_query_len=metadata.max_query_len, max_seq_len=metadata.max_seq_len,
    )  # [T, H, C]
    out = torch.bmm(attended.transpose(0, 1), up_v.transpose(1, 2))  # [H, T, Dv]
    return out.transpose(0, 1).reshape(out.shape[1], -1)


def decompressed_bytes(query_nope, roped_query, cache, metadata, kv_up_weight) -> int:
    """Bytes of the temporary K/V :func:`decompressed_mla_attention` would build (from shapes and
    the metadata's Python bounds only: no host sync, the same answer at capture and replay)."""
    block_size_tokens = cache.shape[1]
    batch_size, max_blocks = metadata.block_table.shape
    kv_blocks = max(1, min(max_blocks, math.ceil(metadata.max_seq_len / block_size_tokens)))
    width = max(query_nope.shape[-1] + roped_query.shape[-1], kv_up_weight.shape[1] - query_nope.shape[-1])
    return 2 * batch_size * kv_blocks * block_size_tokens * query_nope.shape[1] * width * cache.element_size()


def decompressed_mla_attention(
    query_nope: torch.Tensor,  # [T, H, Dqk]
    roped_query: torch.Tensor,  # [T, H, R]
    cache: torch.Tensor,  # [num_blocks, block_size_tokens, C + R]
    metadata,  # AttentionMetadata of the rows
    kv_up_proj,  # [N, C] -> ([N, H * (Dqk + Dv)], bias): megatron's linear_kv_up_proj
    v_head_dim: int,
    softmax_scale: float,
) -> torch.Tensor:  # [T, H * Dv]
    """The batch's cached latents (``ceil(max_seq_len / block_size)`` blocks a request) go through
    the key/value up-projection into a temporary paged K/V, one block per block of the batch's block
    table, then the standard paged kernel attends (K and V padded to one head dim)."""
    num_tokens, num_heads, qk_head_dim = query_nope.shape
    rope_dim, block_size_tokens = roped_query.shape[-1], cache.shape[1]
    batch_size, max_blocks = metadata.block_table.shape
    kv_blocks = max(1, min(max_blocks, math.ceil(metadata.max_seq_len / block_size_tokens)))
    block_ids = metadata.block_table[:, :kv_blocks].long().clamp(min=0)  # [B, nb]; -1 columns lie past seq_lens
    rows = cache[block_ids].view(-1, cache.shape[2])  # [N = B * nb * bs, C + R]
    kv_lora_rank = cache.shape[2] - rope_dim
    kv, _ = kv_up_proj(rows[:, :kv_lora_rank])  # [N, H * (Dqk + Dv)]
    kv = kv.view(rows.shape[0], num_heads, qk_head_dim + v_head_dim)
    width = max(qk_head_dim + rope_dim, v_head_dim)  # K and V share the kernel's head dim
    keys = kv.new_zeros(rows.shape[0], num_heads, width)  # [N, H, width]
    keys[..., :qk_head_dim] = kv[..., :qk_head_dim]
    keys[..., qk_head_dim:qk_head_dim + rope_dim] = rows[:, None, kv_lora_rank:]
    values = kv.new_zeros(rows.shape[0], num_heads, width)
    values[..., :v_head_dim] = kv[..., qk_head_dim:]
    query = query_nope.new_zeros(num_tokens, num_heads, width)
    query[..., :qk_head_dim] = query_nope
    query[..., qk_head_dim:qk_head_dim + rope_dim] = roped_query
    block_table = torch.arange(batch_size * kv_blocks, dtype=torch.int32,
                               device=cache.device).view(batch_size, kv_blocks)
    paged = (batch_size * kv_blocks, block_size_tokens, num_heads, width)
    attended = paged_attention(query, keys.view(paged), values.view(paged), block_table, metadata.seq_lens,
                               metadata.query_start_loc, softmax_scale,
                               max_query_len=metadata.max_query_len, max_seq_len=metadata.max_seq_len)
    return attended[..., :v_head_dim].reshape(num_tokens, -1)  # [T, H * Dv]


class PagedMLASelfAttention(MLASelfAttention):
    """megatron's ``MLASelfAttention``; inside a paged forward (eval mode, with
    :class:`PagedMLACoreAttention`) it attends through the latent cache (module docstring);
    elsewhere (training, the dense twin's SDPA core attention) megatron's forward runs unchanged."""

    def __init__(self, config, submodules, layer_number: int, *args, **kwargs):
        if config.rotary_interleaved:
            raise ValueError("MLA with rotary_interleaved=True is not supported")
        with _latent_rotary_in_mla():
            super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.num_heads_local = self.num_attention_heads_per_partition

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, position_ids=None, sequence_len_offset=None, *,
                inference_params=None):
        paged = not self.training and in_paged_forward() and isinstance(self.core_attention, PagedMLACoreAttention) \
            and key_value_states is None \
            and inference_context is None and inference_params is None and packed_seq_params is None
        if not paged:
            return super().forward(hidden_states, attention_mask, key_value_states=key_value_states,
                                   inference_context=inference_context, rotary_pos_emb=rotary_pos_emb,
                                   rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                                   rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
                                   packed_seq_params=packed_seq_params, position_ids=position_ids,
                                   sequence_len_offset=sequence_len_offset, inference_params=inference_params)
        num_rows = hidden_states.shape[0] * hidden_states.shape[1]  # [T, 1, hidden]
        query_nope, query_rope, kv_latent, key_rope = self.latent_projections(hidden_states)
        weight = self.linear_kv_up_proj.weight.view(self.num_heads_local, -1, self.config.kv_lora_rank)
        attended = self.core_attention.attend(query_nope, query_rope, kv_latent, key_rope, weight,
                                              self.linear_kv_up_proj)  # [T, H_local * Dv]
        return self.linear_proj(attended.view(num_rows, 1, -1))  # (output [T, 1, hidden], bias)

    def latent_projections(self, hidden_states: torch.Tensor):
        """megatron's ``get_query_key_value_tensors`` up to the norms, on packed rows ``[T, 1, h]``:
        ``(query_nope [T, H, Dqk], query_rope [T, H, R], kv_latent [T, C] normed, key_rope [T, R])``."""
        config = self.config
        num_rows = hidden_states.shape[0] * hidden_states.shape[1]
        if config.q_lora_rank is not None:
            q_compressed, _ = self.linear_q_down_proj(hidden_states)
            if q_compressed.size(-1) != config.q_lora_rank:  # column-parallel: gathered, as megatron does
                q_compressed = gather_last_dim_over_tp(q_compressed)
            query, _ = self.linear_q_up_proj(self.q_layernorm(q_compressed))
        else:
            query, _ = self.linear_q_proj(hidden_states)
        query = query.view(num_rows, self.num_heads_local, self.q_head_dim)
        query_nope, query_rope = torch.split(query, [config.qk_head_dim, config.qk_pos_emb_head_dim], dim=-1)
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)
        if kv_combined.size(-1) != config.kv_lora_rank + config.qk_pos_emb_head_dim:
            kv_combined = gather_last_dim_over_tp(kv_combined)
        kv_latent, key_rope = torch.split(kv_combined.view(num_rows, -1),
                                          [config.kv_lora_rank, config.qk_pos_emb_head_dim], dim=-1)
        kv_latent = self.kv_layernorm(kv_latent)
        return query_nope, query_rope.contiguous(), kv_latent.contiguous(), key_rope.contiguous()


def mla_rotary(model) -> Optional[LatentRotary]:
    """The rotary of the model's first MLA layer (all share one configuration); None without MLA."""
    for module in model.modules():
        if isinstance(module, PagedMLASelfAttention):
            return module.rotary_pos_emb
    return None
