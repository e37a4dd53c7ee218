"""Rewind KV-cache bookkeeping past the rejected drafts of each request (contract: docs/kernels.md).

Only the bookkeeping moves (lengths, block counts, block table); the cached K/V of rejected
tokens stay where they are and are overwritten by later steps. Blocks that no longer hold any
token are handed back to the caller, which returns them to the allocator.
"""

import functools
import types
from typing import Optional

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import INDEX_DTYPES, ValidatedSignatures, check_int, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._step_common import (
    ActiveCount,
    check_num_active_requests,
    max_released_blocks,
    release_shape,
)

__all__ = ["rewind_kv_cache", "max_released_blocks"]

_VALIDATED = ValidatedSignatures()  # argument signatures that passed _check_args


@triton.jit
def _load_active_count(num_active_requests, NUM_ACTIVE_PTR, COUNT_IN_MEMORY: tl.constexpr):
    """The real request count: from device memory (CUDA-graph replay) or the scalar argument."""
    if COUNT_IN_MEMORY:
        count = tl.load(NUM_ACTIVE_PTR)
    else:
        count = num_active_requests
    return count


def active_count_launch_args(num_active_requests: ActiveCount, placeholder: torch.Tensor) -> tuple:
    """Kernel arguments ``(num_active_requests, NUM_ACTIVE_PTR, COUNT_IN_MEMORY)`` for either form."""
    if isinstance(num_active_requests, torch.Tensor):
        return 0, num_active_requests, True
    return num_active_requests, placeholder, False


@functools.lru_cache(maxsize=64)
def rewind_constants(num_speculative_tokens: int, block_size_tokens: int) -> types.MappingProxyType:
    """The rewind's compile-time arguments for one ``(S, block_size_tokens)`` (read-only; the fused op's too)."""
    release_width = max_released_blocks(num_speculative_tokens, block_size_tokens)
    return types.MappingProxyType(dict(
        NUM_SPEC_TOKENS=num_speculative_tokens,
        BLOCK_SIZE_TOKENS=block_size_tokens,
        RELEASE_WIDTH=release_width,
        BLOCK_BACK=triton.next_power_of_2(release_width + 1),
    ))


def release_strides(blocks_to_release: torch.Tensor) -> tuple:
    """(request stride, block stride) of a ``[N]`` or ``[N, W]`` release output."""
    return blocks_to_release.stride(0), (blocks_to_release.stride(1) if blocks_to_release.dim() == 2 else 0)


