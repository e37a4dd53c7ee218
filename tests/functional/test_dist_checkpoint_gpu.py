"""Megatron distributed checkpoints on CUDA: megatron's default torch_dist writer (the one that needs
CUDA), and a Transformer Engine spec checkpoint (fused layer-norm names) loaded into the paged model."""

import importlib.util

import pytest
import torch

from mtp_ctrl.models import load_distributed_checkpoint, save_distributed_checkpoint
from tests.unit.dist_checkpoint_fixtures import (
    SPECULATIVE_SIZES,
    build_megatron_gpt,
    generate_greedy,
    megatron_greedy,
    parameter_mismatches,
)
from tests.unit.megatron_fixtures import MAX_SEQUENCE_LENGTH, VOCAB_SIZE, build_tiny_model, \
    ensure_single_process_groups, tiny_config


@pytest.fixture(autouse=True)
def megatron_rng():
    ensure_single_process_groups()
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(123)  # megatron's attention forks its CUDA RNG tracker


def test_default_writer_round_trip_on_gpu(tmp_path):
    config = tiny_config(mtp_num_layers=2)
    saved = build_megatron_gpt(config, seed=1234).cuda()
    save_distributed_checkpoint(saved, tmp_path / "checkpoint")  # CUDA parameters: megatron's default writer
    golden = megatron_greedy(saved)
    paged = build_tiny_model(config, seed=99).cuda()
    load_distributed_checkpoint(paged, tmp_path / "checkpoint")
    assert parameter_mismatches(paged, saved) == []
    for S in SPECULATIVE_SIZES:
        assert generate_greedy(paged, S) == golden, f"S = {S}"


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine")
def test_transformer_engine_checkpoint_loads_into_the_local_paged_model(tmp_path):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec, \
        get_gpt_mtp_block_spec

    config = tiny_config(mtp_num_layers=2)
    spec = get_gpt_layer_with_transformer_engine_spec()
    torch.manual_seed(1234)
    saved = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB_SIZE,
                     max_sequence_length=MAX_SEQUENCE_LENGTH, position_embedding_type="rope",
                     mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=True)).cuda().eval()
    names = dict(saved.named_parameters())
    assert any(name.endswith("linear_qkv.layer_norm_weight") for name in names)  # TE's fused names
    save_distributed_checkpoint(saved, tmp_path / "te")
    paged = build_tiny_model(config, seed=99).cuda()  # megatron's local layers
    load_distributed_checkpoint(paged, tmp_path / "te")
    ours = dict(paged.named_parameters())
    assert torch.equal(ours["decoder.layers.1.input_layernorm.weight"],
                       names["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"])
    assert torch.equal(ours["mtp.layers.1.transformer_layer.pre_mlp_layernorm.weight"],
                       names["mtp.layers.1.transformer_layer.mlp.linear_fc1.layer_norm_weight"])
    golden = megatron_greedy(saved)
    for S in SPECULATIVE_SIZES:
        assert generate_greedy(paged, S) == golden, f"S = {S}"
