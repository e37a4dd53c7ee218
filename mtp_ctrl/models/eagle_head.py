"""An EAGLE-3-style draft head built from megatron-core modules, for a frozen target GPT.

Draft step 1 at position ``i`` reads the target's hidden states at ``k`` chosen decoder layers
(``aux_layer_ids``; the runner's :meth:`~mtp_ctrl.models.PagedGPTRunner.set_aux_layers`),
concatenated, ``[k * H]``; ``fc`` maps them to ``H``. Later draft steps read the head's own
output instead. That feature is combined with the embedding of the next token as megatron's MTP
layer combines them (``eh_proj(cat(enorm(embedding), hnorm(feature)))``), runs through one
transformer layer of the target's layer spec (paged core attention, the head's own KV cache),
and the target's final norm and (shared) output layer give the logits::

    feature_i = fc(cat(aux_0[i], .., aux_{k-1}[i]))   (step 1)   or   out_{i-1}   (step > 1)
    out_i     = layer(eh_proj(cat(enorm(embed(t_{i+1})), hnorm(feature_i))))   predicts t_{i+2}

``fc`` and ``eh_proj`` are column-parallel like megatron's ``eh_proj`` (outputs gathered over
the tensor-parallel ranks), the layer shards its heads and MLP like the target's layers, so the
head runs at any TP size the target runs at. ``dense=True`` builds the training twin: the same
parameter names with causal SDPA attention over whole sequences (state dicts move strictly).
"""

from typing import Optional, Sequence

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from mtp_ctrl.models.layer_specs import get_paged_gpt_layer_spec, transformer_engine_available
from mtp_ctrl.models.paged_core_attention import PagedCoreAttention
from mtp_ctrl.models.runner import _gather_last_dim_over_tp, check_aux_layer_ids


class EagleHead(MegatronModule):
    """``fc``, ``enorm``, ``hnorm``, ``eh_proj`` and one ``transformer_layer``; see the module docstring."""

    def __init__(self, config, aux_layer_ids: Sequence[int], layer_spec, use_transformer_engine: bool):
        super().__init__(config=config)
        if use_transformer_engine:
            from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

            backend = TESpecProvider()
        else:
            backend = LocalSpecProvider()
        hidden_size = config.hidden_size
        self.aux_layer_ids = tuple(aux_layer_ids)
        linear = dict(config=config, init_method=config.init_method, gather_output=False, bias=False,
                      skip_bias_add=False, is_expert=False)
        self.fc = build_module(backend.column_parallel_linear(), len(self.aux_layer_ids) * hidden_size, hidden_size,
                               **linear)
        norm = dict(config=config, hidden_size=hidden_size, eps=config.layernorm_epsilon)
        self.enorm = build_module(backend.layer_norm(), **norm)
        self.hnorm = build_module(backend.layer_norm(), **norm)
        self.eh_proj = build_module(backend.column_parallel_linear(), 2 * hidden_size, hidden_size, **linear)
        self.transformer_layer = build_module(layer_spec, config=config, layer_number=config.num_layers + 1)
        core_attention = getattr(self.transformer_layer.self_attention, "core_attention", None)
        if isinstance(core_attention, PagedCoreAttention):
            core_attention.kv_layer_index = 0  # the head's own cache is the only pair it is given

    def project_aux(self, aux_hidden: torch.Tensor) -> torch.Tensor:  # [..., k * H] -> [..., H]
        """Draft step 1's feature: ``fc`` of the concatenated aux hidden states."""
        projected, _ = self.fc(aux_hidden)  # [..., H / tp]
        return _gather_last_dim_over_tp(projected)

    def forward(self, embedded: torch.Tensor, features: torch.Tensor,
                rotary_pos_emb: Optional[torch.Tensor] = None) -> torch.Tensor:  # [s, b, H] x2 -> [s, b, H]
        """The head's output hidden state (before the target's final norm)."""
        combined = torch.cat((self.enorm(embedded), self.hnorm(features)), dim=-1)  # [s, b, 2H]
        projected, _ = self.eh_proj(combined)  # [s, b, H / tp]
        projected = _gather_last_dim_over_tp(projected)  # [s, b, H]
        out, _ = self.transformer_layer(hidden_states=projected, attention_mask=None, rotary_pos_emb=rotary_pos_emb)
        return out


def default_aux_layer_ids(num_layers: int) -> tuple:
    """EAGLE-3's choice: an early, a middle and the last decoder layer (fewer for tiny models)."""
    return tuple(sorted({0, num_layers // 2, num_layers - 1}))


def build_eagle_head(target_model: GPTModel, aux_layer_ids: Optional[Sequence[int]] = None, *, dense: bool = False,
                     use_transformer_engine: Optional[bool] = None) -> EagleHead:
    """An :class:`EagleHead` for ``target_model`` (same config, dtype and device; the target's
    ``parallel_state`` TP size). ``aux_layer_ids`` default: :func:`default_aux_layer_ids`.
    ``dense=True``: causal SDPA attention over whole sequences (training), else paged attention."""
    if not isinstance(target_model, GPTModel):
        raise TypeError(f"target_model must be a megatron.core GPTModel, got {type(target_model).__name__}")
    config = target_model.config
    if aux_layer_ids is None:
        aux_layer_ids = default_aux_layer_ids(config.num_layers)
    ids = check_aux_layer_ids(aux_layer_ids, len(target_model.decoder.layers))
    if use_transformer_engine is None:
        use_transformer_engine = transformer_engine_available()
    layer_spec = get_paged_gpt_layer_spec(use_transformer_engine, qk_layernorm=config.qk_layernorm,
                                          normalization=config.normalization)
    if dense:
        from mtp_ctrl.models.dense_attention import DenseCausalAttention

        layer_spec.submodules.self_attention.submodules.core_attention = DenseCausalAttention
    head = EagleHead(config, ids, layer_spec, use_transformer_engine)
    reference = target_model.embedding.word_embeddings.weight
    return head.to(device=reference.device, dtype=reference.dtype)


def dense_eagle_forward(target_model: GPTModel, head: EagleHead, features: torch.Tensor,
                        next_tokens: torch.Tensor) -> torch.Tensor:
    """One application of a dense head (``dense=True``) over whole sequences from position 0:
    ``features`` ``[s, b, H]``, ``next_tokens`` ``[b, s]`` int64 (row i's token ``t_{i+1}``) ->
    the head's output ``[s, b, H]``. ``target_model`` is the dense twin (for its embedding and
    rotary); the caller applies :func:`eagle_logits`."""
    seq_len = next_tokens.shape[1]
    positions = torch.arange(seq_len, device=next_tokens.device)[None, :].expand_as(next_tokens)  # [b, s]
    if target_model.position_embedding_type == "learned_absolute":
        positions = positions.clamp(max=target_model.max_sequence_length - 2)
    embedded = target_model.embedding(input_ids=next_tokens, position_ids=positions + 1)  # [s, b, H]
    rotary = target_model.rotary_pos_emb(seq_len) if target_model.position_embedding_type == "rope" else None
    return head(embedded, features, rotary_pos_emb=rotary)


def eagle_logits(target_model: GPTModel, out: torch.Tensor) -> torch.Tensor:  # [s, b, H] -> [s, b, V] fp32
    """The target's final norm and output layer over a head's output (TP = 1, e.g. training)."""
    weight = target_model.shared_embedding_or_output_weight() if target_model.share_embeddings_and_output_weights else None
    logits, _ = target_model.output_layer(target_model.decoder.final_layernorm(out), weight=weight)
    return logits.float()
