"""megatron-core's local GPT layer with its element-wise glue fused into Triton kernels.

megatron's local spec (no Transformer Engine) runs, per decoder layer and besides its GEMMs and
attention: the QKV bias add and a copy of the grouped query view, the output projection's bias
add, the residual add, the pre-MLP norm, the fc1 bias add, the activation (and a multiply for a
GLU), the fc2 bias add and the residual add: 8 to 9 element-wise launches. The two classes here
run the same math in 3 (:mod:`mtp_ctrl.triton_ops.layer_glue`):

- :class:`FusedQKVSelfAttention` (megatron's ``SelfAttention``): inside a paged forward, QKV bias +
  per-group head split + rope + KV-cache write, one launch that reads the QKV GEMM's rows in place;
  with megatron's own rotary, QKV bias + split into contiguous query / key / value heads;
- :class:`FusedGlueTransformerLayer` (megatron's ``TransformerLayer``): attention bias + residual +
  pre-MLP LayerNorm / RMSNorm, one launch; fc1 bias + activation (+ GLU), one launch; fc2 bias +
  residual + the NEXT layer's input norm, one launch (:func:`link_input_norms` tells each layer
  its successor's norm; the successor takes the normed rows instead of running its own norm, which
  at batch 1 was a 5 us launch per layer on an H100).

Same parameters and names as megatron's classes (checkpoints load unchanged). The fused forward
runs only in eval mode inside a paged forward whose runner has ``fused_glue`` on (the default,
:class:`mtp_ctrl.models.PagedGPTRunner`); otherwise (training, the dense twin, ``fused_glue=False``,
or a configuration the kernels do not cover: another norm or activation, recompute, offloading,
cross attention, MoE's MLP part) megatron's own forward runs. Rounding follows megatron's unfused
path (see the kernels' module docstring): fp32 outputs agree to the last bits of a norm's reduction.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from mtp_ctrl.models.forward_context import fused_glue_enabled, stash_normed_input, take_normed_input
from mtp_ctrl.models.paged_core_attention import PagedCoreAttention
from mtp_ctrl.triton_ops import add_bias_residual_norm, bias_activation, split_qkv_heads

_ACTIVATIONS = {F.gelu: "gelu", F.silu: "silu", F.relu: "relu"}


def use_fused_glue_layers(spec: ModuleSpec) -> ModuleSpec:
    """``spec`` (a megatron local-spec ``TransformerLayer``, modified in place and returned) with
    :class:`FusedGlueTransformerLayer` and, for a ``SelfAttention``, :class:`FusedQKVSelfAttention`."""
    if spec.module is TransformerLayer:
        spec.module = FusedGlueTransformerLayer
    attention = getattr(spec.submodules, "self_attention", None)
    if isinstance(attention, ModuleSpec) and attention.module is SelfAttention:
        attention.module = FusedQKVSelfAttention
    return spec


def link_input_norms(layers) -> int:
    """Give each fused layer whose successor in ``layers`` (a decoder's layer list) is a fused
    layer with a plain norm that successor's input norm, so its last kernel computes it; returns
    the number of links. A hybrid model's Mamba layers are fused layers too (their token mixer
    differs, their input norm does not), so they link as well; other kinds break the chain."""
    links = 0
    for layer, successor in zip(layers, list(layers)[1:]):
        if isinstance(layer, FusedGlueTransformerLayer):
            norm = None
            if isinstance(successor, FusedGlueTransformerLayer) and successor.fused_glue_supported:
                norm = _norm_parameters(successor.input_layernorm)
            layer.next_input_norm = norm
            links += norm is not None
    return links


def _norm_parameters(norm) -> Optional[Tuple]:
    """``(weight, bias, eps, rms_norm)`` of a torch LayerNorm / RMSNorm over the last dim; None otherwise."""
    if type(norm) is torch.nn.LayerNorm and norm.elementwise_affine and len(norm.normalized_shape) == 1:
        return norm.weight, norm.bias, norm.eps, False
    if type(norm) is torch.nn.RMSNorm and norm.elementwise_affine and len(norm.normalized_shape) == 1:
        eps = norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps
        return norm.weight, None, eps, True
    return None


def mlp_activation(mlp, config, mlp_class=MLP) -> Optional[Tuple[str, bool]]:
    """``(activation, gated)`` for a megatron MLP of exactly ``mlp_class`` (a dense ``MLP``, or
    the MoE layer's ``SharedExpertMLP``) whose activation :func:`bias_activation` reproduces; None
    otherwise."""
    if type(mlp) is not mlp_class or config.use_te_activation_func or not isinstance(mlp.linear_fc1, ColumnParallelLinear) \
            or not mlp.linear_fc1.skip_bias_add:
        return None
    activation = _ACTIVATIONS.get(mlp.activation_func)
    gated = bool(config.gated_linear_unit)
    if activation is None or (gated and (config.glu_linear_offset != 0 or config.activation_func_clamp_value
                                         is not None)):
        return None
    if config.bias_activation_fusion:  # megatron's fused bias_gelu / bias_geglu use the tanh approximation
        if activation == "relu" or (activation == "silu" and not gated) or (activation == "gelu" and not gated
                                                                          and not config.add_bias_linear):
            return None  # megatron raises (or asserts) on these; keep its behaviour
        activation = "gelu_tanh" if activation == "gelu" else activation
    return activation, gated


def _rows(tensor: torch.Tensor) -> torch.Tensor:  # [s, b, H] -> [s * b, H]
    return tensor.reshape(-1, tensor.shape[-1])


def _same_dtype(bias: Optional[torch.Tensor], like: torch.Tensor) -> Optional[torch.Tensor]:
    return bias if bias is None or bias.dtype == like.dtype else bias.to(like.dtype)


class FusedQKVSelfAttention(SelfAttention):
    """megatron's ``SelfAttention``. Inside a paged forward its QKV bias add, head split, rope and
    KV-cache write are one launch (:meth:`PagedCoreAttention.forward_mixed_qkv`); with megatron's
    rotary (the unfused comparison path) the bias add and the split are one launch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.config
        self.fused_split_supported = (
            isinstance(self.linear_qkv, ColumnParallelLinear) and not self.linear_qkv.skip_bias_add
            and not self.linear_qkv.gather_output and not config.sequence_parallel and not config.test_mode
            and config.num_query_groups >= self.world_size
        )
        self.fused_mixed_supported = (
            self.fused_split_supported and isinstance(self.core_attention, PagedCoreAttention)
            and isinstance(self.q_layernorm, (type(None), IdentityOp))
            and isinstance(self.k_layernorm, (type(None), IdentityOp))
            and not config.attention_output_gate
        )

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        megatron_only = (key_value_states, inference_context, inference_params, rotary_pos_emb, rotary_pos_cos,
                         rotary_pos_sin, rotary_pos_cos_sin, attention_bias, packed_seq_params)
        if not (self.fused_mixed_supported and all(arg is None for arg in megatron_only) and not self.training
                and fused_glue_enabled()):
            return super().forward(
                hidden_states, attention_mask, key_value_states=key_value_states, inference_context=inference_context,
                rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
                packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                inference_params=inference_params)
        mixed_qkv, bias = self._qkv_projection(hidden_states)  # [s, b, G * (Q / G + 2) * D], bias or None
        attended = self.core_attention.forward_mixed_qkv(_rows(mixed_qkv), _same_dtype(bias, mixed_qkv))
        return self.linear_proj(attended.view(*mixed_qkv.shape[:2], -1))  # (output [s, b, H], bias)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        if not (self.fused_split_supported and split_qkv and not output_gate and key_value_states is None
                and not self.training and fused_glue_enabled()):
            return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate=output_gate,
                                                       split_qkv=split_qkv)
        mixed_qkv, bias = self._qkv_projection(hidden_states)
        seq, batch = mixed_qkv.shape[:2]
        head_dim = self.hidden_size_per_attention_head
        query, key, value = split_qkv_heads(_rows(mixed_qkv), _same_dtype(bias, mixed_qkv),
                                            self.num_query_groups_per_partition, head_dim)  # [s*b, Q|G|G, D]
        query = query.view(seq, batch, -1, head_dim)  # [s, b, Q_local, D]
        key = key.view(seq, batch, -1, head_dim)  # [s, b, G_local, D]
        value = value.view(seq, batch, -1, head_dim)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value

    def _qkv_projection(self, hidden_states):
        """The QKV GEMM without its bias add: (rows ``[s, b, G * (Q / G + 2) * D]``, bias or None)."""
        linear = self.linear_qkv
        linear.skip_bias_add = True  # the bias goes to the next kernel (restored right after)
        try:
            return linear(hidden_states)
        finally:
            linear.skip_bias_add = False


