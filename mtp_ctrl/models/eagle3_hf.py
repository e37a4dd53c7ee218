"""Public EAGLE-3 draft heads (the EAGLE / SpecForge safetensors layout) as an :class:`EagleHead`.

A public EAGLE-3 head (e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`` converted to safetensors, or
a SpecForge output directory) holds, next to a Llama-style ``config.json``
(``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``)::

    fc.weight                     [H, 3H]   the aux hidden states of three target layers -> H
    midlayer.hidden_norm.weight   [H]       (SpecForge: ``layers.0.*`` for ``midlayer.*``)
    midlayer.input_layernorm.weight [H]     on the token embedding
    midlayer.self_attn.{q,k,v}_proj.weight  [.., 2H]: attention over cat(embedding, feature)
    midlayer.self_attn.o_proj.weight, midlayer.post_attention_layernorm.weight, midlayer.mlp.*
    norm.weight [H], lm_head.weight [Vd, H]  the head's own final norm and draft-vocabulary head
    d2t [Vd] int64                            draft id d is target id ``d + d2t[d]``
    t2d [V] bool                              which target ids the draft vocabulary holds
    embed_tokens.weight [V, H]                optional: the target's embedding (checked equal)

One draft step (the EAGLE reference; ``feature`` is ``fc(aux)`` at step 1, then the head's own
pre-norm output)::

    x   = cat(input_layernorm(embed(t_{i+1})), hidden_norm(feature))          [2H]
    h   = feature + o_proj(attention(q/k/v_proj(x)))                         (residual: the feature)
    out = h + mlp(post_attention_layernorm(h))
    logits over the draft vocabulary = lm_head(norm(out))  -> target ids through d2t

:class:`Eagle3Head` is our EAGLE head with that layer: megatron's paged attention layer whose
fused QKV takes ``2H`` inputs, the head's ``hnorm`` as ``hidden_norm``, the layer's
``input_layernorm`` on the embedding. Its logits (:meth:`Eagle3Head.target_logits`) are the
draft-vocabulary logits scattered into the target vocabulary, ``-inf`` elsewhere, so
:class:`~mtp_ctrl.controllers.EagleProposer` samples and the acceptance verifies them unchanged:
lossless as ever (the draft can only propose ids of its vocabulary).

Deeper heads (``num_hidden_layers`` N > 1, vLLM's layout): layer 0 is the layer above (also
named ``layers.0.*``), layers ``1 .. N - 1`` (``layers.{i}.*``) are plain Llama decoder layers
(input norm, attention over H inputs, MLP, residuals) applied in turn to layer 0's output; each
has its own paged KV cache (``Eagle3Head.num_kv_layers``), and ``out`` is the last one's.

Aux layers: EAGLE-3 captures the *input* of target layers ``eagle_aux_hidden_state_layer_ids``
(default ``(2, L // 2, L - 3)``), which is the output of layers ``id - 1`` here.
"""

import os
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from mtp_ctrl.models.eagle_head import EagleHead
from mtp_ctrl.models.hf_checkpoint import (
    ParameterSource,
    SafetensorsShards,
    expected_full_shapes,
    mark_tensor_parallel_weights,
    read_hf_config,
    read_local_tensor,
)
from mtp_ctrl.models.hf_families import (
    Layout,
    TensorRule,
    UnsupportedCheckpointError,
    _refuse_unsupported_attention,
    read_rope,
)
from mtp_ctrl.models.layer_specs import get_paged_gpt_layer_spec
from mtp_ctrl.models.tp_gather import gather_last_dim_over_tp


