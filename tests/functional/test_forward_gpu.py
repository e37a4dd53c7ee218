"""Fused rope + paged KV write on CUDA: kernel == torch twin, fused runner == megatron's rotary,
and a fused forward captured in a CUDA graph (no host sync) replays new rows exactly."""

import pytest
import torch

from mtp_ctrl.models import PagedGPTRunner, count_kv_layers
from mtp_ctrl.triton_ops import reference, rope_and_write_kv_cache, rope_and_write_kv_cache_mixed
from tests.functional.sync_checks import no_host_sync
from tests.unit.megatron_fixtures import (
    MAX_SEQUENCE_LENGTH,
    NUM_BLOCKS,
    VOCAB_SIZE,
    allocate_kv_caches,
    build_gpt_model,
    ensure_single_process_groups,
    make_metadata,
    random_sequences,
    run_paged_schedule,
    tiny_config,
)

GPU_FP32_TOL = dict(atol=1e-3, rtol=1e-3)


def _kernel_case(seed, dtype, num_tokens, num_kv_heads, group, head_dim, rotary_dim, block_size_tokens=16,
                 num_blocks=64):
    num_blocks = max(num_blocks, -(-num_tokens // block_size_tokens))  # a distinct slot for every row
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator).to("cuda", dtype)  # noqa: E731
    query = randn(num_tokens, num_kv_heads * group, head_dim)  # [T, Hq, D]
    key, value = randn(num_tokens, num_kv_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim)
    key_cache = randn(num_blocks, block_size_tokens, num_kv_heads, head_dim)
    value_cache = randn(num_blocks, block_size_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size_tokens, generator=generator)[:num_tokens]
    slots[::5] = -1  # padding rows
    positions = torch.randint(0, 32768, (num_tokens,), generator=generator).float()  # [T]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))  # [R / 2]
    angles = torch.outer(positions, inv_freq).cuda()  # [T, R / 2] fp32
    return query, key, value, key_cache, value_cache, slots.cuda(), angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("num_tokens,num_kv_heads,group,head_dim,rotary_dim", [
    (0, 4, 4, 128, 128), (1, 4, 4, 128, 128), (96, 4, 4, 128, 64), (333, 8, 1, 64, 64), (2048, 2, 8, 128, 128),
])
def test_kernel_matches_reference_on_gpu(dtype, interleaved, num_tokens, num_kv_heads, group, head_dim, rotary_dim):
    case = _kernel_case(num_tokens + head_dim, dtype, num_tokens, num_kv_heads, group, head_dim, rotary_dim)
    query, key, value, key_cache, value_cache, slots, cos, sin = case
    results = []
    for op in (rope_and_write_kv_cache, reference.rope_and_write_kv_cache):
        caches = key_cache.clone(), value_cache.clone()
        results.append((op(query, key, value, *caches, slots, cos, sin, interleaved), *caches))
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **tolerance)
    assert torch.equal(results[0][2], results[1][2])  # values are copied bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias,rotary", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("num_tokens,num_kv_heads,group,head_dim", [(1, 4, 4, 128), (96, 4, 4, 128), (333, 8, 1, 64)])
def test_mixed_qkv_kernel_matches_reference_on_gpu(dtype, with_bias, rotary, num_tokens, num_kv_heads, group,
                                                   head_dim):
    """rope_and_write_kv_cache_mixed (QKV rows + bias in place) == split + rope twins, also replayed from a graph."""
    case = _kernel_case(num_tokens + 7, dtype, num_tokens, num_kv_heads, group, head_dim, head_dim)
    _, _, _, key_cache, value_cache, slots, cos, sin = case
    generator = torch.Generator().manual_seed(num_tokens)
    width = num_kv_heads * (group + 2) * head_dim
    mixed = torch.randn(num_tokens, width, generator=generator).to("cuda", dtype)  # [T, G * (Q/G + 2) * D]
    bias = torch.randn(width, generator=generator).to("cuda", dtype) if with_bias else None
    cos, sin = (cos, sin) if rotary else (None, None)
    want_caches = key_cache.clone(), value_cache.clone()
    want = reference.rope_and_write_kv_cache_mixed(mixed, bias, num_kv_heads, head_dim, *want_caches, slots, cos, sin)
    caches = key_cache.clone(), value_cache.clone()
    rope_and_write_kv_cache_mixed(mixed, bias, num_kv_heads, head_dim, *caches, slots, cos, sin)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = rope_and_write_kv_cache_mixed(mixed, bias, num_kv_heads, head_dim, *caches, slots, cos, sin)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for got_tensor, want_tensor in zip((got, *caches), (want, *want_caches)):
        torch.testing.assert_close(got_tensor, want_tensor, **tolerance)
    assert torch.equal(caches[1], want_caches[1])  # values: a copy after one rounding, bit for bit


