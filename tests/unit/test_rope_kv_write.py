"""rope_and_write_kv_cache: Triton kernel (interpreter) == torch reference == megatron's rotary + a scatter."""

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from mtp_ctrl.triton_ops import reference, rope_and_write_kv_cache, rope_and_write_kv_cache_mixed

BLOCK_SIZE_TOKENS = 4


def _case(num_tokens, num_query_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=16, dtype=torch.float32,
          num_blocks=6, seed=0, pad_every=3):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    query = randn(num_tokens, num_query_heads, head_dim)  # [T, Hq, D]
    key = randn(num_tokens, num_kv_heads, head_dim)  # [T, Hkv, D]
    value = randn(num_tokens, num_kv_heads, head_dim)  # [T, Hkv, D]
    key_cache = randn(num_blocks, BLOCK_SIZE_TOKENS, num_kv_heads, head_dim)
    value_cache = randn(num_blocks, BLOCK_SIZE_TOKENS, num_kv_heads, head_dim)
    # a random subset of every slot: rows land on the first and last offsets of blocks alike
    slots = torch.randperm(num_blocks * BLOCK_SIZE_TOKENS, generator=generator)[:num_tokens]  # [T] int64, unique
    if pad_every:
        slots[::pad_every] = -1
    positions = torch.randint(0, 500, (num_tokens,), generator=generator)  # [T] int64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))  # [R / 2]
    angles = torch.outer(positions.float(), inv_freq)  # [T, R / 2] fp32
    return query, key, value, key_cache, value_cache, slots, angles


def _megatron_rope(rows, angles, interleaved):  # rows [T, H, D] fp32, angles [T, R / 2]
    """megatron-core's unfused rotary on [T, 1, H, D] with its own [T, 1, 1, R] frequency layout."""
    if rows.shape[0] == 0:  # megatron's interleaved rotate-half cannot view an empty tensor
        return rows.clone()
    if interleaved:
        freqs = torch.stack((angles, angles), dim=-1).flatten(-2)  # f0 f0 f1 f1 ...
    else:
        freqs = torch.cat((angles, angles), dim=-1)
    return _apply_rotary_pos_emb_bshd(rows[:, None], freqs[:, None, None], rotary_interleaved=interleaved)[:, 0]


