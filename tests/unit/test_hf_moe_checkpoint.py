"""load_hf_checkpoint for the MoE and MLA families (Qwen3-MoE, GLM-4.5, DeepSeek-V3) against
``transformers``' forward of tiny random models saved with ``save_pretrained`` (fp32, CPU), and
their MTP layers against a reference step built on ``transformers``' own decoder layer.

Checked: logits over a paged schedule (prefill chunks, decodes, verifies) == transformers' causal
forward; every MTP depth == the reference; the controller's greedy tokens == transformers'
``generate``, and speculative (the loaded MTP layers drafting, S = 2) == plain (S = 0), greedy and
sampled; the MTP layer's own embedding / head copies are checked against the trunk's; refusals name
their field.
"""

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from mtp_ctrl.models import PagedGPTRunner, load_hf_checkpoint  # noqa: E402
from mtp_ctrl.models.hf_families import UnsupportedCheckpointError  # noqa: E402
from tests.unit import hf_moe_fixtures  # noqa: E402
from tests.unit.megatron_fixtures import (  # noqa: E402
    BLOCK_SIZE_TOKENS,
    NUM_BLOCKS,
    ensure_single_process_groups,
    free_port,
    random_sequences,
    run_paged_schedule,
    shifted_tokens,
    spawn_ranks,
)
from tests.unit.megatron_fixtures import torch_twins as use_torch_twins  # noqa: E402

TOLERANCE = dict(atol=3e-5, rtol=1e-4)
FAMILIES = tuple(hf_moe_fixtures.FAMILIES)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (directory, transformers model, MTP layer models or None)}."""
    ensure_single_process_groups()
    root = tmp_path_factory.mktemp("hf_moe")
    made = {}
    for family in FAMILIES:
        (root / family).mkdir()
        made[family] = (root / family, *hf_moe_fixtures.write_checkpoint(family, root / family))
    return made


def paged_logits(model):
    runner = PagedGPTRunner(model)
    caches = runner.kv_cache_spec(torch.float32).allocate(NUM_BLOCKS, BLOCK_SIZE_TOKENS, "cpu")
    return run_paged_schedule(runner, random_sequences(seed=0), caches)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoints, family):
    directory, hf_model, mtp_models = checkpoints[family]
    model = load_hf_checkpoint(directory, tp=1, device="cpu")
    assert model.config.mtp_num_layers == (None if mtp_models is None else hf_moe_fixtures.NEXTN_DEPTH)
    decoder_logits, mtp_logits = paged_logits(model)
    sequences = random_sequences(seed=0)
    with torch.no_grad():
        for ours, tokens in zip(decoder_logits, sequences):
            torch.testing.assert_close(ours, hf_model(tokens[None]).logits[0], **TOLERANCE)
    if mtp_models is not None:
        reference = hf_moe_fixtures.reference_mtp_logits(hf_model, mtp_models, sequences, shifted_tokens)
        for depth in range(hf_moe_fixtures.NEXTN_DEPTH):
            for ours, theirs in zip(mtp_logits[depth], reference[depth]):
                torch.testing.assert_close(ours, theirs, **TOLERANCE)


def _parallel_worker(rank, world_size, port, tensor_parallel_size, expert_parallel_size, directories, expected_path):
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size,
                                             expert_model_parallel_size=expert_parallel_size)
    try:
        expected = torch.load(expected_path)
        for family, directory in directories.items():
            model = load_hf_checkpoint(directory, tp=tensor_parallel_size, device="cpu")
            with use_torch_twins():  # the subject is which weights each rank reads, not the kernels
                decoder_logits, mtp_logits = paged_logits(model)
            for ours, theirs in zip(decoder_logits, expected[family]["decoder"]):
                torch.testing.assert_close(ours, theirs, **TOLERANCE)
            for depth, per_request in enumerate(expected[family]["mtp"]):
                for ours, theirs in zip(mtp_logits[depth], per_request):
                    torch.testing.assert_close(ours, theirs, **TOLERANCE)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.parametrize("tensor_parallel_size, expert_parallel_size, families", [
    (2, 1, ("glm4_moe", "deepseek_v3")), (1, 2, ("deepseek_v3",))], ids=["tp2", "ep2"])
def test_parallel_load_matches_transformers(checkpoints, tmp_path, tensor_parallel_size, expert_parallel_size,
                                            families):
    """Two gloo ranks each read their part: TP 2 splits heads (fused QKV with biases), the MLA
    projections, the shared and routed experts (expert TP) and the vocabulary; EP 2 gives each rank
    its 2 of the 4 experts (decoder and MTP layers). Qwen3-MoE shares GLM-4.5's TP rules."""
    sequences = random_sequences(seed=0)
    expected, directories = {}, {}
    with torch.no_grad():
        for family in families:
            directory, hf_model, mtp_models = checkpoints[family]
            directories[family] = str(directory)
            expected[family] = {
                "decoder": [hf_model(tokens[None]).logits[0] for tokens in sequences],
                "mtp": [] if mtp_models is None else
                hf_moe_fixtures.reference_mtp_logits(hf_model, mtp_models, sequences, shifted_tokens)}
    path = tmp_path / "expected.pt"
    torch.save(expected, path)
    spawn_ranks(_parallel_worker, (2, free_port(), tensor_parallel_size, expert_parallel_size, directories,
                                     str(path)))


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_matches_transformers_and_speculation_is_lossless(checkpoints, family, torch_twins):
    """Greedy S = 0 == transformers' ``generate``; with MTP layers, S = 2 == S = 0 (greedy, and
    sampled with the same seed)."""
    directory, hf_model, mtp_models = checkpoints[family]
    model = load_hf_checkpoint(directory, device="cpu")
    prompts = [[5, 17, 33, 2, 90, 41], [7, 7, 60, 12]]
    new_tokens = 8
    with torch.no_grad():
        expected = [hf_model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert hf_moe_fixtures.generate_tokens(model, prompts, 0, new_tokens) == expected
    if mtp_models is None:
        return
    assert hf_moe_fixtures.generate_tokens(model, prompts, 2, new_tokens) == expected
    sampled = dict(temperature=1.0, seed=3)
    generate = hf_moe_fixtures.generate_tokens
    assert generate(model, prompts, 2, new_tokens, **sampled) == generate(model, prompts, 0, new_tokens, **sampled)


# ----- the MTP layer's copies of trunk tensors, and refusals ---------------------------------------

def _copy(checkpoints, family, tmp_path):
    target = tmp_path / family
    shutil.copytree(checkpoints[family][0], target)
    return target


def _edit_config(directory, **fields):
    config = json.loads((directory / "config.json").read_text())
    config.update(fields)
    (directory / "config.json").write_text(json.dumps(config))


def _edit_mtp_shard(directory, edit):
    from safetensors.torch import load_file, save_file

    path = directory / "model-mtp.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    index["weight_map"] = {name: file for name, file in index["weight_map"].items()
                           if file != "model-mtp.safetensors" or name in tensors}
    index["weight_map"].update({name: "model-mtp.safetensors" for name in tensors})
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def test_mtp_copies_of_trunk_tensors(checkpoints, tmp_path):
    """The MTP layer's ``embed_tokens`` / ``shared_head.head`` are optional, and must equal the trunk's."""
    directory = _copy(checkpoints, "deepseek_v3", tmp_path / "a")
    _edit_mtp_shard(directory, lambda t: [t.pop(f"model.layers.{2 + k}.embed_tokens.weight") for k in range(2)])
    load_hf_checkpoint(directory, device="cpu")

    directory = _copy(checkpoints, "deepseek_v3", tmp_path / "b")
    _edit_mtp_shard(directory, lambda t: t["model.layers.3.shared_head.head.weight"][5].add_(1.0))
    with pytest.raises(ValueError, match=r"'model.layers.3.shared_head.head.weight' differs from 'lm_head.weight'"):
        load_hf_checkpoint(directory, device="cpu")


