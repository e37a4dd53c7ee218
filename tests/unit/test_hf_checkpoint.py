"""load_hf_checkpoint against an implementation nobody here wrote: ``transformers``' forward of tiny
random models saved with ``save_pretrained`` (fp32, CPU), and a plain-torch MiMo MTP step.

Checked: logits over a paged schedule (prefill chunks, decodes, verifies) == transformers' full
causal forward, at TP = 1 and TP = 2 (gloo); MTP logits of every depth == the reference; greedy
tokens of the controller (plain and MTP-speculative) == ``transformers``' ``generate``; every
refusal names its tensor or field.
"""

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from mtp_ctrl.models import PagedGPTRunner, count_kv_layers, load_hf_checkpoint  # noqa: E402
from mtp_ctrl.models.hf_families import UnsupportedCheckpointError  # noqa: E402
from tests.unit import hf_fixtures  # noqa: E402
from tests.unit.megatron_fixtures import (  # noqa: E402
    NUM_BLOCKS,
    allocate_kv_caches,
    ensure_single_process_groups,
    free_port,
    init_process_groups,
    random_sequences,
    run_paged_schedule,
    shifted_tokens,
    spawn_ranks,
)

TOLERANCE = dict(atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (directory, transformers model)}; MiMo's entry also carries its MTP tensors."""
    ensure_single_process_groups()
    root = tmp_path_factory.mktemp("hf")
    made = {}
    for name, write in (("llama", hf_fixtures.write_llama), ("qwen3", hf_fixtures.write_qwen3)):
        (root / name).mkdir()
        made[name] = (root / name, write(root / name), None)
    (root / "mimo").mkdir()
    trunk, mtp = hf_fixtures.write_mimo(root / "mimo")
    made["mimo"] = (root / "mimo", trunk, mtp)
    return made


@torch.no_grad()
def transformers_logits(hf_model, sequences):
    return [hf_model(tokens[None]).logits[0] for tokens in sequences]


@torch.no_grad()
def reference_mtp_logits(hf_model, mtp, sequences):
    """[depth][request] -> [n, V]: the plain-torch MTP chain over each whole sequence, fed as
    megatron feeds it (depth k reads the tokens shifted by k + 1, zeros past the end)."""
    embedding = hf_model.model.embed_tokens.weight
    lm_head = hf_model.lm_head.weight
    per_depth = [[] for _ in range(hf_fixtures.MIMO_MTP_DEPTH)]
    for tokens in sequences:
        hidden = hf_model.model(tokens[None]).last_hidden_state[0]  # [n, H] after the final norm
        for depth in range(hf_fixtures.MIMO_MTP_DEPTH):
            logits, hidden = hf_fixtures.mimo_mtp_reference(mtp, depth, hidden, shifted_tokens(tokens, depth + 1),
                                                            embedding, lm_head)
            per_depth[depth].append(logits)
    return per_depth


