"""Layer-glue kernels on CUDA: kernel == torch twin at the 944M bench's sizes, the fused-glue runner
== megatron's glue (fp32 tokens, bf16 logits), and the fused forward in a CUDA graph without host sync
(tests/functional/test_forward_gpu.py captures the default runner, which has the glue on)."""

import pytest
import torch
import torch.nn.functional as F

from mtp_ctrl.models import PagedGPTRunner, count_kv_layers
from mtp_ctrl.triton_ops import add_bias_residual_norm, bias_activation, gated_rms_norm, reference, split_qkv_heads
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
)

TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(scope="module")
def megatron_groups():
    ensure_single_process_groups()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 3, 96, 1000])
def test_glue_kernels_match_twins(dtype, num_tokens):
    generator = torch.Generator(device="cuda").manual_seed(num_tokens)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device="cuda").to(dtype)

    hidden, ffn, groups, per_group, head_dim = 2048, 8192, 4, 4, 128
    x, residual = randn(num_tokens, hidden), randn(num_tokens, hidden)
    residual[-1] = 0  # a padding row
    bias, weight, norm_bias = randn(hidden), randn(hidden) + 1, randn(hidden)
    for rms_norm in (False, True):
        got = add_bias_residual_norm(x, bias, residual, weight, None if rms_norm else norm_bias, 1e-5, rms_norm)
        want = reference.add_bias_residual_norm(x, bias, residual, weight, None if rms_norm else norm_bias, 1e-5,
                                                rms_norm)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], **TOLERANCE[dtype])
    fc1 = randn(num_tokens, 2 * ffn)
    fc1_bias = randn(2 * ffn)
    for activation in ("gelu", "gelu_tanh", "silu", "relu"):
        for gated in (False, True):
            torch.testing.assert_close(bias_activation(fc1, fc1_bias, activation, gated),
                                       reference.bias_activation(fc1, fc1_bias, activation, gated), **TOLERANCE[dtype])
    mixed = randn(num_tokens, groups * (per_group + 2) * head_dim)
    mixed_bias = randn(mixed.shape[1])
    for got_part, want_part in zip(split_qkv_heads(mixed, mixed_bias, groups, head_dim),
                                   reference.split_qkv_heads(mixed, mixed_bias, groups, head_dim)):
        assert torch.equal(got_part, want_part)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 88, 1000])
def test_gated_rms_norm_matches_twin_at_the_hybrid_mixer_sizes(out_dtype, num_tokens):
    """The hybrid bench's mixer: 4096 channels in 8 groups, y and z fp32, z a strided view of the
    projected rows, a bf16 weight; a padding row of zeros gives zeros."""
    generator = torch.Generator(device="cuda").manual_seed(num_tokens)
    projected = torch.randn(num_tokens, 2 * 4096 + 264, generator=generator, device="cuda")
    z, y = projected[:, :4096], torch.randn(num_tokens, 4096, generator=generator, device="cuda")
    y[-1], z[-1] = 0, 0
    weight = (torch.rand(4096, generator=generator, device="cuda") + 0.5).to(torch.bfloat16)
    got = gated_rms_norm(y, z, weight, 512, 1e-5, out_dtype)
    torch.testing.assert_close(got, reference.gated_rms_norm(y, z, weight, 512, 1e-5, out_dtype), **TOLERANCE[out_dtype])
    assert not got[-1].any()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overrides", [dict(), dict(normalization="RMSNorm", gated_linear_unit=True,
                                                    activation_func=F.silu, add_bias_linear=False)])
def test_fused_glue_runner_matches_megatron_glue_on_gpu(megatron_groups, dtype, overrides):
    torch.manual_seed(23)
    extra = dict(params_dtype=torch.bfloat16, bf16=True) if dtype == torch.bfloat16 else {}
    model = build_gpt_model(tiny_config(mtp_num_layers=2, **overrides, **extra), VOCAB_SIZE,
                            MAX_SEQUENCE_LENGTH).cuda().eval()
    sequences = [tokens.cuda() for tokens in random_sequences(seed=0)]
    results = []
    for fused_glue in (True, False):
        caches = allocate_kv_caches(count_kv_layers(model), NUM_BLOCKS, num_kv_heads_local=2, head_dim=16,
                                    dtype=dtype, device="cuda")
        decoder_logits, mtp_logits = run_paged_schedule(PagedGPTRunner(model, fused_glue=fused_glue), sequences,
                                                        caches, device="cuda")
        results.append([decoder_logits] + mtp_logits)
    tolerance = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=6e-2, rtol=6e-2)
    for fused_depth, unfused_depth in zip(*results):
        for got, want in zip(fused_depth, unfused_depth):
            torch.testing.assert_close(got, want, **tolerance)
            if dtype == torch.float32:
                assert torch.equal(got.argmax(-1), want.argmax(-1))
