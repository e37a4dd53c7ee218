"""MLA on CUDA: the paged MLA kernel (Triton, and the Gluon kernel on sm_90) and the latent write ==
their torch twins (bf16 / fp32, DeepSeek-V3's latent shape), and an MLA GPT's decode / verify steps
replay CUDA graphs with no host sync; the controller's graph steps give its eager tokens, and S = 2
== S = 0."""

import pytest
import torch

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from mtp_ctrl.models import PagedGPTRunner
from mtp_ctrl.triton_ops import paged_mla_attention, reference, rope_and_write_latent_cache
from mtp_ctrl.triton_ops.mla_attention import wgmma_kernel_applies
from mtp_ctrl.triton_ops.mla_tiles import (TILE_TABLE, WGMMA_ASYNC_TILES, WGMMA_TILES, WGMMA_WS_TILES, MLATiles,
                                          mla_tiles)
from tests.functional.sync_checks import no_host_sync
from tests.unit.megatron_fixtures import (
    BLOCK_SIZE_TOKENS,
    NUM_BLOCKS,
    build_tiny_model,
    ensure_single_process_groups,
    make_metadata,
)
from tests.unit.mla_cases import make_mla_case
from tests.unit.mla_fixtures import YARN, tiny_mla_config
from tests.unit.paged_attention_cases import random_mixed_lengths

PROMPTS = ([5, 17, 3, 88, 41], [9, 9, 2], [60, 1, 33, 70, 12, 8, 45])


@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("num_kv_splits", [None, 1, 6])
def test_kernel_equals_twin_bf16_deepseek_shape(num_heads, num_kv_splits):
    q_lens = [3, 1, 0, 40, 3]  # verify 1 + S, decode, padding request, prefill chunk, verify
    seq_lens = [700, 513, 0, 77, 1030]
    case = make_mla_case(q_lens, seq_lens, num_heads=num_heads, latent_dim=512, rope_dim=64, block_size_tokens=64,
                         dtype=torch.bfloat16, device="cuda", padding_rows=4)
    out = paged_mla_attention(*case.op_args(), max_query_len=40, max_seq_len=2048, num_kv_splits=num_kv_splits)
    torch.testing.assert_close(out.float(), case.expected(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), reference.paged_mla_attention(*case.op_args()).float(),
                               atol=2e-2, rtol=2e-2)
    assert out[-4:].abs().sum() == 0


@pytest.mark.parametrize("seed", range(2))
def test_kernel_equals_twin_fp32_random(seed):
    q_lens, seq_lens = random_mixed_lengths(torch.Generator().manual_seed(seed), num_requests=12, max_context=600)
    case = make_mla_case(q_lens, seq_lens, num_heads=8, latent_dim=64, rope_dim=32, block_size_tokens=16,
                         device="cuda", seed=seed, padding_rows=seed)
    torch.testing.assert_close(paged_mla_attention(*case.op_args()), case.expected(), atol=1e-4, rtol=1e-4)


