"""load_hf_checkpoint for the Gated DeltaNet hybrids (Qwen3-Next; dense Qwen3.5 in its
vision-language checkpoint) against ``transformers``' forward of tiny random models saved with
``save_pretrained`` (fp32, CPU; its torch fallbacks for the conv and the delta rule), and their MTP
layers against a plain-torch reference of the published MTP step (``hf_gdn_fixtures``).

Checked: logits over prefill, verify rows with a state commit after one accepted draft, and a
chunked prefill == transformers'; every MTP depth == the reference; the controller's greedy tokens
== transformers' ``generate``; S = 2 (the loaded MTP layers drafting) == S = 0, greedy and sampled;
TP = 2 over gloo (heads of the gated QKV, every in_proj section, the conv channels) == transformers;
the released one-MTP-layer layout drafting S = 2 by rerunning it == transformers' tokens; refusals
name their field.
"""

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from mtp_ctrl.models import PagedGPTRunner, load_hf_checkpoint  # noqa: E402
from mtp_ctrl.models.hf_families import UnsupportedCheckpointError  # noqa: E402
from tests.unit import hf_gdn_fixtures, hf_moe_fixtures  # noqa: E402
from tests.unit.megatron_fixtures import VOCAB_SIZE, ensure_single_process_groups, free_port  # noqa: E402
from tests.unit.megatron_fixtures import shifted_tokens, spawn_ranks  # noqa: E402
from tests.unit.megatron_fixtures import torch_twins as use_torch_twins  # noqa: E402