class FusedGlueTransformerLayer(TransformerLayer):
    """megatron's ``TransformerLayer``; on the fused path bias + residual + norm and bias +
    activation are single launches (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.config
        self.pre_mlp_norm = _norm_parameters(self.pre_mlp_layernorm)
        self.mlp_activation = mlp_activation(self.mlp, config)
        self.next_input_norm: Optional[Tuple] = None  # the successor's input norm (link_input_norms)
        self.fused_glue_supported = (
            self.pre_mlp_norm is not None
            and isinstance(self.cross_attention, IdentityOp) and isinstance(self.pre_cross_attn_layernorm, IdentityOp)
            and not (self.recompute_input_layernorm or self.recompute_pre_mlp_layernorm or self.recompute_mlp)
            and not (getattr(self, "offload_attn_norm", False) or getattr(self, "offload_mlp_norm", False))
            and not config.inference_fuse_tp_communication and not config.sequence_parallel
            and not (config.fp8 or config.fp4) and config.mlp_chunks_for_prefill <= 1
        )

    def forward(self, *args, **kwargs):
        if not (self.fused_glue_supported and not self.training and fused_glue_enabled()):
            return super().forward(*args, **kwargs)
        kwargs.pop("dynamic_inference_decode_only", None)
        return self._fused_forward(*args, **kwargs)

    def _fused_forward(self, hidden_states, attention_mask=None, context=None, context_mask=None,
                       rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                       attention_bias=None, inference_context=None, packed_seq_params=None,
                       sequence_len_offset=None, padding_mask=None, *, inference_params=None):
        shape = hidden_states.shape  # [s, b, H]
        if inference_context is None:
            inference_context = inference_params  # megatron's deprecated name
        normed = take_normed_input(hidden_states)  # the predecessor's last kernel normed it
        if normed is None:
            normed = self.input_layernorm(hidden_states)  # [s, b, H]
        attention_out, attention_out_bias = self.self_attention(
            normed, attention_mask=attention_mask, inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
            packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
        )  # [s, b, H], [H] or None
        weight, norm_bias, eps, rms_norm = self.pre_mlp_norm
        residual, normed = add_bias_residual_norm(
            _rows(attention_out), _same_dtype(attention_out_bias, attention_out), _rows(hidden_states),
            weight, norm_bias, eps, rms_norm)  # [s*b, H] each
        mlp_out, mlp_out_bias = self._mlp(normed.view(shape), padding_mask)  # [s, b, H], [H] or None
        output, next_normed = add_bias_residual_norm(_rows(mlp_out), _same_dtype(mlp_out_bias, mlp_out), residual,
                                                     *(self.next_input_norm or ()))  # [s*b, H], [s*b, H] or None
        output = output.view(shape)
        if next_normed is not None:
            stash_normed_input(output, next_normed.view(shape))
        return output, context

    def _mlp(self, normed: torch.Tensor, padding_mask) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.mlp_activation is None:  # megatron's own MLP (e.g. MoE), then the fused bias + residual
            return self.mlp(normed) if padding_mask is None else self.mlp(normed, padding_mask=padding_mask)
        activation, gated = self.mlp_activation
        fc1_out, fc1_bias = self.mlp.linear_fc1(normed)  # [s, b, F or 2F], bias or None
        activated = bias_activation(_rows(fc1_out), _same_dtype(fc1_bias, fc1_out), activation, gated)  # [s*b, F]
        return self.mlp.linear_fc2(activated.view(*normed.shape[:-1], -1))