@triton.jit
def _rewind_request(
    request,
    state_row,
    rewind,
    is_real,
    LAST_KV_BLOCK_OFFSET_PTR,
    offset_stride,
    KV_LENGTH_OFFSETS_PTR,
    length_stride,
    KV_BLOCK_COUNTS_PTR,
    count_stride,
    LAST_KV_BLOCK_ID_PTR,
    last_id_stride,
    KV_BLOCK_IDS_PTR,
    block_ids_stride_request,
    block_ids_stride_block,
    max_blocks,
    BLOCKS_TO_RELEASE_PTR,
    REMOVE_MASK_PTR,
    release_stride_request,
    release_stride_block,
    BLOCK_SIZE_TOKENS: tl.constexpr,
    RELEASE_WIDTH: tl.constexpr,
    BLOCK_BACK: tl.constexpr,
    KEEP_RELEASED_BLOCKS: tl.constexpr,
):
    """Rewind ``request`` by ``rewind`` tokens; a request that is not real only writes "release nothing".
    Its KV state is row ``state_row`` of the state tensors (its table slot; ``request`` itself
    when the state is indexed by request); the release outputs are row ``request``.

    With ``KEEP_RELEASED_BLOCKS`` the block ids past the new length stay in the table (the caller
    keeps them as the request's reserve for its next step) and nothing is reported released.

    ``back = j`` names the j-th block counting back from the old last block (column
    ``old_count - 1 - j`` of the block table). One tile load and one tile store over the same
    addresses cover every block this request can release, so no thread reads an entry that
    another thread of the program has already cleared.
    """
    request64 = request.to(tl.int64)
    state64 = state_row.to(tl.int64)
    offset_ptr = LAST_KV_BLOCK_OFFSET_PTR + state64 * offset_stride
    length_ptr = KV_LENGTH_OFFSETS_PTR + state64 * length_stride
    count_ptr = KV_BLOCK_COUNTS_PTR + state64 * count_stride
    last_id_ptr = LAST_KV_BLOCK_ID_PTR + state64 * last_id_stride
    old_offset = tl.load(offset_ptr, mask=is_real, other=0)
    kv_length = tl.load(length_ptr, mask=is_real, other=0)
    old_count = tl.load(count_ptr, mask=is_real, other=0)
    old_last_id = tl.load(last_id_ptr, mask=is_real, other=0)  # 0 for padding: "release nothing"

    rewind = tl.where(is_real, rewind, 0)
    position = old_offset - rewind  # the new last token's offset, relative to the old last block
    released = (tl.maximum(-position, 0) + BLOCK_SIZE_TOKENS - 1) // BLOCK_SIZE_TOKENS
    # never more than the request holds, nor than W (only inconsistent inputs reach either bound)
    released = tl.minimum(released, tl.minimum(tl.maximum(old_count, 0), RELEASE_WIDTH))
    released = tl.where(is_real, released, 0)
    new_count = old_count - released

    back = tl.arange(0, BLOCK_BACK)
    columns = old_count - 1 - back
    # padding loaded old_count = 0, so none of its columns is in the table
    in_table = (back <= RELEASE_WIDTH) & (columns >= 0) & (columns < max_blocks)
    back_ptrs = KV_BLOCK_IDS_PTR + state64 * block_ids_stride_request + columns.to(tl.int64) * block_ids_stride_block
    back_ids = tl.load(back_ptrs, mask=in_table, other=0)  # [BLOCK_BACK]
    is_released = back < released
    # the stored values depend on the loaded ones, so each entry is read before it is cleared
    if not KEEP_RELEASED_BLOCKS:
        tl.store(back_ptrs, tl.where(is_released, -1, back_ids), mask=in_table)
    new_last_back = old_count - 1 - tl.maximum(new_count - 1, 0)
    new_last_id = tl.sum(tl.where(back == new_last_back, back_ids, 0), axis=0)

    tl.store(offset_ptr, ((position % BLOCK_SIZE_TOKENS) + BLOCK_SIZE_TOKENS) % BLOCK_SIZE_TOKENS, mask=is_real)
    tl.store(length_ptr, kv_length - rewind, mask=is_real)
    tl.store(count_ptr, new_count, mask=is_real)
    tl.store(last_id_ptr, tl.where(released > 0, new_last_id, old_last_id), mask=is_real)

    release_ids = tl.where(back == 0, old_last_id, tl.where(is_released, back_ids, 0))
    release_offsets = request64 * release_stride_request + back * release_stride_block
    tl.store(BLOCKS_TO_RELEASE_PTR + release_offsets, release_ids, mask=back < RELEASE_WIDTH)
    tl.store(REMOVE_MASK_PTR + release_offsets, is_released & (not KEEP_RELEASED_BLOCKS), mask=back < RELEASE_WIDTH)


