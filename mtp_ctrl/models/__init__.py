"""Adapters that run megatron-core models against mtp_ctrl's inference state.

Importing this package imports megatron-core.
"""

from mtp_ctrl.models.dense_attention import DenseCausalAttention, build_dense_gpt_model, dense_full_sequence
from mtp_ctrl.models.demo_model import load_demo_model, shipped_checkpoint_path
from mtp_ctrl.models.dist_checkpoint import load_distributed_checkpoint, read_content_metadata, save_distributed_checkpoint
from mtp_ctrl.models.eagle3_hf import Eagle3Head, load_eagle3_head
from mtp_ctrl.models.eagle_head import EagleHead, build_eagle_head, default_aux_layer_ids
from mtp_ctrl.models.forward_context import MambaForward, paged_forward_context
from mtp_ctrl.models.gpt_builder import build_gpt_model
from mtp_ctrl.models.hf_checkpoint import load_hf_checkpoint
from mtp_ctrl.models.layer_specs import (
    assign_kv_layer_indices,
    assign_mamba_layer_indices,
    count_kv_layers,
    get_paged_gpt_layer_spec,
    get_paged_mamba_layer_spec,
    get_paged_mla_layer_spec,
    get_paged_mtp_block_spec,
)
from mtp_ctrl.models.gdn_mixer import PagedGatedDeltaNet
from mtp_ctrl.models.mamba_mixer import PagedMambaMixer
from mtp_ctrl.models.mla_attention import PagedMLACoreAttention, PagedMLASelfAttention
from mtp_ctrl.models.moe import InferenceTopKRouter, has_moe_layers, moe_layer_pattern, moe_layers
from mtp_ctrl.models.multi_layer_eagle import (
    MultiLayerEagleHeads,
    build_multi_layer_eagle_heads,
    dense_multi_layer_eagle_forward,
)
from mtp_ctrl.models.paged_core_attention import PagedCoreAttention
from mtp_ctrl.models.runner import PagedGPTRunner

__all__ = [
    "DenseCausalAttention",
    "Eagle3Head",
    "EagleHead",
    "InferenceTopKRouter",
    "MambaForward",
    "MultiLayerEagleHeads",
    "PagedCoreAttention",
    "PagedGPTRunner",
    "PagedMLACoreAttention",
    "PagedMLASelfAttention",
    "PagedGatedDeltaNet",
    "PagedMambaMixer",
    "assign_kv_layer_indices",
    "assign_mamba_layer_indices",
    "build_dense_gpt_model",
    "build_eagle_head",
    "build_gpt_model",
    "build_multi_layer_eagle_heads",
    "count_kv_layers",
    "default_aux_layer_ids",
    "dense_full_sequence",
    "dense_multi_layer_eagle_forward",
    "get_paged_gpt_layer_spec",
    "get_paged_mamba_layer_spec",
    "get_paged_mla_layer_spec",
    "get_paged_mtp_block_spec",
    "has_moe_layers",
    "load_demo_model",
    "load_distributed_checkpoint",
    "load_eagle3_head",
    "load_hf_checkpoint",
    "moe_layer_pattern",
    "moe_layers",
    "paged_forward_context",
    "read_content_metadata",
    "save_distributed_checkpoint",
    "shipped_checkpoint_path",
]