@pytest.fixture(scope="module")
def megatron_groups():
    ensure_single_process_groups()


@pytest.mark.parametrize("rotary_percent,interleaved", [(1.0, False), (0.5, True)])
def test_fused_runner_matches_megatron_rotary_on_gpu(megatron_groups, rotary_percent, interleaved):
    torch.manual_seed(21)
    config = tiny_config(mtp_num_layers=2, rotary_interleaved=interleaved)
    model = build_gpt_model(config, VOCAB_SIZE, MAX_SEQUENCE_LENGTH, rotary_percent=rotary_percent).cuda().eval()
    sequences = [tokens.cuda() for tokens in random_sequences(seed=0)]
    results = []
    for fused in (True, False):
        caches = allocate_kv_caches(count_kv_layers(model), NUM_BLOCKS, num_kv_heads_local=2, head_dim=16,
                                    device="cuda")
        decoder_logits, mtp_logits = run_paged_schedule(PagedGPTRunner(model, fused_rope=fused), sequences, caches,
                                                        device="cuda")
        results.append([decoder_logits] + mtp_logits)
    for fused_depth, unfused_depth in zip(*results):
        for got, want in zip(fused_depth, unfused_depth):
            torch.testing.assert_close(got, want, **GPU_FP32_TOL)
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_fused_forward_in_a_cuda_graph_without_host_sync(megatron_groups):
    torch.manual_seed(22)
    model = build_gpt_model(tiny_config(mtp_num_layers=1), VOCAB_SIZE, MAX_SEQUENCE_LENGTH).cuda().eval()
    runner = PagedGPTRunner(model, fused_rope=True)
    caches = allocate_kv_caches(count_kv_layers(model), NUM_BLOCKS, num_kv_heads_local=2, head_dim=16, device="cuda")
    prefill = make_metadata([[7, 2, 5, 0]], [(0, 6)], device="cuda")
    runner.forward(random_sequences(seed=1)[0][:6].cuda(), prefill.positions, prefill, caches)
    # static decode inputs: 1 + S = 3 rows at positions 6..8; replays change the token ids only
    metadata = make_metadata([[7, 2, 5, 0]], [(6, 3)], device="cuda")
    token_ids = torch.zeros(3, dtype=torch.int64, device="cuda")  # [T]
    hidden_buffer = torch.zeros(3, model.config.hidden_size, device="cuda")  # [T, H]

    def step():
        logits, hidden = runner.forward(token_ids, metadata.positions, metadata, caches)
        draft_logits, _ = runner.mtp_forward(0, hidden, token_ids, metadata.positions, metadata=metadata,
                                             kv_caches=caches)
        hidden_buffer.copy_(hidden)
        return logits, draft_logits

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with no_host_sync():
        with torch.cuda.graph(graph):
            graph_logits, graph_draft_logits = step()
    for seed in (3, 4):
        token_ids.copy_(torch.randint(0, VOCAB_SIZE, (3,), generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        want_logits, want_draft_logits = step()  # eager, same inputs, rewrites the same slots
        torch.testing.assert_close(graph_logits, want_logits, atol=0, rtol=0)
        torch.testing.assert_close(graph_draft_logits, want_draft_logits, atol=0, rtol=0)
