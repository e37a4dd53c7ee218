"""Build a megatron-core GPTModel whose attention runs through the paged KV cache."""

from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

from mtp_ctrl.models.layer_specs import (
    ATTENTION_LAYER,
    GDN_LAYER,
    MAMBA_LAYER,
    assign_kv_layer_indices,
    assign_mamba_layer_indices,
    get_paged_gdn_layer_spec,
    get_paged_gpt_layer_spec,
    get_paged_mamba_layer_spec,
    get_paged_mla_layer_spec,
    get_paged_mtp_block_spec,
    mamba_mixers,
)
from mtp_ctrl.models.mamba_mixer import PagedMambaMixer
from mtp_ctrl.models.moe import check_moe_config, moe_layer_pattern, use_inference_dispatchers
from mtp_ctrl.models.moe_inference import use_inference_moe_layers


def check_tensor_parallel_heads(config: TransformerConfig) -> None:
    """Raise ValueError unless query heads and kv heads split evenly over the TP ranks."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    num_query_groups = config.num_query_groups or config.num_attention_heads
    for name, count in (("num_attention_heads", config.num_attention_heads), ("num_query_groups", num_query_groups)):
        if count % tp_size != 0:
            raise ValueError(f"config.{name}={count} is not divisible by the tensor-parallel size {tp_size}")


def build_gpt_model(
    config: TransformerConfig,
    vocab_size: int,
    max_sequence_length: int,
    *,
    use_transformer_engine: Optional[bool] = None,
    share_embeddings_and_output_weights: bool = False,
    rotary_base: int = 10000,
    rotary_percent: float = 1.0,
    layer_pattern: Optional[str] = None,
    mamba_d_conv: int = 4,
) -> GPTModel:
    """GPTModel with rotary position embedding, paged attention and ``config.mtp_num_layers`` MTP layers.

    ``layer_pattern`` makes a hybrid model: one character per decoder layer, ``"*"`` attention,
    ``"M"`` Mamba-2 (sizes from ``config.mamba_state_dim``, ``mamba_head_dim``,
    ``mamba_num_groups``, ``mamba_num_heads``; conv width ``mamba_d_conv``), ``"G"`` Gated DeltaNet
    (sizes from ``config.linear_*``), e.g. ``"M*M*"`` or ``"GGG*"``. None means every layer is
    attention, unless ``config.experimental_attention_variant == "gated_delta_net"``: then
    megatron's ``config.linear_attention_freq`` picks the GDN layers (Qwen3-Next: 4, three GDN
    layers per attention layer). Attention layers are built as the config says (gated output
    ``attention_output_gate``, ``qk_layernorm``; partial rotary: ``rotary_percent``). MTP layers
    are attention layers. One model holds Mamba or GDN layers, not both.

    MoE: ``config.num_moe_experts`` makes the MLP of the layers ``config.moe_layer_freq`` picks
    (an int N: layers 0, N, 2N, ...; or one 0/1 per layer) megatron's own ``MoELayer`` (router,
    experts, token dispatcher), sized by ``moe_router_topk``, ``moe_ffn_hidden_size`` and
    ``moe_shared_expert_intermediate_size``; experts shard over parallel_state's expert-parallel
    ranks (``expert_model_parallel_size``). MTP layers take the last decoder layer's MLP kind, as
    megatron's ``get_gpt_mtp_block_spec`` does. Settings under which a row's routing would depend
    on the other rows are refused (``mtp_ctrl/models/moe.py``). The MoE layers compute through the
    sync-free path inside the runner's forwards (``mtp_ctrl/models/moe_inference.py``), so MoE steps
    are captured in CUDA graphs; megatron's own forward stays available (``moe_backend="megatron"``).

    megatron-core's ``parallel_state`` must be initialised (TP and EP only: no pipeline or context
    parallelism; Mamba layers shard over tensor-parallel ranks like megatron's MambaMixer). KV and Mamba layer indices are assigned, so the
    model is ready for :class:`mtp_ctrl.models.PagedGPTRunner`.
    """
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("initialise megatron.core.parallel_state before building the model")
    if parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError("pipeline parallelism is not supported: every rank holds the whole model")
    check_tensor_parallel_heads(config)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if vocab_size % tp_size != 0:
        raise ValueError(f"vocab_size={vocab_size} is not divisible by the tensor-parallel size {tp_size}; "
                         "pad the vocabulary (megatron's training scripts do)")
    check_moe_config(config, parallel_state.get_expert_model_parallel_world_size())
    layer_spec, decoder_spec = paged_model_specs(config, use_transformer_engine, layer_pattern, mamba_d_conv)
    model = gpt_model_from_specs(config, layer_spec, vocab_size, max_sequence_length, decoder_spec=decoder_spec,
                                 use_transformer_engine=use_transformer_engine,
                                 share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                                 rotary_base=rotary_base, rotary_percent=rotary_percent)
    assign_kv_layer_indices(model)
    assign_mamba_layer_indices(model)
    return model


def gpt_model_from_specs(config: TransformerConfig, layer_spec, vocab_size: int, max_sequence_length: int, *,
                         decoder_spec=None, use_transformer_engine: Optional[bool] = None,
                         share_embeddings_and_output_weights: bool = False, rotary_base: int = 10000,
                         rotary_percent: float = 1.0) -> GPTModel:
    """megatron's GPTModel with rotary embedding, ``decoder_spec`` (default: ``layer_spec`` for every
    layer) and an MTP block built on ``layer_spec``, in one dtype (``config.params_dtype``)."""
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec if decoder_spec is None else decoder_spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type="rope",
        rotary_base=rotary_base,
        rotary_percent=rotary_percent,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        mtp_block_spec=get_paged_mtp_block_spec(config, layer_spec, use_transformer_engine),
    )
    use_inference_dispatchers(model)  # MoE all-gather collectives on the rows' device (models/moe.py)
    use_inference_moe_layers(model)  # MoE layers take the sync-free path when the runner asks (models/moe_inference.py)
    if config.params_dtype != torch.float32:
        # megatron builds layer norms in fp32 and leaves the cast to its Float16Module wrapper;
        # do the same cast here, so inference runs in one dtype (CUDA's layer_norm rejects a mix)
        model = model.to(config.params_dtype)
        for mixer in mamba_mixers(model):  # as megatron's MambaMixer: the SSM decay A_log and skip D stay fp32
            if isinstance(mixer, PagedMambaMixer):  # (megatron's GatedDeltaNet keeps its A_log in params_dtype)
                mixer.A_log.data, mixer.D.data = mixer.A_log.data.float(), mixer.D.data.float()
    return model


def paged_model_specs(config: TransformerConfig, use_transformer_engine: Optional[bool] = None,
                      layer_pattern: Optional[str] = None, mamba_d_conv: int = 4):
    """``(MTP layer spec, decoder spec)`` of the paged model: the decoder spec is one layer spec for
    every layer (dense attention model) or one per layer, under megatron's final layer norm, when
    layers differ (``layer_pattern`` for Mamba layers, ``config.moe_layer_freq`` for MoE MLPs)."""
    moe_pattern = moe_layer_pattern(config)  # [L] bool, all False without experts
    layer_pattern = _hybrid_layer_pattern(config, layer_pattern)

    def attention_spec(moe: bool):
        if config.multi_latent_attention:
            if use_transformer_engine:
                raise ValueError("MLA layers are built from megatron's local spec: pass use_transformer_engine=False")
            return get_paged_mla_layer_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization,
                                            num_experts=config.num_moe_experts if moe else None,
                                            moe_grouped_gemm=config.moe_grouped_gemm)
        return get_paged_gpt_layer_spec(use_transformer_engine, qk_layernorm=config.qk_layernorm,
                                        normalization=config.normalization,
                                        num_experts=config.num_moe_experts if moe else None,
                                        moe_grouped_gemm=config.moe_grouped_gemm)

    dense_spec = attention_spec(False)
    moe_spec = attention_spec(True) if any(moe_pattern) else None
    mtp_spec = moe_spec if moe_pattern[-1] else dense_spec  # megatron: MTP layers follow the last decoder layer
    if layer_pattern is None and not any(moe_pattern):
        return mtp_spec, dense_spec
    if layer_pattern is None:
        layer_pattern = ATTENTION_LAYER * config.num_layers
    if not isinstance(layer_pattern, str) or len(layer_pattern) != config.num_layers or \
            set(layer_pattern) - {ATTENTION_LAYER, MAMBA_LAYER, GDN_LAYER}:
        raise ValueError(f"layer_pattern must be a string of {config.num_layers} (config.num_layers) characters, "
                         f"each {ATTENTION_LAYER!r} (attention), {MAMBA_LAYER!r} (Mamba) or {GDN_LAYER!r} "
                         f"(Gated DeltaNet); got {layer_pattern!r}")
    if MAMBA_LAYER in layer_pattern and GDN_LAYER in layer_pattern:
        raise ValueError(f"layer_pattern {layer_pattern!r} mixes Mamba and Gated DeltaNet layers: their states "
                         "differ in shape and share one set of state slots; use one kind")
    layer_specs = []
    for kind, moe in zip(layer_pattern, moe_pattern):
        if kind == MAMBA_LAYER:
            layer_specs.append(get_paged_mamba_layer_spec(config.normalization, d_conv=mamba_d_conv,
                                                          num_experts=config.num_moe_experts if moe else None))
        elif kind == GDN_LAYER:
            layer_specs.append(get_paged_gdn_layer_spec(config.normalization,
                                                        num_experts=config.num_moe_experts if moe else None))
        else:
            layer_specs.append(moe_spec if moe else dense_spec)
    return mtp_spec, TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=LayerNormImpl)


def _hybrid_layer_pattern(config: TransformerConfig, layer_pattern: Optional[str]) -> Optional[str]:
    """``layer_pattern``, or the one megatron's GDN settings give (``linear_attention_freq``: an int
    N, every N-th layer attention; or one 1 (GDN) / 0 (attention) per layer)."""
    variant = config.experimental_attention_variant
    if variant is None:
        return layer_pattern
    if variant != "gated_delta_net":
        raise ValueError(f"config.experimental_attention_variant={variant!r} is not supported "
                         "(only 'gated_delta_net')")
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern

    derived = "".join(GDN_LAYER if linear else ATTENTION_LAYER for linear in get_linear_attention_pattern(config))
    if layer_pattern is not None and layer_pattern != derived:
        raise ValueError(f"layer_pattern {layer_pattern!r} disagrees with config.linear_attention_freq "
                         f"({config.linear_attention_freq!r} gives {derived!r}); pass one of them")
    return derived
