"""Run a megatron-core GPTModel (decoder and MTP layers) over packed rows and the paged KV cache.

Rows are packed as one sequence of ``T`` tokens with batch 1 (megatron's ``[s, b, h]`` with
``s = T``, ``b = 1``); rotary embedding is taken per row from ``positions``, so any mix of
prefill chunks and ``1 + S`` decode rows runs in one forward.

Rotary, fused (the default): cos and sin of the rows' angles are computed once per
:meth:`~PagedGPTRunner.forward` / :meth:`~PagedGPTRunner.mtp_forward` call and handed to every
attention layer through the forward context; megatron's attention gets ``rotary_pos_emb=None``
and each :class:`PagedCoreAttention` ropes q and k inside its KV-cache write (one launch). Unfused
(``fused_rope=False``; ``InferenceConfig.fused_rope`` for a controller): megatron's own rotary, as in training; kept for comparison and benchmarks.

Which hidden state is returned. megatron's ``TransformerBlock`` applies the final layer norm
itself, and ``GPTModel`` feeds that normed decoder output to MTP depth 0; each MTP layer ends in
its own ``final_layernorm``, whose output feeds the next depth and the shared output layer.
:meth:`PagedGPTRunner.forward` and :meth:`PagedGPTRunner.mtp_forward` return exactly those
tensors, so chaining them reproduces megatron's MTP.

Aux hidden states (EAGLE): :meth:`PagedGPTRunner.set_aux_layers` registers forward hooks on
chosen decoder layers; every later :meth:`~PagedGPTRunner.forward` then leaves those layers'
outputs (before the final norm) in :attr:`PagedGPTRunner.aux_hidden`, ``[T, k * H]``, from the
same forward pass (no second forward, no host sync; works inside a captured CUDA graph).
"""

from typing import Optional, Sequence, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.models.gpt import GPTModel

from mtp_ctrl.models.forward_context import KVCachePair, MambaForward, RotaryTables, paged_forward_context
from mtp_ctrl.models.fused_layers import link_input_norms
from mtp_ctrl.models.gpt_builder import check_tensor_parallel_heads
from mtp_ctrl.models.layer_specs import assign_kv_layer_indices, assign_mamba_layer_indices, mamba_mixers
from mtp_ctrl.models.mla_attention import mla_rotary
from mtp_ctrl.models.moe import has_moe_layers
from mtp_ctrl.models.moe_inference import DEFAULT_MOE_BACKEND, MEGATRON_BACKEND, check_moe_backend
from mtp_ctrl.models.tp_gather import gather_last_dim_over_tp
from mtp_ctrl.state.attention_metadata import AttentionMetadata
from mtp_ctrl.state.kv_cache import AnyKVCacheSpec, KVCacheSpec, LatentKVCacheSpec
from mtp_ctrl.state.mamba_slots import MambaSpec

_SUPPORTED_POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")


def check_aux_layer_ids(aux_layer_ids, num_decoder_layers: int) -> Tuple[int, ...]:
    """``aux_layer_ids`` as a tuple of distinct decoder layer indices in ``[0, num_decoder_layers)``."""
    if isinstance(aux_layer_ids, (str, bytes, torch.Tensor)) or not isinstance(aux_layer_ids, Sequence):
        raise TypeError(f"aux_layer_ids must be a sequence of ints, got {type(aux_layer_ids).__name__}")
    ids = tuple(aux_layer_ids)
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(f"aux_layer_ids must be a non-empty sequence of ints, got {aux_layer_ids!r}")
    if any(not 0 <= i < num_decoder_layers for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"aux_layer_ids must be distinct decoder layer indices in [0, {num_decoder_layers}), "
                         f"got {aux_layer_ids!r}")
    return ids


