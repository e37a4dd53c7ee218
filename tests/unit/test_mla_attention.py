"""MLA ops: Triton kernels (interpreter) == torch twins == dense SDPA / megatron's MLA rope."""

import dataclasses
import importlib.util

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from mtp_ctrl.triton_ops import paged_mla_attention, reference, rope_and_write_latent_cache
from mtp_ctrl.triton_ops.mla_attention import MAX_KV_SPLITS, wgmma_kernel_applies, wgmma_operands_fit
from mtp_ctrl.triton_ops.mla_tiles import (DEFAULT_TILES, TILE_TABLE, TRITON_TILES_64_ROWS, VERIFY_TILES_16_HEADS,
                                          WGMMA_TILES, WGMMA_WS_TILES, MLATiles, kv_split_count, mla_tiles)
from tests.unit.mla_cases import make_mla_case
from tests.unit.paged_attention_cases import nan_filled_empty, random_mixed_lengths

TOL = dict(atol=2e-5, rtol=2e-5)


def _check(case, **hints):
    expected = case.expected()
    torch.testing.assert_close(reference.paged_mla_attention(*case.op_args(), **hints), expected, **TOL)
    torch.testing.assert_close(paged_mla_attention(*case.op_args(), **hints), expected, **TOL)


def test_verify_rows_mid_block_ends_and_padding():
    # 1 + S = 3 verify rows, a plain decode, a padding request, a prefill chunk; contexts end mid-block
    case = make_mla_case([3, 1, 0, 5], [13, 6, 0, 9], num_heads=4, latent_dim=32, rope_dim=16, block_size_tokens=4,
                         padding_rows=3, seed=1)
    _check(case, max_query_len=5, max_seq_len=13)


@pytest.mark.parametrize("num_kv_splits", [2, 5])
def test_split_kv(num_kv_splits):
    case = make_mla_case([3, 1, 2], [70, 3, 40], num_heads=8, latent_dim=24, rope_dim=8, block_size_tokens=16,
                         seed=num_kv_splits)
    out = paged_mla_attention(*case.op_args(), max_query_len=3, max_seq_len=256, num_kv_splits=num_kv_splits)
    torch.testing.assert_close(out, case.expected(), **TOL)


def test_many_heads_span_head_tiles_and_combine_groups():
    case = make_mla_case([3, 2], [9, 17], num_heads=40, latent_dim=16, rope_dim=16, block_size_tokens=8, seed=4)
    _check(case)
    # 8 splits: the combine merges heads in groups of gcd(40, 256 / 8) = 8
    out = paged_mla_attention(*case.op_args(), max_query_len=3, max_seq_len=17, num_kv_splits=8)
    torch.testing.assert_close(out, case.expected(), **TOL)


@pytest.mark.parametrize("seed", range(2))
def test_random_batches(seed):
    generator = torch.Generator().manual_seed(seed)
    q_lens, seq_lens = random_mixed_lengths(generator, num_requests=4, max_context=30)
    case = make_mla_case(q_lens, seq_lens, num_heads=3, latent_dim=16, rope_dim=8, block_size_tokens=4,
                         padding_rows=seed, seed=seed)
    _check(case)


