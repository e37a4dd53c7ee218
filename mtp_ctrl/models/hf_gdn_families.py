"""Hugging Face Gated DeltaNet hybrids: Qwen3-Next and dense Qwen3.5 (name tables and config readers).

Both are megatron's GDN hybrid (:mod:`mtp_ctrl.models.gdn_mixer`, docs/gdn.md): ``layer_types``
says which decoder layers are ``linear_attention`` (Gated DeltaNet) and which ``full_attention``
(megatron's ``linear_attention_freq`` as one 1/0 per layer); every MTP depth is a full-attention
layer. Layouts beyond the dense families' (:mod:`mtp_ctrl.models.hf_families`):

- **Zero-centred norms** (``Layout.PLUS_ONE``): every RMSNorm of the model except the GDN output
  norm scales by ``1 + w`` (``Qwen3NextRMSNorm``); megatron's torch norm scales by its weight, so the
  loader stores ``1 + w`` (computed in fp32, then cast to the model's dtype: a bf16 model rounds
  ``1 + w`` once, where Hugging Face adds in fp32 at every call).
- **Gated attention** (``Layout.QKV_GATED``): ``q_proj`` holds, per query head, the head's query
  rows then its output-gate rows (``[q_0; g_0; q_1; g_1; ...]``); megatron's gated ``linear_qkv``
  holds per query group its query heads, then their gates, then the key and value heads. Partial
  rotary (``partial_rotary_factor``) rotates the first fraction of each head with ``rotate_half``,
  megatron's ``rotary_percent``.
- **GDN input projection**: Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` are grouped per key head
  (``[q_i, k_i, v_i, z_i]`` and ``[b_i, a_i]``, with v, z, b, a of the ``H / Hk`` value heads of key
  head i; ``Layout.GDN_GROUPED``); Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a`` hold whole sections (``Layout.SECTIONS``). megatron's ``in_proj`` is
  ``[q; k; v; z; b; a]``, each section split over TP ranks by heads. The conv (``[q; k; v]``
  channels), ``A_log``, ``dt_bias``, ``norm`` (megatron's ``out_norm``, not zero-centred) and
  ``out_proj`` map one to one.
- **MoE** (Qwen3-Next): softmax routing as Qwen3-MoE; one shared expert (``shared_expert``) scaled
  by ``sigmoid(shared_expert_gate(x))``, megatron's gated shared expert (``gate_weight``).
- **MTP** (``mtp.*``): ``mtp.fc`` is megatron's ``eh_proj`` over ``[pre_fc_norm_embedding(embedding),
  pre_fc_norm_hidden(hidden)]`` (megatron's order), ``mtp.norm`` the final norm before the shared
  head, ``mtp.layers.{k}`` depth k's layer. With several depths the fc and norms are shared (one
  copy, read into every megatron depth). transformers does not build these layers (it drops
  ``mtp.*`` on load).
- Qwen3.5's released checkpoints are vision-language (``Qwen3_5ForConditionalGeneration``): the text
  model is read from ``text_config`` and ``model.language_model.*``; the vision tower
  (``model.visual.*``) is not loaded (text prompts only, for which Qwen3.5's multimodal rotary is
  the plain one).
"""

from typing import Any, Dict, Mapping, Tuple

from mtp_ctrl.models.hf_families import (
    DENSE_TOP_TABLE,
    MOE_MLP_TABLE,
    HFFamily,
    Layout,
    ModelSettings,
    TensorRule,
    UnsupportedCheckpointError,
    _dense_settings,
    _moe_fields,
    _positive_int,
    _rule,
)

