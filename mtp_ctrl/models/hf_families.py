"""Hugging Face model families: which ``config.json`` we serve, and one name/layout table per family.

A family says how a Hugging Face checkpoint's ``config.json`` becomes megatron's
``TransformerConfig`` (plus the builder's arguments), and where each parameter of our paged
model (:func:`mtp_ctrl.models.build_gpt_model`, megatron's local layer spec) comes from: which
Hugging Face tensors, and in which layout (:class:`Layout`). The loader
(:mod:`mtp_ctrl.models.hf_checkpoint`) applies the table; nothing else maps names.

The MoE and MLA families (Qwen3-MoE, GLM-4.5, DeepSeek-V3) add the tables ``MOE_MLP_TABLE``,
``MLA_LAYER_TABLE`` and ``NEXTN_MTP_TABLE`` below (experts, routing, multi-latent attention, the
MTP layers after the last decoder layer); docs/hf_checkpoints.md explains each.

Layouts every dense family here shares (Llama-3, Qwen2, Qwen3, MiMo's Qwen2 trunk):

- **Fused QKV**: megatron's ``linear_qkv`` holds, per query group g, that group's query heads,
  then its key head, then its value head (``[q_g0 .. k_g0 v_g0 q_g1 .. k_g1 v_g1 ...]``);
  Hugging Face keeps ``q_proj``, ``k_proj``, ``v_proj`` apart. Example, 4 query heads over 2
  groups: rows ``[q0 q1 k0 v0 q2 q3 k1 v1]`` (each a head_dim block). Biases the same.
- **GLU order**: megatron's ``linear_fc1`` is ``[gate; up]`` (``silu(gate) * up``); at tensor
  parallel size ``tp`` each rank holds ``[gate_r; up_r]``, its chunk of each.
- **Rotary layout**: Hugging Face's Llama/Qwen checkpoints rotate halves (``rotate_half``), which
  is megatron's non-interleaved rotary: no permutation of q/k rows.
- **Tied embeddings** (``tie_word_embeddings``): the output layer shares the embedding;
  ``lm_head.weight``, if present, is not read.
- **MTP layers** (MiMo, ``model.mtp_layers.{k}``): ``token_layernorm`` is megatron's ``enorm``,
  ``hidden_layernorm`` its ``hnorm``, ``input_proj`` its ``eh_proj`` and ``final_layernorm`` the
  same; MiMo concatenates ``[hidden, embedding]`` where megatron concatenates
  ``[embedding, hidden]``, so the two column halves of ``input_proj`` are swapped on load. The
  layer inside is a Qwen2 decoder layer (same table as the trunk's layers).
"""

import dataclasses
import enum
import math
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig


class Layout(enum.Enum):
    """How Hugging Face tensors become one megatron parameter (see the module docstring)."""

    COPY = "copy"  # one tensor, the same layout; split along the parameter's partition dim under TP
    QKV = "qkv"  # q_proj, k_proj, v_proj -> megatron's grouped fused QKV
    GLU = "glu"  # gate_proj, up_proj -> [gate; up]
    SWAP_HALVES = "swap_halves"  # one [H, 2H] tensor whose two input halves megatron orders the other way
    PLUS_ONE = "plus_one"  # a zero-centred norm weight (the norm scales by 1 + w): megatron holds 1 + w
    QKV_GATED = "qkv_gated"  # q_proj holding [q_h; gate_h] per head, k_proj, v_proj -> megatron's gated fused QKV
    SECTIONS = "sections"  # tensors holding the parameter's TP sections in order (``TensorRule.sections_per_tensor``)
    GDN_GROUPED = "gdn_grouped"  # Qwen3-Next's in_proj_qkvz, in_proj_ba grouped per key head -> megatron's in_proj


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """The Hugging Face tensors (names relative to a prefix; ``{i}`` is a layer index) of one parameter."""

    hf_names: Tuple[str, ...]
    layout: Layout = Layout.COPY
    # SECTIONS: how many of the parameter's TP sections (``mamba_mixer.TP_SECTIONS_ATTR``) each tensor holds
    sections_per_tensor: Tuple[int, ...] = ()


