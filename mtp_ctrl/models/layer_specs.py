"""megatron-core GPT layer specs whose token mixers run through mtp_ctrl's paged state.

Three kinds of decoder layer: attention layers (megatron's GPT layer, core attention replaced by
:class:`PagedCoreAttention`), Mamba layers (the same layer with :class:`PagedMambaMixer` in
the self-attention slot) and Gated DeltaNet layers (:class:`PagedGatedDeltaNet` there). MTP layers
are attention layers. Mamba and GDN mixers keep their state in the same recurrent state slots
("Mamba layer index" below counts both kinds).

KV cache index of every attention layer (``kv_caches[i]``): decoder attention layers in order,
then MTP depth ``k``. Mamba layer index (the first dim of the Mamba state slots): decoder Mamba
layers in order. Example, decoder pattern ``"M*M*"`` and 2 MTP layers::

    decoder.layers[0] Mamba 0    decoder.layers[1] KV 0    decoder.layers[2] Mamba 1
    decoder.layers[3] KV 1       mtp.layers[0]     KV 2    mtp.layers[1]     KV 3
"""

import copy
import importlib.util
from typing import List, Optional

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from mtp_ctrl.models.fused_layers import use_fused_glue_layers
from mtp_ctrl.models.gdn_mixer import PagedGatedDeltaNet
from mtp_ctrl.models.mamba_mixer import PagedMambaMixer
from mtp_ctrl.models.mla_attention import PagedMLACoreAttention, PagedMLASelfAttention
from mtp_ctrl.models.moe import InferenceTopKRouter
from mtp_ctrl.models.paged_core_attention import PagedCoreAttention

ATTENTION_LAYER, MAMBA_LAYER, GDN_LAYER = "*", "M", "G"  # the characters of a hybrid layer pattern
RECURRENT_MIXERS = (PagedMambaMixer, PagedGatedDeltaNet)  # token mixers whose state lives in the state slots


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def get_paged_gpt_layer_spec(use_transformer_engine: Optional[bool] = None, qk_layernorm: bool = False,
                             normalization: Optional[str] = None, num_experts: Optional[int] = None,
                             moe_grouped_gemm: bool = False) -> ModuleSpec:
    """megatron's GPT layer spec with :class:`PagedCoreAttention` as core attention.

    ``use_transformer_engine=None`` picks Transformer Engine's spec when it is installed and the
    local (pure megatron-core) spec otherwise. ``normalization`` ("LayerNorm" or "RMSNorm") only
    matters for the local spec; TE's layers read it from the config. ``num_experts`` makes the
    MLP megatron's MoE layer (its router is :class:`InferenceTopKRouter`; see ``models/moe.py``).
    """
    if use_transformer_engine is None:
        use_transformer_engine = transformer_engine_available()
    if use_transformer_engine:
        if not transformer_engine_available():
            raise ValueError("use_transformer_engine=True but transformer_engine is not installed")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                                          qk_layernorm=qk_layernorm)
    else:
        spec = use_fused_glue_layers(copy.deepcopy(  # the same layers, glue fused when the runner asks
            get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                     qk_layernorm=qk_layernorm, normalization=normalization)))
    spec = _with_inference_router(copy.deepcopy(spec))
    spec.submodules.self_attention.submodules.core_attention = PagedCoreAttention
    return spec


def get_paged_mla_layer_spec(qk_layernorm: bool = True, normalization: Optional[str] = None,
                             num_experts: Optional[int] = None, moe_grouped_gemm: bool = False) -> ModuleSpec:
    """megatron's local MLA layer spec (``get_gpt_layer_local_spec(multi_latent_attention=True)``)
    with :class:`PagedMLASelfAttention` over :class:`PagedMLACoreAttention` (models/mla_attention.py).
    ``qk_layernorm`` gives the compressed query and latent their norms (DeepSeek-V3 has them)."""
    spec = use_fused_glue_layers(copy.deepcopy(get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm,
        multi_latent_attention=True, normalization=normalization)))
    spec = _with_inference_router(spec)
    spec.submodules.self_attention.module = PagedMLASelfAttention
    spec.submodules.self_attention.submodules.core_attention = PagedMLACoreAttention
    return spec


def _with_inference_router(spec: ModuleSpec) -> ModuleSpec:
    """An MoE layer spec's router replaced by :class:`InferenceTopKRouter` (same parameters;
    ``models/moe.py``; the builder also swaps the all-gather dispatcher, ``use_inference_dispatchers``)."""
    mlp = spec.submodules.mlp
    if isinstance(mlp, ModuleSpec) and isinstance(mlp.submodules, MoESubmodules):
        mlp.submodules.router = InferenceTopKRouter
    return spec


