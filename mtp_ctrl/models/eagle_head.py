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

``parallel_drafting=True`` adds what parallel drafting (PTD) needs: a learned ``mask_hidden``
``[H]`` feature and a ``mask_token_id``; the rows after the bonus token carry them, so all S
drafts come from one forward (:class:`~mtp_ctrl.controllers.ParallelDraftingProposer`,
:mod:`mtp_ctrl.models.ptd_layout`).
"""

from typing import Optional, Sequence

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from mtp_ctrl.models.layer_specs import get_paged_gpt_layer_spec, transformer_engine_available
from mtp_ctrl.models.paged_core_attention import PagedCoreAttention
from mtp_ctrl.models.runner import check_aux_layer_ids
from mtp_ctrl.models.tp_gather import gather_last_dim_over_tp


class EagleHead(MegatronModule):
    """``fc``, ``enorm``, ``hnorm``, ``eh_proj`` and one ``transformer_layer``; see the module docstring."""

    def __init__(self, config, aux_layer_ids: Sequence[int], layer_spec, use_transformer_engine: bool,
                 mask_token_id: Optional[int] = None):
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
        # parallel drafting: the token id and the feature of every mask row (None: a serial-only head)
        self.mask_token_id = mask_token_id
        if mask_token_id is not None:  # [H], replicated over TP ranks (features are gathered)
            self.mask_hidden = torch.nn.Parameter(torch.empty(hidden_size, dtype=config.params_dtype))
            torch.nn.init.normal_(self.mask_hidden, std=config.init_method_std)
        else:
            self.mask_hidden = None

    @property
    def num_kv_layers(self) -> int:
        """How many paged KV cache pairs the head attends through (one per attention layer)."""
        return 1

    @property
    def parallel_drafting(self) -> bool:
        """The head has ``mask_token_id`` and ``mask_hidden`` (built with ``parallel_drafting=True``)."""
        return self.mask_token_id is not None and self.mask_hidden is not None

    def project_aux(self, aux_hidden: torch.Tensor) -> torch.Tensor:  # [..., k * H] -> [..., H]
        """Draft step 1's feature: ``fc`` of the concatenated aux hidden states."""
        projected, _ = self.fc(aux_hidden)  # [..., H / tp]
        return gather_last_dim_over_tp(projected)

    def forward(self, embedded: torch.Tensor, features: torch.Tensor,
                rotary_pos_emb: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:  # [s, b, H] x2 -> [s, b, H]
        """The head's output hidden state (before the target's final norm). ``attention_mask``
        (dense heads only): ``[s, s]`` bool, True where a row may NOT attend (megatron's
        convention); None is causal."""
        combined = torch.cat((self.enorm(embedded), self.hnorm(features)), dim=-1)  # [s, b, 2H]
        projected, _ = self.eh_proj(combined)  # [s, b, H / tp]
        projected = gather_last_dim_over_tp(projected)  # [s, b, H]
        out, _ = self.transformer_layer(hidden_states=projected, attention_mask=attention_mask,
                                        rotary_pos_emb=rotary_pos_emb)
        return out


def default_aux_layer_ids(num_layers: int) -> tuple:
    """EAGLE-3's choice: an early, a middle and the last decoder layer (fewer for tiny models)."""
    return tuple(sorted({0, num_layers // 2, num_layers - 1}))


def default_mask_token_id(vocab_size: int) -> int:
    """The mask token of a parallel-drafting head: the last id of the (padded) vocabulary.

    megatron pads the vocabulary to a multiple of 128, so its last ids are never text; the demo's
    byte vocabulary (512 ids, bytes 0..255) never emits 511 either. A token that never occurs in
    text keeps the mask rows apart from real ones: its embedding says "unknown token here",
    nothing the head could mistake for a verified byte."""
    return vocab_size - 1


def build_eagle_head(target_model: GPTModel, aux_layer_ids: Optional[Sequence[int]] = None, *, dense: bool = False,
                     use_transformer_engine: Optional[bool] = None, parallel_drafting: bool = False,
                     mask_token_id: Optional[int] = None) -> EagleHead:
    """An :class:`EagleHead` for ``target_model`` (same config, dtype and device; the target's
    ``parallel_state`` TP size). ``aux_layer_ids`` default: :func:`default_aux_layer_ids`.
    ``dense=True``: causal SDPA attention over whole sequences (training), else paged attention.
    ``parallel_drafting=True``: the head also owns ``mask_hidden`` ``[H]`` and ``mask_token_id``
    (default :func:`default_mask_token_id`), for :class:`~mtp_ctrl.controllers.ParallelDraftingProposer`."""
    if not isinstance(target_model, GPTModel):
        raise TypeError(f"target_model must be a megatron.core GPTModel, got {type(target_model).__name__}")
    if not isinstance(parallel_drafting, bool):
        raise TypeError(f"parallel_drafting must be a bool, got {type(parallel_drafting).__name__}")
    vocab_size = target_model.vocab_size
    if not parallel_drafting:
        if mask_token_id is not None:
            raise ValueError("mask_token_id is for parallel_drafting=True heads only")
    elif mask_token_id is None:
        mask_token_id = default_mask_token_id(vocab_size)
    elif isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"mask_token_id must be an int in [0, {vocab_size}), got {mask_token_id!r}")
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
    head = EagleHead(config, ids, layer_spec, use_transformer_engine, mask_token_id=mask_token_id)
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
