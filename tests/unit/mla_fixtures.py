"""A tiny MLA GPT (DeepSeek-V3-shaped, scaled down) and megatron's own MLA GPT as its oracle.

megatron 0.16's MLA needs CUDA for its rotary tables (``torch.cuda.current_device()``) and, on a
machine without Transformer Engine, fails on ``isinstance(.., TELinear)`` with ``TELinear = None``;
:func:`megatron_on_cpu` patches exactly those two things so megatron's own modules run on the CPU.
"""

import contextlib
import copy
from unittest import mock

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.transformer_config import MLATransformerConfig

from mtp_ctrl.models.dense_attention import DenseCausalAttention
from tests.unit.megatron_fixtures import MAX_SEQUENCE_LENGTH, VOCAB_SIZE

YARN = dict(rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=0.7,  # both mscales != 1
            original_max_position_embeddings=8, beta_fast=4.0, beta_slow=1.0)


def tiny_mla_config(mtp_num_layers=2, tensor_parallel_size=1, **overrides) -> MLATransformerConfig:
    """2 layers, hidden 64, 4 heads; q_lora 32, kv_lora 24, qk 16 + rope 8, v 12; plain rope; fp32."""
    fields = dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=24,
        qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12, rope_type="rope", normalization="RMSNorm",
        qk_layernorm=True, mtp_num_layers=mtp_num_layers, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, tensor_model_parallel_size=tensor_parallel_size,
    )
    fields.update(overrides)
    return MLATransformerConfig(**fields)


@contextlib.contextmanager
def megatron_on_cpu():
    with mock.patch("torch.cuda.current_device", return_value=torch.device("cpu")), \
            mock.patch.object(multi_latent_attention, "HAVE_TE", False):
        yield


def build_megatron_mla_gpt(config: MLATransformerConfig, paged_model) -> GPTModel:
    """megatron's own GPTModel from its local MLA spec (SDPA core attention), holding the paged
    model's weights (a strict load: the parameter names are the same). Run it inside
    :func:`megatron_on_cpu`."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=config.qk_layernorm,
                                                  normalization=config.normalization))
    spec.submodules.self_attention.submodules.core_attention = DenseCausalAttention
    with megatron_on_cpu():
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB_SIZE,
                         max_sequence_length=MAX_SEQUENCE_LENGTH, position_embedding_type="rope",
                         mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
                         if config.mtp_num_layers else None)
    model.load_state_dict(paged_model.state_dict())
    return model.eval()