def _by_hand(query, key, value, key_cache, value_cache, slots, angles, interleaved):
    """megatron's rotary, then a Python loop scattering the rows into copies of the caches."""
    roped_query = _megatron_rope(query.float(), angles, interleaved).to(query.dtype)
    roped_key = _megatron_rope(key.float(), angles, interleaved).to(key.dtype)
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            key_cache[slot // BLOCK_SIZE_TOKENS, slot % BLOCK_SIZE_TOKENS] = roped_key[row]
            value_cache[slot // BLOCK_SIZE_TOKENS, slot % BLOCK_SIZE_TOKENS] = value[row]
    return roped_query, key_cache, value_cache


def _run(op, case, interleaved):
    query, key, value, key_cache, value_cache, slots, angles = case
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    roped = op(query, key, value, key_cache, value_cache, slots, angles.cos(), angles.sin(), interleaved)
    return roped, key_cache, value_cache


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("num_tokens,heads,head_dim,rotary_dim", [
    (0, (4, 2), 16, 16),  # empty step
    (1, (4, 4), 16, 16),  # MHA
    (7, (4, 2), 16, 8),  # GQA, partial rotary (rotary_percent 0.5)
    (9, (6, 2), 24, 12),  # group of 3 and head_dim 24 (tiles padded past both)
    (5, (8, 1), 32, 32),  # MQA
])
def test_fp32_kernel_reference_and_megatron_agree(num_tokens, heads, head_dim, rotary_dim, interleaved):
    case = _case(num_tokens, *heads, head_dim=head_dim, rotary_dim=rotary_dim, seed=num_tokens + head_dim)
    want = _by_hand(*case, interleaved)
    for op in (rope_and_write_kv_cache, reference.rope_and_write_kv_cache):
        got = _run(op, case, interleaved)
        for got_tensor, want_tensor in zip(got, want):
            torch.testing.assert_close(got_tensor, want_tensor, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_seeded_stress_bf16_kernel_matches_reference(seed):
    generator = torch.Generator().manual_seed(100 + seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=generator))]  # noqa: E731
    num_kv_heads, group = pick([1, 2, 3]), pick([1, 2, 4])
    head_dim = pick([16, 20, 32])
    rotary_dim = pick([head_dim, head_dim // 2 - head_dim // 2 % 2, 2])
    case = _case(pick([1, 5, 13]), num_kv_heads * group, num_kv_heads, head_dim, rotary_dim, dtype=torch.bfloat16,
                 seed=seed, pad_every=pick([0, 2, 4]))
    interleaved = bool(seed % 2)
    got = _run(rope_and_write_kv_cache, case, interleaved)
    want = _run(reference.rope_and_write_kv_cache, case, interleaved)
    for got_tensor, want_tensor in zip(got, want):
        assert got_tensor.dtype == torch.bfloat16
        torch.testing.assert_close(got_tensor, want_tensor, atol=1e-2, rtol=1e-2)  # at most a rounding apart
    assert torch.equal(got[2], want[2])  # values are copied, never rounded
    passed = case[0][..., rotary_dim:]
    assert torch.equal(got[0][..., rotary_dim:], passed)  # dims past the rotary dim pass through unchanged


def test_padding_rows_write_nothing_but_their_query_is_roped():
    case = _case(6, pad_every=1)  # every slot is -1
    query, _, _, key_cache, value_cache, _, angles = case
    for op in (rope_and_write_kv_cache, reference.rope_and_write_kv_cache):
        roped, got_key_cache, got_value_cache = _run(op, case, False)
        assert torch.equal(got_key_cache, key_cache) and torch.equal(got_value_cache, value_cache)
        torch.testing.assert_close(roped, _megatron_rope(query, angles, False), atol=1e-5, rtol=1e-5)


def test_position_zero_is_the_identity():
    query, key, value, key_cache, value_cache, slots, angles = _case(3, pad_every=0)
    angles.zero_()
    roped, got_key_cache, _ = _run(rope_and_write_kv_cache, (query, key, value, key_cache, value_cache, slots, angles),
                                   True)
    assert torch.equal(roped, query)
    block_ids, offsets = slots // BLOCK_SIZE_TOKENS, slots % BLOCK_SIZE_TOKENS
    assert torch.equal(got_key_cache[block_ids, offsets], key)


def test_without_rotary_only_the_cache_write_runs():
    query, key, value, key_cache, value_cache, slots, angles = _case(5)
    _, want_key_cache, want_value_cache = _by_hand(query, key, value, key_cache, value_cache, slots,
                                                   angles.zero_(), False)
    for op in (rope_and_write_kv_cache, reference.rope_and_write_kv_cache):
        got_key_cache, got_value_cache = key_cache.clone(), value_cache.clone()
        assert op(query, key, value, got_key_cache, got_value_cache, slots, None, None) is query
        assert torch.equal(got_key_cache, want_key_cache) and torch.equal(got_value_cache, want_value_cache)


def test_strided_inputs_from_a_fused_qkv():
    query, key, value, key_cache, value_cache, slots, angles = _case(6, pad_every=0)
    fused = torch.cat([query, key, value], dim=1)  # [T, Hq + 2 Hkv, D]: q, k, v are strided views
    views = fused[:, :4], fused[:, 4:6], fused[:, 6:]
    want = _run(reference.rope_and_write_kv_cache, (query, key, value, key_cache, value_cache, slots, angles), False)
    got = _run(rope_and_write_kv_cache, (*views, key_cache, value_cache, slots, angles), False)
    for got_tensor, want_tensor in zip(got, want):
        torch.testing.assert_close(got_tensor, want_tensor, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "index,bad,error,match",
    [
        (0, lambda q: q.double(), TypeError, "query"),
        (1, lambda k: k[:, :, :8], ValueError, "key"),
        (1, lambda k: torch.cat([k, k[:, :1]], dim=1), ValueError, "multiple"),
        (2, lambda v: v.half(), TypeError, "value"),
        (3, lambda kc: kc[..., :8], ValueError, "key_cache"),
        (4, lambda vc: vc[:1], ValueError, "value_cache"),
        (5, lambda s: s.int(), TypeError, "slot_mapping"),
        (6, lambda c: c.double(), TypeError, "cos"),
        (6, lambda c: torch.cat([c, c, c], dim=1), ValueError, "rotary dim"),
        (7, lambda s: s[:, :2], ValueError, "sin"),
        (7, lambda s: None, ValueError, "both"),
        (8, lambda flag: 1, TypeError, "rotary_interleaved"),
        (0, lambda q: torch.cat([q, q], dim=-1)[..., ::2], ValueError, "query"),
    ],
)
def test_bad_inputs(index, bad, error, match):
    query, key, value, key_cache, value_cache, slots, angles = _case(4)
    args = [query, key, value, key_cache, value_cache, slots, angles.cos(), angles.sin(), False]
    args[index] = bad(args[index])
    with pytest.raises(error, match=match):
        rope_and_write_kv_cache(*args)


def _mixed_case(num_tokens, num_kv_heads, heads_per_group, head_dim, dtype, seed, with_bias):
    generator = torch.Generator().manual_seed(seed)
    width = num_kv_heads * (heads_per_group + 2) * head_dim
    mixed = torch.randn(num_tokens, width, generator=generator).to(dtype)  # [T, G * (Q/G + 2) * D]
    bias = torch.randn(width, generator=generator).to(dtype) if with_bias else None
    return mixed, bias


@pytest.mark.parametrize("seed", range(12))
def test_mixed_qkv_kernel_matches_split_then_rope(seed):
    """rope_and_write_kv_cache_mixed == split_qkv_heads + rope_and_write_kv_cache (the twin) on random
    shapes: with and without bias and rotary, padding rows, fp32 exactly and bf16 within a rounding."""
    pick = torch.Generator().manual_seed(100 + seed)

    def choose(options):
        return options[int(torch.randint(len(options), (1,), generator=pick))]

    num_kv_heads, heads_per_group, head_dim = choose([1, 2, 3]), choose([1, 2, 3]), choose([8, 16, 24])
    num_tokens, dtype = choose([0, 1, 6, 11]), choose([torch.float32, torch.bfloat16])
    rotary_dim = choose([0, head_dim // 2 // 2 * 2, head_dim])  # 0: a layer without rotary
    with_bias, interleaved = bool(seed % 2), choose([False, True])
    mixed, bias = _mixed_case(num_tokens, num_kv_heads, heads_per_group, head_dim, dtype, seed, with_bias)
    _, _, _, key_cache, value_cache, slots, angles = _case(num_tokens, num_kv_heads * heads_per_group, num_kv_heads,
                                                           head_dim, max(rotary_dim, 2), dtype=dtype, seed=seed)
    cos, sin = (angles.cos(), angles.sin()) if rotary_dim else (None, None)
    outputs = []
    for op in (rope_and_write_kv_cache_mixed, reference.rope_and_write_kv_cache_mixed):
        caches = key_cache.clone(), value_cache.clone()
        query = op(mixed, bias, num_kv_heads, head_dim, *caches, slots, cos, sin, interleaved)
        assert query.shape == (num_tokens, num_kv_heads * heads_per_group, head_dim) and query.dtype == dtype
        outputs.append((query, *caches))
    tolerance = dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for got, want in zip(*outputs):
        torch.testing.assert_close(got, want, **tolerance)
    assert torch.equal(outputs[0][2], outputs[1][2])  # values are a copy after one rounding: exact in any dtype


def test_mixed_qkv_known_layout():
    """G = 2 groups of 1 query head, D = 1, no rotary: the row [q0 k0 v0 q1 k1 v1] + bias."""
    mixed = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    bias = torch.tensor([10.0, 20.0, 30.0, 40.0, 50.0, 60.0])
    key_cache, value_cache = torch.zeros(1, 2, 2, 1), torch.zeros(1, 2, 2, 1)
    query = rope_and_write_kv_cache_mixed(mixed, bias, 2, 1, key_cache, value_cache, torch.tensor([1]), None, None)
    assert query.flatten().tolist() == [11.0, 44.0]
    assert key_cache[0, 1].flatten().tolist() == [22.0, 55.0] and value_cache[0, 1].flatten().tolist() == [33.0, 66.0]
    assert not key_cache[0, 0].any() and not value_cache[0, 0].any()


@pytest.mark.parametrize("bad,error,match", [
    (dict(mixed_qkv=torch.zeros(2, 10)), ValueError, "width"),
    (dict(bias=torch.zeros(5)), ValueError, "bias"),
    (dict(num_kv_heads=2.0), TypeError, "num_kv_heads"),
    (dict(key_cache=torch.zeros(2, 4, 2, 8)), ValueError, "key_cache"),
])
def test_mixed_qkv_bad_inputs(bad, error, match):
    args = dict(mixed_qkv=torch.zeros(3, 2 * 3 * 4), bias=None, num_kv_heads=2, head_dim=4,
                key_cache=torch.zeros(2, 4, 2, 4), value_cache=torch.zeros(2, 4, 2, 4),
                slot_mapping=torch.tensor([0, 1, -1]), cos=None, sin=None)
    args.update(bad)
    with pytest.raises(error, match=match):
        rope_and_write_kv_cache_mixed(**args)
