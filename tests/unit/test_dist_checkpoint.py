"""Megatron distributed checkpoints into the paged model: saved at TP = 2, loaded at TP = 1 and TP = 2.

megatron's own GPTModel (local layer spec, 2 MTP layers) is saved through ``dist_checkpointing``
by two gloo ranks on the CPU (tests/unit/dist_checkpoint_fixtures.py says how the save and the
oracle run without CUDA). The loaded paged model must hold exactly the saved weights, and our
greedy output at S = 0 and S = 2 must equal megatron's own forward (a full-sequence greedy loop,
no KV cache). Bad checkpoints raise errors that name the path or the key, and leave the model
as it was.
"""

import shutil

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state

from mtp_ctrl.models import load_distributed_checkpoint, save_distributed_checkpoint
from mtp_ctrl.models.checkpoint_record import RECORD_FILE
from mtp_ctrl.models.dist_checkpoint import CHECKPOINT_KEY_ALIASES, checkpoint_key_spellings
from tests.unit.dist_checkpoint_fixtures import (
    SPECULATIVE_SIZES,
    build_megatron_gpt,
    generate_greedy,
    megatron_greedy,
    parameter_mismatches,
    snapshot,
    unchanged,
)
from tests.unit.megatron_fixtures import build_tiny_model, ensure_single_process_groups, free_port, \
    init_process_groups, spawn_ranks, tiny_config

SAVED_SEED, OTHER_SEED = 1234, 99  # the paged models start from other weights than the saved ones