class Eagle3Head(EagleHead):
    """An EAGLE-3 head in the public layout (module docstring): ``fc``, ``hnorm`` (hidden_norm),
    ``transformer_layer`` (its ``input_layernorm`` norms the embedding; its QKV reads ``2H``),
    ``final_norm``, ``lm_head`` over ``draft_vocab_size`` ids and ``draft_to_target`` ``[Vd]`` int64;
    ``extra_layers``: the ``num_layers - 1`` plain decoder layers after the first (KV caches 1, 2, ...)."""

    def __init__(self, config: TransformerConfig, aux_layer_ids, draft_vocab_size: int, target_vocab_size: int,
                 norm_before_residual: bool = False, num_layers: int = 1):
        layer_spec = get_paged_gpt_layer_spec(False, qk_layernorm=False, normalization=config.normalization)
        super().__init__(config, aux_layer_ids, layer_spec, use_transformer_engine=False)
        self.extra_layers = torch.nn.ModuleList(
            build_module(layer_spec, config=config, layer_number=config.num_layers + 1 + index)
            for index in range(1, num_layers))
        for index, layer in enumerate(self.extra_layers, start=1):
            layer.self_attention.core_attention.kv_layer_index = index  # the head's cache pair ``index``
        del self.enorm, self.eh_proj  # EAGLE-3 concatenates without a projection: attention reads 2H
        backend = LocalSpecProvider()
        linear = dict(config=config, init_method=config.init_method, gather_output=False, bias=False,
                      skip_bias_add=False, is_expert=False)
        attention = self.transformer_layer.self_attention
        qkv_size = attention.query_projection_size + 2 * attention.kv_projection_size
        attention.linear_qkv = build_module(backend.column_parallel_linear(), 2 * config.hidden_size, qkv_size,
                                            **linear)
        self.final_norm = build_module(backend.layer_norm(), config=config, hidden_size=config.hidden_size,
                                       eps=config.layernorm_epsilon)
        self.lm_head = build_module(backend.column_parallel_linear(), config.hidden_size, draft_vocab_size, **linear)
        self.register_buffer("draft_to_target", torch.arange(draft_vocab_size), persistent=False)  # [Vd] int64
        self.target_vocab_size = target_vocab_size
        self.norm_before_residual = norm_before_residual

    def forward(self, embedded: torch.Tensor, features: torch.Tensor, rotary_pos_emb: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:  # [s, b, H] x2 -> [s, b, H]
        layer = self.transformer_layer
        normed_features = self.hnorm(features)
        combined = torch.cat((layer.input_layernorm(embedded), normed_features), dim=-1)  # [s, b, 2H]
        attended, bias = layer.self_attention(combined, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        hidden = (normed_features if self.norm_before_residual else features) + attended
        if bias is not None:
            hidden = hidden + bias
        mlp_out, bias = layer.mlp(layer.pre_mlp_layernorm(hidden))
        out = hidden + mlp_out + (bias if bias is not None else 0)
        for extra in self.extra_layers:  # plain pre-norm decoder layers
            out, _ = extra(hidden_states=out, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        return out

    @property
    def num_kv_layers(self) -> int:
        return 1 + len(self.extra_layers)

    def target_logits(self, out: torch.Tensor) -> torch.Tensor:  # [K, 1, H] -> [K, V] fp32
        """Draft-vocabulary logits at their target ids, ``-inf`` at ids the draft vocabulary lacks."""
        local, _ = self.lm_head(self.final_norm(out))  # [K, 1, Vd / tp]
        draft = gather_last_dim_over_tp(local)[:, 0].float()  # [K, Vd]
        logits = draft.new_full((draft.shape[0], self.target_vocab_size), float("-inf"))  # [K, V]
        return logits.index_copy_(1, self.draft_to_target, draft)


# ----- loading --------------------------------------------------------------------------------------

def _layer_table(prefix: str, num_layers: int = 1) -> Dict[str, TensorRule]:
    """Our parameter -> the public layout's tensors (``prefix``: the first layer's, ``midlayer.`` or
    ``layers.0.``; layers ``1 .. num_layers - 1`` at ``layers.{i}.``)."""
    def rule(*names, layout=Layout.COPY):
        return TensorRule(tuple(prefix + name if not name.startswith("/") else name[1:] for name in names), layout)

    extra = {}
    for index in range(1, num_layers):
        for ours, theirs in _DECODER_LAYER.items():
            extra[f"extra_layers.{index - 1}.{ours}"] = TensorRule(
                tuple(f"layers.{index}.{name}" for name in theirs.hf_names), theirs.layout)
    return {**extra,
        "fc.weight": rule("/fc.weight"),
        "hnorm.weight": rule("hidden_norm.weight"),
        "transformer_layer.input_layernorm.weight": rule("input_layernorm.weight"),
        "transformer_layer.self_attention.linear_qkv.weight": rule("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                                   "self_attn.v_proj.weight", layout=Layout.QKV),
        "transformer_layer.self_attention.linear_proj.weight": rule("self_attn.o_proj.weight"),
        "transformer_layer.pre_mlp_layernorm.weight": rule("post_attention_layernorm.weight"),
        "transformer_layer.mlp.linear_fc1.weight": rule("mlp.gate_proj.weight", "mlp.up_proj.weight",
                                                        layout=Layout.GLU),
        "transformer_layer.mlp.linear_fc2.weight": rule("mlp.down_proj.weight"),
        "final_norm.weight": rule("/norm.weight"),
        "lm_head.weight": rule("/lm_head.weight"),
    }


# A plain decoder layer of a deeper head (our parameter under ``extra_layers.{i}.`` -> ``layers.{i + 1}.``).
_DECODER_LAYER: Dict[str, TensorRule] = {
    "input_layernorm.weight": TensorRule(("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": TensorRule(("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                    "self_attn.v_proj.weight"), Layout.QKV),
    "self_attention.linear_proj.weight": TensorRule(("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": TensorRule(("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": TensorRule(("mlp.gate_proj.weight", "mlp.up_proj.weight"), Layout.GLU),
    "mlp.linear_fc2.weight": TensorRule(("mlp.down_proj.weight",)),
}


def _aux_layer_ids(config: dict, num_target_layers: int) -> Tuple[int, ...]:
    """Our aux layer ids (outputs) from EAGLE-3's (inputs of target layers)."""
    eagle_config = config.get("eagle_config") or {}
    theirs = eagle_config.get("eagle_aux_hidden_state_layer_ids") or \
        (2, num_target_layers // 2, num_target_layers - 3)
    if any(isinstance(i, bool) or not isinstance(i, int) or not 1 <= i < num_target_layers + 1 for i in theirs):
        raise UnsupportedCheckpointError(f"EAGLE-3 aux layers {list(theirs)} must be target layers in [1, "
                                         f"{num_target_layers}] (the input of layer 0 is the embedding, not captured)")
    return tuple(i - 1 for i in theirs)


def _head_config(config: dict, target: GPTModel) -> TransformerConfig:
    """The head layer's megatron config from the head's ``config.json`` (Llama-style fields)."""
    _refuse_unsupported_attention(config)
    target_config = target.config
    hidden_size = config.get("hidden_size")
    if hidden_size != target_config.hidden_size:
        raise ValueError(f"the EAGLE-3 head's hidden_size {hidden_size} != the target's {target_config.hidden_size}")
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or heads % kv_heads:
        raise UnsupportedCheckpointError(f"EAGLE-3 config.json: num_attention_heads={heads!r}, "
                                         f"num_key_value_heads={kv_heads!r}")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise UnsupportedCheckpointError("EAGLE-3 config.json: attention or MLP biases are not supported")
    return TransformerConfig(
        num_layers=target_config.num_layers, hidden_size=hidden_size, ffn_hidden_size=config["intermediate_size"],
        num_attention_heads=heads, num_query_groups=kv_heads,
        kv_channels=config.get("head_dim") or hidden_size // heads, normalization="RMSNorm",
        layernorm_epsilon=float(config.get("rms_norm_eps") or 1e-6), gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=target_config.params_dtype,
        tensor_model_parallel_size=target_config.tensor_model_parallel_size, use_cpu_initialization=True,
        perform_initialization=False)


def _check_rotary(config: dict, head_config: TransformerConfig, target: GPTModel) -> None:
    """The head attends with the target's rotary tables: its own rope settings must give the same."""
    rope = read_rope(config)
    dim = int(head_config.kv_channels * rope.partial_rotary_factor)
    inv_freq = 1.0 / rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    rotary = target.rotary_pos_emb
    if rope.rope_type == "llama3":
        inv_freq = rotary._apply_scaling(inv_freq, factor=rope.factor, low_freq_factor=rope.low_freq_factor,
                                         high_freq_factor=rope.high_freq_factor,
                                         original_max_position_embeddings=rope.original_max_position_embeddings)
    elif rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    target_freq = rotary.inv_freq.detach().float().cpu()
    if inv_freq.shape != target_freq.shape or not torch.allclose(inv_freq, target_freq, rtol=1e-6, atol=0.0):
        raise ValueError("the EAGLE-3 head's rotary settings (rope_theta / rope_scaling / head_dim) differ from "
                         "the target's: the head attends with the target's rotary tables")


def _vocabulary_maps(shards: SafetensorsShards, draft_vocab_size: int, target_vocab_size: int) -> torch.Tensor:
    """``[Vd]`` int64 target id of each draft id, from ``d2t`` (identity without one), checked
    against ``t2d`` when present."""
    names = set(shards.names())
    if "d2t" not in names:
        if draft_vocab_size != target_vocab_size:
            raise ValueError(f"the EAGLE-3 head has draft_vocab_size {draft_vocab_size} != vocab_size "
                             f"{target_vocab_size} but no 'd2t' tensor")
        return torch.arange(draft_vocab_size)
    offsets = shards.read("d2t").long()
    if offsets.shape != (draft_vocab_size,):
        raise ValueError(f"tensor 'd2t' has shape {list(offsets.shape)}, expected [{draft_vocab_size}]")
    target_ids = torch.arange(draft_vocab_size) + offsets  # [Vd]
    if target_ids.min() < 0 or target_ids.max() >= target_vocab_size or target_ids.unique().numel() != draft_vocab_size:
        raise ValueError(f"tensor 'd2t' maps draft ids outside [0, {target_vocab_size}) or two onto one target id")
    if "t2d" in names:
        t2d = shards.read("t2d").bool()
        if t2d.shape != (target_vocab_size,) or int(t2d.sum()) != draft_vocab_size or not bool(t2d[target_ids].all()):
            raise ValueError("tensors 't2d' and 'd2t' disagree on the draft vocabulary")
    return target_ids


def load_eagle3_head(path: Union[str, os.PathLike], target: GPTModel) -> Eagle3Head:
    """The public EAGLE-3 head in directory ``path`` (``config.json`` + safetensors) for the loaded
    target ``target`` (e.g. :func:`~mtp_ctrl.models.load_hf_checkpoint`'s), on its device, in its
    dtype, sharded for this TP rank; pass it to :class:`~mtp_ctrl.controllers.EagleProposer`.
    ValueError (or :class:`UnsupportedCheckpointError`) names a missing, unexpected or misshapen
    tensor or an unsupported field; nothing half-loaded is returned."""
    if not isinstance(target, GPTModel):
        raise TypeError(f"target must be a megatron.core GPTModel, got {type(target).__name__}")
    if target.config.multi_latent_attention:
        raise UnsupportedCheckpointError("EAGLE-3 heads attend with the target's rotary tables; an MLA target "
                                         "(DeepSeek-V3) has none: draft with its MTP layers")
    if not Path(path).is_dir():
        raise FileNotFoundError(f"{path} is not a directory (an EAGLE-3 head directory is expected)")
    config = read_hf_config(path)
    architectures = config.get("architectures") or []
    if not any("eagle3" in name.lower() for name in architectures):
        raise UnsupportedCheckpointError(f"architecture {architectures} is not an EAGLE-3 head "
                                         "(e.g. LlamaForCausalLMEagle3)")
    num_layers = config.get("num_hidden_layers") or 1
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise UnsupportedCheckpointError(f"EAGLE-3 config.json field 'num_hidden_layers' must be a positive int, "
                                         f"got {num_layers!r}")
    target_vocab_size = target.vocab_size
    if config.get("vocab_size", target_vocab_size) != target_vocab_size:
        raise ValueError(f"the EAGLE-3 head's vocab_size {config['vocab_size']} != the target's {target_vocab_size}")
    draft_vocab_size = config.get("draft_vocab_size") or target_vocab_size
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if draft_vocab_size % tp_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} is not divisible by the tensor-parallel size {tp_size}")
    head_config = _head_config(config, target)
    _check_rotary(config, head_config, target)
    reference = target.embedding.word_embeddings.weight
    with SafetensorsShards(path) as shards:
        names = set(shards.names())
        prefix = "midlayer." if any(name.startswith("midlayer.") for name in names) else "layers.0."
        with torch.device(reference.device):
            head = Eagle3Head(head_config, _aux_layer_ids(config, target.config.num_layers), draft_vocab_size,
                              target_vocab_size, norm_before_residual=bool(config.get("norm_before_residual")),
                              num_layers=num_layers)
        head = head.to(reference.dtype)
        mark_tensor_parallel_weights(head)
        table, used = _layer_table(prefix, num_layers), {"d2t", "t2d"}
        parameters = dict(head.named_parameters())
        if set(parameters) != set(table):
            raise ValueError(f"Eagle3Head parameters {sorted(set(parameters) ^ set(table))} have no table entry")
        sources = []
        for name, parameter in parameters.items():
            source = ParameterSource(name, table[name], "")
            for hf_name, shape in zip(source.hf_names, expected_full_shapes(source, parameter, head_config, tp_size)):
                if hf_name not in names:
                    raise ValueError(f"the EAGLE-3 head lacks tensor {hf_name!r} (for parameter {name})")
                if shards.shape(hf_name) != shape:
                    raise ValueError(f"tensor {hf_name!r} has shape {list(shards.shape(hf_name))}, expected "
                                     f"{list(shape)} from config.json (parameter {name})")
                used.add(hf_name)
            sources.append(source)
        if "embed_tokens.weight" in names:  # a frozen copy of the target's: this rank's rows must equal it
            used.add("embed_tokens.weight")
            rank, rows = parallel_state.get_tensor_model_parallel_rank(), reference.shape[0]
            copy = shards.read("embed_tokens.weight", 0, rank * rows, (rank + 1) * rows)
            if not torch.equal(copy.to(reference.device, reference.dtype), reference.detach()):
                raise ValueError("tensor 'embed_tokens.weight' of the EAGLE-3 head differs from the target's embedding")
        unexpected = sorted(names - used)
        if unexpected:
            raise ValueError(f"the EAGLE-3 head has tensors it does not use: {unexpected[:5]}")
        with torch.no_grad():
            for source in sources:
                parameter = parameters[source.parameter_name]
                parameter.copy_(read_local_tensor(source, parameter, shards, head_config))
        head.draft_to_target = _vocabulary_maps(shards, draft_vocab_size, target_vocab_size).to(reference.device)
    return head.eval()
