"""load_hf_checkpoint on CUDA: parameters allocated on the GPU and filled from the mapped files; the
paged model's logits (decoder and MTP depths of MiMo, GLM-4.5, DeepSeek-V3, Qwen3-Next, Qwen3.5) ==
transformers' / the plain-torch MTP step on the same device (fp32); speculation with CUDA graphs ==
plain; bf16 loads."""

import pytest
import torch

pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from mtp_ctrl.models import PagedGPTRunner, count_kv_layers, load_hf_checkpoint  # noqa: E402
from tests.unit import hf_fixtures  # noqa: E402
from tests.unit.megatron_fixtures import (  # noqa: E402
    NUM_BLOCKS,
    allocate_kv_caches,
    ensure_single_process_groups,
    random_sequences,
    run_paged_schedule,
    shifted_tokens,
)

GPU_FP32_TOL = dict(atol=1e-3, rtol=1e-3)


def _graph_outputs(model, num_speculative_tokens):
    """Greedy tokens of two prompts through the controller with CUDA graphs."""
    from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController

    config = InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=2, block_size_tokens=16,
                             max_model_len=64, max_tokens_per_step=64, cuda_graph_batch_sizes=(1, 2))
    results = TextGenerationController(model, config, seed=0).generate([[5, 17, 33, 2, 90, 41], [7, 7, 60, 12]],
                                                                       SamplingParams(max_new_tokens=12))
    return [list(result.output_tokens) for result in results]


def test_mimo_on_cuda_matches_transformers(tmp_path):
    ensure_single_process_groups()
    trunk, mtp = hf_fixtures.write_mimo(tmp_path)
    model = load_hf_checkpoint(tmp_path, device="cuda")
    assert all(p.is_cuda for p in model.parameters())
    caches = allocate_kv_caches(count_kv_layers(model), NUM_BLOCKS, num_kv_heads_local=2, head_dim=16, device="cuda")
    sequences = [s.cuda() for s in random_sequences(seed=0)]
    decoder_logits, mtp_logits = run_paged_schedule(PagedGPTRunner(model), sequences, caches, device="cuda")
    trunk = trunk.cuda()
    mtp = {name: tensor.cuda() for name, tensor in mtp.items()}
    with torch.no_grad():
        for b, tokens in enumerate(sequences):
            torch.testing.assert_close(decoder_logits[b], trunk(tokens[None]).logits[0], **GPU_FP32_TOL)
            hidden = trunk.model(tokens[None]).last_hidden_state[0]
            for depth in range(hf_fixtures.MIMO_MTP_DEPTH):
                expected, hidden = hf_fixtures.mimo_mtp_reference(mtp, depth, hidden, shifted_tokens(tokens, depth + 1),
                                                                  trunk.model.embed_tokens.weight, trunk.lm_head.weight)
                torch.testing.assert_close(mtp_logits[depth][b], expected, **GPU_FP32_TOL)
    bf16 = load_hf_checkpoint(tmp_path, device="cuda", dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_moe_and_mla_on_cuda_match_transformers_and_speculate_losslessly(tmp_path, family):
    """GLM-4.5 (MoE + MTP) and DeepSeek-V3 (MLA + MoE + MTP) on the GPU: logits == transformers
    (fp32), the MTP depths == the reference step, and the controller with CUDA graphs gives
    S = 2 == S = 0 (bf16 loads too; its expert bias stays fp32)."""
    from tests.unit import hf_moe_fixtures

    ensure_single_process_groups()
    hf_model, mtp_models = hf_moe_fixtures.write_checkpoint(family, tmp_path)
    model = load_hf_checkpoint(tmp_path, device="cuda")
    runner = PagedGPTRunner(model)
    caches = runner.kv_cache_spec(torch.float32).allocate(NUM_BLOCKS, 4, "cuda")
    sequences = [s.cuda() for s in random_sequences(seed=0)]
    decoder_logits, mtp_logits = run_paged_schedule(runner, sequences, caches, device="cuda")
    hf_model = hf_model.cuda()
    mtp_models = {depth: layer.cuda() for depth, layer in mtp_models.items()}
    for depth, layer in mtp_models.items():  # plain tensors the reference reads
        layer.enorm, layer.hnorm, layer.eh_proj = layer.enorm.cuda(), layer.hnorm.cuda(), layer.eh_proj.cuda()
    with torch.no_grad():
        for b, tokens in enumerate(sequences):
            torch.testing.assert_close(decoder_logits[b], hf_model(tokens[None]).logits[0], **GPU_FP32_TOL)
        reference = hf_moe_fixtures.reference_mtp_logits(hf_model, mtp_models, sequences, shifted_tokens)
        for depth in range(hf_moe_fixtures.NEXTN_DEPTH):
            for b in range(len(sequences)):
                torch.testing.assert_close(mtp_logits[depth][b], reference[depth][b], **GPU_FP32_TOL)
    assert _graph_outputs(model, 2) == _graph_outputs(model, 0)
    bf16 = load_hf_checkpoint(tmp_path, device="cuda", dtype=torch.bfloat16)
    biases = [b for name, b in bf16.named_buffers() if name.endswith("router.expert_bias")]
    assert biases and all(b.dtype == torch.float32 for b in biases)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_gdn_hybrids_on_cuda_match_transformers_and_speculate_losslessly(tmp_path, family):
    """Qwen3-Next (GDN + MoE + MTP) and Qwen3.5 (GDN + MTP, vision-language checkpoint) on the GPU,
    through the Triton kernels: logits over prefill / verify + commit / chunked prefill ==
    transformers (fp32, its torch fallbacks), the MTP depths == the reference step; the controller
    with CUDA graphs gives S = 2 == S = 0; bf16 loads."""
    import transformers

    from tests.unit import hf_gdn_fixtures

    needed = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration"}[family]
    if not hasattr(transformers, needed):
        pytest.skip(f"transformers {transformers.__version__} has no {needed}")
    ensure_single_process_groups()
    hf_model, mtp, layer_models = hf_gdn_fixtures.write_checkpoint(family, tmp_path)
    model = load_hf_checkpoint(tmp_path, device="cuda")
    tokens = torch.randint(0, 96, (13,), generator=torch.Generator().manual_seed(5)).cuda()
    decoder, mtp_logits = hf_gdn_fixtures.paged_logits(PagedGPTRunner(model), tokens, device="cuda")
    hf_model = hf_model.cuda()
    layer_models = [layer.cuda() for layer in layer_models]
    with torch.no_grad():
        expected = hf_gdn_fixtures.expected_decoder_rows(hf_model(tokens[None]).logits[0])
        reference = hf_gdn_fixtures.reference_mtp_logits(hf_model, {k: v.cuda() for k, v in mtp.items()},
                                                         layer_models, tokens, shifted_tokens)
    torch.testing.assert_close(decoder, expected, **GPU_FP32_TOL)
    for ours, theirs in zip(mtp_logits, reference):
        torch.testing.assert_close(ours, theirs, **GPU_FP32_TOL)
    assert _graph_outputs(model, 2) == _graph_outputs(model, 0)
    bf16 = load_hf_checkpoint(tmp_path, device="cuda", dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
