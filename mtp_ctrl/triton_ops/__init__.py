"""Per-step kernels (Triton) with pure-torch twins of the same signature.

Contracts: docs/kernels.md. Each public op validates its arguments, then runs the Triton
kernel on CUDA tensors (or on CPU tensors under ``TRITON_INTERPRET=1``) and the torch reference
in :mod:`mtp_ctrl.triton_ops.reference` otherwise.

Ops are loaded on first use, so importing the package imports neither Triton nor any kernel.
"""

from mtp_ctrl.triton_ops._lazy import lazy_exports

# public name -> module of this package that defines it
_OP_MODULES = {
    # MTP step (contract: docs/kernels.md) and the fused step op
    "verify_speculative_tokens": "verify_tokens",
    "prepare_next_forward_pass": "prepare_next_forward",
    "rewind_kv_cache": "kv_rewind",
    "mamba_state_selective_copy": "mamba_state_copy",
    "verify_and_commit": "fused_step",
    "prepare_step_inputs": "step_inputs",
    "logits_row_requests": "step_rows",
    "draft_batch_rows": "step_rows",
    # drafting inputs (contract: docs/kernels.md)
    "copy_and_expand_eagle_inputs": "eagle_inputs",
    "eagle_prepare_inputs_padded": "eagle_padded",
    "eagle_prepare_next_token_padded": "eagle_padded",
    "eagle_step_update_slot_mapping_and_metadata": "eagle_slot_mapping",
    "extend_all_queries_by_n": "extend_queries",
    "ptd_prepare_inputs": "parallel_drafting",
    "mtp_draft_window": "mtp_window",
    "mtp_advance_window": "mtp_window",
    "TokenRecord": "mtp_window",
    "shift_and_gather_cache": "shift_gather_cache",
    "shift_and_gather_cache_hidden": "shift_gather_cache",
    # the fused op's result type and release width
    "StepCommit": "_step_common",
    "max_released_blocks": "_step_common",
    # sampling
    "sample_tokens": "gumbel_sampling",
    "rejection_sample": "rejection_sampling",
    "sampling_probs": "sampling_filter",
    # paged attention
    "write_kv_cache": "kv_cache_write",
    "paged_attention": "paged_attn",
    "rope_and_write_kv_cache": "rope_kv_write",
    "rope_and_write_kv_cache_mixed": "rope_kv_write",
    # multi-latent attention: the latent cache write and the absorbed paged attention
    "rope_and_write_latent_cache": "mla_attention",
    "paged_mla_attention": "mla_attention",
    # Mamba-2 prefill over the packed rows of a step
    "causal_conv_varlen": "mamba_varlen",
    "ssm_varlen_scan": "mamba_varlen",
    "segment_of_rows": "mamba_varlen",
    "mamba_decode_rows": "mamba_decode",
    # Gated DeltaNet: the delta rule's decode/verify rows and prefill segments
    "gdn_decode_rows": "gdn_recurrent",
    "gdn_varlen_scan": "gdn_recurrent",
    "gdn_verify_rows": "gdn_replay",
    "gdn_mark_pending_rows": "gdn_replay",
    "gdn_row_input_width": "gdn_replay",
    # transformer-layer glue (bias, residual, norm, activation, QKV split)
    "add_bias_residual_norm": "layer_glue",
    "bias_activation": "layer_glue",
    "split_qkv_heads": "layer_glue",
    "gated_rms_norm": "layer_glue",
    # mixture-of-experts: grouped expert products over device-sorted (row, expert) pairs
    "align_expert_pairs": "moe_gemm",
    "grouped_expert_matmul": "moe_gemm",
    "block_rows_for": "moe_gemm",
    "route_top_k": "moe_routing",
    "scaled_pair_activation": "moe_pairs",
    "combine_expert_pairs": "moe_pairs",
    "ExpertSegments": "_moe_common",
}

__all__ = sorted(_OP_MODULES)


__getattr__, __dir__ = lazy_exports(__name__, _OP_MODULES, globals())