def get_paged_mamba_layer_spec(normalization: Optional[str] = None, num_experts: Optional[int] = None,
                               **mixer_params) -> ModuleSpec:
    """A Mamba layer: megatron's local GPT layer (input norm, mixer, residual, MLP or, with
    ``num_experts``, megatron's MoE layer) with :class:`PagedMambaMixer` as its token mixer;
    ``mixer_params`` go to the mixer (e.g. ``d_conv``)."""
    spec = _with_inference_router(use_fused_glue_layers(copy.deepcopy(
        get_gpt_layer_local_spec(num_experts=num_experts, normalization=normalization))))
    spec.submodules.self_attention = ModuleSpec(module=PagedMambaMixer, params=dict(mixer_params))
    return spec


def get_paged_gdn_layer_spec(normalization: Optional[str] = None, num_experts: Optional[int] = None,
                             **mixer_params) -> ModuleSpec:
    """A Gated DeltaNet layer: megatron's local GPT layer (input norm, mixer, residual, MLP or MoE)
    with :class:`PagedGatedDeltaNet` as its token mixer (megatron's GDN spec fuses the input norm
    into ``in_proj``; here it stays the layer's ``input_layernorm``); ``mixer_params`` go to the mixer."""
    spec = _with_inference_router(use_fused_glue_layers(copy.deepcopy(
        get_gpt_layer_local_spec(num_experts=num_experts, normalization=normalization))))
    spec.submodules.self_attention = ModuleSpec(module=PagedGatedDeltaNet, params=dict(mixer_params))
    # checkpoints spell the input norm as megatron's GDN spec does (fused into in_proj)
    keys_map = dict(spec.submodules.sharded_state_dict_keys_map or {})
    keys_map["input_layernorm."] = "self_attention.in_proj.layer_norm_"
    spec.submodules.sharded_state_dict_keys_map = keys_map
    return spec


def get_paged_mtp_block_spec(config: TransformerConfig, layer_spec: ModuleSpec,
                             use_transformer_engine: Optional[bool] = None):
    """megatron's MTP block spec built on ``layer_spec``; None when ``config.mtp_num_layers`` is unset."""
    if not config.mtp_num_layers:
        return None
    if use_transformer_engine is None:
        use_transformer_engine = transformer_engine_available()
    if isinstance(layer_spec, ModuleSpec) and layer_spec.module is not TransformerLayer:
        # megatron accepts a bare layer spec only for TransformerLayer itself (not our fused subclass);
        # a one-layer block spec hands it the same layer spec
        layer_spec = TransformerBlockSubmodules(layer_specs=[layer_spec])
    return get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=use_transformer_engine)


def mamba_mixers(model) -> List:
    """The decoder's recurrent-state mixers (:class:`PagedMambaMixer` and :class:`PagedGatedDeltaNet`)
    in layer order (empty for a pure-attention model): the layers of the state slots."""
    return [layer.self_attention for layer in model.decoder.layers
            if isinstance(getattr(layer, "self_attention", None), RECURRENT_MIXERS)]


def assign_mamba_layer_indices(model) -> int:
    """Give every recurrent mixer its index in the state slots; returns the number of such layers."""
    mixers = mamba_mixers(model)
    for index, mixer in enumerate(mixers):
        mixer.mamba_layer_index = index
    return len(mixers)


def _attention_owners(model) -> List:
    """Every attention-holding transformer layer, in kv-cache order (decoder, then MTP depths)."""
    layers = [layer for layer in model.decoder.layers
              if not isinstance(getattr(layer, "self_attention", None), RECURRENT_MIXERS)]
    if getattr(model, "mtp_process", False):
        layers += [mtp_layer.transformer_layer for mtp_layer in model.mtp.layers]
    return layers


def paged_attention_modules(model) -> List:
    """The model's core-attention modules (:class:`PagedCoreAttention`, or
    :class:`PagedMLACoreAttention` for MLA layers) in kv-cache order; TypeError if any is not paged."""
    modules = []
    for position, layer in enumerate(_attention_owners(model)):
        core_attention = getattr(getattr(layer, "self_attention", None), "core_attention", None)
        if not isinstance(core_attention, (PagedCoreAttention, PagedMLACoreAttention)):
            raise TypeError(
                f"attention layer {position} uses {type(core_attention).__name__}, not PagedCoreAttention: "
                "build the model with mtp_ctrl.models.get_paged_gpt_layer_spec (or build_gpt_model)"
            )
        modules.append(core_attention)
    return modules


def assign_kv_layer_indices(model) -> int:
    """Give every paged core attention its ``kv_caches`` index; returns the number of layers."""
    modules = paged_attention_modules(model)
    for index, module in enumerate(modules):
        module.kv_layer_index = index
    return len(modules)


def count_kv_layers(model) -> int:
    """How many layer caches the model needs (a ``(key_cache, value_cache)`` pair or an MLA latent
    cache each): decoder attention layers + MTP layers."""
    return len(paged_attention_modules(model))
