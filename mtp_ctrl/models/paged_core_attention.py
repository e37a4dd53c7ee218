"""megatron-core core-attention module that attends through mtp_ctrl's paged KV cache.

It fills the ``core_attention`` slot of megatron's ``SelfAttention`` and keeps
``DotProductAttention``'s forward signature. Megatron hands it this forward's rows as a
sequence of ``T`` packed query rows with batch 1 (``[T, 1, heads_local, D]``); it stores the
rows' keys and values at ``metadata.slot_mapping`` in its own layer's cache, then runs causal
paged attention over each request's blocks.

Rotary: on the fused path (:class:`mtp_ctrl.models.PagedGPTRunner`'s default) megatron gets
``rotary_pos_emb=None`` and this module ropes q and k itself from the forward's
:class:`~mtp_ctrl.models.forward_context.RotaryTables`, in the same launch as the cache write
(:func:`mtp_ctrl.triton_ops.rope_and_write_kv_cache`). Without tables (the unfused path, or a
model without rotary) megatron has applied rotary already, and only the cache write runs.
"""

from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from mtp_ctrl.models.forward_context import current_paged_forward
from mtp_ctrl.triton_ops import paged_attention, rope_and_write_kv_cache, rope_and_write_kv_cache_mixed


class PagedCoreAttention(MegatronModule):
    """Causal attention of packed rows over a paged KV cache (one cache pair per instance).

    ``kv_layer_index`` picks this module's pair in ``kv_caches``; the model builder assigns it
    (:func:`mtp_ctrl.models.layer_specs.assign_kv_layer_indices`).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        cp_comm_type: Optional[str] = None,
        softmax_scale: Optional[float] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(f"PagedCoreAttention supports self attention only, got attention_type={attention_type!r}")
        if config.context_parallel_size != 1:
            raise ValueError("PagedCoreAttention does not support context parallelism (context_parallel_size != 1)")
        tp_size = (pg_collection.tp.size() if pg_collection is not None and hasattr(pg_collection, "tp")
                   else parallel_state.get_tensor_model_parallel_world_size())
        for name in ("num_attention_heads", "num_query_groups"):
            if getattr(config, name) % tp_size != 0:
                raise ValueError(f"config.{name}={getattr(config, name)} is not divisible by the "
                                 f"tensor-parallel size {tp_size}")
        self.layer_number = layer_number
        self.num_query_heads_local = divide(config.num_attention_heads, tp_size)
        self.num_kv_heads_local = divide(config.num_query_groups, tp_size)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.head_dim ** -0.5
        self.kv_layer_index: Optional[int] = None
        # megatron's SelfAttention skips rotary in layers flagged by config.no_rope_freq (0-indexed
        # list, 1-indexed layer_number); the fused path must skip them too
        no_rope_freq = config.no_rope_freq if isinstance(config.no_rope_freq, (list, tuple)) else None
        self.skips_rotary = bool(no_rope_freq and layer_number - 1 < len(no_rope_freq)
                                 and no_rope_freq[layer_number - 1])

    def forward(
        self,
        query: torch.Tensor,  # [T, 1, Hq_local, D]
        key: torch.Tensor,  # [T, 1, Hkv_local, D]
        value: torch.Tensor,  # [T, 1, Hkv_local, D]
        attention_mask: Optional[torch.Tensor],
        attn_mask_type=None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:  # [T, 1, Hq_local * D]
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("PagedCoreAttention takes no attention_bias or packed_seq_params")
        if query.dim() != 4 or query.shape[1] != 1:
            raise ValueError(f"query must be [T, 1, heads, D] (packed rows, batch 1), got {tuple(query.shape)}")
        forward, key_cache, value_cache = self._layer_cache(query.shape[0])
        rotary = None if self.skips_rotary else forward.rotary
        roped_query = rope_and_write_kv_cache(
            query[:, 0], key[:, 0], value[:, 0], key_cache, value_cache, forward.metadata.slot_mapping,
            None if rotary is None else rotary.cos, None if rotary is None else rotary.sin,
            self.config.rotary_interleaved,
        )  # [T, Hq_local, D]
        return self._attend(roped_query, key_cache, value_cache, forward.metadata)

    def forward_mixed_qkv(
        self,
        mixed_qkv: torch.Tensor,  # [T, G_local * (Hq / G + 2) * D]: megatron's fused QKV projection rows
        bias: Optional[torch.Tensor],  # [mixed_qkv.shape[1]] or None: that projection's bias, not yet added
    ) -> torch.Tensor:  # [T, 1, Hq_local * D]
        """:meth:`forward` straight from the QKV projection: the bias add, the head split, rope and
        the cache write are one launch (:func:`mtp_ctrl.triton_ops.rope_and_write_kv_cache_mixed`)."""
        forward, key_cache, value_cache = self._layer_cache(mixed_qkv.shape[0])
        rotary = None if self.skips_rotary else forward.rotary
        roped_query = rope_and_write_kv_cache_mixed(
            mixed_qkv, bias, self.num_kv_heads_local, self.head_dim, key_cache, value_cache,
            forward.metadata.slot_mapping, None if rotary is None else rotary.cos,
            None if rotary is None else rotary.sin, self.config.rotary_interleaved,
        )  # [T, Hq_local, D]
        return self._attend(roped_query, key_cache, value_cache, forward.metadata)

    def _layer_cache(self, num_rows: int):
        """This forward's context and this layer's cache pair, checked against ``num_rows`` query rows."""
        forward = current_paged_forward()
        if self.kv_layer_index is None:
            raise RuntimeError(f"layer {self.layer_number}: kv_layer_index is unset; build the model with "
                               "mtp_ctrl.models.build_gpt_model or call assign_kv_layer_indices(model)")
        if self.kv_layer_index >= len(forward.kv_caches):
            raise ValueError(f"kv_caches has {len(forward.kv_caches)} layers, this attention uses index "
                             f"{self.kv_layer_index}")
        key_cache, value_cache = forward.kv_caches[self.kv_layer_index]
        want = (self.num_kv_heads_local, self.head_dim)
        if tuple(key_cache.shape[2:]) != want:
            raise ValueError(f"kv_caches[{self.kv_layer_index}] is {tuple(key_cache.shape)}, expected "
                             f"[num_blocks, block_size_tokens, {want[0]}, {want[1]}]")
        if forward.metadata.num_tokens != num_rows:
            raise ValueError(f"metadata has {forward.metadata.num_tokens} rows, the forward has {num_rows}")
        return forward, key_cache, value_cache

    def _attend(self, roped_query, key_cache, value_cache, metadata) -> torch.Tensor:  # [T, 1, Hq_local * D]
        attended = paged_attention(
            roped_query, key_cache, value_cache, metadata.block_table, metadata.seq_lens,
            metadata.query_start_loc, self.softmax_scale,
            max_query_len=metadata.max_query_len, max_seq_len=metadata.max_seq_len,
        )  # [T, Hq_local, D]
        return attended.view(attended.shape[0], 1, -1)
