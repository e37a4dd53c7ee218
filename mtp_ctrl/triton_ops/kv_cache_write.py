"""Write this step's keys and values into the paged KV cache.

Cache layout: ``[num_blocks, block_size_tokens, Hkv, D]``. Row ``t`` of the step goes to slot
``slot_mapping[t] = block_id * block_size_tokens + offset``; slot ``-1`` (padding) writes nothing.
"""

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import FLOAT_DTYPES, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton


@triton.jit
def _write_kv_cache_kernel(
    KEY_PTR,
    VALUE_PTR,
    KEY_CACHE_PTR,
    VALUE_CACHE_PTR,
    SLOT_MAPPING_PTR,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    key_cache_stride_block,
    key_cache_stride_token,
    key_cache_stride_h,
    value_cache_stride_block,
    value_cache_stride_token,
    value_cache_stride_h,
    block_size_tokens,
    head_dim,
    BLOCK_D: tl.constexpr,
):
    """One program per (row, kv head): copy one key and one value vector of ``head_dim``."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(SLOT_MAPPING_PTR + row).to(tl.int64)
    if slot >= 0:
        block_id = slot // block_size_tokens
        offset = slot % block_size_tokens
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < head_dim
        key = tl.load(KEY_PTR + row * key_stride_t + head * key_stride_h + dims, mask=dim_mask)
        value = tl.load(VALUE_PTR + row * value_stride_t + head * value_stride_h + dims, mask=dim_mask)
        key_dst = KEY_CACHE_PTR + block_id * key_cache_stride_block + offset * key_cache_stride_token
        value_dst = VALUE_CACHE_PTR + block_id * value_cache_stride_block + offset * value_cache_stride_token
        tl.store(key_dst + head * key_cache_stride_h + dims, key, mask=dim_mask)
        tl.store(value_dst + head * value_cache_stride_h + dims, value, mask=dim_mask)


def _check_args(key, value, key_cache, value_cache, slot_mapping):
    check_tensor("key", key, dtypes=FLOAT_DTYPES, ndim=3)
    num_tokens, num_kv_heads, head_dim = key.shape
    check_tensor("value", value, dtypes=(key.dtype,), shape=(num_tokens, num_kv_heads, head_dim))
    check_tensor("key_cache", key_cache, dtypes=(key.dtype,), shape=(None, None, num_kv_heads, head_dim))
    check_tensor("value_cache", value_cache, dtypes=(key.dtype,), shape=tuple(key_cache.shape))
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), shape=(num_tokens,))
    check_same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    for name, tensor in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D] float
    value: torch.Tensor,  # [T, Hkv, D] float, same dtype
    key_cache: torch.Tensor,  # [num_blocks, block_size_tokens, Hkv, D], same dtype
    value_cache: torch.Tensor,  # [num_blocks, block_size_tokens, Hkv, D], same dtype
    slot_mapping: torch.Tensor,  # [T] int64, block_id * block_size_tokens + offset; -1 = skip
) -> None:
    """Store ``key[t]``/``value[t]`` at slot ``slot_mapping[t]`` of the caches, in place.

    Example with ``block_size_tokens = 4``: ``slot_mapping = [9, -1]`` writes row 0 into
    block 2, offset 1 (``key_cache[2, 1] = key[0]``) and skips row 1 (a padding row).
    Slots must lie in ``[-1, num_blocks * block_size_tokens)``; values are not checked
    (that would need a host sync), so an out-of-range slot is the caller's bug.
    """
    _check_args(key, value, key_cache, value_cache, slot_mapping)
    if not use_triton(key):
        return reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return None
    _write_kv_cache_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        key_cache.shape[1],
        head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return None
