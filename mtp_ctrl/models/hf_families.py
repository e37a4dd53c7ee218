"""Hugging Face model families: which ``config.json`` we serve, and one name/layout table per family.

A family says how a Hugging Face checkpoint's ``config.json`` becomes megatron's
``TransformerConfig`` (plus the builder's arguments), and where each parameter of our paged
model (:func:`mtp_ctrl.models.build_gpt_model`, megatron's local layer spec) comes from: which
Hugging Face tensors, and in which layout (:class:`Layout`). The loader
(:mod:`mtp_ctrl.models.hf_checkpoint`) applies the table; nothing else maps names.

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
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F


class Layout(enum.Enum):
    """How Hugging Face tensors become one megatron parameter (see the module docstring)."""

    COPY = "copy"  # one tensor, the same layout; split along the parameter's partition dim under TP
    QKV = "qkv"  # q_proj, k_proj, v_proj -> megatron's grouped fused QKV
    GLU = "glu"  # gate_proj, up_proj -> [gate; up]
    SWAP_HALVES = "swap_halves"  # one [H, 2H] tensor whose two input halves megatron orders the other way


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """The Hugging Face tensors (names relative to a prefix; ``{i}`` is a layer index) of one parameter."""

    hf_names: Tuple[str, ...]
    layout: Layout = Layout.COPY


def _rule(*names: str, layout: Layout = Layout.COPY) -> TensorRule:
    return TensorRule(tuple(names), layout)


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


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """What a family reads from ``config.json``: megatron's config fields and the builder's arguments."""

    config_fields: Dict[str, Any]  # TransformerConfig keyword arguments (shape, norms, activation, biases, MTP)
    vocab_size: int
    max_sequence_length: int
    tied_embeddings: bool
    rope: RopeSettings
    dtype: torch.dtype  # the checkpoint's dtype (config "dtype" / "torch_dtype"; default bf16)


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


def read_rope(config: Mapping[str, Any]) -> RopeSettings:
    """Rotary settings from ``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling``
    (older files); a scaling type we do not implement is refused, naming it."""
    parameters = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling")
    if scaling:
        parameters = {**parameters, **scaling}
    theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = parameters.get("rope_type", parameters.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedCheckpointError(
            f"config.json rope scaling type {rope_type!r} (rope_scaling / rope_parameters) is not implemented; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if float(config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedCheckpointError(f"config.json field 'partial_rotary_factor' = "
                                         f"{config['partial_rotary_factor']} is not supported (only 1.0)")
    fields = {name: parameters[name] for name in ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings") if name in parameters}
    if rope_type == "default":
        fields = {}
    elif "factor" not in fields:
        raise UnsupportedCheckpointError(f"config.json rope scaling {rope_type!r} lacks its 'factor'")
    return RopeSettings(theta=float(theta), rope_type=rope_type, **fields)


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
    dtype_name = _get(config, "dtype", _get(config, "torch_dtype", "bfloat16"))
    if dtype_name not in _DTYPES:
        raise UnsupportedCheckpointError(f"config.json dtype {dtype_name!r} is not one of {sorted(_DTYPES)}")
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
                         dtype=_DTYPES[dtype_name])


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


def _mimo_settings(config):
    depth = config.get("num_nextn_predict_layers", 0) or 0
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise UnsupportedCheckpointError(f"config.json field 'num_nextn_predict_layers' must be an int >= 0, "
                                         f"got {depth!r}")
    return _dense_settings(config, qkv_bias=True, qk_layernorm=False, mtp_num_layers=depth)


FAMILIES: Tuple[HFFamily, ...] = (
    HFFamily("Llama-3", ("LlamaForCausalLM",), ("llama",), _llama_settings),
    HFFamily("Qwen2", ("Qwen2ForCausalLM",), ("qwen2",), _qwen2_settings),
    HFFamily("Qwen3", ("Qwen3ForCausalLM",), ("qwen3",), _qwen3_settings),
    HFFamily("MiMo", ("MiMoForCausalLM",), ("mimo",), _mimo_settings, mtp_prefix="model.mtp_layers.{i}.",
             mtp_table=MIMO_MTP_TABLE),
)

# Families people hold whose layers this package does not build yet: model_type -> what is missing.
REFUSED_FAMILIES: Mapping[str, str] = {
    "deepseek_v3": "DeepSeek-V3 needs multi-latent attention (MLA) layers, which mtp_ctrl does not build yet",
    "deepseek_v2": "DeepSeek-V2 needs multi-latent attention (MLA) layers, which mtp_ctrl does not build yet",
    "glm4_moe": "GLM-4.5/4.6 (MoE + MTP): its name table (routed and shared experts, the MTP layer after the "
                "last) is not written yet",
    "qwen3_moe": "Qwen3-MoE: its name table (routed experts) is not written yet",
    "qwen3_next": "Qwen3-Next needs Gated DeltaNet layers, which mtp_ctrl does not build yet",
    "qwen3_5": "Qwen3.5 needs Gated DeltaNet layers, which mtp_ctrl does not build yet",
    "qwen3_5_moe": "Qwen3.5 needs Gated DeltaNet layers, which mtp_ctrl does not build yet",
    "mimo_v2_flash": "MiMo-V2-Flash needs sliding-window attention with attention sinks and MoE layers, "
                     "which mtp_ctrl does not build yet",
    "mistral": "Mistral checkpoints use sliding-window attention; their table is not written yet",
}


def resolve_family(config: Mapping[str, Any]) -> HFFamily:
    """The family of a ``config.json`` (by ``architectures``, else ``model_type``); refused families
    and unknown ones raise :class:`UnsupportedCheckpointError` naming what is missing."""
    model_type = config.get("model_type")
    if model_type in REFUSED_FAMILIES:
        raise UnsupportedCheckpointError(f"model_type {model_type!r}: {REFUSED_FAMILIES[model_type]}")
    architectures = tuple(config.get("architectures") or ())
    if any("eagle" in name.lower() for name in architectures):
        raise UnsupportedCheckpointError(f"architecture {list(architectures)} is an EAGLE draft head, not a target "
                                         "model; EAGLE-3 heads in the EAGLE/SpecForge layout do not load yet")
    for family in FAMILIES:  # by architecture; by model_type only when config.json names none
        if set(architectures) & set(family.architectures) or (not architectures and model_type in family.model_types):
            return family
    supported = ", ".join(f"{family.name} ({'/'.join(family.architectures)})" for family in FAMILIES)
    raise UnsupportedCheckpointError(f"architecture {list(architectures)} (model_type {model_type!r}) is not "
                                     f"supported; supported families: {supported}")
