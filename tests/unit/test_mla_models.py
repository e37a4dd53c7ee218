"""A paged MLA GPT (TP = 1, CPU, fp32) stepping through its latent cache == megatron's own MLA GPT
over the whole sequence: decoder and MTP logits, prefill chunks, decode and verify rows, positions
at block boundaries; absorbed and decompressed attention; with and without q_lora_rank; plain
rotary and YaRN."""

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

from mtp_ctrl.models import PagedGPTRunner, count_kv_layers, dense_full_sequence
from mtp_ctrl.models.mla_attention import LatentRotary, PagedMLACoreAttention
from mtp_ctrl.state import LatentKVCacheSpec
from tests.unit.megatron_fixtures import (
    BLOCK_SIZE_TOKENS,
    NUM_BLOCKS,
    build_tiny_model,
    ensure_single_process_groups,
    random_sequences,
    run_paged_schedule,
)
from tests.unit.mla_fixtures import YARN, build_megatron_mla_gpt, megatron_on_cpu, tiny_mla_config

FP32_TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def megatron_groups():
    ensure_single_process_groups()


@pytest.mark.parametrize("variant", ["q_lora+rope+absorbed", "no_q_lora+yarn+absorbed", "q_lora+yarn+decompressed"])
def test_paged_mla_gpt_matches_megatron(megatron_groups, variant):
    overrides = {} if "no_q_lora" not in variant else dict(q_lora_rank=None)
    if "yarn" in variant:
        overrides.update(YARN)
    config = tiny_mla_config(**overrides)
    model = build_tiny_model(config)
    runner = PagedGPTRunner(model)
    if "decompressed" in variant:  # every chunk (even single decode rows) through decompressed K/V
        for module in model.modules():
            if isinstance(module, PagedMLACoreAttention):
                module.absorb_max_query_len = 0
    spec = runner.kv_cache_spec(torch.float32)
    assert count_kv_layers(model) == 4
    assert spec == LatentKVCacheSpec(num_layers=4, latent_dim=24 + 8,
                                     dtype=torch.float32)
    sequences = random_sequences(seed=0)
    decoder_logits, mtp_logits = run_paged_schedule(runner, sequences,
                                                    spec.allocate(NUM_BLOCKS, BLOCK_SIZE_TOKENS, "cpu"))
    megatron_model = build_megatron_mla_gpt(config, model)
    for b, tokens in enumerate(sequences):
        with megatron_on_cpu():
            want_logits, want_mtp = dense_full_sequence(megatron_model, tokens)
        torch.testing.assert_close(decoder_logits[b], want_logits, **FP32_TOL)
        for depth in range(2):
            torch.testing.assert_close(mtp_logits[depth][b], want_mtp[depth], **FP32_TOL)


@pytest.mark.parametrize("yarn", [False, True])
def test_latent_rotary_matches_megatron(yarn):
    config = tiny_mla_config(**(YARN if yarn else {}))
    ours = LatentRotary(8, rotary_base=config.rotary_base, yarn=yarn, scaling_factor=config.rotary_scaling_factor,
                        original_max_position_embeddings=config.original_max_position_embeddings,
                        beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
                        mscale_all_dim=config.mscale_all_dim)
    with megatron_on_cpu():
        if yarn:
            theirs = YarnRotaryEmbedding(8, rotary_base=config.rotary_base, scaling_factor=config.rotary_scaling_factor,
                                         original_max_position_embeddings=config.original_max_position_embeddings,
                                         beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
                                         mscale_all_dim=config.mscale_all_dim, use_cpu_initialization=True)
            want, want_mscale = theirs(20)
            got, got_mscale = ours(20)
            assert got_mscale == pytest.approx(want_mscale) and want_mscale != 1.0
        else:
            want = RotaryEmbedding(8, rotary_percent=1.0, rotary_base=config.rotary_base, use_cpu_initialization=True)(20)
            got = ours(20)
    torch.testing.assert_close(got, want)
    tables = ours.tables(torch.tensor([3, 17]))
    torch.testing.assert_close(tables.cos, torch.cos(want[[3, 17], 0, 0, :4]) * ours.mscale)