@pytest.mark.parametrize("family, fields, named", [
    ("deepseek_v3", dict(rope_interleave=False), "rope_interleave"),
    ("deepseek_v3", dict(scoring_func="softmax"), "scoring_func"),
    ("deepseek_v3", dict(norm_topk_prob=False), "norm_topk_prob"),
    ("deepseek_v3", dict(moe_layer_freq=2), "moe_layer_freq"),
    ("deepseek_v3", dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    ("deepseek_v3", dict(rope_parameters={**hf_moe_fixtures.YARN, "mscale": 0.0}), "mscale"),
    ("deepseek_v3", dict(rope_parameters={**hf_moe_fixtures.YARN, "truncate": False}), "truncate"),
    ("glm4_moe", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "yarn"),
    ("glm4_moe", dict(n_group=3), "n_group"),
    ("qwen3_moe", dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"]), "DeepSeek-V2"),
])
def test_unsupported_config_is_refused_naming_the_field(checkpoints, tmp_path, family, fields, named):
    directory = _copy(checkpoints, family, tmp_path)
    _edit_config(directory, **fields)
    with pytest.raises(UnsupportedCheckpointError, match=named):
        load_hf_checkpoint(directory, device="cpu")


def test_missing_expert_and_mtp_tensors_are_named(checkpoints, tmp_path):
    directory = _copy(checkpoints, "glm4_moe", tmp_path / "a")
    _edit_mtp_shard(directory, lambda t: t.pop("model.layers.3.mlp.experts.2.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks tensor 'model.layers.3.mlp.experts.2.up_proj.weight'.*"
                                         r"mtp.layers.1.transformer_layer.mlp.experts.local_experts.2.linear_fc1"):
        load_hf_checkpoint(directory, device="cpu")

    directory = _copy(checkpoints, "glm4_moe", tmp_path / "b")  # config says 1 MTP layer, the shard holds 2
    _edit_config(directory, num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match="does not use: 'model.layers.3."):
        load_hf_checkpoint(directory, device="cpu")
