"""A dense (unpaged) twin of :func:`build_gpt_model`'s GPT, for training and as a reference.

The twin is megatron-core's GPTModel with the same layer spec as the paged model, except that
core attention is plain causal SDPA over whole sequences: parameter names are identical, so a
state_dict moves between the two with a strict ``load_state_dict``. It runs megatron's training
path (``model(input_ids, position_ids, None, labels=labels)`` computes the language-model loss
and adds each MTP depth's loss to the backward pass) on any device.
"""

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from mtp_ctrl.models.gpt_builder import gpt_model_from_specs, paged_model_specs


class DenseCausalAttention(MegatronModule):
    """Core attention of one causal sequence per batch entry: ``[s, b, heads, D]`` in, ``[s, b, heads * D]`` out.

    Grouped-query attention is handled by SDPA (``enable_gqa``). ``attention_mask=None`` (what
    every caller but parallel-drafting training passes) is causal; else a bool mask broadcastable
    to ``[b, heads, s, s]``, True where a row may NOT attend (megatron's convention).
    """

    def __init__(self, config, layer_number, attn_mask_type=None, attention_type="self", cp_comm_type=None,
                 softmax_scale=None, pg_collection=None, k_channels=None, v_channels=None):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        allowed = None if attention_mask is None else ~attention_mask  # SDPA: True = may attend
        out = F.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
            attn_mask=allowed, is_causal=attention_mask is None, scale=self.softmax_scale, enable_gqa=True,
            dropout_p=self.dropout_p if self.training else 0.0,
        )  # [b, heads, s, D]
        return out.permute(2, 0, 1, 3).flatten(2)  # [s, b, heads * D]


class DeviceRotaryEmbedding(RotaryEmbedding):
    """megatron's RotaryEmbedding computed on the device the model is on.

    megatron keeps ``inv_freq`` as a plain attribute and moves it to the current CUDA device on
    first use (which raises on a machine without CUDA), and caches tables per length with
    ``lru_cache`` (stale after ``model.to(device)``). Here ``inv_freq`` is a non-persistent
    buffer (it follows ``.to``; state_dict keys do not change) and the table is recomputed per
    call. No context parallelism.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        inv_freq = self.inv_freq  # [rotary_dim / 2] fp32
        del self.inv_freq
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:  # [s, 1, 1, rotary_dim] fp32
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, rotary_dim / 2]
        if self.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(1)  # f0 f0 f1 f1 ...
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # f0 f1 ... f0 f1 ...
        return emb[:, None, None, :]

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        return self.get_emb(max_seq_len, offset)


def build_dense_gpt_model(
    config: TransformerConfig,
    vocab_size: int,
    max_sequence_length: int,
    *,
    use_transformer_engine: Optional[bool] = None,
    share_embeddings_and_output_weights: bool = False,
    rotary_base: int = 10000,
    rotary_percent: float = 1.0,
) -> GPTModel:
    """The GPTModel :func:`mtp_ctrl.models.build_gpt_model` builds with the same arguments, with dense causal attention.

    >>> dense = build_dense_gpt_model(config, vocab_size=512, max_sequence_length=1024)
    >>> loss = dense(tokens[:, :-1], positions, None, labels=tokens[:, 1:])  # [b, s] per-token loss
    >>> build_gpt_model(config, 512, 1024).load_state_dict(dense.state_dict())  # strict
    """
    if config.context_parallel_size != 1 or config.sequence_parallel:
        raise ValueError("the dense model supports neither context nor sequence parallelism")
    layer_spec, decoder_spec = paged_model_specs(config, use_transformer_engine)  # MoE layers as build_gpt_model's
    decoder_layers = getattr(decoder_spec, "layer_specs", [decoder_spec])
    for spec in [layer_spec, *decoder_layers]:
        spec.submodules.self_attention.submodules.core_attention = DenseCausalAttention
    model = gpt_model_from_specs(config, layer_spec, vocab_size, max_sequence_length, decoder_spec=decoder_spec,
                                 use_transformer_engine=use_transformer_engine,
                                 share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                                 rotary_base=rotary_base, rotary_percent=rotary_percent)
    if config.multi_latent_attention:  # MLA layers hold their own rotary (models/mla_attention.py)
        return model
    model.rotary_pos_emb = DeviceRotaryEmbedding(
        kv_channels=config.kv_channels, rotary_percent=rotary_percent, rotary_interleaved=config.rotary_interleaved,
        rotary_base=rotary_base, use_cpu_initialization=True,
    )
    return model


@torch.no_grad()
def dense_full_sequence(model: GPTModel, tokens: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """One causal forward over ``tokens`` [n] int64: decoder logits [n, V] and each MTP depth's logits [n, V].

    Runs megatron's own modules (embedding, decoder block, MTP block, output layer) on a dense
    model. Row i of MTP depth k's logits predicts token ``i + k + 2`` (depth k reads the input
    ids rolled left by ``k + 1``, zeros past the end), as megatron trains it.
    """
    positions = torch.arange(tokens.shape[0], device=tokens.device)  # [n] int64
    # [n, 1, 1, rotary_dim]; MLA layers rope from their own rotary
    rotary = None if model.config.multi_latent_attention else model.rotary_pos_emb(tokens.shape[0])
    embedded = model.embedding(input_ids=tokens[None], position_ids=positions[None])  # [n, 1, H]
    hidden = model.decoder(hidden_states=embedded, attention_mask=None, rotary_pos_emb=rotary)  # [n, 1, H]
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits = model.output_layer(hidden, weight=weight)[0][:, 0]
    mtp_logits = []
    if model.mtp_process:
        stacked = model.mtp(input_ids=tokens[None], position_ids=positions[None], hidden_states=hidden,
                            attention_mask=None, rotary_pos_emb=rotary, embedding=model.embedding)
        for depth_hidden in torch.chunk(stacked, 1 + model.config.mtp_num_layers, dim=0)[1:]:
            mtp_logits.append(model.output_layer(depth_hidden, weight=weight)[0][:, 0])
    return logits, mtp_logits