def test_latent_write_equals_twin_bf16():
    num_tokens, heads, latent_dim, rope_dim = 300, 16, 512, 64
    generator = torch.Generator(device="cuda").manual_seed(0)
    query_rope = torch.randn(num_tokens, heads, rope_dim, device="cuda", generator=generator).bfloat16()
    kv_latent = torch.randn(num_tokens, latent_dim, device="cuda", generator=generator).bfloat16()
    key_rope = torch.randn(num_tokens, rope_dim, device="cuda", generator=generator).bfloat16()
    angles = torch.rand(num_tokens, rope_dim // 2, device="cuda", generator=generator) * 100
    slots = torch.randperm(40 * 16, device="cuda")[:num_tokens]
    slots[::7] = -1
    caches = [torch.zeros(40, 16, latent_dim + rope_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    args = (slots, torch.cos(angles), torch.sin(angles))
    roped = rope_and_write_latent_cache(query_rope, kv_latent, key_rope, caches[0], *args)
    roped_ref = reference.rope_and_write_latent_cache(query_rope, kv_latent, key_rope, caches[1], *args)
    torch.testing.assert_close(roped, roped_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(caches[0], caches[1], atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def mla_model():
    ensure_single_process_groups()
    return build_tiny_model(tiny_mla_config(**YARN)).cuda()


def test_mla_step_replays_a_graph_without_host_sync(mla_model):
    """A verify step (1 + S = 3 rows) of the decoder and an MTP depth, captured under
    set_sync_debug_mode("error"); replays with new tokens equal eager forwards."""
    runner = PagedGPTRunner(mla_model)
    caches = runner.kv_cache_spec(torch.float32).allocate(NUM_BLOCKS, BLOCK_SIZE_TOKENS, "cuda")
    prefill = make_metadata([[0, 1]], [(0, 5)], device="cuda")
    runner.forward(torch.arange(5, device="cuda"), prefill.positions, prefill, caches)
    metadata = make_metadata([[0, 1]], [(5, 3)], device="cuda")
    token_ids = torch.zeros(3, dtype=torch.int64, device="cuda")

    def step():
        logits, hidden = runner.forward(token_ids, metadata.positions, metadata, caches)
        draft_logits, _ = runner.mtp_forward(0, hidden, token_ids, metadata.positions, metadata, caches)
        return logits, draft_logits

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with no_host_sync():
        with torch.cuda.graph(graph):
            graph_logits, graph_draft_logits = step()
    for seed in (3, 4):
        token_ids.copy_(torch.randint(0, 96, (3,), generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        with no_host_sync():
            want_logits, want_draft_logits = step()
        torch.testing.assert_close(graph_logits, want_logits, atol=0, rtol=0)
        torch.testing.assert_close(graph_draft_logits, want_draft_logits, atol=0, rtol=0)


def _tokens(model, num_speculative_tokens, graphs, sampling):
    config = InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=4, block_size_tokens=4,
                             max_model_len=48, max_tokens_per_step=64, cuda_graph_batch_sizes=(1, 2, 4) if graphs else ())
    controller = TextGenerationController(model, config)
    results = controller.generate([list(p) for p in PROMPTS], SamplingParams(max_new_tokens=8, **sampling))
    assert (controller.debug_view().num_cuda_graphs > 0) == graphs
    controller.close()
    return [list(r.output_tokens) for r in results]


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_k=20, seed=7)], ids=["greedy", "seeded"])
def test_graph_steps_equal_eager_and_speculation_is_lossless(mla_model, sampling):
    plain = _tokens(mla_model, 0, graphs=True, sampling=sampling)
    assert _tokens(mla_model, 2, graphs=True, sampling=sampling) == plain
    assert _tokens(mla_model, 2, graphs=False, sampling=sampling) == plain


def test_every_tile_option_equals_twin_bf16():
    """The table's entries and the tile options (whole waves, a register cap) compile
    and equal the twin; the output's memory held NaNs before, so unwritten padding rows show."""
    num_heads, q_lens, seq_lens = 16, [3, 1, 0, 2, 1], [700, 513, 0, 77, 1030]
    case = make_mla_case(q_lens, seq_lens, num_heads=num_heads, latent_dim=512, rope_dim=64, block_size_tokens=64,
                         dtype=torch.bfloat16, device="cuda", padding_rows=4)
    expected = case.expected()
    options = [MLATiles(32, 64, 8, 2, 1, 64, True), MLATiles(32, 64, 8, 2, 2, 64, True, 128),
               MLATiles(64, 64, 8, 2, 1, 128, True), MLATiles(16, 32, 4, 3, 2, 64, True)]
    for tiles in dict.fromkeys([tiles for _, tiles in TILE_TABLE] + options):
        for num_kv_splits in (None, 5):
            torch.full((sum(q_lens) + 4, num_heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
            out = paged_mla_attention(*case.op_args(), max_query_len=3, max_seq_len=2048, num_kv_splits=num_kv_splits,
                                      tiles=tiles)
            torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2, msg=lambda m: f"{tiles}: {m}")


def _check_wgmma(q_lens, seq_lens, num_heads, block_size_tokens, num_kv_splits, seed, tiles=None):
    """The Gluon kernel (it must run here: an sm_90 device) == the twin and the dense oracle in bf16;
    the output's memory held NaNs before, so unwritten rows show; padding rows are zeros."""
    padding_rows = 3
    case = make_mla_case(q_lens, seq_lens, num_heads=num_heads, latent_dim=512, rope_dim=64,
                         block_size_tokens=block_size_tokens, dtype=torch.bfloat16, device="cuda",
                         padding_rows=padding_rows, seed=seed)
    args = case.op_args()
    if not wgmma_kernel_applies(args[0], args[2], 64):
        pytest.skip("the Gluon MLA kernel needs an sm_90 device and a Triton with Gluon")
    max_query_len, max_seq_len = max(q_lens), max(seq_lens) + 100
    assert (tiles or mla_tiles(num_heads, len(q_lens), max_seq_len, max_query_len)).wgmma
    torch.full((sum(q_lens) + padding_rows, num_heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = paged_mla_attention(*args, max_query_len=max_query_len, max_seq_len=max_seq_len,
                              num_kv_splits=num_kv_splits, tiles=tiles)
    torch.testing.assert_close(out.float(), case.expected(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), reference.paged_mla_attention(*args).float(), atol=2e-2, rtol=2e-2)
    assert out[-padding_rows:].abs().sum() == 0


# the Gluon kernel's schedules (MLATiles.schedule)
SCHEDULES = pytest.mark.parametrize("schedule", [WGMMA_TILES, WGMMA_ASYNC_TILES, WGMMA_WS_TILES],
                                    ids=["serial", "async", "warp_specialized"])


@SCHEDULES
@pytest.mark.parametrize("num_heads", [64, 128, 96])
@pytest.mark.parametrize("num_kv_splits", [None, 1, 5])
def test_wgmma_kernel_equals_twin_bf16_decode_rows(num_heads, num_kv_splits, schedule):
    # decode rows (the table's Gluon entry: > 32 heads, 1 row a request), requests with no rows,
    # contexts ending mid-block and on a block's end; 96 heads: a second head tile half padding
    generator = torch.Generator().manual_seed(num_heads + (num_kv_splits or 0))
    seq_lens = torch.randint(1, 3000, (9,), generator=generator).tolist()
    seq_lens[1], seq_lens[2] = 0, 1024
    q_lens = [0 if length == 0 else 1 for length in seq_lens]
    _check_wgmma(q_lens, seq_lens, num_heads, 64, num_kv_splits, seed=num_heads, tiles=schedule)


@SCHEDULES
@pytest.mark.parametrize("num_heads,rows,block_size_tokens", [(16, 3, 64), (32, 2, 16), (64, 1, 16)])
def test_wgmma_kernel_equals_twin_bf16_verify_rows(num_heads, rows, block_size_tokens, schedule):
    # the kernel's 64-row tile holding several query rows (1 + S verify rows: causal within the
    # tile), other cache block sizes (the block table looked up a token at a time)
    q_lens = [rows, rows, 0, rows, rows]
    seq_lens = [700, 65, 0, 1030, rows]
    for num_kv_splits in (None, 1, 3):
        _check_wgmma(q_lens, seq_lens, num_heads, block_size_tokens, num_kv_splits, seed=rows, tiles=schedule)


@SCHEDULES
def test_wgmma_kernel_equals_twin_bf16_long_splits(schedule):
    # many tiles a program (the loop's steady state: both buffers refilled many times, the
    # block table a tile ahead), a split ending mid-tile, a context ending mid-block
    q_lens, seq_lens = [1, 1, 1], [9000, 4097, 6001]
    for num_kv_splits in (1, 3):
        _check_wgmma(q_lens, seq_lens, 128, 64, num_kv_splits, seed=5, tiles=schedule)
