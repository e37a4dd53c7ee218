"""write_kv_cache: Triton kernel (interpreter) == torch reference == a hand-written scatter."""

import pytest
import torch

from mtp_ctrl.triton_ops import reference, write_kv_cache


def _case(num_tokens, num_blocks=6, block_size_tokens=4, num_kv_heads=2, head_dim=64, seed=0, pad_every=3):
    generator = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    slots = torch.randperm(num_blocks * block_size_tokens, generator=generator)[:num_tokens]  # [T] unique
    if pad_every:
        slots[::pad_every] = -1
    key_cache = torch.randn(num_blocks, block_size_tokens, num_kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(num_blocks, block_size_tokens, num_kv_heads, head_dim, generator=generator)
    return key, value, key_cache, value_cache, slots


def _by_hand(key, value, key_cache, value_cache, slots):
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    block_size_tokens = key_cache.shape[1]
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            key_cache[slot // block_size_tokens, slot % block_size_tokens] = key[row]
            value_cache[slot // block_size_tokens, slot % block_size_tokens] = value[row]
    return key_cache, value_cache


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 24])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_kernel_and_reference_match_hand_scatter(num_tokens, head_dim):
    key, value, key_cache, value_cache, slots = _case(num_tokens, head_dim=head_dim, seed=num_tokens)
    want_key_cache, want_value_cache = _by_hand(key, value, key_cache, value_cache, slots)
    for op in (write_kv_cache, reference.write_kv_cache):
        got_key_cache, got_value_cache = key_cache.clone(), value_cache.clone()
        assert op(key, value, got_key_cache, got_value_cache, slots) is None
        torch.testing.assert_close(got_key_cache, want_key_cache, atol=0, rtol=0)
        torch.testing.assert_close(got_value_cache, want_value_cache, atol=0, rtol=0)


def test_all_padding_writes_nothing():
    key, value, key_cache, value_cache, slots = _case(5)
    slots.fill_(-1)
    before = key_cache.clone(), value_cache.clone()
    write_kv_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])


def test_strided_inputs_from_a_fused_qkv():
    key, value, key_cache, value_cache, slots = _case(6, pad_every=0)
    fused = torch.cat([key, value], dim=1)  # [T, 2 * Hkv, D]: key and value are strided views
    strided_key, strided_value = fused[:, :2], fused[:, 2:]
    want = _by_hand(key, value, key_cache, value_cache, slots)
    write_kv_cache(strided_key, strided_value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want[0]) and torch.equal(value_cache, want[1])


@pytest.mark.parametrize(
    "index,bad,error,match",
    [
        (0, lambda k: k.double(), TypeError, "key"),
        (1, lambda v: v[:, :1], ValueError, "value"),
        (2, lambda kc: kc[..., :32], ValueError, "key_cache"),
        (3, lambda vc: vc[:1], ValueError, "value_cache"),
        (4, lambda s: s.int(), TypeError, "slot_mapping"),
        (4, lambda s: s[:-1], ValueError, "slot_mapping"),
        (0, lambda k: torch.cat([k, k], dim=-1)[..., ::2], ValueError, "contiguous"),
    ],
)
def test_bad_inputs(index, bad, error, match):
    args = list(_case(4))
    args[index] = bad(args[index])
    with pytest.raises(error, match=match):
        write_kv_cache(*args)