# Norms and attention of a full-attention layer, and the layer norms every layer has.
_NORMS_AND_ATTENTION: Mapping[str, TensorRule] = {
    "input_layernorm.weight": _rule("input_layernorm.weight", layout=Layout.PLUS_ONE),
    "pre_mlp_layernorm.weight": _rule("post_attention_layernorm.weight", layout=Layout.PLUS_ONE),
    "self_attention.linear_qkv.weight": _rule("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                              "self_attn.v_proj.weight", layout=Layout.QKV_GATED),
    "self_attention.linear_proj.weight": _rule("self_attn.o_proj.weight"),
    "self_attention.q_layernorm.weight": _rule("self_attn.q_norm.weight", layout=Layout.PLUS_ONE),
    "self_attention.k_layernorm.weight": _rule("self_attn.k_norm.weight", layout=Layout.PLUS_ONE),
}
# A GDN layer's mixer (``self_attention.*`` of our layer) apart from its input projection.
_GDN_MIXER: Mapping[str, TensorRule] = {
    "self_attention.conv1d.weight": _rule("linear_attn.conv1d.weight", layout=Layout.SECTIONS,
                                          sections_per_tensor=(3,)),  # q, k, v channels
    "self_attention.A_log": _rule("linear_attn.A_log"),
    "self_attention.dt_bias": _rule("linear_attn.dt_bias"),
    "self_attention.out_norm.weight": _rule("linear_attn.norm.weight"),
    "self_attention.out_proj.weight": _rule("linear_attn.out_proj.weight"),
}
_DENSE_MLP: Mapping[str, TensorRule] = {
    "mlp.linear_fc1.weight": _rule("mlp.gate_proj.weight", "mlp.up_proj.weight", layout=Layout.GLU),
    "mlp.linear_fc2.weight": _rule("mlp.down_proj.weight"),
}
_QWEN3_NEXT_MOE_MLP: Mapping[str, TensorRule] = {
    **{name: rule for name, rule in MOE_MLP_TABLE.items() if not name.startswith("mlp.shared_experts.")},
    "mlp.shared_experts.linear_fc1.weight": _rule("mlp.shared_expert.gate_proj.weight",
                                                  "mlp.shared_expert.up_proj.weight", layout=Layout.GLU),
    "mlp.shared_experts.linear_fc2.weight": _rule("mlp.shared_expert.down_proj.weight"),
    "mlp.shared_experts.gate_weight": _rule("mlp.shared_expert_gate.weight"),
}

QWEN3_NEXT_LAYER_TABLE: Mapping[str, TensorRule] = {
    **_NORMS_AND_ATTENTION, **_GDN_MIXER, **_DENSE_MLP, **_QWEN3_NEXT_MOE_MLP,
    "self_attention.in_proj.weight": _rule("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight",
                                           layout=Layout.GDN_GROUPED),
}
QWEN3_5_LAYER_TABLE: Mapping[str, TensorRule] = {
    **_NORMS_AND_ATTENTION, **_GDN_MIXER, **_DENSE_MLP,
    "self_attention.in_proj.weight": _rule("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                                           "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight",
                                           layout=Layout.SECTIONS, sections_per_tensor=(3, 1, 1, 1)),
}

QWEN3_NEXT_TOP_TABLE: Mapping[str, TensorRule] = {
    **DENSE_TOP_TABLE, "decoder.final_layernorm.weight": _rule("model.norm.weight", layout=Layout.PLUS_ONE)}
QWEN3_5_VL_TOP_TABLE: Mapping[str, TensorRule] = {
    "embedding.word_embeddings.weight": _rule("model.language_model.embed_tokens.weight"),
    "decoder.final_layernorm.weight": _rule("model.language_model.norm.weight", layout=Layout.PLUS_ONE),
    "output_layer.weight": _rule("lm_head.weight"),
}

# Every MTP depth, relative to ``mtp.`` (its layer: ``mtp.layers.{k}.`` with the family's layer table).
QWEN3_NEXT_MTP_TABLE: Mapping[str, TensorRule] = {
    "enorm.weight": _rule("pre_fc_norm_embedding.weight", layout=Layout.PLUS_ONE),
    "hnorm.weight": _rule("pre_fc_norm_hidden.weight", layout=Layout.PLUS_ONE),
    "eh_proj.weight": _rule("fc.weight"),
    "final_layernorm.weight": _rule("norm.weight", layout=Layout.PLUS_ONE),
}

_LAYER_KINDS = {"linear_attention": 1, "full_attention": 0}  # megatron's linear_attention_freq entries


def _text_config(config: Mapping[str, Any]) -> Dict[str, Any]:
    """The text model's fields: ``text_config`` of a vision-language config (with the top level's
    ``tie_word_embeddings`` and dtype where it lacks them), else the config itself."""
    if not isinstance(config.get("text_config"), Mapping):
        return dict(config)
    text = dict(config["text_config"])
    for name in ("tie_word_embeddings", "dtype", "torch_dtype", "quantization_config"):
        if text.get(name) is None and config.get(name) is not None:
            text[name] = config[name]
    return text


def _gdn_mtp_depth(config: Mapping[str, Any]) -> int:
    for name in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers"):
        depth = config.get(name)
        if depth is not None:
            if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
                raise UnsupportedCheckpointError(f"config.json field {name!r} must be an int >= 0, got {depth!r}")
            return depth
    return 0


def _gdn_settings(config: Mapping[str, Any]) -> ModelSettings:
    """The hybrid's megatron config: a Qwen3-style attention model (q/k norm, no bias) whose
    attention has an output gate, with GDN layers where ``layer_types`` says ``linear_attention``."""
    layer_types = config.get("layer_types")
    num_layers = _positive_int(config, "num_hidden_layers")
    if not isinstance(layer_types, list) or len(layer_types) != num_layers or set(layer_types) - set(_LAYER_KINDS):
        raise UnsupportedCheckpointError(f"config.json field 'layer_types' must list {num_layers} entries "
                                         f"(num_hidden_layers), each one of {sorted(_LAYER_KINDS)}; got {layer_types!r}")
    if config.get("attention_bias"):
        raise UnsupportedCheckpointError("config.json field 'attention_bias' is true: attention biases are not "
                                         "supported for this family")
    attention_fields = {name: value for name, value in config.items() if name != "layer_types"}
    settings = _dense_settings(attention_fields, qkv_bias=False, qk_layernorm=True,
                               mtp_num_layers=_gdn_mtp_depth(config))
    num_key_heads = _positive_int(config, "linear_num_key_heads")
    num_value_heads = _positive_int(config, "linear_num_value_heads")
    if num_value_heads % num_key_heads:
        raise UnsupportedCheckpointError(f"config.json: linear_num_value_heads={num_value_heads} is not a multiple "
                                         f"of linear_num_key_heads={num_key_heads}")
    settings.config_fields.update(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[_LAYER_KINDS[kind] for kind in layer_types],
        linear_conv_kernel_dim=_positive_int(config, "linear_conv_kernel_dim", 4),
        linear_key_head_dim=_positive_int(config, "linear_key_head_dim"),
        linear_value_head_dim=_positive_int(config, "linear_value_head_dim"),
        linear_num_key_heads=num_key_heads, linear_num_value_heads=num_value_heads, attention_output_gate=True)
    return settings


def _qwen3_next_settings(config: Mapping[str, Any]) -> ModelSettings:
    """Qwen3-Next: the hybrid with Qwen3-MoE's routing on the layers ``decoder_sparse_step`` picks
    (except ``mlp_only_layers``) plus one gated shared expert (``shared_expert_intermediate_size``)."""
    settings = _gdn_settings(config)
    num_layers = settings.config_fields["num_layers"]
    step, dense = _positive_int(config, "decoder_sparse_step", 1), set(config.get("mlp_only_layers") or ())
    has_experts = (config.get("num_experts") or 0) > 0
    moe_layers = tuple(has_experts and layer not in dense and (layer + 1) % step == 0 for layer in range(num_layers))
    fields = _moe_fields(config, moe_layers, sigmoid=False)
    shared = config.get("shared_expert_intermediate_size") or 0
    if fields and shared:
        fields.update(moe_shared_expert_intermediate_size=_positive_int(config, "shared_expert_intermediate_size"),
                      moe_shared_expert_gate=True)
    settings.config_fields.update(fields)
    return settings


def _qwen3_5_settings(config: Mapping[str, Any]) -> ModelSettings:
    """Dense Qwen3.5 (text model, or the text part of the vision-language checkpoint)."""
    return _gdn_settings(_text_config(config))


_FAMILY_COMMON = dict(top_table=QWEN3_NEXT_TOP_TABLE, mtp_prefix="mtp.", mtp_table=QWEN3_NEXT_MTP_TABLE,
                      mtp_layer_prefix="mtp.layers.{i}.")

GDN_FAMILIES: Tuple[HFFamily, ...] = (
    HFFamily("Qwen3-Next", ("Qwen3NextForCausalLM",), ("qwen3_next",), _qwen3_next_settings,
             layer_table=QWEN3_NEXT_LAYER_TABLE, **_FAMILY_COMMON),
    HFFamily("Qwen3.5", ("Qwen3_5ForCausalLM",), ("qwen3_5_text",), _qwen3_5_settings,
             layer_table=QWEN3_5_LAYER_TABLE, **_FAMILY_COMMON),
    HFFamily("Qwen3.5 (vision-language checkpoint, text model)", ("Qwen3_5ForConditionalGeneration",), ("qwen3_5",),
             _qwen3_5_settings, layer_table=QWEN3_5_LAYER_TABLE, layer_prefix="model.language_model.layers.{i}.",
             ignored_prefixes=("model.visual.",), **{**_FAMILY_COMMON, "top_table": QWEN3_5_VL_TOP_TABLE}),
)
