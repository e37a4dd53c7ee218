"""Build a megatron-core GPTModel whose attention runs through the paged KV cache."""

from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from mtp_ctrl.models.layer_specs import assign_kv_layer_indices, get_paged_gpt_layer_spec, get_paged_mtp_block_spec


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
) -> GPTModel:
    """GPTModel with rotary position embedding, paged attention and ``config.mtp_num_layers`` MTP layers.

    megatron-core's ``parallel_state`` must be initialised (TP only: no pipeline or context
    parallelism). KV layer indices are assigned, so the model is ready for
    :class:`mtp_ctrl.models.PagedGPTRunner`.
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
    layer_spec = get_paged_gpt_layer_spec(use_transformer_engine, qk_layernorm=config.qk_layernorm,
                                          normalization=config.normalization)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type="rope",
        rotary_base=rotary_base,
        rotary_percent=rotary_percent,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        mtp_block_spec=get_paged_mtp_block_spec(config, layer_spec, use_transformer_engine),
    )
    if config.params_dtype != torch.float32:
        # megatron builds layer norms in fp32 and leaves the cast to its Float16Module wrapper;
        # do the same cast here, so inference runs in one dtype (CUDA's layer_norm rejects a mix)
        model = model.to(config.params_dtype)
    assign_kv_layer_indices(model)
    return model
