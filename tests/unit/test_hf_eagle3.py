"""load_eagle3_head: a tiny random EAGLE-3 head in the public (EAGLE / SpecForge) layout, with a
reduced draft vocabulary (``d2t`` / ``t2d``), over a ``transformers``-written Llama target.

Checked: the head's step-1 logits (through the paged runner) == a plain-torch EAGLE-3 step written
here from the published layout (target aux states and rotary from ``transformers``), with every id
outside the draft vocabulary at -inf; the controller with :class:`EagleProposer` over the loaded
head: S = 2 == S = 0, greedy and sampled; the same for a deeper head (``num_hidden_layers`` 2:
``layers.0.*`` as above, ``layers.1.*`` a plain decoder layer after it); bad heads are refused by name.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from mtp_ctrl.controllers import EagleProposer, InferenceConfig, SamplingParams, TextGenerationController  # noqa: E402
from mtp_ctrl.models import PagedGPTRunner, load_eagle3_head, load_hf_checkpoint  # noqa: E402
from mtp_ctrl.models.hf_families import UnsupportedCheckpointError  # noqa: E402
from tests.unit import hf_fixtures  # noqa: E402
from tests.unit.megatron_fixtures import (  # noqa: E402
    BLOCK_SIZE_TOKENS,
    BLOCK_TABLES,
    NUM_BLOCKS,
    VOCAB_SIZE,
    allocate_kv_caches,
    ensure_single_process_groups,
    free_port,
    init_process_groups,
    make_metadata,
    random_sequences,
    shifted_tokens,
    spawn_ranks,
)

TOLERANCE = dict(atol=3e-5, rtol=1e-4)
NUM_TARGET_LAYERS = 4
EAGLE_AUX_IDS = [1, 2, 3]  # inputs of target layers 1..3 = outputs of layers 0..2
DRAFT_VOCAB_SIZE = 64
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 64, 96, 4, 2, 16


def head_tensors(seed: int = 7, num_layers: int = 1):
    """Random EAGLE-3 head tensors (``midlayer.*``; with several layers ``layers.{i}.*``, as vLLM
    names them), fp32, and the draft vocabulary's target ids."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.08):
        return torch.randn(*shape, generator=generator) * scale

    def norm():
        return 1.0 + rand(HIDDEN, scale=0.1)

    target_ids = torch.randperm(VOCAB_SIZE, generator=generator)[:DRAFT_VOCAB_SIZE].sort().values  # [Vd]
    t2d = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    t2d[target_ids] = True
    p = "midlayer." if num_layers == 1 else "layers.0."
    tensors = {
        "fc.weight": rand(HIDDEN, 3 * HIDDEN), p + "hidden_norm.weight": norm(), p + "input_layernorm.weight": norm(),
        p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, 2 * HIDDEN),
        p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM), p + "post_attention_layernorm.weight": norm(),
        p + "mlp.gate_proj.weight": rand(FFN, HIDDEN), p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
        p + "mlp.down_proj.weight": rand(HIDDEN, FFN), "norm.weight": norm(),
        "lm_head.weight": rand(DRAFT_VOCAB_SIZE, HIDDEN, scale=0.3),
        "d2t": target_ids - torch.arange(DRAFT_VOCAB_SIZE), "t2d": t2d,
    }
    for index in range(1, num_layers):
        p = f"layers.{index}."
        tensors.update({
            p + "input_layernorm.weight": norm(), p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM), p + "post_attention_layernorm.weight": norm(),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN), p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN)})
    return tensors, target_ids


