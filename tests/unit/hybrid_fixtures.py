"""A tiny hybrid model for the Mamba tests: decoder layers ``"M*M*"`` (Mamba-2, attention,
Mamba-2, attention) and attention MTP layers, randomly initialised, fp32."""

import torch

from mtp_ctrl.models import build_gpt_model
from tests.unit.megatron_fixtures import MAX_SEQUENCE_LENGTH, VOCAB_SIZE, tiny_config

LAYER_PATTERN = "M*M*"


def hybrid_config(mtp_num_layers: int = 2):
    """hidden 64, 8 Mamba heads of 16 channels in 2 groups, state size 8, conv width 4."""
    return tiny_config(mtp_num_layers=mtp_num_layers, num_layers=len(LAYER_PATTERN), mamba_state_dim=8,
                       mamba_head_dim=16, mamba_num_groups=2)


def build_hybrid_model(mtp_num_layers: int = 2, seed: int = 4321, chunk_size: int = 64):
    torch.manual_seed(seed)
    model = build_gpt_model(hybrid_config(mtp_num_layers), VOCAB_SIZE, MAX_SEQUENCE_LENGTH,
                            layer_pattern=LAYER_PATTERN).eval()
    for layer in model.decoder.layers:  # a small scan chunk makes short test prompts span several chunks
        if hasattr(layer.self_attention, "chunk_size"):
            layer.self_attention.chunk_size = chunk_size
    return model