def paged_logits(model):
    caches = allocate_kv_caches(count_kv_layers(model), NUM_BLOCKS, num_kv_heads_local=model.config.num_query_groups
                                // model.config.tensor_model_parallel_size, head_dim=model.config.kv_channels)
    return run_paged_schedule(PagedGPTRunner(model), random_sequences(seed=0), caches)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mimo"])
def test_logits_match_transformers(checkpoints, family):
    directory, hf_model, mtp = checkpoints[family]
    model = load_hf_checkpoint(directory, tp=1, device="cpu")
    assert model.config.mtp_num_layers == (hf_fixtures.MIMO_MTP_DEPTH if family == "mimo" else None)
    decoder_logits, mtp_logits = paged_logits(model)
    sequences = random_sequences(seed=0)
    for ours, theirs in zip(decoder_logits, transformers_logits(hf_model, sequences)):
        torch.testing.assert_close(ours, theirs, **TOLERANCE)
    if mtp is not None:
        reference = reference_mtp_logits(hf_model, mtp, sequences)
        for depth in range(hf_fixtures.MIMO_MTP_DEPTH):
            for ours, theirs in zip(mtp_logits[depth], reference[depth]):
                torch.testing.assert_close(ours, theirs, **TOLERANCE)


def test_greedy_tokens_match_transformers_generate(checkpoints, torch_twins):
    """The controller's greedy output with the loaded MTP layers drafting (S = 2) equals
    transformers' greedy ``generate`` on the same weights (plain decoding's logits are checked
    above; speculation adds the drafts, their verification and the KV rewinds)."""
    from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController

    directory, hf_model, _ = checkpoints["mimo"]
    model = load_hf_checkpoint(directory, device="cpu")
    prompts = [[5, 17, 33, 2, 90, 41], [7, 7, 60, 12]]
    new_tokens = 10
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
    config = InferenceConfig(num_speculative_tokens=2, max_requests=2, block_size_tokens=4, max_model_len=32,
                             max_tokens_per_step=32)
    results = TextGenerationController(model, config, seed=0).generate(prompts, SamplingParams(max_new_tokens=new_tokens))
    assert [list(result.output_tokens) for result in results] == expected


def _tp_worker(rank, world_size, port, directories, expected_path):
    init_process_groups(rank, world_size, port, world_size)
    try:
        expected = torch.load(expected_path)
        for family, directory in directories.items():
            model = load_hf_checkpoint(directory, tp=world_size, device="cpu")
            decoder_logits, mtp_logits = paged_logits(model)
            for ours, theirs in zip(decoder_logits, expected[family]["decoder"]):
                torch.testing.assert_close(ours, theirs, **TOLERANCE)
            for depth, per_request in enumerate(expected[family]["mtp"]):
                for ours, theirs in zip(mtp_logits[depth], per_request):
                    torch.testing.assert_close(ours, theirs, **TOLERANCE)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def test_tp2_matches_transformers(checkpoints, tmp_path):
    """Two gloo ranks each read their shard (fused QKV with bias, GLU, MTP eh_proj, vocab rows)."""
    sequences = random_sequences(seed=0)
    expected, directories = {}, {}
    for family in ("qwen3", "mimo"):
        directory, hf_model, mtp = checkpoints[family]
        directories[family] = str(directory)
        expected[family] = {"decoder": transformers_logits(hf_model, sequences),
                            "mtp": reference_mtp_logits(hf_model, mtp, sequences) if mtp else []}
    path = tmp_path / "expected.pt"
    torch.save(expected, path)
    spawn_ranks(_tp_worker, (2, free_port(), directories, str(path)))


# ----- refusals ----------------------------------------------------------------------------------

def _copy(checkpoints, family, tmp_path):
    target = tmp_path / family
    shutil.copytree(checkpoints[family][0], target)
    return target


def _edit_config(directory, **fields):
    config = json.loads((directory / "config.json").read_text())
    config.update(fields)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("fields, named", [
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    (dict(attention_sink_bias=True), "attention_sink_bias"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}), "yarn"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"]), "DeepSeek-V2"),
    (dict(model_type="falcon", architectures=["FalconForCausalLM"]), "FalconForCausalLM"),
    (dict(architectures=["Qwen3ForSequenceClassification"]), "Qwen3ForSequenceClassification"),
    (dict(model_type="llama", architectures=["LlamaForCausalLMEagle3"]), "EAGLE draft head"),
])
def test_unsupported_config_is_refused_naming_the_field(checkpoints, tmp_path, fields, named):
    directory = _copy(checkpoints, "qwen3", tmp_path)
    _edit_config(directory, **fields)
    with pytest.raises(UnsupportedCheckpointError, match=named):
        load_hf_checkpoint(directory, device="cpu")


def _rewrite_tensors(directory, edit):
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_unexpected_and_misshapen_tensors_are_named(checkpoints, tmp_path):
    directory = _copy(checkpoints, "llama", tmp_path)
    _rewrite_tensors(directory, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks tensor 'model.layers.1.mlp.up_proj.weight'.*linear_fc1"):
        load_hf_checkpoint(directory, device="cpu")

    directory = _copy(checkpoints, "qwen3", tmp_path / "b")
    _rewrite_tensors(directory, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="does not use: 'model.layers.0.self_attn.extra.weight'"):
        load_hf_checkpoint(directory, device="cpu")

    directory = _copy(checkpoints, "qwen3", tmp_path / "c")
    _rewrite_tensors(directory, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(48, 64)}))
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \[48, 64\], expected \[32, 64\]"):
        load_hf_checkpoint(directory, device="cpu")

    directory = _copy(checkpoints, "mimo", tmp_path / "d")  # config says 2 MTP layers, the shard holds them:
    _edit_config(directory, num_nextn_predict_layers=1)     # the second is unexpected
    with pytest.raises(ValueError, match="model.mtp_layers.1."):
        load_hf_checkpoint(directory, device="cpu")


def test_bad_arguments(checkpoints, tmp_path):
    directory = checkpoints["llama"][0]
    with pytest.raises(ValueError, match="tp=2"):
        load_hf_checkpoint(directory, tp=2, device="cpu")
    with pytest.raises(TypeError, match="path"):
        load_hf_checkpoint(3)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_hf_checkpoint(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        load_hf_checkpoint(directory, dtype=torch.int8, device="cpu")


def test_older_config_spelling_and_linear_rope(checkpoints, tmp_path):
    """Hub files written before transformers 5 spell rotary as ``rope_theta`` + ``rope_scaling``;
    ``linear`` scaling divides the frequencies (transformers' own model is the oracle)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = _copy(checkpoints, "llama", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (directory / "config.json").write_text(json.dumps(config))
    hf_model = checkpoints["llama"][1]
    tokens = random_sequences(seed=0)[0]
    torch.testing.assert_close(paged_logits(load_hf_checkpoint(directory, device="cpu"))[0][0],
                               transformers_logits(hf_model, [tokens])[0], **TOLERANCE)

    torch.manual_seed(5)
    linear = LlamaForCausalLM(LlamaConfig(**hf_fixtures.TINY_SHAPE, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})).eval()
    linear.save_pretrained(str(tmp_path / "linear"))
    torch.testing.assert_close(paged_logits(load_hf_checkpoint(tmp_path / "linear", device="cpu"))[0][0],
                               transformers_logits(linear, [tokens])[0], **TOLERANCE)
