"""Pure-torch references of every kernel in :mod:`mtp_ctrl.triton_ops`.

Same names, argument order and return values as the public ops; vectorised torch with no
Python loop over requests. They are the CPU path and the ground truth of the kernel tests.

Where each kernel file's twin lives (``triton_ops/<kernel>.py`` -> ``reference/<twin>.py``;
``tests/unit/test_docs.py`` checks this table against the two export maps)::

    kernel file              twin file        ops
    verify_tokens            mtp_step         verify_speculative_tokens
    prepare_next_forward     mtp_step         prepare_next_forward_pass
    kv_rewind                mtp_step         rewind_kv_cache
    mamba_state_copy         mtp_step         mamba_state_selective_copy
    fused_step               mtp_step         verify_and_commit
    step_inputs              step_inputs      prepare_step_inputs
    step_rows                step_rows        logits_row_requests, draft_batch_rows
    eagle_inputs             drafting         copy_and_expand_eagle_inputs
    eagle_padded             drafting         eagle_prepare_inputs_padded, eagle_prepare_next_token_padded
    eagle_slot_mapping       drafting         eagle_step_update_slot_mapping_and_metadata
    extend_queries           drafting         extend_all_queries_by_n
    parallel_drafting        drafting         ptd_prepare_inputs
    shift_gather_cache       drafting         shift_and_gather_cache, shift_and_gather_cache_hidden
    mtp_window               mtp_window       mtp_draft_window, mtp_advance_window
    gumbel_sampling          sampling         sample_tokens (and gumbel_noise, filter_top_k_top_p)
    sampling_filter          sampling         sampling_probs
    rejection_sampling       rejection        rejection_sample (and rejection_rule, stream_seeds, stream_uniform)
    kv_cache_write           attention        write_kv_cache
    paged_attn               attention        paged_attention
    rope_kv_write            attention        rope_and_write_kv_cache, rope_and_write_kv_cache_mixed
    mla_attention            mla              rope_and_write_latent_cache, paged_mla_attention
                                              (and mla_wgmma, mla_wgmma_ws: paged_mla_attention's Gluon kernels)
    mamba_varlen             mamba_varlen     causal_conv_varlen, ssm_varlen_scan, segment_of_rows
    mamba_decode             mamba_decode     mamba_decode_rows
    gdn_recurrent            gdn              gdn_decode_rows, gdn_varlen_scan
    gdn_replay               gdn              gdn_verify_rows, gdn_mark_pending_rows
    layer_glue               glue             add_bias_residual_norm, bias_activation, split_qkv_heads,
                                              gated_rms_norm
    moe_gemm                 moe              align_expert_pairs, grouped_expert_matmul
    moe_routing              moe              route_top_k
    moe_pairs                moe              scaled_pair_activation, combine_expert_pairs
"""

from mtp_ctrl.triton_ops._lazy import lazy_exports

_REFERENCE_MODULES = {
    "verify_speculative_tokens": "mtp_step",
    "prepare_next_forward_pass": "mtp_step",
    "rewind_kv_cache": "mtp_step",
    "mamba_state_selective_copy": "mtp_step",
    "verify_and_commit": "mtp_step",
    "prepare_step_inputs": "step_inputs",
    "logits_row_requests": "step_rows",
    "draft_batch_rows": "step_rows",
    "copy_and_expand_eagle_inputs": "drafting",
    "eagle_prepare_inputs_padded": "drafting",
    "eagle_prepare_next_token_padded": "drafting",
    "eagle_step_update_slot_mapping_and_metadata": "drafting",
    "extend_all_queries_by_n": "drafting",
    "ptd_prepare_inputs": "drafting",
    "mtp_draft_window": "mtp_window",
    "mtp_advance_window": "mtp_window",
    "shift_and_gather_cache": "drafting",
    "shift_and_gather_cache_hidden": "drafting",
    "sample_tokens": "sampling",
    "gumbel_noise": "sampling",
    "filter_top_k_top_p": "sampling",
    "sampling_probs": "sampling",
    "rejection_sample": "rejection",
    "rejection_rule": "rejection",
    "stream_seeds": "rejection",
    "stream_uniform": "rejection",
    "write_kv_cache": "attention",
    "paged_attention": "attention",
    "rope_and_write_kv_cache": "attention",
    "rope_and_write_kv_cache_mixed": "attention",
    "rope_and_write_latent_cache": "mla",
    "paged_mla_attention": "mla",
    "causal_conv_varlen": "mamba_varlen",
    "ssm_varlen_scan": "mamba_varlen",
    "segment_of_rows": "mamba_varlen",
    "mamba_decode_rows": "mamba_decode",
    "gdn_decode_rows": "gdn",
    "gdn_varlen_scan": "gdn",
    "gdn_verify_rows": "gdn",
    "gdn_mark_pending_rows": "gdn",
    "add_bias_residual_norm": "glue",
    "bias_activation": "glue",
    "split_qkv_heads": "glue",
    "gated_rms_norm": "glue",
    "align_expert_pairs": "moe",
    "grouped_expert_matmul": "moe",
    "route_top_k": "moe",
    "scaled_pair_activation": "moe",
    "combine_expert_pairs": "moe",
}

__all__ = sorted(_REFERENCE_MODULES)


__getattr__, __dir__ = lazy_exports(__name__, _REFERENCE_MODULES, globals())