def _rule(*names: str, layout: Layout = Layout.COPY, sections_per_tensor: Tuple[int, ...] = ()) -> TensorRule:
    return TensorRule(tuple(names), layout, sections_per_tensor)


# Parameters of one transformer layer (decoder layer or an MTP depth's layer), relative to
# ``decoder.layers.{i}.`` / ``mtp.layers.{k}.transformer_layer.`` and the family's layer prefix.
# A rule is used only where the model has the parameter (e.g. biases only with attention bias).
DENSE_LAYER_TABLE: Mapping[str, TensorRule] = {
    "input_layernorm.weight": _rule("input_layernorm.weight"),
    "self_attention.linear_qkv.weight": _rule("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                              "self_attn.v_proj.weight", layout=Layout.QKV),
    "self_attention.linear_qkv.bias": _rule("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                            "self_attn.v_proj.bias", layout=Layout.QKV),
    "self_attention.linear_proj.weight": _rule("self_attn.o_proj.weight"),
    "self_attention.q_layernorm.weight": _rule("self_attn.q_norm.weight"),
    "self_attention.k_layernorm.weight": _rule("self_attn.k_norm.weight"),
    "pre_mlp_layernorm.weight": _rule("post_attention_layernorm.weight"),
    "mlp.linear_fc1.weight": _rule("mlp.gate_proj.weight", "mlp.up_proj.weight", layout=Layout.GLU),
    "mlp.linear_fc2.weight": _rule("mlp.down_proj.weight"),
}

# Whole-model parameters: megatron name -> Hugging Face tensor.
DENSE_TOP_TABLE: Mapping[str, TensorRule] = {
    "embedding.word_embeddings.weight": _rule("model.embed_tokens.weight"),
    "decoder.final_layernorm.weight": _rule("model.norm.weight"),
    "output_layer.weight": _rule("lm_head.weight"),
}

# MiMo's MTP depth k, relative to ``mtp.layers.{k}.`` and ``model.mtp_layers.{k}.`` (its
# ``transformer_layer.*`` parameters follow DENSE_LAYER_TABLE under the same prefix).
MIMO_MTP_TABLE: Mapping[str, TensorRule] = {
    "enorm.weight": _rule("token_layernorm.weight"),
    "hnorm.weight": _rule("hidden_layernorm.weight"),
    "eh_proj.weight": _rule("input_proj.weight", layout=Layout.SWAP_HALVES),
    "final_layernorm.weight": _rule("final_layernorm.weight"),
}

# The MLP of an MoE layer, relative to the layer prefixes (``{e}``: the expert's global index; under
# expert parallelism rank r's local expert i is global expert ``r * local_count + i``, megatron's
# placement). Qwen3-MoE has no shared experts and no expert bias: those rules go unused there.
MOE_MLP_TABLE: Mapping[str, TensorRule] = {
    "mlp.router.weight": _rule("mlp.gate.weight"),
    "mlp.router.expert_bias": _rule("mlp.gate.e_score_correction_bias"),  # a buffer, kept in fp32
    "mlp.experts.local_experts.{e}.linear_fc1.weight": _rule("mlp.experts.{e}.gate_proj.weight",
                                                             "mlp.experts.{e}.up_proj.weight", layout=Layout.GLU),
    "mlp.experts.local_experts.{e}.linear_fc2.weight": _rule("mlp.experts.{e}.down_proj.weight"),
    "mlp.shared_experts.linear_fc1.weight": _rule("mlp.shared_experts.gate_proj.weight",
                                                  "mlp.shared_experts.up_proj.weight", layout=Layout.GLU),
    "mlp.shared_experts.linear_fc2.weight": _rule("mlp.shared_experts.down_proj.weight"),
}
MOE_LAYER_TABLE: Mapping[str, TensorRule] = {**DENSE_LAYER_TABLE, **MOE_MLP_TABLE}

# DeepSeek-V3's multi-latent attention: megatron's MLA parameters hold Hugging Face's tensors in the
# same layout (q up-projection rows per head ``[nope | rope]``, KV down-projection rows
# ``[latent | rope key]``, KV up-projection rows per head ``[k nope | v]``); ``q_proj`` without q LoRA.
MLA_LAYER_TABLE: Mapping[str, TensorRule] = {
    "input_layernorm.weight": _rule("input_layernorm.weight"),
    "self_attention.linear_q_proj.weight": _rule("self_attn.q_proj.weight"),
    "self_attention.linear_q_down_proj.weight": _rule("self_attn.q_a_proj.weight"),
    "self_attention.q_layernorm.weight": _rule("self_attn.q_a_layernorm.weight"),
    "self_attention.linear_q_up_proj.weight": _rule("self_attn.q_b_proj.weight"),
    "self_attention.linear_kv_down_proj.weight": _rule("self_attn.kv_a_proj_with_mqa.weight"),
    "self_attention.kv_layernorm.weight": _rule("self_attn.kv_a_layernorm.weight"),
    "self_attention.linear_kv_up_proj.weight": _rule("self_attn.kv_b_proj.weight"),
    "self_attention.linear_proj.weight": _rule("self_attn.o_proj.weight"),
    "pre_mlp_layernorm.weight": _rule("post_attention_layernorm.weight"),
    "mlp.linear_fc1.weight": _rule("mlp.gate_proj.weight", "mlp.up_proj.weight", layout=Layout.GLU),
    "mlp.linear_fc2.weight": _rule("mlp.down_proj.weight"),
    **MOE_MLP_TABLE,
}

# DeepSeek-V3 / GLM-4.5 MTP depth k: ``model.layers.{num_hidden_layers + k}.``, whose decoder-layer
# tensors follow the family's layer table under the same prefix. The concatenation is megatron's
# ``[enorm(embedding), hnorm(hidden)]``: no swap.
NEXTN_MTP_TABLE: Mapping[str, TensorRule] = {
    "enorm.weight": _rule("enorm.weight"),
    "hnorm.weight": _rule("hnorm.weight"),
    "eh_proj.weight": _rule("eh_proj.weight"),
    "final_layernorm.weight": _rule("shared_head.norm.weight"),
}
# The MTP layer's own copies of the embedding and the output head (megatron's MTP shares the
# trunk's): loaded only after checking they equal the trunk tensor (this rank's vocabulary rows).
NEXTN_MTP_SHARED_COPIES: Mapping[str, str] = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "shared_head.head.weight": "lm_head.weight",
}

# Tensors some checkpoints carry that hold nothing we load (old transformers saved rotary tables).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclasses.dataclass(frozen=True)
class RopeSettings:
    """Rotary base and scaling of a checkpoint (``rope_type`` one of :data:`SUPPORTED_ROPE_TYPES`)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0  # the rotated fraction of each head (megatron's rotary_percent)
    yarn: Dict[str, float] = dataclasses.field(default_factory=dict)  # MLATransformerConfig's YaRN fields


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """What a family reads from ``config.json``: megatron's config fields and the builder's arguments."""

    config_fields: Dict[str, Any]  # TransformerConfig keyword arguments (shape, norms, activation, biases, MTP)
    vocab_size: int
    max_sequence_length: int
    tied_embeddings: bool
    rope: RopeSettings
    dtype: torch.dtype  # the checkpoint's dtype (config "dtype" / "torch_dtype"; default bf16)
    config_class: type = TransformerConfig  # MLATransformerConfig for multi-latent attention


@dataclasses.dataclass(frozen=True)
class HFFamily:
    """One family: its names, config reader and tables (see the module docstring)."""

    name: str
    architectures: Tuple[str, ...]
    model_types: Tuple[str, ...]
    read_config: Callable[[Mapping[str, Any]], ModelSettings]
    layer_prefix: str = "model.layers.{i}."
    layer_table: Mapping[str, TensorRule] = dataclasses.field(default_factory=lambda: DENSE_LAYER_TABLE)
    top_table: Mapping[str, TensorRule] = dataclasses.field(default_factory=lambda: DENSE_TOP_TABLE)
    mtp_prefix: Optional[str] = None  # e.g. "model.mtp_layers.{i}."; None: the family ships no MTP layers
    mtp_table: Mapping[str, TensorRule] = dataclasses.field(default_factory=dict)
    mtp_after_decoder: bool = False  # MTP depth k is numbered num_hidden_layers + k (DeepSeek-V3, GLM-4.5)
    mtp_shared_copies: Mapping[str, str] = dataclasses.field(default_factory=dict)  # see NEXTN_MTP_SHARED_COPIES
    # where MTP depth k's transformer layer lives when not under ``mtp_prefix`` (Qwen3-Next: "mtp.layers.{i}.",
    # its fc and norms "mtp.", shared by every depth)
    mtp_layer_prefix: Optional[str] = None
    ignored_prefixes: Tuple[str, ...] = ()  # tensors nothing here reads (a vision tower: "model.visual.")


class UnsupportedCheckpointError(ValueError):
    """A checkpoint this package cannot serve (yet): the message names the field or what is missing."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _get(config: Mapping[str, Any], name: str, default: Any = None, required: bool = False) -> Any:
    if required and config.get(name) is None:
        raise UnsupportedCheckpointError(f"config.json lacks the field {name!r}")
    value = config.get(name)
    return default if value is None else value


def _positive_int(config: Mapping[str, Any], name: str, default: Any = None) -> int:
    value = _get(config, name, default, required=default is None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedCheckpointError(f"config.json field {name!r} must be a positive int, got {value!r}")
    return value


def read_rope(config: Mapping[str, Any], supported: Tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> RopeSettings:
    """Rotary settings from ``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling``
    (older files); a scaling type outside ``supported`` is refused, naming it. ``partial_rotary_factor``
    (top level, or inside ``rope_parameters``) rotates the first fraction of each head, as megatron's
    ``rotary_percent`` does (Hugging Face's ``rotate_half`` on ``q[..., :rotary_dim]``)."""
    parameters = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling")
    if scaling:
        parameters = {**parameters, **scaling}
    theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = parameters.get("rope_type", parameters.get("type", "default")) or "default"
    if rope_type not in supported:
        raise UnsupportedCheckpointError(
            f"config.json rope scaling type {rope_type!r} (rope_scaling / rope_parameters) is not implemented "
            f"for this family; supported: {', '.join(supported)}")
    partial = float(parameters.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if not 0.0 < partial <= 1.0:
        raise UnsupportedCheckpointError(f"config.json field 'partial_rotary_factor' = {partial} must be in (0, 1]")
    if rope_type == "yarn":
        return RopeSettings(theta=float(theta), rope_type=rope_type, partial_rotary_factor=partial,
                            yarn=_read_yarn(config, parameters))
    fields = {name: parameters[name] for name in ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings") if name in parameters}
    if rope_type == "default":
        fields = {}
    elif "factor" not in fields:
        raise UnsupportedCheckpointError(f"config.json rope scaling {rope_type!r} lacks its 'factor'")
    return RopeSettings(theta=float(theta), rope_type=rope_type, partial_rotary_factor=partial, **fields)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _read_yarn(config: Mapping[str, Any], parameters: Mapping[str, Any]) -> Dict[str, float]:
    """YaRN as megatron's ``MLATransformerConfig`` holds it. Hugging Face's rule for the cos/sin factor
    (``attention_factor``: the mscale ratio when both mscales are set and non-zero, else
    ``0.1 ln(factor) + 1``) and megatron's (the ratio whenever both are set) are compared, and a
    checkpoint on which they differ is refused, as are an explicit ``attention_factor`` megatron
    cannot hold and ``truncate: false`` (megatron always rounds the correction range)."""
    original = parameters.get("original_max_position_embeddings")
    if original is None:
        raise UnsupportedCheckpointError("config.json yarn rope scaling lacks 'original_max_position_embeddings'")
    factor = parameters.get("factor")
    factor = float(factor if factor is not None else _positive_int(config, "max_position_embeddings") / original)
    mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
    theirs = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
              else _yarn_mscale(factor))
    if parameters.get("attention_factor") is not None:
        theirs = float(parameters["attention_factor"])
    ours_mscale, ours_all_dim = float(mscale if mscale is not None else 1.0), float(mscale_all_dim or 0.0)
    ours = _yarn_mscale(factor, ours_mscale) / _yarn_mscale(factor, ours_all_dim)
    if not math.isclose(theirs, ours, rel_tol=1e-12):
        raise UnsupportedCheckpointError(
            f"config.json yarn rope scaling (mscale={mscale}, mscale_all_dim={mscale_all_dim}, attention_factor="
            f"{parameters.get('attention_factor')}) gives a cos/sin factor {theirs}, which megatron's YaRN cannot "
            f"express (it would use {ours})")
    if parameters.get("truncate") is False:
        raise UnsupportedCheckpointError("config.json yarn rope scaling 'truncate': false is not supported "
                                         "(megatron rounds the YaRN correction range)")
    return dict(rotary_scaling_factor=factor, original_max_position_embeddings=int(original),
                beta_fast=float(parameters.get("beta_fast") or 32), beta_slow=float(parameters.get("beta_slow") or 1),
                mscale=ours_mscale, mscale_all_dim=ours_all_dim)


def _refuse_unsupported_attention(config: Mapping[str, Any]) -> None:
    """Sliding-window attention, attention sinks and biases megatron's layout cannot hold."""
    if config.get("use_sliding_window"):
        raise UnsupportedCheckpointError("config.json field 'use_sliding_window' is true: sliding-window "
                                         "attention is not supported")
    layer_types = config.get("layer_types")
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        raise UnsupportedCheckpointError(f"config.json field 'layer_types' has {sorted(set(layer_types))}: only "
                                         "'full_attention' layers are supported (no sliding window)")
    for name, value in config.items():
        if "sink" in name.lower() and value:
            raise UnsupportedCheckpointError(f"config.json field {name!r} = {value!r}: attention sinks are not supported")
    if _get(config, "hidden_act", "silu") != "silu":
        raise UnsupportedCheckpointError(f"config.json field 'hidden_act' = {config['hidden_act']!r}: only 'silu' "
                                         "(SwiGLU) is supported")
    if config.get("mlp_bias"):
        raise UnsupportedCheckpointError("config.json field 'mlp_bias' is true: MLP biases are not supported")
    if config.get("quantization_config"):
        raise UnsupportedCheckpointError("config.json has a 'quantization_config': quantized checkpoints are not "
                                         "supported (use a bf16/fp16/fp32 checkpoint)")


def _dense_settings(config: Mapping[str, Any], qkv_bias: bool, qk_layernorm: bool,
                    mtp_num_layers: int = 0) -> ModelSettings:
    """The megatron config of a Llama/Qwen-style dense GQA decoder (RMSNorm, SwiGLU, rotary)."""
    _refuse_unsupported_attention(config)
    hidden_size = _positive_int(config, "hidden_size")
    num_heads = _positive_int(config, "num_attention_heads")
    num_kv_heads = _positive_int(config, "num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise UnsupportedCheckpointError(f"config.json: num_attention_heads={num_heads} is not a multiple of "
                                         f"num_key_value_heads={num_kv_heads}")
    head_dim = _positive_int(config, "head_dim", hidden_size // num_heads)
    fields = dict(
        num_layers=_positive_int(config, "num_hidden_layers"), hidden_size=hidden_size,
        ffn_hidden_size=_positive_int(config, "intermediate_size"), num_attention_heads=num_heads,
        num_query_groups=num_kv_heads, kv_channels=head_dim,
        normalization="RMSNorm", layernorm_epsilon=float(_get(config, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=qkv_bias,
        qk_layernorm=qk_layernorm, hidden_dropout=0.0, attention_dropout=0.0,
        mtp_num_layers=mtp_num_layers or None,
    )
    return ModelSettings(config_fields=fields, vocab_size=_positive_int(config, "vocab_size"),
                         max_sequence_length=_positive_int(config, "max_position_embeddings"),
                         tied_embeddings=bool(config.get("tie_word_embeddings", False)), rope=read_rope(config),
                         dtype=_checkpoint_dtype(config))


def _checkpoint_dtype(config: Mapping[str, Any]) -> torch.dtype:
    dtype_name = _get(config, "dtype", _get(config, "torch_dtype", "bfloat16"))
    if dtype_name not in _DTYPES:
        raise UnsupportedCheckpointError(f"config.json dtype {dtype_name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[dtype_name]


def _refuse_attention_bias(config: Mapping[str, Any]) -> None:
    if config.get("attention_bias"):  # Llama / Qwen3: on q, k, v AND o_proj, which megatron ties to MLP biases
        raise UnsupportedCheckpointError("config.json field 'attention_bias' is true: biases on q/k/v/o "
                                         "projections are not supported for this family")


def _llama_settings(config):
    _refuse_attention_bias(config)
    return _dense_settings(config, qkv_bias=False, qk_layernorm=False)


def _qwen2_settings(config):
    return _dense_settings(config, qkv_bias=True, qk_layernorm=False)


def _qwen3_settings(config):
    _refuse_attention_bias(config)
    return _dense_settings(config, qkv_bias=False, qk_layernorm=True)


def _mtp_depth(config: Mapping[str, Any]) -> int:
    depth = config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 0)) or 0
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise UnsupportedCheckpointError(f"config.json field 'num_nextn_predict_layers' must be an int >= 0, "
                                         f"got {depth!r}")
    return depth


def _mimo_settings(config):
    return _dense_settings(config, qkv_bias=True, qk_layernorm=False, mtp_num_layers=_mtp_depth(config))


# ----- mixture-of-experts families ----------------------------------------------------------------

def _moe_fields(config: Mapping[str, Any], moe_layers: Tuple[bool, ...], *, sigmoid: bool,
                shared_experts: int = 0) -> Dict[str, Any]:
    """megatron's MoE fields: routed experts (``n_routed_experts`` / ``num_experts``), top-k, expert
    width, which layers are MoE (one 0/1 per layer), routing; none when no layer is MoE. The router
    runs in fp32 as Hugging Face's does (and the one-launch routing kernel needs fp32 logits).

    - softmax (Qwen3-MoE): ``norm_topk_prob`` renormalises the top-k of the softmax, which is
      megatron's softmax over the top-k logits (``moe_router_pre_softmax=False``); without it,
      megatron's softmax before the top-k (``moe_router_pre_softmax=True``).
    - sigmoid (GLM-4.5, DeepSeek-V3): ``e_score_correction_bias`` steers the choice only (megatron's
      expert bias), ``n_group`` / ``topk_group`` limit it to the best groups by their top-2 sum
      (megatron's group-limited top-k), the chosen scores are renormalised (``norm_topk_prob``, which
      megatron always does for sigmoid) and scaled by ``routed_scaling_factor``.
    """
    if not any(moe_layers):
        return {}
    num_experts = _positive_int(config, "n_routed_experts" if "n_routed_experts" in config else
                                "num_experts" if "num_experts" in config else "num_local_experts")
    top_k = _positive_int(config, "num_experts_per_tok")
    fields = dict(num_moe_experts=num_experts, moe_router_topk=top_k,
                  moe_ffn_hidden_size=_positive_int(config, "moe_intermediate_size"),
                  moe_layer_freq=[int(flag) for flag in moe_layers], moe_router_dtype="fp32",
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    if shared_experts:
        fields["moe_shared_expert_intermediate_size"] = shared_experts * fields["moe_ffn_hidden_size"]
    if not sigmoid:
        fields.update(moe_router_score_function="softmax",
                      moe_router_pre_softmax=not config.get("norm_topk_prob", False))
        return fields
    if top_k > 1 and config.get("norm_topk_prob", True) is False:
        raise UnsupportedCheckpointError("config.json field 'norm_topk_prob' is false: megatron's sigmoid routing "
                                         "always renormalises the chosen scores")
    groups, group_topk = _positive_int(config, "n_group", 1), _positive_int(config, "topk_group", 1)
    if num_experts % groups:
        raise UnsupportedCheckpointError(f"config.json: n_routed_experts={num_experts} is not a multiple of "
                                         f"n_group={groups}")
    fields.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_bias_update_rate=0.0,
                  moe_router_topk_scaling_factor=float(_get(config, "routed_scaling_factor", 1.0)))
    if groups > 1:
        fields.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    return fields


def _dense_prefix_layers(config: Mapping[str, Any]) -> Tuple[bool, ...]:
    """MoE layers of GLM-4.5 / DeepSeek-V3: every layer from ``first_k_dense_replace`` on."""
    num_layers = _positive_int(config, "num_hidden_layers")
    first_moe = config.get("first_k_dense_replace", 0) or 0
    if _get(config, "moe_layer_freq", 1) != 1:
        raise UnsupportedCheckpointError(f"config.json field 'moe_layer_freq' = {config['moe_layer_freq']!r}: only 1 "
                                         "(every layer after first_k_dense_replace) is supported")
    return tuple(layer >= first_moe for layer in range(num_layers))


def _qwen3_moe_settings(config):
    """Qwen3-MoE: Qwen3 attention; MoE on the layers ``decoder_sparse_step`` picks, except
    ``mlp_only_layers``; softmax routing, no shared expert."""
    _refuse_attention_bias(config)
    settings = _dense_settings(config, qkv_bias=False, qk_layernorm=True)
    step = _positive_int(config, "decoder_sparse_step", 1)
    dense = set(config.get("mlp_only_layers") or ())
    moe_layers = tuple(layer not in dense and (layer + 1) % step == 0
                       for layer in range(settings.config_fields["num_layers"]))
    settings.config_fields.update(_moe_fields(config, moe_layers, sigmoid=False))
    return settings


def _refuse_other_routing(config: Mapping[str, Any]) -> None:
    """DeepSeek-V3's own config names its routing; Hugging Face's class implements only this one."""
    for name, wanted in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if config.get(name, wanted) != wanted:
            raise UnsupportedCheckpointError(f"config.json field {name!r} = {config[name]!r}: only {wanted!r} routing "
                                             "is supported")


def _glm4_moe_settings(config):
    """GLM-4.5 / 4.6: GQA with q/k/v biases (``attention_bias``; o_proj has none), optional q/k norms
    (``use_qk_norm``), partial rotary (``partial_rotary_factor``, half-split), dense layers before
    ``first_k_dense_replace`` then sigmoid-routed MoE with shared experts; MTP layers after the last."""
    _refuse_other_routing(config)
    settings = _dense_settings(config, qkv_bias=bool(config.get("attention_bias")),
                               qk_layernorm=bool(config.get("use_qk_norm")), mtp_num_layers=_mtp_depth(config))
    settings.config_fields.update(_moe_fields(config, _dense_prefix_layers(config), sigmoid=True,
                                              shared_experts=_get(config, "n_shared_experts", 0)))
    return settings


def _deepseek_v3_settings(config):
    """DeepSeek-V3 / R1: multi-latent attention (megatron's ``MLATransformerConfig``: q LoRA optional,
    the latent and the compressed query normed, plain or YaRN rotary on ``qk_rope_head_dim`` dims
    laid out in interleaved pairs, which megatron's MLA de-interleaves as Hugging Face's does), dense
    layers before ``first_k_dense_replace`` then sigmoid-routed MoE with shared experts; MTP layers
    after the last."""
    _refuse_unsupported_attention(config)
    _refuse_other_routing(config)
    if config.get("attention_bias"):
        raise UnsupportedCheckpointError("config.json field 'attention_bias' is true: MLA projection biases are "
                                         "not supported")
    if config.get("rope_interleave", True) is not True:
        raise UnsupportedCheckpointError("config.json field 'rope_interleave' is false: megatron's MLA ropes "
                                         "interleaved pairs only")
    rope = read_rope(config, supported=("default", "yarn"))
    if rope.partial_rotary_factor != 1.0:
        raise UnsupportedCheckpointError("config.json field 'partial_rotary_factor' is not supported with MLA")
    q_lora_rank = config.get("q_lora_rank")
    fields = dict(
        num_layers=_positive_int(config, "num_hidden_layers"), hidden_size=_positive_int(config, "hidden_size"),
        ffn_hidden_size=_positive_int(config, "intermediate_size"),
        num_attention_heads=_positive_int(config, "num_attention_heads"), multi_latent_attention=True,
        q_lora_rank=None if q_lora_rank is None else _positive_int(config, "q_lora_rank"),
        kv_lora_rank=_positive_int(config, "kv_lora_rank"), qk_head_dim=_positive_int(config, "qk_nope_head_dim"),
        qk_pos_emb_head_dim=_positive_int(config, "qk_rope_head_dim"), v_head_dim=_positive_int(config, "v_head_dim"),
        rotary_base=rope.theta, rope_type="yarn" if rope.rope_type == "yarn" else "rope", **rope.yarn,
        normalization="RMSNorm", layernorm_epsilon=float(_get(config, "rms_norm_eps", 1e-6)), qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, mtp_num_layers=_mtp_depth(config) or None,
    )
    fields.update(_moe_fields(config, _dense_prefix_layers(config), sigmoid=True,
                              shared_experts=_get(config, "n_shared_experts", 0)))
    return ModelSettings(config_fields=fields, vocab_size=_positive_int(config, "vocab_size"),
                         max_sequence_length=_positive_int(config, "max_position_embeddings"),
                         tied_embeddings=bool(config.get("tie_word_embeddings", False)), rope=rope,
                         dtype=_checkpoint_dtype(config), config_class=MLATransformerConfig)


FAMILIES: Tuple[HFFamily, ...] = (
    HFFamily("Llama-3", ("LlamaForCausalLM",), ("llama",), _llama_settings),
    HFFamily("Qwen2", ("Qwen2ForCausalLM",), ("qwen2",), _qwen2_settings),
    HFFamily("Qwen3", ("Qwen3ForCausalLM",), ("qwen3",), _qwen3_settings),
    HFFamily("MiMo", ("MiMoForCausalLM",), ("mimo",), _mimo_settings, mtp_prefix="model.mtp_layers.{i}.",
             mtp_table=MIMO_MTP_TABLE),
    HFFamily("Qwen3-MoE", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), _qwen3_moe_settings, layer_table=MOE_LAYER_TABLE),
    HFFamily("GLM-4.5", ("Glm4MoeForCausalLM",), ("glm4_moe",), _glm4_moe_settings, layer_table=MOE_LAYER_TABLE,
             mtp_prefix="model.layers.{i}.", mtp_table=NEXTN_MTP_TABLE, mtp_after_decoder=True,
             mtp_shared_copies=NEXTN_MTP_SHARED_COPIES),
    HFFamily("DeepSeek-V3", ("DeepseekV3ForCausalLM",), ("deepseek_v3",), _deepseek_v3_settings,
             layer_table=MLA_LAYER_TABLE, mtp_prefix="model.layers.{i}.", mtp_table=NEXTN_MTP_TABLE,
             mtp_after_decoder=True, mtp_shared_copies=NEXTN_MTP_SHARED_COPIES),
)