@pytest.mark.parametrize("seed", range(4))
def test_flat_tiles_random_mixed_steps_on_dirty_memory(seed):
    """Requests of more rows than one query tile (4 rows x 4 heads in the 16-row tile) take the flat
    grid: prefill chunks of 5-20 rows among decodes of 1-3 rows, empty requests and padding rows,
    with the graph's bounds or none, 1 or 3 splits, on NaN-filled memory: equal to the twin's
    dense reference, padding rows exactly 0."""
    generator = torch.Generator().manual_seed(seed)

    def draw(low, high):
        return int(torch.randint(low, high, (), generator=generator))

    q_lens = []
    for _ in range(draw(1, 6)):
        decode, prefill = draw(1, 4), draw(5, 21)
        q_lens.append((0, decode, prefill)[draw(0, 3)])  # padding, decode or prefill chunk
    q_lens[draw(0, len(q_lens))] = 9  # at least one request of 3 tiles
    seq_lens = [q + draw(0, 25) if q else 0 for q in q_lens]
    padding_rows = draw(0, 9)
    case = make_mla_case(q_lens, seq_lens, num_heads=4, latent_dim=16, rope_dim=8, block_size_tokens=4,
                         padding_rows=padding_rows, seed=seed)
    hints = [{}, dict(max_query_len=sum(q_lens) + padding_rows, max_seq_len=64)][seed % 2]
    tiles = dataclasses.replace(DEFAULT_TILES, block_m=16, wgmma=False)
    expected = case.expected()
    with nan_filled_empty():
        out = paged_mla_attention(*case.op_args(), num_kv_splits=(1, 3)[seed // 2], tiles=tiles, **hints)
    torch.testing.assert_close(out, expected, **TOL)
    assert not out[sum(q_lens):].any()


@pytest.mark.parametrize("tiles", list(dict.fromkeys([DEFAULT_TILES] + [tiles for _, tiles in TILE_TABLE])),
                         ids=str)
def test_every_table_entry_equals_twin(tiles):
    # block_m + 8 heads: two head tiles, the second partly padding; verify rows, a decode, a
    # padding request, a prefill chunk; contexts over several splits
    case = make_mla_case([3, 1, 0, 4], [45, 6, 0, 21], num_heads=tiles.block_m + 8, latent_dim=16, rope_dim=8,
                         block_size_tokens=16, padding_rows=2, seed=tiles.block_m)
    _check(case, max_query_len=4, max_seq_len=45, num_kv_splits=2, tiles=tiles)
    # few heads: several query rows share a program (block_q > 1)
    case = make_mla_case([3, 2], [33, 9], num_heads=4, latent_dim=16, rope_dim=8, block_size_tokens=8, seed=1)
    _check(case, max_query_len=3, max_seq_len=33, tiles=tiles)


def test_tile_table_lookup():
    by_bounds = dict(TILE_TABLE)
    assert mla_tiles(16, 1, 8192) is DEFAULT_TILES
    assert mla_tiles(16, 32, 8192) is by_bounds[(16, 64, 16384, 1)]  # TP 8, batch 32: by context and rows
    assert mla_tiles(16, 32, 32768) is by_bounds[(16, 64, None, 1)]
    # verify rows (1 + S <= 4) at 16 heads: one 64-row tile holds them (the default at batch 1-4 / 2k)
    # (from batch 5 in the warp-specialized schedule, batch 1-4 in the serial one)
    assert mla_tiles(16, 32, 8192, 3) is mla_tiles(16, 5, 2048, 2) is mla_tiles(16, 128, 32768, 4) is WGMMA_WS_TILES
    assert mla_tiles(16, 1, 8192, 2) is mla_tiles(16, 4, 32768, 3) is WGMMA_TILES
    assert mla_tiles(16, 32, 8192, 3, gluon=False) is VERIFY_TILES_16_HEADS  # the Gluon kernel's fallback
    assert VERIFY_TILES_16_HEADS.block_m == 64 and mla_tiles(16, 1, 2048, 3) is DEFAULT_TILES
    assert mla_tiles(16, 32, 8192, 5) is DEFAULT_TILES  # more rows (a prefill chunk): as before
    assert mla_tiles(16, 32, 32768, 16) is by_bounds[(16, 64, None, None)]
    assert mla_tiles(16, 128, 8192) is DEFAULT_TILES
    assert mla_tiles(128, 1, 8192).block_m == mla_tiles(128, 128, 131072, 3).block_m == 64  # 64-head tiles
    assert mla_tiles(128, 1, 2048) is DEFAULT_TILES
    for bounds, tiles in TILE_TABLE:  # every entry is reachable (a Gluon entry's Triton fallback without it)
        dims = [bound or 2**20 for bound in bounds]
        assert tiles in (mla_tiles(*dims), mla_tiles(*dims, gluon=False))
    with pytest.raises(ValueError, match="block_m"):
        MLATiles(block_m=24, block_n=32, num_warps=4, num_stages=2, programs_per_sm=2, min_split_tokens=64)
    with pytest.raises(ValueError, match="programs_per_sm"):
        MLATiles(block_m=32, block_n=32, num_warps=4, num_stages=2, programs_per_sm=0, min_split_tokens=64)


def test_gluon_kernel_serves_decode_rows_above_32_heads():
    # the table: decode rows at > 32 heads (TP 1 / 2) and 16-head verify rows (1 + S <= 4: one
    # 64-row tile) from batch 5 or a context over 4k; everything else stays in Triton
    for heads, batch, context in ((64, 32, 8192), (128, 128, 32768), (128, 1, 8192), (96, 8, 2048)):
        assert mla_tiles(heads, batch, context) is WGMMA_WS_TILES  # decode rows: the warp-specialized schedule
    assert mla_tiles(128, 1, 2048) is DEFAULT_TILES
    assert mla_tiles(128, 32, 8192, 3) is mla_tiles(64, 128, 32768, 2) is TRITON_TILES_64_ROWS
    assert mla_tiles(128, 32, 8192, gluon=False) is TRITON_TILES_64_ROWS  # its fallback
    assert mla_tiles(16, 32, 8192, 3) is WGMMA_WS_TILES and mla_tiles(16, 1, 8192, 3) is WGMMA_TILES
    assert not any(mla_tiles(heads, batch, context, rows).wgmma for heads in (1, 16, 32) for batch in (1, 32, 128)
                   for context in (2048, 131072) for rows in (1, 5, 16))
    assert not any(mla_tiles(32, batch, context, rows).wgmma for batch in (1, 128) for context in (2048, 131072)
                   for rows in (2, 3))
    # where the kernel can run: compute capability 9.x, bf16, C = 512, R = 64, 16-byte aligned rows, Gluon
    query = torch.zeros(2, 64, 512, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    assert wgmma_operands_fit(query, cache, 64, (9, 0)) is (importlib.util.find_spec("triton.experimental.gluon")
                                                            is not None)
    assert not wgmma_operands_fit(query, cache, 64, (8, 0)) and not wgmma_operands_fit(query, cache, 64, (10, 0))
    assert not wgmma_operands_fit(query.float(), cache.float(), 64, (9, 0))
    assert not wgmma_operands_fit(query[..., :256], cache[..., :320], 64, (9, 0))  # C = 256
    assert not wgmma_operands_fit(query, cache[..., :544], 32, (9, 0))  # R = 32
    assert not wgmma_operands_fit(query, torch.zeros(4, 64, 580, dtype=torch.bfloat16)[..., :576], 64, (9, 0))
    assert not wgmma_kernel_applies(query, cache, 64)  # CPU tensors: never (nor under the interpreter)
    with pytest.raises(ValueError, match="wgmma"):
        MLATiles(32, 64, 8, 2, programs_per_sm=1, min_split_tokens=64, wgmma=True)
    with pytest.raises(TypeError, match="wgmma"):
        dataclasses.replace(WGMMA_TILES, wgmma=1)
    with pytest.raises(ValueError, match="schedule"):  # a schedule of the Gluon kernel only
        MLATiles(64, 64, 8, 2, programs_per_sm=1, min_split_tokens=128, schedule="async")
    with pytest.raises(ValueError, match="schedule"):
        dataclasses.replace(WGMMA_TILES, schedule="pingpong")


def test_split_count_fills_whole_waves():
    tiles = MLATiles(block_m=32, block_n=64, num_warps=8, num_stages=2, programs_per_sm=1, min_split_tokens=64)
    whole = dataclasses.replace(tiles, whole_waves=True)
    # 132 SMs, 32 one-tile requests at 8k: 5 splits (160 programs, a second wave of 28) or 4 (one wave)
    assert kv_split_count(tiles, 132, 32, 8192, MAX_KV_SPLITS) == 5
    assert kv_split_count(whole, 132, 32, 8192, MAX_KV_SPLITS) == 4
    two = dataclasses.replace(whole, programs_per_sm=2)  # 264 slots: 8 splits fill 256, 5 of 48 fill 240
    assert [kv_split_count(two, 132, batch, 8192, MAX_KV_SPLITS) for batch in (1, 32, 48, 300)] == [128, 8, 5, 1]
    assert kv_split_count(two, 132, 32, 300, MAX_KV_SPLITS) == 4  # 64 tokens a split at least
    with pytest.raises(TypeError, match="whole_waves"):
        dataclasses.replace(tiles, whole_waves=1)
    with pytest.raises(ValueError, match="max_registers"):
        dataclasses.replace(tiles, max_registers=300)


def test_most_splits_reduce_exactly():
    # batch 1's split-K at its cap: 16 tokens a split, the later splits past the context (empty partials)
    case = make_mla_case([3], [300], num_heads=3, latent_dim=32, rope_dim=8, block_size_tokens=16, seed=5)
    tiles = MLATiles(block_m=16, block_n=16, num_warps=4, num_stages=1, programs_per_sm=4, min_split_tokens=16)
    _check(case, max_query_len=3, max_seq_len=2048, num_kv_splits=MAX_KV_SPLITS, tiles=tiles)


def test_empty_batch_and_no_rows():
    case = make_mla_case([], [], num_heads=2, latent_dim=16, rope_dim=8, block_size_tokens=4)
    assert paged_mla_attention(*case.op_args()).shape == (0, 2, 16)
    case = make_mla_case([0, 0], [0, 0], num_heads=2, latent_dim=16, rope_dim=8, block_size_tokens=4, padding_rows=2)
    assert torch.count_nonzero(paged_mla_attention(*case.op_args())) == 0


def test_bad_arguments_name_themselves():
    case = make_mla_case([1], [3], num_heads=2, latent_dim=16, rope_dim=8, block_size_tokens=4)
    args = list(case.op_args())
    with pytest.raises(ValueError, match="latent_cache"):
        paged_mla_attention(args[0], args[1], args[2][..., :-1], *args[3:])
    with pytest.raises(ValueError, match="softmax_scale"):
        paged_mla_attention(*args[:6], -1.0)
    with pytest.raises(ValueError, match="num_kv_splits"):
        paged_mla_attention(*args, num_kv_splits=MAX_KV_SPLITS + 1)
    with pytest.raises(TypeError, match="tiles"):
        paged_mla_attention(*args, tiles=(32, 64, 8, 2, 2, 64))


def _megatron_mla_rope(rows, cos, sin):  # rows [T, H, R]; megatron's own rotary on [s, b=1, H, R]
    freqs = torch.atan2(sin, cos)  # [T, R / 2]: the angles (mscale 1)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [T, 1, 1, R]
    return _apply_rotary_pos_emb_bshd(rows[:, None], emb, multi_latent_attention=True)[:, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_write_latent_cache(dtype):
    generator = torch.Generator().manual_seed(0)
    num_tokens, heads, latent_dim, rope_dim, block_size = 5, 3, 20, 8, 4
    query_rope = torch.randn(num_tokens, heads, rope_dim, generator=generator).to(dtype)
    kv_latent = torch.randn(num_tokens, latent_dim, generator=generator).to(dtype)
    key_rope = torch.randn(num_tokens, rope_dim, generator=generator).to(dtype)
    angles = torch.rand(num_tokens, rope_dim // 2, generator=generator) * 3
    cos, sin = torch.cos(angles), torch.sin(angles)
    slot_mapping = torch.tensor([6, -1, 0, 11, 3])
    caches = [torch.zeros(3, block_size, latent_dim + rope_dim, dtype=dtype) for _ in range(2)]
    roped_ref = reference.rope_and_write_latent_cache(query_rope, kv_latent, key_rope, caches[0], slot_mapping, cos, sin)
    roped = rope_and_write_latent_cache(query_rope, kv_latent, key_rope, caches[1], slot_mapping, cos, sin)
    tol = TOL if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(roped, roped_ref, **tol)
    torch.testing.assert_close(caches[1], caches[0], **tol)
    torch.testing.assert_close(roped_ref.float(), _megatron_mla_rope(query_rope.float(), cos, sin), **tol)
    flat = caches[0].view(-1, latent_dim + rope_dim)
    torch.testing.assert_close(flat[6, :latent_dim], kv_latent[0])
    torch.testing.assert_close(flat[6, latent_dim:].float(),
                               _megatron_mla_rope(key_rope[:, None].float(), cos, sin)[0, 0], **tol)
    assert torch.count_nonzero(flat[[1, 2, 4, 5, 7, 8, 9, 10]]) == 0  # only the four real slots were written