TOLERANCE = dict(atol=3e-5, rtol=1e-4)
FAMILIES = tuple(hf_gdn_fixtures.FAMILIES)
TOKENS = torch.randint(0, VOCAB_SIZE, (13,), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (directory, transformers model, MTP tensors, MTP layer models, expected logits)}."""
    ensure_single_process_groups()
    root = tmp_path_factory.mktemp("hf_gdn")
    made = {}
    for family in FAMILIES:
        (root / family).mkdir()
        model, mtp, layer_models = hf_gdn_fixtures.write_checkpoint(family, root / family)
        with torch.no_grad():
            expected = {"decoder": hf_gdn_fixtures.expected_decoder_rows(model(TOKENS[None]).logits[0]),
                        "mtp": hf_gdn_fixtures.reference_mtp_logits(model, mtp, layer_models, TOKENS,
                                                                    shifted_tokens)}
        made[family] = (root / family, model, expected)
    return made


def _check_logits(model, expected, tensor_parallel_size=1):
    decoder, mtp = hf_gdn_fixtures.paged_logits(PagedGPTRunner(model), TOKENS, tensor_parallel_size)
    torch.testing.assert_close(decoder, expected["decoder"], **TOLERANCE)
    assert len(mtp) == len(expected["mtp"]) == hf_gdn_fixtures.MTP_DEPTH
    for ours, theirs in zip(mtp, expected["mtp"]):
        torch.testing.assert_close(ours, theirs, **TOLERANCE)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_mtp_depths_match_transformers(checkpoints, family, torch_twins):
    """The subject is the loaded weights: the ops run their torch twins (each kernel == its twin in
    tests/unit/test_gdn_kernels.py; the mixer with kernels in test_gdn_mixer.py)."""
    directory, _, expected = checkpoints[family]
    model = load_hf_checkpoint(directory, tp=1, device="cpu")
    config = model.config
    assert config.mtp_num_layers == hf_gdn_fixtures.MTP_DEPTH and config.attention_output_gate
    assert config.linear_attention_freq == [1, 0, 1, 0]
    assert bool(config.num_moe_experts) == (family == "qwen3_next")
    _check_logits(model, expected)


def _parallel_worker(rank, world_size, port, directories, expected_path):
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        expected = torch.load(expected_path)
        for family, directory in directories.items():
            model = load_hf_checkpoint(directory, tp=world_size, device="cpu")
            with use_torch_twins():  # the subject is which weights each rank reads, not the kernels
                _check_logits(model, expected[family], world_size)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_tp2_load_matches_transformers(checkpoints, tmp_path):
    """Two gloo ranks each read their heads: the gated QKV's query groups, Qwen3-Next's per-key-head
    in_proj groups and Qwen3.5's split sections, the conv channels, A_log / dt_bias, out_proj columns,
    the (shared) experts and the vocabulary."""
    path = tmp_path / "expected.pt"
    torch.save({family: checkpoints[family][2] for family in FAMILIES}, path)
    directories = {family: str(checkpoints[family][0]) for family in FAMILIES}
    spawn_ranks(_parallel_worker, (2, free_port(), directories, str(path)))


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_matches_transformers_and_speculation_is_lossless(checkpoints, family, torch_twins):
    """Greedy S = 0 == transformers' ``generate``; S = 2 (the loaded MTP layers drafting) == S = 0,
    greedy and sampled with the same seed."""
    directory, hf_model, _ = checkpoints[family]
    model = load_hf_checkpoint(directory, device="cpu")
    prompts = [[5, 17, 33, 2, 90, 41], [7, 7, 60, 12]]
    new_tokens = 6
    with torch.no_grad():
        expected = [hf_model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert hf_moe_fixtures.generate_tokens(model, prompts, 0, new_tokens) == expected
    assert hf_moe_fixtures.generate_tokens(model, prompts, 2, new_tokens) == expected
    sampled = dict(temperature=1.0, seed=3)
    generate = hf_moe_fixtures.generate_tokens
    assert generate(model, prompts, 2, new_tokens, **sampled) == generate(model, prompts, 0, new_tokens, **sampled)


# ----- refusals and missing tensors ------------------------------------------------------------------

def _copy_with_config(checkpoints, family, tmp_path, **fields):
    target = tmp_path / family
    shutil.copytree(checkpoints[family][0], target)
    config = json.loads((target / "config.json").read_text())
    (config.get("text_config") or config).update(fields)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("family, fields, named", [
    ("qwen3_next", dict(layer_types=["linear_attention", "sliding_attention"] * 2), "layer_types"),
    ("qwen3_next", dict(linear_num_value_heads=3), "linear_num_value_heads"),
    ("qwen3_next", dict(attention_bias=True), "attention_bias"),
    ("qwen3_5", dict(hidden_act="gelu"), "hidden_act"),
    ("qwen3_5", dict(model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"]), "Qwen3.5-MoE"),
])
def test_unsupported_config_is_refused_naming_the_field(checkpoints, tmp_path, family, fields, named):
    if "model_type" in fields:  # the family is named at the top level
        directory = tmp_path / family
        shutil.copytree(checkpoints[family][0], directory)
        config = json.loads((directory / "config.json").read_text())
        config.update(fields)
        (directory / "config.json").write_text(json.dumps(config))
    else:
        directory = _copy_with_config(checkpoints, family, tmp_path, **fields)
    with pytest.raises(UnsupportedCheckpointError, match=named):
        load_hf_checkpoint(directory, device="cpu")


def test_mtp_depth_disagreeing_with_the_files_is_named(checkpoints, tmp_path):
    directory = _copy_with_config(checkpoints, "qwen3_next", tmp_path / "a", num_nextn_predict_layers=3)
    with pytest.raises(ValueError, match=r"lacks tensor 'mtp.layers.2.input_layernorm.weight'.*mtp.layers.2"):
        load_hf_checkpoint(directory, device="cpu")
    directory = _copy_with_config(checkpoints, "qwen3_5", tmp_path / "b", mtp_num_hidden_layers=1)
    with pytest.raises(ValueError, match="does not use: 'mtp.layers.1."):
        load_hf_checkpoint(directory, device="cpu")


def test_one_mtp_layer_drafts_two_tokens_losslessly(checkpoints, tmp_path, torch_twins):
    """The released layout: one MTP layer (``mtp.layers.0``); S = 2 reruns it
    (``mtp_reuse_last_layer``) and the greedy tokens stay transformers'."""
    from safetensors.torch import load_file, save_file

    from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController

    directory = _copy_with_config(checkpoints, "qwen3_next", tmp_path, num_nextn_predict_layers=1)
    mtp = {name: tensor for name, tensor in load_file(str(directory / "model-mtp.safetensors")).items()
           if not name.startswith("mtp.layers.1.")}
    save_file(mtp, str(directory / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    index["weight_map"] = {name: file for name, file in index["weight_map"].items() if not name.startswith("mtp.layers.1.")}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_hf_checkpoint(directory, device="cpu")
    assert model.config.mtp_num_layers == 1
    prompt, new_tokens = [5, 17, 33, 2, 90, 41], 6
    with torch.no_grad():
        expected = checkpoints["qwen3_next"][1].generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                                         do_sample=False, eos_token_id=None, pad_token_id=0)
    config = InferenceConfig(num_speculative_tokens=2, mtp_reuse_last_layer=True, max_requests=1, block_size_tokens=4,
                             max_model_len=32, max_tokens_per_step=32)
    result = TextGenerationController(model, config, seed=0).generate([prompt], SamplingParams(max_new_tokens=new_tokens))
    assert list(result[0].output_tokens) == expected[0, len(prompt):].tolist()