def write_head(directory, tensors, **config_fields):
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    config = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=HIDDEN,
                  intermediate_size=FFN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  num_hidden_layers=1, rms_norm_eps=1e-6, vocab_size=VOCAB_SIZE, draft_vocab_size=DRAFT_VOCAB_SIZE,
                  max_position_embeddings=128, rope_parameters=dict(hf_fixtures.LLAMA3_ROPE),
                  eagle_config={"eagle_aux_hidden_state_layer_ids": EAGLE_AUX_IDS})
    config.update(config_fields)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target directory, transformers target, head directory, head tensors, draft target ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ensure_single_process_groups()
    root = tmp_path_factory.mktemp("eagle3")
    torch.manual_seed(0)
    shape = {**hf_fixtures.TINY_SHAPE, "num_hidden_layers": NUM_TARGET_LAYERS}
    target = LlamaForCausalLM(LlamaConfig(**shape, rope_parameters=dict(hf_fixtures.LLAMA3_ROPE),
                                          tie_word_embeddings=False)).eval()
    target.save_pretrained(str(root / "target"))
    tensors, target_ids = head_tensors()
    tensors["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()  # SpecForge keeps a copy
    write_head(root / "head", tensors)
    deep_tensors, deep_ids = head_tensors(seed=8, num_layers=2)
    write_head(root / "deep_head", deep_tensors, num_hidden_layers=2)
    return root / "target", target, root / "head", tensors, target_ids, root / "deep_head", deep_tensors, deep_ids


def _rms(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x, cos, sin):  # x [T, heads, D]; cos, sin [T, D]
    rotated = torch.cat((-x[..., HEAD_DIM // 2:], x[..., :HEAD_DIM // 2]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _decoder_layer(x, residual, w, p, cos, sin):
    """A Llama decoder layer whose attention reads ``x`` [T, in] and adds to ``residual`` [T, H]."""
    seq_len = x.shape[0]
    q = _rotate((x @ w[p + "self_attn.q_proj.weight"].T).view(seq_len, HEADS, HEAD_DIM), cos[0], sin[0])
    k = _rotate((x @ w[p + "self_attn.k_proj.weight"].T).view(seq_len, KV_HEADS, HEAD_DIM), cos[0], sin[0])
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(seq_len, KV_HEADS, HEAD_DIM)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1), float("-inf"))
    attended = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(seq_len, HEADS * HEAD_DIM)
    h = residual + attended @ w[p + "self_attn.o_proj.weight"].T
    y = _rms(h, w[p + "post_attention_layernorm.weight"])
    return h + (F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) @ \
        w[p + "mlp.down_proj.weight"].T


@torch.no_grad()
def eagle3_step_reference(hf_target, w, target_ids, tokens, num_layers: int = 1):
    """EAGLE-3's first draft step over one whole sequence: logits ``[T, V]`` (-inf off the draft
    vocabulary) of the token after next at every position. Layer 0 attends over
    ``cat(input_layernorm(embedding), hidden_norm(feature))`` with the feature as its residual;
    layers 1.. are plain decoder layers on its output."""
    seq_len = tokens.shape[0]
    states = hf_target(tokens[None], output_hidden_states=True).hidden_states  # [L + 1] x [1, T, H]
    feature = torch.cat([states[i][0] for i in EAGLE_AUX_IDS], dim=-1) @ w["fc.weight"].T  # [T, H]
    p = "midlayer." if num_layers == 1 else "layers.0."
    embedded = hf_target.model.embed_tokens.weight[shifted_tokens(tokens, 1)]  # [T, H]
    x = torch.cat((_rms(embedded, w[p + "input_layernorm.weight"]), _rms(feature, w[p + "hidden_norm.weight"])), -1)
    cos, sin = hf_target.model.rotary_emb(x[None], torch.arange(seq_len)[None])  # [1, T, D]
    out = _decoder_layer(x, feature, w, p, cos, sin)
    for index in range(1, num_layers):
        p = f"layers.{index}."
        out = _decoder_layer(_rms(out, w[p + "input_layernorm.weight"]), out, w, p, cos, sin)
    draft = _rms(out, w["norm.weight"]) @ w["lm_head.weight"].T  # [T, Vd]
    logits = torch.full((seq_len, VOCAB_SIZE), float("-inf"))
    logits[:, target_ids] = draft
    return logits


def first_step_logits(target_dir, head_dir, tokens, tp: int = 1):
    """The loaded head's step-1 logits ``[T, V]`` over one prefilled sequence (this TP rank's run)."""
    model = load_hf_checkpoint(target_dir, tp=tp, device="cpu")
    head = load_eagle3_head(head_dir, model)
    assert head.aux_layer_ids == (0, 1, 2)
    runner = PagedGPTRunner(model)
    runner.set_aux_layers(head.aux_layer_ids)
    metadata = make_metadata([BLOCK_TABLES[0]], [(0, tokens.shape[0])])
    with torch.no_grad():
        runner.forward(tokens, metadata.positions, metadata,
                       runner.kv_cache_spec(torch.float32).allocate(NUM_BLOCKS, BLOCK_SIZE_TOKENS, "cpu"))
        head_cache = allocate_kv_caches(head.num_kv_layers, NUM_BLOCKS, KV_HEADS // tp, HEAD_DIM)
        logits, _ = runner.eagle_forward(head, head.project_aux(runner.aux_hidden), shifted_tokens(tokens, 1),
                                         metadata.positions, metadata, head_cache)
    return logits


def _tp_worker(rank, world_size, port, target_dir, head_dir, expected_path):
    from megatron.core import parallel_state

    init_process_groups(rank, world_size, port, world_size)
    try:
        tokens, expected = torch.load(expected_path)
        torch.testing.assert_close(first_step_logits(target_dir, head_dir, tokens, tp=world_size), expected,
                                   **TOLERANCE)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def test_tp2_matches_reference(setup, tmp_path):
    """Two gloo ranks: the deeper head's fused 2H-input QKV, its plain second layer, MLPs and
    draft-vocabulary head split over TP."""
    target_dir, hf_target = setup[:2]
    head_dir, tensors, target_ids = setup[5:]
    tokens = random_sequences(seed=0)[0]
    path = tmp_path / "expected.pt"
    torch.save((tokens, eagle3_step_reference(hf_target, tensors, target_ids, tokens, num_layers=2)), path)
    spawn_ranks(_tp_worker, (2, free_port(), str(target_dir), str(head_dir), str(path)))


@pytest.mark.parametrize("num_layers", [1, 2])
def test_first_draft_step_matches_reference(setup, num_layers):
    target_dir, hf_target, head_dir, tensors, target_ids = setup[:5]
    if num_layers == 2:
        head_dir, tensors, target_ids = setup[5:]
    tokens = random_sequences(seed=0)[0]
    logits = first_step_logits(target_dir, head_dir, tokens)
    reference = eagle3_step_reference(hf_target, tensors, target_ids, tokens, num_layers)
    off_vocabulary = torch.ones(VOCAB_SIZE, dtype=torch.bool)
    off_vocabulary[target_ids] = False
    assert torch.isneginf(logits[:, off_vocabulary]).all()
    torch.testing.assert_close(logits[:, target_ids], reference[:, target_ids], **TOLERANCE)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_speculation_with_the_loaded_head_is_lossless(setup, num_layers, torch_twins):
    target_dir, head_dir = setup[0], setup[2 if num_layers == 1 else 5]
    model = load_hf_checkpoint(target_dir, device="cpu")
    head = load_eagle3_head(head_dir, model)
    assert head.num_kv_layers == num_layers
    prompts = [[5, 17, 33, 2, 90, 41], [7, 7, 60, 12]]

    def generate(num_speculative_tokens, **sampling):
        config = InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=2, block_size_tokens=4,
                                 max_model_len=32, max_tokens_per_step=32)
        proposer = EagleProposer(head) if num_speculative_tokens else None
        controller = TextGenerationController(model, config, seed=0, proposer=proposer)
        results = controller.generate([list(p) for p in prompts], SamplingParams(max_new_tokens=8, **sampling))
        return [list(result.output_tokens) for result in results]

    assert generate(2) == generate(0)
    if num_layers == 1:  # sampling draws the same way whatever the head's depth
        assert generate(2, temperature=1.0, seed=3) == generate(0, temperature=1.0, seed=3)


def _bad_d2t(tensors):
    tensors["d2t"][1] = tensors["d2t"][0] - 1  # draft ids 0 and 1 -> the same target id


def _bad_t2d(tensors):
    tensors["t2d"][:] = False


@pytest.mark.parametrize("edit, config_fields, named", [
    (lambda t: t.pop("midlayer.mlp.up_proj.weight"), {}, "lacks tensor 'midlayer.mlp.up_proj.weight'"),
    (lambda t: t.update({"extra.weight": torch.zeros(2)}), {}, "does not use"),
    (_bad_d2t, {}, "d2t"),
    (_bad_t2d, {}, "t2d"),
    (lambda t: t["embed_tokens.weight"].add_(1.0), {}, "embed_tokens"),
    (None, {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "rotary"),
    (None, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}, "aux layers"),
    (None, {"architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3 head"),
])
def test_bad_heads_are_refused_by_name(setup, tmp_path, edit, config_fields, named):
    target_dir, _, _, tensors = setup[:4]
    tensors = {name: tensor.clone() for name, tensor in tensors.items()}
    if edit is not None:
        edit(tensors)
    directory = write_head(tmp_path / "head", tensors)
    if config_fields:
        config = json.loads((directory / "config.json").read_text())
        config.update(config_fields)
        (directory / "config.json").write_text(json.dumps(config))
    model = load_hf_checkpoint(target_dir, device="cpu")
    with pytest.raises((ValueError, UnsupportedCheckpointError), match=named):
        load_eagle3_head(directory, model)


def test_generate_script_drafts_with_the_head(setup, tmp_path):
    """``examples/generate.py --hf DIR --proposer eagle --draft-hf DIR2``: text in, both modes agree."""
    import shutil

    from tests.unit.test_scripts import run_script

    target_dir, _, head_dir = setup[:3]
    target = shutil.copytree(target_dir, tmp_path / "target")
    hf_fixtures.write_tokenizer(target)
    path = tmp_path / "metrics.json"
    result = run_script("examples/generate.py", "--hf", str(target), "--proposer", "eagle", "--draft-hf", str(head_dir),
                        "--device", "cpu", "--prompt", "the quick brown fox", "--num-prompts", "1",
                        "--max-new-tokens", "4", "--repeats", "1", "--metrics-json", str(path), timeout=300)
    assert result.returncode == 0, result.stderr
    assert "EAGLE-3 head from head" in result.stdout
    assert json.loads(path.read_text())["comparison"]["outputs_identical"] is True
    result = run_script("examples/generate.py", "--hf", str(target), "--proposer", "eagle", timeout=60)
    assert result.returncode == 2 and "--draft-hf" in result.stderr


@pytest.mark.parametrize("module", ["generate", "serve"])
def test_draft_hf_flag_combinations_are_checked(setup, module, capsys):
    """--draft-hf goes with --hf and --proposer eagle; --hf --proposer eagle needs it."""
    import importlib

    parse_args = importlib.import_module(f"mtp_ctrl.cli.{module}").parse_args
    target_dir, _, head_dir = setup[:3]
    for argv, named in ((["--random-weights", "--draft-hf", str(head_dir)], "--draft-hf goes with --hf"),
                        (["--hf", str(target_dir), "--proposer", "eagle"], "needs --draft-hf"),
                        (["--hf", str(target_dir), "--draft-hf", str(head_dir)], "goes with --proposer eagle"),
                        (["--hf", str(target_dir), "--proposer", "ptd"], "--draft-hf"),
                        (["--hf", str(target_dir), "--proposer", "eagle", "--draft-hf", str(target_dir / "none")],
                         "not an EAGLE-3 head directory")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert named in capsys.readouterr().err
    args = parse_args(["--hf", str(target_dir), "--proposer", "eagle", "--draft-hf", str(head_dir)])
    assert args.draft_hf == str(head_dir)
