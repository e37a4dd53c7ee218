"""Torch twins of the transformer-layer glue kernels (:mod:`mtp_ctrl.triton_ops.layer_glue`).

Each rounds to the input dtype at the points where megatron-core's unfused local layer does (an
element-wise op on bf16 tensors rounds its result to bf16), and normalises in fp32 with one
rounding at the end, as torch's LayerNorm / RMSNorm kernels do. In fp32 every rounding is a no-op.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")


def add_bias_residual_norm(
    x: torch.Tensor,  # [T, H] float: a sublayer's output before its bias
    bias: Optional[torch.Tensor],  # [H], x's dtype, or None
    residual: torch.Tensor,  # [T, H], x's dtype
    norm_weight: Optional[torch.Tensor] = None,  # [H] float, or None: no norm
    norm_bias: Optional[torch.Tensor] = None,  # [H] float, or None (RMSNorm, or LayerNorm without bias)
    eps: float = 1e-5,
    rms_norm: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:  # new residual [T, H], normed [T, H] or None; x's dtype
    hidden = x if bias is None else x + bias  # [T, H] rounded to x's dtype
    new_residual = residual + hidden  # [T, H] rounded to x's dtype
    if norm_weight is None:
        return new_residual, None
    rows = new_residual.float()  # [T, H] fp32
    if rms_norm:
        normed = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)
    else:
        centred = rows - rows.mean(-1, keepdim=True)
        normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    normed = normed * norm_weight.float()
    if norm_bias is not None:
        normed = normed + norm_bias.float()
    return new_residual, normed.to(x.dtype)


def _activate(hidden: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(hidden)
    if activation == "gelu_tanh":
        return F.gelu(hidden, approximate="tanh")
    if activation == "silu":
        return F.silu(hidden)
    return F.relu(hidden)


def bias_activation(
    x: torch.Tensor,  # [T, F] float, or [T, 2F] when gated (the activated half first)
    bias: Optional[torch.Tensor],  # [x.shape[1]], x's dtype, or None
    activation: str,  # one of ACTIVATIONS
    gated: bool = False,
) -> torch.Tensor:  # [T, F], x's dtype
    hidden = x if bias is None else x + bias  # rounded to x's dtype
    if not gated:
        return _activate(hidden, activation)
    activated, linear = torch.chunk(hidden, 2, dim=-1)
    return _activate(activated, activation) * linear  # two roundings, as megatron's glu


def split_qkv_heads(
    mixed_qkv: torch.Tensor,  # [T, G * (Q / G + 2) * D] float: per kv group, its query heads, key, value
    bias: Optional[torch.Tensor],  # [mixed_qkv.shape[1]], mixed_qkv's dtype, or None
    num_kv_heads: int,
    head_dim: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # query [T, Q, D], key [T, G, D], value [T, G, D]
    num_tokens = mixed_qkv.shape[0]
    heads_per_group = mixed_qkv.shape[1] // (num_kv_heads * head_dim) - 2
    hidden = mixed_qkv if bias is None else mixed_qkv + bias  # [T, W] rounded to the input dtype
    grouped = hidden.view(num_tokens, num_kv_heads, heads_per_group + 2, head_dim)
    query = grouped[:, :, :heads_per_group].reshape(num_tokens, num_kv_heads * heads_per_group, head_dim)
    return query.contiguous(), grouped[:, :, heads_per_group].contiguous(), grouped[:, :, heads_per_group + 1].contiguous()


def gated_rms_norm(
    y: torch.Tensor,  # [T, d] float
    gate: torch.Tensor,  # [T, d] float
    weight: torch.Tensor,  # [d] float
    group_size: int,
    eps: float,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:  # [T, d] out_dtype (default: y's dtype)
    gated = y.float() * F.silu(gate.float())  # [T, d] fp32
    grouped = gated.view(gated.shape[0], gated.shape[1] // group_size, group_size)  # [T, groups, group_size]
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return (normed.view_as(gated) * weight.float()).to(y.dtype if out_dtype is None else out_dtype)
