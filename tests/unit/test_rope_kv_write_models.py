"""The runner's fused rotary path (rope inside the paged KV write) == megatron's own rotary, on the tiny GPT.

Both runners wrap the same weights and step through the same schedule of prefill chunks and
1 + S decode rows; the fused one gets cos/sin once per call and ropes in core attention.
"""

import pytest
import torch
from megatron.core.models.gpt import GPTModel

from mtp_ctrl.models import PagedGPTRunner, count_kv_layers, get_paged_gpt_layer_spec, get_paged_mtp_block_spec
from mtp_ctrl.models.forward_context import RotaryTables
from mtp_ctrl.controllers import InferenceConfig
from tests.unit.megatron_fixtures import (
    MAX_SEQUENCE_LENGTH,
    NUM_BLOCKS,
    VOCAB_SIZE,
    allocate_kv_caches,
    build_gpt_model,
    ensure_single_process_groups,
    random_sequences,
    run_paged_schedule,
    tiny_config,
    torch_twins,
)

FP32_TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", autouse=True)
def megatron_groups():
    ensure_single_process_groups()


@pytest.fixture(autouse=True)
def attention_on_twins():
    """The subject is the rope + cache write: attention (the same in both paths, == its twin in its
    own tests) runs its twin; the rope and cache-write kernels stay interpreted."""
    with torch_twins("paged_attn"):
        yield


def _schedule_logits(model, fused_rope, dtype=torch.float32):
    runner = PagedGPTRunner(model, fused_rope=fused_rope)
    caches = allocate_kv_caches(count_kv_layers(model), NUM_BLOCKS, num_kv_heads_local=2, head_dim=16, dtype=dtype)
    decoder_logits, mtp_logits = run_paged_schedule(runner, random_sequences(seed=0), caches)
    return [decoder_logits] + mtp_logits, caches


def _assert_paths_agree(model, dtype=torch.float32, tolerance=FP32_TOL):
    (fused, fused_caches), (unfused, unfused_caches) = (_schedule_logits(model, flag, dtype) for flag in (True, False))
    for fused_depth, unfused_depth in zip(fused, unfused):  # decoder, then each MTP depth
        for got, want in zip(fused_depth, unfused_depth):  # per request
            torch.testing.assert_close(got, want, **tolerance)
            if dtype == torch.float32:
                assert torch.equal(got.argmax(-1), want.argmax(-1))  # the same greedy tokens
    for (got_key, got_value), (want_key, want_value) in zip(fused_caches, unfused_caches):
        torch.testing.assert_close(got_key, want_key, **tolerance)  # roped keys, same slots
        torch.testing.assert_close(got_value, want_value, **tolerance)


@pytest.mark.parametrize("rotary_percent,interleaved", [(1.0, False), (0.5, False), (1.0, True), (0.5, True)])
def test_fused_rope_matches_megatron_rotary(rotary_percent, interleaved):
    torch.manual_seed(11)
    config = tiny_config(mtp_num_layers=2, rotary_interleaved=interleaved)
    model = build_gpt_model(config, VOCAB_SIZE, MAX_SEQUENCE_LENGTH, rotary_percent=rotary_percent).eval()
    _assert_paths_agree(model)


def test_fused_rope_skips_layers_megatron_skips():
    """config.no_rope_freq: layer 2 of 2 runs without rotary in both paths (no MTP layers: megatron's
    attention indexes no_rope_freq by layer_number, which runs past the list in an MTP layer)."""
    torch.manual_seed(12)
    model = build_gpt_model(tiny_config(mtp_num_layers=None, no_rope_freq=[0, 1]), VOCAB_SIZE, MAX_SEQUENCE_LENGTH)
    assert [layer.self_attention.core_attention.skips_rotary for layer in model.decoder.layers] == [False, True]
    _assert_paths_agree(model.eval())


def test_fused_rope_bf16_is_within_rounding_of_megatron():
    torch.manual_seed(13)
    config = tiny_config(mtp_num_layers=1, params_dtype=torch.bfloat16, bf16=True)
    model = build_gpt_model(config, VOCAB_SIZE, MAX_SEQUENCE_LENGTH).eval()
    # megatron rounds cos/sin and each product to bf16; the kernel rounds once: a few bf16 ulps apart
    _assert_paths_agree(model, dtype=torch.bfloat16, tolerance=dict(atol=5e-2, rtol=5e-2))


@pytest.mark.parametrize("position_embedding_type", ["learned_absolute", "none"])
def test_models_without_rope_only_write_the_cache(position_embedding_type):
    torch.manual_seed(14)
    config = tiny_config(mtp_num_layers=1)
    spec = get_paged_gpt_layer_spec(use_transformer_engine=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB_SIZE,
                     max_sequence_length=MAX_SEQUENCE_LENGTH, position_embedding_type=position_embedding_type,
                     mtp_block_spec=get_paged_mtp_block_spec(config, spec, use_transformer_engine=False)).eval()
    runner = PagedGPTRunner(model, fused_rope=True)
    assert runner.rotary_tables(torch.arange(3)) == (None, None)
    _assert_paths_agree(model)


def test_rotary_tables_are_computed_once_per_call():
    torch.manual_seed(15)
    model = build_gpt_model(tiny_config(mtp_num_layers=1), VOCAB_SIZE, MAX_SEQUENCE_LENGTH).eval()
    runner = PagedGPTRunner(model, fused_rope=True)
    emb, tables = runner.rotary_tables(torch.tensor([0, 5, 9]))
    assert emb is None and isinstance(tables, RotaryTables)
    assert tables.cos.shape == (3, 8) and tables.cos.dtype == torch.float32  # head_dim 16: 8 frequencies
    torch.testing.assert_close(tables.cos[0], torch.ones(8))
    emb, tables = PagedGPTRunner(model, fused_rope=False).rotary_tables(torch.tensor([0, 5, 9]))
    assert tables is None and emb.shape == (3, 1, 1, 16)


def test_fused_rope_switch():
    torch.manual_seed(16)
    model = build_gpt_model(tiny_config(mtp_num_layers=None), VOCAB_SIZE, MAX_SEQUENCE_LENGTH).eval()
    assert PagedGPTRunner(model).fused_rope is True
    assert PagedGPTRunner(model, fused_rope=False).fused_rope is False
    with pytest.raises(TypeError, match="fused_rope"):
        PagedGPTRunner(model, fused_rope=1)
    with pytest.raises(TypeError, match="fused_rope"):
        InferenceConfig(fused_rope=None)