@triton.jit(do_not_specialize=["num_active_requests"])
def _rewind_kv_cache_kernel(
    ACCEPTED_COUNTS_PTR,
    accepted_stride,
    PREFILL_STATUS_PTR,
    prefill_stride,
    LAST_KV_BLOCK_OFFSET_PTR,
    offset_stride,
    KV_LENGTH_OFFSETS_PTR,
    length_stride,
    KV_BLOCK_COUNTS_PTR,
    count_stride,
    LAST_KV_BLOCK_ID_PTR,
    last_id_stride,
    KV_BLOCK_IDS_PTR,
    block_ids_stride_request,
    block_ids_stride_block,
    max_blocks,
    BLOCKS_TO_RELEASE_PTR,
    REMOVE_MASK_PTR,
    release_stride_request,
    release_stride_block,
    num_active_requests,
    NUM_ACTIVE_PTR,
    NUM_SPEC_TOKENS: tl.constexpr,
    BLOCK_SIZE_TOKENS: tl.constexpr,
    RELEASE_WIDTH: tl.constexpr,
    BLOCK_BACK: tl.constexpr,
    COUNT_IN_MEMORY: tl.constexpr,
):
    """One program per request slot; slots at or past the real count are padding."""
    request = tl.program_id(0)
    is_real = request < _load_active_count(num_active_requests, NUM_ACTIVE_PTR, COUNT_IN_MEMORY)
    request64 = request.to(tl.int64)
    accepted = tl.load(ACCEPTED_COUNTS_PTR + request64 * accepted_stride, mask=is_real, other=0)
    prefill = tl.load(PREFILL_STATUS_PTR + request64 * prefill_stride, mask=is_real, other=1)
    rewind = tl.where(prefill == 1, 0, NUM_SPEC_TOKENS - accepted)
    _rewind_request(
        request,
        request,
        rewind,
        is_real,
        LAST_KV_BLOCK_OFFSET_PTR,
        offset_stride,
        KV_LENGTH_OFFSETS_PTR,
        length_stride,
        KV_BLOCK_COUNTS_PTR,
        count_stride,
        LAST_KV_BLOCK_ID_PTR,
        last_id_stride,
        KV_BLOCK_IDS_PTR,
        block_ids_stride_request,
        block_ids_stride_block,
        max_blocks,
        BLOCKS_TO_RELEASE_PTR,
        REMOVE_MASK_PTR,
        release_stride_request,
        release_stride_block,
        BLOCK_SIZE_TOKENS,
        RELEASE_WIDTH,
        BLOCK_BACK,
        False,
    )


def check_kv_state(
    last_kv_block_offset, kv_length_offsets, kv_block_counts, last_kv_block_id, kv_block_ids, num_requests, device
):
    """Validate the per-request KV bookkeeping tensors of ``num_requests`` requests (shared with the fused op)."""
    for name, tensor in (
        ("last_kv_block_offset", last_kv_block_offset),
        ("kv_length_offsets", kv_length_offsets),
        ("kv_block_counts", kv_block_counts),
        ("last_kv_block_id", last_kv_block_id),
    ):
        check_tensor(name, tensor, dtypes=INDEX_DTYPES, shape=(num_requests,), device=device)
    check_tensor("kv_block_ids", kv_block_ids, dtypes=INDEX_DTYPES, shape=(num_requests, None), device=device)
    if num_requests > 0 and kv_block_ids.shape[1] == 0:
        raise ValueError("kv_block_ids must have at least one block column")


def _check_args(
    accepted_counts,
    prefill_status,
    last_kv_block_offset,
    kv_length_offsets,
    kv_block_counts,
    last_kv_block_id,
    kv_block_ids,
    num_speculative_tokens,
    block_size_tokens,
    num_active_requests,
) -> None:
    """Validate every argument (metadata only, so cacheable per signature)."""
    check_tensor("accepted_counts", accepted_counts, dtypes=INDEX_DTYPES, ndim=1)
    num_requests = accepted_counts.shape[0]
    device = accepted_counts.device
    check_tensor("prefill_status", prefill_status, dtypes=INDEX_DTYPES, shape=(num_requests,), device=device)
    check_kv_state(
        last_kv_block_offset, kv_length_offsets, kv_block_counts, last_kv_block_id, kv_block_ids, num_requests, device
    )
    check_int("num_speculative_tokens", num_speculative_tokens, low=0)
    check_int("block_size_tokens", block_size_tokens, low=1)
    check_num_active_requests(num_active_requests, num_requests, device)