def _save_at_tp2_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Save megatron's model at TP = 2, record its greedy tokens, then load it at TP = 2 into a paged model."""
    init_process_groups(rank, world_size, port, world_size)
    try:
        config = tiny_config(mtp_num_layers=2, tensor_parallel_size=world_size)
        saved = build_megatron_gpt(config, seed=SAVED_SEED)
        save_distributed_checkpoint(saved, f"{out_dir}/checkpoint")
        golden = megatron_greedy(saved)
        paged = build_tiny_model(config, seed=OTHER_SEED)
        load_distributed_checkpoint(paged, f"{out_dir}/checkpoint")
        torch.save({"golden": golden, "mismatches": parameter_mismatches(paged, saved),
                    "outputs": {S: generate_greedy(paged, S) for S in SPECULATIVE_SIZES}}, f"{out_dir}/rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    """``(checkpoint dir, [per-rank results])`` of the TP = 2 save and load."""
    out_dir = tmp_path_factory.mktemp("dist_checkpoint")
    spawn_ranks(_save_at_tp2_worker, (2, free_port(), str(out_dir)))
    return out_dir / "checkpoint", [torch.load(out_dir / f"rank{rank}.pt") for rank in range(2)]


@pytest.fixture
def tp1_paged():
    ensure_single_process_groups()
    return build_tiny_model(tiny_config(mtp_num_layers=2), seed=OTHER_SEED)


def test_saved_at_tp2_loads_at_tp2(tp2_run):
    _, results = tp2_run
    golden = results[0]["golden"]
    assert results[1]["golden"] == golden
    assert len(set(map(tuple, golden))) > 1  # the prompts do not all continue alike
    for rank, result in enumerate(results):
        assert result["mismatches"] == [], f"rank {rank}: {result['mismatches']}"
        for S in SPECULATIVE_SIZES:
            assert result["outputs"][S] == golden, f"rank {rank}, S = {S}"


def test_saved_at_tp2_loads_at_tp1(tp2_run, tp1_paged):
    checkpoint_dir, results = tp2_run
    assert parameter_mismatches(tp1_paged, build_megatron_gpt(tiny_config(mtp_num_layers=2), seed=SAVED_SEED))
    load_distributed_checkpoint(tp1_paged, checkpoint_dir)
    # megatron draws the same master weights at every TP size (CPU initialisation, same seed)
    reference = build_megatron_gpt(tiny_config(mtp_num_layers=2), seed=SAVED_SEED)
    assert parameter_mismatches(tp1_paged, reference) == []  # MTP layers included
    for S in SPECULATIVE_SIZES:
        assert generate_greedy(tp1_paged, S) == results[0]["golden"], f"S = {S}"


def test_unfused_norm_names_load_through_the_aliases(tmp_path, tp1_paged):
    """A checkpoint whose layer norms are ``input_layernorm`` / ``pre_mlp_layernorm`` (not TE's fused names)."""
    saved = build_megatron_gpt(tiny_config(mtp_num_layers=2), seed=SAVED_SEED, fused_norm_names=False)
    save_distributed_checkpoint(saved, tmp_path / "unfused")
    keys = dist_checkpointing.load_tensors_metadata(str(tmp_path / "unfused"))
    assert "decoder.layers.input_layernorm.weight" in keys and "decoder.layers.pre_mlp_layernorm.weight" in keys
    assert not any("layer_norm_weight" in key for key in keys)
    load_distributed_checkpoint(tp1_paged, tmp_path / "unfused")
    assert parameter_mismatches(tp1_paged, saved) == []


def test_key_spellings():
    assert checkpoint_key_spellings("decoder.layers.self_attention.linear_qkv.layer_norm_weight") == [
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.input_layernorm.weight"]
    assert checkpoint_key_spellings("mtp.layers.0.transformer_layer.pre_mlp_layernorm.bias") == [
        "mtp.layers.0.transformer_layer.pre_mlp_layernorm.bias",
        "mtp.layers.0.transformer_layer.mlp.linear_fc1.layer_norm_bias"]
    assert checkpoint_key_spellings("output_layer.weight") == ["output_layer.weight"]
    assert checkpoint_key_spellings("decoder.layers.0.self_attention.in_proj.layer_norm_weight") == [  # GDN layers
        "decoder.layers.0.self_attention.in_proj.layer_norm_weight", "decoder.layers.0.input_layernorm.weight"]
    assert len(CHECKPOINT_KEY_ALIASES) == 3


def test_not_a_checkpoint(tmp_path, tp1_paged):
    before = snapshot(tp1_paged)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_distributed_checkpoint(tp1_paged, tmp_path / "nowhere")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(NotADirectoryError, match="a_file"):
        load_distributed_checkpoint(tp1_paged, tmp_path / "a_file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty.*not a megatron.core.dist_checkpointing checkpoint"):
        load_distributed_checkpoint(tp1_paged, tmp_path / "empty")
    with pytest.raises(TypeError, match="checkpoint_dir"):
        load_distributed_checkpoint(tp1_paged, 3)
    assert unchanged(tp1_paged, before)


def test_missing_keys(tp2_run):
    ensure_single_process_groups()
    model = build_tiny_model(tiny_config(mtp_num_layers=3), seed=OTHER_SEED)  # one MTP layer more than saved
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"missing key 'mtp\.layers\.2\.enorm\.weight'"):
        load_distributed_checkpoint(model, tp2_run[0])
    assert unchanged(model, before)


def test_unexpected_keys(tp2_run):
    ensure_single_process_groups()
    model = build_tiny_model(tiny_config(mtp_num_layers=1), seed=OTHER_SEED)  # one MTP layer fewer than saved
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"unexpected key 'mtp\.layers\.1\.eh_proj\.weight'"):
        load_distributed_checkpoint(model, tp2_run[0])
    assert unchanged(model, before)


@pytest.mark.parametrize("change, key", [
    (dict(hidden_size=32), "embedding.word_embeddings.weight"),
    (dict(num_layers=3), "decoder.layers.0.self_attention.linear_qkv.weight"),
    (dict(ffn_hidden_size=96), "decoder.layers.0.mlp.linear_fc1.weight"),
])
def test_other_architecture(tp2_run, change, key):
    ensure_single_process_groups()
    model = build_tiny_model(tiny_config(mtp_num_layers=2, **change), seed=OTHER_SEED)
    before = snapshot(model)
    with pytest.raises(ValueError, match=rf"shape mismatch for '{key}'.*the checkpoint has"):
        load_distributed_checkpoint(model, tp2_run[0])
    assert unchanged(model, before)


def test_failure_while_reading_leaves_the_model_unchanged(tp2_run, tmp_path, tp1_paged):
    """Keys and shapes match, then a data file is truncated: the read fails, the model keeps its weights.
    The record is removed, as in a checkpoint megatron wrote (with it, the checksum fails first:
    test_checkpoint_integrity.py)."""
    broken = tmp_path / "broken"
    shutil.copytree(tp2_run[0], broken)
    (broken / RECORD_FILE).unlink()
    data_files = sorted(broken.glob("*.distcp"))
    assert data_files
    for path in data_files:
        path.write_bytes(path.read_bytes()[:64])
    before = snapshot(tp1_paged)
    with pytest.raises(RuntimeError, match="reading checkpoint .*broken.* failed"):
        load_distributed_checkpoint(tp1_paged, broken)
    assert unchanged(tp1_paged, before)


def test_save_needs_an_empty_directory(tmp_path, tp1_paged):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "something").write_text("x")
    with pytest.raises(ValueError, match="checkpoint_dir .*full.* must be an empty directory"):
        save_distributed_checkpoint(tp1_paged, tmp_path / "full")


def test_generate_serves_a_dist_checkpoint(tmp_path):
    """``examples/generate.py --load DIR``: the shape comes from the checkpoint's content metadata."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mtp_ctrl.models import build_gpt_model
    from tests.unit.test_scripts import run_script

    ensure_single_process_groups()
    model_args = dict(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                      mtp_num_layers=2, vocab_size=512, max_sequence_length=256)
    config = TransformerConfig(**{k: v for k, v in model_args.items() if k not in ("vocab_size", "max_sequence_length")},
                               hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)
    torch.manual_seed(0)
    save_distributed_checkpoint(build_gpt_model(config, 512, 256), tmp_path / "served",
                                content_metadata={"model_args": model_args})
    result = run_script("examples/generate.py", "--load", str(tmp_path / "served"), "--device", "cpu",
                        "--max-new-tokens", "3", "--num-prompts", "1", "--prompt-len", "8", "--repeats", "1",
                        timeout=600)
    assert result.returncode == 0, result.stderr
    assert f"loaded {tmp_path / 'served'} at TP 1" in result.stdout
    assert "outputs identical: yes" in result.stdout
    result = run_script("examples/generate.py", "--load", str(tmp_path), "--device", "cpu", timeout=600)
    assert result.returncode != 0 and "not a megatron dist_checkpointing directory" in result.stderr