class PagedGPTRunner:
    """Decoder and MTP forwards of a paged-spec GPTModel; the model is put in eval mode.

    >>> runner = PagedGPTRunner(build_gpt_model(config, vocab_size=96, max_sequence_length=256))
    >>> logits, hidden = runner.forward(input_ids, positions, metadata, kv_caches)
    >>> draft_logits, hidden = runner.mtp_forward(0, hidden, next_token_ids, positions, mtp_metadata, kv_caches)

    ``fused_rope``: rope q and k inside the paged KV write, with cos/sin computed once per call
    (True, default), or let megatron's attention apply rotary per layer (False). Both give the same
    tokens; see the module docstring.

    ``fused_glue``: layers built by :func:`mtp_ctrl.models.build_gpt_model` (local spec) run their
    bias / residual / norm / activation / QKV-split glue as Triton kernels
    (:mod:`mtp_ctrl.models.fused_layers`) (True), or megatron's element-wise ops (False); None
    (default): True for a model on CUDA, False elsewhere (on the CPU the kernels would run through
    Triton's interpreter). Same math and rounding points; fp32 tokens are identical.

    ``mamba_kernels``: every Mamba mixer's conv / scan / decode-row ops are the Triton kernels
    (True) or their torch twins (False); None (default) leaves each mixer's own choice (kernels
    on CUDA, twins elsewhere).

    ``moe_backend``: how MoE layers compute (:mod:`mtp_ctrl.models.moe_inference`): ``"triton"``
    or ``"grouped_mm"`` (the sync-free path, captured in CUDA graphs; a setting it does not cover
    raises ValueError naming it) or ``"megatron"`` (megatron's eager MoELayer: its steps sync with
    the host, so :attr:`cuda_graph_capturable` is False for an MoE model).
    """

    def __init__(self, model: GPTModel, fused_rope: bool = True, fused_glue: Optional[bool] = None,
                 mamba_kernels: Optional[bool] = None, moe_backend: str = DEFAULT_MOE_BACKEND):
        if not isinstance(model, GPTModel):
            raise TypeError(f"model must be a megatron.core GPTModel, got {type(model).__name__}")
        if fused_glue is None:
            fused_glue = next(model.parameters()).device.type == "cuda"
        if not isinstance(fused_rope, bool):
            raise TypeError(f"fused_rope must be a bool, got {type(fused_rope).__name__}")
        for name, flag in (("fused_glue", fused_glue), ("mamba_kernels", mamba_kernels)):
            if flag is not None and not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool or None, got {type(flag).__name__}")
        if not (model.pre_process and model.post_process):
            raise ValueError("model must hold the whole network (pre_process and post_process): no pipeline stages")
        if model.config.sequence_parallel:
            raise ValueError("sequence_parallel is not supported by PagedGPTRunner")
        if model.position_embedding_type not in _SUPPORTED_POSITION_EMBEDDINGS:
            raise ValueError(f"position_embedding_type {model.position_embedding_type!r} is not supported; "
                             f"use one of {_SUPPORTED_POSITION_EMBEDDINGS}")
        check_tensor_parallel_heads(model.config)
        self.model = model.eval()
        self.num_kv_layers = assign_kv_layer_indices(model)  # TypeError when attention is not paged
        self.num_mamba_layers = assign_mamba_layer_indices(model)
        if mamba_kernels is not None:
            for mixer in mamba_mixers(model):
                mixer.mamba_kernels = mamba_kernels
        self.num_decoder_layers = len(model.decoder.layers)
        link_input_norms(model.decoder.layers)  # fused layers norm their successor's input (fused_layers.py)
        self.mtp_num_layers = len(model.mtp.layers) if model.mtp_process else 0
        check_moe_backend(model, moe_backend)  # ValueError naming a setting the graph MoE path refuses
        self.moe_backend = moe_backend
        # MoE layers: the sync-free path (models/moe_inference.py) is captured like a dense layer;
        # megatron's MoELayer reads per-expert token counts on the host, so its steps run eagerly
        self._moe_forward_backend = None if moe_backend == MEGATRON_BACKEND else moe_backend
        self.cuda_graph_capturable = moe_backend != MEGATRON_BACKEND or not has_moe_layers(model)
        self.fused_rope = fused_rope
        self.fused_glue = fused_glue
        self._inv_freq: Optional[torch.Tensor] = None  # [rotary_dim / 2] fp32 on the rows' device
        self._mla_rotary = mla_rotary(model)  # MLA layers rope from their own (shared) frequencies; else None
        self.aux_layer_ids: Tuple[int, ...] = ()
        self.aux_hidden: Optional[torch.Tensor] = None  # [T, k * H] after each forward with aux layers
        self._aux_parts: list = []  # [T, H] output of each aux layer, filled by the hooks
        self._aux_hooks: list = []

    def set_aux_layers(self, aux_layer_ids: Sequence[int]) -> None:
        """Keep the outputs of decoder layers ``aux_layer_ids`` (0-based, in the order given) of
        every later :meth:`forward` in :attr:`aux_hidden` ``[T, k * H]``; ``()`` stops it.
        Forward hooks on those layers: the forward runs once, as before."""
        ids = () if isinstance(aux_layer_ids, (tuple, list)) and not aux_layer_ids else check_aux_layer_ids(aux_layer_ids, self.num_decoder_layers)
        for handle in self._aux_hooks:
            handle.remove()
        self._aux_hooks = [self.model.decoder.layers[layer].register_forward_hook(self._aux_hook(slot))
                           for slot, layer in enumerate(ids)]
        self.aux_layer_ids, self.aux_hidden = ids, None

    def _aux_hook(self, slot: int):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output  # [T, 1, H]
            if self._aux_parts:  # only inside forward(): an MTP or EAGLE forward leaves it alone
                self._aux_parts[slot] = hidden[:, 0].clone()  # a later layer may not write into it
        return hook

    @property
    def hidden_size(self) -> int:
        """H: the width of the target's hidden states (what drafters read and write)."""
        return self.model.config.hidden_size

    @property
    def mamba_spec(self) -> Optional[MambaSpec]:
        """The state shapes of the model's recurrent layers (Mamba-2 or Gated DeltaNet; kept in fp32);
        None without such layers."""
        mixers = mamba_mixers(self.model)
        if not mixers:
            return None
        shapes = {(mixer.conv_state_shape, mixer.ssm_state_shape) for mixer in mixers}
        if len(shapes) != 1:
            raise ValueError(f"the model's recurrent layers differ in state shape ({sorted(shapes)}): one set of "
                             "state slots holds one shape")
        key_heads = {getattr(mixer, "num_key_heads_local", None) for mixer in mixers}  # Gated DeltaNet: Hk
        if len(key_heads) != 1:
            raise ValueError("the model mixes Mamba-2 and Gated DeltaNet layers: one set of state slots holds one kind")
        return MambaSpec(num_layers=len(mixers), conv_state_shape=mixers[0].conv_state_shape,
                         ssm_state_shape=mixers[0].ssm_state_shape, dtype=torch.float32,
                         gdn_key_heads=key_heads.pop())

    def kv_cache_spec(self, dtype: torch.dtype) -> AnyKVCacheSpec:
        """The layout of the model's paged caches on this rank: a latent cache per layer for MLA
        (replicated over TP ranks), else K and V per local kv head."""
        config = self.model.config
        if self._mla_rotary is not None:
            return LatentKVCacheSpec(num_layers=self.num_kv_layers, dtype=dtype,
                                     latent_dim=config.kv_lora_rank + config.qk_pos_emb_head_dim)
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        num_kv_heads = config.num_query_groups or config.num_attention_heads
        return KVCacheSpec(num_layers=self.num_kv_layers, num_kv_heads=num_kv_heads // tp_size,
                           head_dim=config.kv_channels, dtype=dtype)

    def _rotary_angles(self, positions: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, rotary_dim / 2] fp32
        """megatron's RotaryEmbedding frequencies (``get_freqs_non_repeated``) at each row's position."""
        rotary = self.model.rotary_pos_emb
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = rotary.inv_freq.to(positions.device)
        scaled_positions = positions.to(self._inv_freq.dtype)  # [T]
        if rotary.seq_len_interpolation_factor is not None:
            scaled_positions = scaled_positions / rotary.seq_len_interpolation_factor
        return torch.outer(scaled_positions, self._inv_freq)  # [T, rotary_dim / 2]

    def rotary_tables(self, positions: torch.Tensor) -> Tuple[Optional[torch.Tensor], Optional[RotaryTables]]:
        """``(rotary_pos_emb for megatron, tables for the fused path)`` at ``positions`` ``[T]``
        int64: at most one is not None. Drafting passes them to every depth over the same rows.
        MLA layers always rope from the tables (megatron's MLA rotary covers positions 0..s-1 only)."""
        if self._mla_rotary is not None:
            return None, self._mla_rotary.tables(positions)
        if self.model.position_embedding_type != "rope":
            return None, None
        freqs = self._rotary_angles(positions)  # [T, rotary_dim / 2] fp32
        if self.fused_rope:
            mscale = _yarn_get_concentration_factor_from_config(self.model.config)  # 1.0 unless YaRN
            cos, sin = torch.cos(freqs), torch.sin(freqs)  # [T, rotary_dim / 2] fp32 each
            if mscale != 1.0:
                cos, sin = cos * mscale, sin * mscale
            return None, RotaryTables(cos=cos, sin=sin)
        if self.model.rotary_pos_emb.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).view(freqs.shape[0], -1)  # f0 f0 f1 f1 ...
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # f0 f1 ... f0 f1 ...
        return emb[:, None, None, :], None  # [T, 1, 1, rotary_dim]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, 1, H] -> [T, V] fp32
        model = self.model
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        local_logits, _ = model.output_layer(hidden, weight=weight, runtime_gather_output=False)  # [T, 1, V/tp]
        return gather_last_dim_over_tp(local_logits)[:, 0].float()

    def _check_rows(self, input_ids, positions, metadata, kv_caches):
        for name, tensor in (("input_ids", input_ids), ("positions", positions)):
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int64 or tensor.dim() != 1:
                raise TypeError(f"{name} must be a 1-D int64 tensor")
        if not isinstance(metadata, AttentionMetadata):
            raise TypeError(f"metadata must be an AttentionMetadata, got {type(metadata).__name__}")
        if input_ids.shape[0] != positions.shape[0] or input_ids.shape[0] != metadata.num_tokens:
            raise ValueError(f"input_ids ({input_ids.shape[0]}), positions ({positions.shape[0]}) and "
                             f"metadata.slot_mapping ({metadata.num_tokens}) must have the same number of rows")
        if kv_caches is not None and len(kv_caches) != self.num_kv_layers:
            raise ValueError(f"kv_caches has {len(kv_caches)} pairs, the model has {self.num_kv_layers} "
                             f"attention layers ({self.num_decoder_layers} decoder + {self.mtp_num_layers} MTP)")

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        metadata: AttentionMetadata,
        kv_caches: Sequence[KVCachePair],
        logits_rows: Optional[torch.Tensor] = None,  # [K] int64: rows whose logits are needed (default all)
        mamba: Optional[MambaForward] = None,  # the requests' Mamba state (required with Mamba layers)
    ) -> Tuple[torch.Tensor, torch.Tensor]:  # logits [K, V] fp32 (all TP ranks), hidden [T, H]
        """Embedding, decoder layers (KV written at ``metadata.slot_mapping``, Mamba state
        read and written at ``mamba``'s slots), final norm, output layer.

        ``hidden`` is the decoder output after the final layer norm: the input of MTP depth 0.
        Only ``logits_rows`` go through the output layer (a prefill samples from its last row
        only, so projecting every row to the vocabulary would be wasted work and memory).
        """
        self._check_rows(input_ids, positions, metadata, kv_caches)
        self._check_logits_rows(logits_rows)
        self._check_mamba(mamba)
        rotary_pos_emb, rotary = self.rotary_tables(positions)
        self._aux_parts = [None] * len(self.aux_layer_ids)
        try:
            with paged_forward_context(metadata, kv_caches, mamba, rotary, fused_glue=self.fused_glue,
                                   moe_backend=self._moe_forward_backend):
                embedded = self.model.embedding(input_ids=input_ids[None], position_ids=self._position_ids(positions))  # [T, 1, H]
                hidden = self.model.decoder(hidden_states=embedded, attention_mask=None,
                                            rotary_pos_emb=rotary_pos_emb)  # [T, 1, H]
            self.aux_hidden = torch.cat(self._aux_parts, dim=-1) if self._aux_parts else None  # [T, k * H]
        finally:
            self._aux_parts = []
        projected = hidden if logits_rows is None else hidden[logits_rows]  # [K, 1, H]
        return self._logits(projected), hidden[:, 0]

    def _position_ids(self, positions: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """``[1, T]`` position ids (``positions + offset``) for megatron's embedding, which reads
        them only for a learned position table (else no kernel runs here). That table has
        ``max_sequence_length`` rows: positions past it (only a step the overlapped loop runs
        past a request's stop, whose output is discarded) read its last row instead of faulting."""
        if self.model.position_embedding_type == "learned_absolute":
            positions = (positions + offset).clamp(max=self.model.max_sequence_length - 1)
        return positions[None]

    @staticmethod
    def _check_logits_rows(logits_rows: Optional[torch.Tensor]) -> None:
        if logits_rows is not None and (not isinstance(logits_rows, torch.Tensor) or logits_rows.dim() != 1
                                        or logits_rows.dtype != torch.int64):
            raise TypeError("logits_rows must be a 1-D int64 tensor")

    def _check_mamba(self, mamba: Optional[MambaForward]) -> None:
        if self.num_mamba_layers == 0:
            if mamba is not None:
                raise ValueError("mamba was given but the model has no Mamba layers")
            return
        if not isinstance(mamba, MambaForward):
            raise TypeError(f"the model has {self.num_mamba_layers} Mamba layers: mamba must be a MambaForward, "
                            f"got {type(mamba).__name__}")
        if mamba.conv_states.shape[0] != self.num_mamba_layers:
            raise ValueError(f"mamba states hold {mamba.conv_states.shape[0]} layers, the model has "
                             f"{self.num_mamba_layers} Mamba layers")

    @torch.no_grad()
    def mtp_forward(
        self,
        depth: int,
        hidden: torch.Tensor,  # [T, H] from the decoder (depth 0) or MTP depth - 1
        token_ids: torch.Tensor,  # [T] int64, the token following each row
        positions: torch.Tensor,  # [T] int64, each row's own position
        metadata: AttentionMetadata,
        kv_caches: Sequence[KVCachePair],
        logits_rows: Optional[torch.Tensor] = None,  # [K] int64: rows that draft (default all)
        rotary=None,  # rotary_tables(positions), to share one computation across depths
    ) -> Tuple[torch.Tensor, torch.Tensor]:  # logits [K, V] fp32, hidden [T, H]
        """MTP layer ``depth`` as megatron computes it in training, attending through cache ``L + depth``.

        Row i combines ``hnorm(hidden[i])`` with ``enorm(embedding(token_ids[i]))`` (megatron rolls
        the input ids by one per depth: row i at depth k sees token i + k + 1), projects with
        ``eh_proj``, runs the depth's transformer layer with rotary at ``positions[i]``, applies the
        depth's ``final_layernorm`` and the shared output layer. Only ``logits_rows`` go through the
        output layer: a paged draft window has 2S rows per request and drafts from one of them, and
        at a large vocabulary the output GEMM and the logits dominate drafting.
        """
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth < self.mtp_num_layers:
            raise ValueError(f"depth must be an int in [0, {self.mtp_num_layers}), got {depth!r}")
        self._check_rows(token_ids, positions, metadata, kv_caches)
        self._check_logits_rows(logits_rows)
        if not isinstance(hidden, torch.Tensor) or hidden.shape != (token_ids.shape[0], self.model.config.hidden_size):
            raise ValueError(f"hidden must be [T, hidden_size] = [{token_ids.shape[0]}, "
                             f"{self.model.config.hidden_size}], got {getattr(hidden, 'shape', None)}")
        layer = self.model.mtp.layers[depth]
        rotary_pos_emb, rotary = rotary if rotary is not None else self.rotary_tables(positions)
        with paged_forward_context(metadata, kv_caches, rotary=rotary, fused_glue=self.fused_glue,
                                   moe_backend=self._moe_forward_backend):
            # megatron rolls position ids with the tokens; only a learned position embedding reads them
            embedded = self.model.embedding(input_ids=token_ids[None], position_ids=self._position_ids(positions, offset=1))  # [T, 1, H]
            combined = torch.cat((layer.enorm(embedded), layer.hnorm(hidden[:, None])), dim=-1)  # [T, 1, 2H]
            projected, _ = layer.eh_proj(combined)  # [T, 1, H / tp]
            projected = gather_last_dim_over_tp(projected)  # [T, 1, H]
            out, _ = layer.transformer_layer(hidden_states=projected, attention_mask=None,
                                             rotary_pos_emb=rotary_pos_emb)
            out = layer.final_layernorm(out)  # [T, 1, H]
        projected_rows = out if logits_rows is None else out[logits_rows]  # [K, 1, H]
        return self._logits(projected_rows), out[:, 0]

    @torch.no_grad()
    def eagle_forward(
        self,
        head,  # mtp_ctrl.models.EagleHead built for this model
        features: torch.Tensor,  # [T, H]: head.fc(aux hidden) (draft step 1) or the head's own output
        token_ids: torch.Tensor,  # [T] int64, the token following each row
        positions: torch.Tensor,  # [T] int64, each row's own position
        metadata: AttentionMetadata,
        kv_caches: Sequence[KVCachePair],  # the head's own caches: one pair per attention layer (head.num_kv_layers)
        logits_rows: Optional[torch.Tensor] = None,  # [K] int64: rows that draft (default all)
    ) -> Tuple[torch.Tensor, torch.Tensor]:  # logits [K, V] fp32, hidden [T, H] (the head's output, pre-norm)
        """One application of an EAGLE head: row i combines ``features[i]`` with the embedding of
        ``token_ids[i]`` (:meth:`EagleHead.forward`), attends through the head's paged cache at
        ``positions[i]``, and the target's final norm and output layer give the logits (a head
        with its own, :class:`~mtp_ctrl.models.eagle3_hf.Eagle3Head`: its ``target_logits``)."""
        self._check_rows(token_ids, positions, metadata, None)
        self._check_logits_rows(logits_rows)
        if not isinstance(features, torch.Tensor) or features.shape != (token_ids.shape[0], self.model.config.hidden_size):
            raise ValueError(f"features must be [T, hidden_size] = [{token_ids.shape[0]}, "
                             f"{self.model.config.hidden_size}], got {getattr(features, 'shape', None)}")
        rotary_pos_emb, rotary = self.rotary_tables(positions)
        with paged_forward_context(metadata, kv_caches, rotary=rotary, fused_glue=self.fused_glue,
                                   moe_backend=self._moe_forward_backend):
            embedded = self.model.embedding(input_ids=token_ids[None], position_ids=self._position_ids(positions, offset=1))  # [T, 1, H]
            out = head(embedded, features[:, None], rotary_pos_emb=rotary_pos_emb)  # [T, 1, H]
        own_logits = getattr(head, "target_logits", None)  # a head with its own norm and head (Eagle3Head)
        if own_logits is not None:
            return own_logits(out if logits_rows is None else out[logits_rows]), out[:, 0]
        normed = self.model.decoder.final_layernorm(out)  # the target's final norm
        projected_rows = normed if logits_rows is None else normed[logits_rows]  # [K, 1, H]
        return self._logits(projected_rows), out[:, 0]