def rewind_kv_cache(
    accepted_counts: torch.Tensor,  # [N] int, accepted drafts per request (0..S)
    prefill_status: torch.Tensor,  # [N] int, 1 = prefill (no rewind), 0 = decode
    last_kv_block_offset: torch.Tensor,  # [N] int, in/out: offset of the last token in its block
    kv_length_offsets: torch.Tensor,  # [N] int, in/out: KV length
    kv_block_counts: torch.Tensor,  # [N] int, in/out: blocks held
    last_kv_block_id: torch.Tensor,  # [N] int, in/out: id of the last block
    kv_block_ids: torch.Tensor,  # [N, max_blocks] int, in/out: block table, -1 = unused
    num_speculative_tokens: int,
    block_size_tokens: int,
    num_active_requests: Optional[ActiveCount] = None,
):
    """Drop the ``S - accepted_counts[r]`` rejected tokens of each decode request; return
    ``(blocks_to_release, remove_mask)``. The caller releases ``blocks_to_release[remove_mask]``.

    Invariant: every block that no longer holds a token of its request is returned exactly once
    (with ``remove_mask`` True), cleared to -1 in ``kv_block_ids``, and counted out of
    ``kv_block_counts``. With ``W = max_released_blocks(S, block_size_tokens)`` the outputs are
    ``[N]`` when ``W == 1`` (``S <= block_size_tokens``: the reference API) and ``[N, W]``
    otherwise: column 0 is the old last block (as in the ``[N]`` form, True in the mask iff it was
    freed), column ``j`` the block ``j`` places before it (0 unless freed).

    Example, ``block_size_tokens = 2``, ``S = 5`` (W = 3), one decode request with 7 tokens in
    blocks ``[10, 11, 12, 13]`` (last token at offset 0 of block 13) accepting 1 draft::

        rewind 4 -> 3 tokens remain, in blocks [10, 11]; last offset (0 - 4) mod 2 = 0
        blocks_to_release = [[13, 12, 0]]   remove_mask = [[True, True, False]]
        kv_block_ids -> [10, 11, -1, -1], kv_block_counts 4 -> 2, last_kv_block_id -> 11

    Requests with ``prefill_status == 1`` do not rewind. Slots ``r >= num_active_requests`` are
    padding: ``blocks_to_release = 0``, ``remove_mask = False``, no state change.
    ``num_active_requests`` is an int in ``[0, N]`` or a 1-element int tensor on the device, read
    by the kernel (a CUDA graph can replay with a changing count). State tensors may be strided
    views of larger tables; they are updated in place. Arguments are checked once per signature
    (dtypes, shapes, devices, ints); see ``ValidatedSignatures``.
    """
    _VALIDATED.validate(
        _check_args,
        accepted_counts,
        prefill_status,
        last_kv_block_offset,
        kv_length_offsets,
        kv_block_counts,
        last_kv_block_id,
        kv_block_ids,
        num_speculative_tokens,
        block_size_tokens,
        num_active_requests,
    )
    num_requests = accepted_counts.shape[0]
    num_active = num_requests if num_active_requests is None else num_active_requests
    if not use_triton(accepted_counts):
        return reference.rewind_kv_cache(
            accepted_counts,
            prefill_status,
            last_kv_block_offset,
            kv_length_offsets,
            kv_block_counts,
            last_kv_block_id,
            kv_block_ids,
            num_speculative_tokens,
            block_size_tokens,
            num_active,
        )
    constants = rewind_constants(num_speculative_tokens, block_size_tokens)
    shape = release_shape(num_requests, constants["RELEASE_WIDTH"])
    blocks_to_release = torch.empty(shape, dtype=last_kv_block_id.dtype, device=accepted_counts.device)
    remove_mask = torch.empty(shape, dtype=torch.bool, device=accepted_counts.device)
    if num_requests == 0:
        return blocks_to_release, remove_mask
    active_count, active_count_ptr, count_in_memory = active_count_launch_args(num_active, accepted_counts)
    _rewind_kv_cache_kernel[(num_requests,)](
        accepted_counts,
        accepted_counts.stride(0),
        prefill_status,
        prefill_status.stride(0),
        last_kv_block_offset,
        last_kv_block_offset.stride(0),
        kv_length_offsets,
        kv_length_offsets.stride(0),
        kv_block_counts,
        kv_block_counts.stride(0),
        last_kv_block_id,
        last_kv_block_id.stride(0),
        kv_block_ids,
        kv_block_ids.stride(0),
        kv_block_ids.stride(1),
        kv_block_ids.shape[1],
        blocks_to_release,
        remove_mask,
        *release_strides(blocks_to_release),
        active_count,
        active_count_ptr,
        COUNT_IN_MEMORY=count_in_memory,
        num_warps=1,
        **constants,
    )
    return blocks_to_release, remove_mask
