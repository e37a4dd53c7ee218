"""A tiny Gated DeltaNet hybrid for the GDN tests: megatron's settings
(``experimental_attention_variant="gated_delta_net"``, ``linear_attention_freq=2``: decoder layers
GDN, attention, GDN, attention), gated attention with q/k norm and partial rotary as in Qwen3-Next,
attention MTP layers, randomly initialised, fp32."""

import torch
import torch.nn.functional as F

from mtp_ctrl.models import build_gpt_model
from tests.unit.megatron_fixtures import MAX_SEQUENCE_LENGTH, VOCAB_SIZE, tiny_config


def gdn_config(mtp_num_layers: int = 2, tensor_parallel_size: int = 1, **overrides):
    """hidden 64; GDN: 2 key heads of 16, 4 value heads of 8, conv width 4; silu (GDN's conv and
    gate use the config's activation, as in megatron), RMSNorm."""
    fields = dict(num_layers=4, experimental_attention_variant="gated_delta_net", linear_attention_freq=2,
                  linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_conv_kernel_dim=4, activation_func=F.silu,
                  gated_linear_unit=True, normalization="RMSNorm", attention_output_gate=True, qk_layernorm=True)
    fields.update(overrides)
    return tiny_config(mtp_num_layers=mtp_num_layers, tensor_parallel_size=tensor_parallel_size, **fields)


def build_gdn_model(mtp_num_layers: int = 2, seed: int = 2468, tensor_parallel_size: int = 1, **overrides):
    torch.manual_seed(seed)
    return build_gpt_model(gdn_config(mtp_num_layers, tensor_parallel_size, **overrides), VOCAB_SIZE, MAX_SEQUENCE_LENGTH,
                           rotary_percent=0.5).eval()