def test_state_dict_names_are_megatrons(megatron_groups):
    config = tiny_mla_config(mtp_num_layers=1)
    model = build_tiny_model(config)
    megatron_model = build_megatron_mla_gpt(config, model)
    assert set(model.state_dict()) == set(megatron_model.state_dict())
    names = set(model.state_dict())
    assert "decoder.layers.0.self_attention.linear_kv_down_proj.weight" in names
    assert "mtp.layers.0.transformer_layer.self_attention.linear_q_up_proj.weight" in names


def test_wrong_cache_layout_is_a_clear_error(megatron_groups):
    model = build_tiny_model(tiny_mla_config(mtp_num_layers=0))
    runner = PagedGPTRunner(model)
    pairs = [(torch.zeros(NUM_BLOCKS, BLOCK_SIZE_TOKENS, 4, 24),) * 2 for _ in range(2)]
    with pytest.raises(ValueError, match="latent cache"):
        run_paged_schedule(runner, random_sequences(seed=0), pairs)


def test_megatron_written_dist_checkpoint_loads_and_reproduces_megatrons_tokens(megatron_groups, tmp_path):
    """megatron's own MLA GPT (other weights than the paged model's) saved through
    dist_checkpointing loads into the paged MLA model; its greedy tokens, plain and speculative,
    are megatron's full-sequence greedy tokens."""
    from mtp_ctrl.models import load_distributed_checkpoint, save_distributed_checkpoint
    from tests.unit.controller_fixtures import dense_greedy
    from tests.unit.dist_checkpoint_fixtures import PROMPTS, generate_greedy, parameter_mismatches

    config = tiny_mla_config(**YARN)
    saved = build_megatron_mla_gpt(config, build_tiny_model(config, seed=1234))
    save_distributed_checkpoint(saved, str(tmp_path / "checkpoint"))
    paged = build_tiny_model(config, seed=99)
    load_distributed_checkpoint(paged, str(tmp_path / "checkpoint"))
    assert parameter_mismatches(paged, saved) == []
    with megatron_on_cpu():
        golden = [dense_greedy(saved, prompt, 5) for prompt in PROMPTS[:2]]
    for num_speculative_tokens in (0, 2):
        assert generate_greedy(paged, num_speculative_tokens, prompts=PROMPTS[:2], max_new_tokens=5) == golden


def test_latent_cache_spec_checks_and_sizes():
    spec = LatentKVCacheSpec(num_layers=3, latent_dim=576, dtype=torch.bfloat16)
    assert spec.bytes_per_block(64) == 3 * 64 * 576 * 2
    caches = LatentKVCacheSpec(num_layers=2, latent_dim=6, dtype=torch.float32).allocate(5, 4, "cpu")
    assert len(caches) == 2 and caches[0].shape == (5, 4, 6) and not caches[0].any()
    with pytest.raises(ValueError, match="num_layers"):
        LatentKVCacheSpec(num_layers=0, latent_dim=576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="latent_dim"):
        LatentKVCacheSpec(num_layers=1, latent_dim=True, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="dtype"):
        LatentKVCacheSpec(num_layers=1, latent_dim=576, dtype=torch.int32)


def test_yarn_rotary_builds_on_the_default_device():
    """A model built inside ``with torch.device(...)`` (as the HF loader builds on CUDA) gets its
    YaRN frequencies on that device, not a CPU/device mix (found on the GPU)."""
    from mtp_ctrl.models.mla_attention import LatentRotary

    with torch.device("meta"):
        rotary = LatentRotary(64, yarn=True, scaling_factor=40.0, original_max_position_embeddings=4096,
                              mscale=1.0, mscale_all_dim=1.0)
    assert rotary.inv_freq.device.type == "meta"
