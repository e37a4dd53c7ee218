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


def give_long_memory(model, seed: int = 99) -> None:
    """Make the recurrent layers (Mamba-2 or Gated DeltaNet) of ``model`` carry their state: the
    default initialisation forgets it within a token or two (GDN decays ~exp(-10) a token; Mamba's
    dt ~0.01 beside the D skip), so a wrong or zeroed state hardly moves a logit. Here the state
    decays 0.9-0.97 a token and dominates the mixer's output. In place."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.decoder.layers:
            mixer = layer.self_attention
            if not hasattr(mixer, "A_log"):
                continue
            heads = mixer.A_log.shape[0]
            if hasattr(mixer, "D"):  # Mamba-2
                mixer.A_log.copy_(torch.log(torch.empty(heads).uniform_(0.05, 0.3, generator=generator)))
                mixer.D.fill_(0.05)
                mixer.in_proj.weight.mul_(6.0)
            else:  # Gated DeltaNet
                mixer.A_log.copy_(torch.log(torch.empty(heads).uniform_(0.03, 0.15, generator=generator)))
            mixer.dt_bias.fill_(0.0)
            mixer.out_proj.weight.mul_(4.0)
