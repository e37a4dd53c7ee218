"""Commit the accepted Mamba state of each decode request (contract: docs/kernels.md).

The forward pass writes one intermediate state per row of a decode request (after the base
token and after each draft); the state after the last accepted row becomes the current state.
This is a pure copy, bound by memory bandwidth: each program moves one tile of one layer's state
with wide contiguous loads.
"""

import math

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import INDEX_DTYPES, check_int, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton

_TILE_BYTES = 16384  # bytes one program copies: 32 x 16-byte vectors per thread at 4 warps
_MAX_GRID_Z = 65535  # CUDA's limit on the third grid dimension (tiles of one state)


@triton.jit
def _mamba_state_selective_copy_kernel(
    INTERMEDIATE_PTR,
    CURRENT_PTR,
    PREFILL_STATUS_PTR,
    prefill_stride,
    STATE_IDX_PTR,
    state_idx_stride,
    ACCEPTED_COUNTS_PTR,
    accepted_stride,
    intermediate_stride_layer,
    intermediate_stride_slot,
    intermediate_stride_spec,
    current_stride_layer,
    current_stride_slot,
    state_size,
    BLOCK_ELEMS: tl.constexpr,
):
    """Grid ``(N, L, tiles)``: program (r, l, t) copies elements ``[t * BLOCK_ELEMS, (t + 1) * BLOCK_ELEMS)``
    of ``intermediate[l, state_idx[r], accepted_counts[r]]`` to ``current[l, state_idx[r]]``."""
    request = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2).to(tl.int64)
    prefill = tl.load(PREFILL_STATUS_PTR + request * prefill_stride)
    if prefill == 0:
        slot = tl.load(STATE_IDX_PTR + request * state_idx_stride).to(tl.int64)
        accepted = tl.load(ACCEPTED_COUNTS_PTR + request * accepted_stride).to(tl.int64)
        src = (
            INTERMEDIATE_PTR
            + layer * intermediate_stride_layer
            + slot * intermediate_stride_slot
            + accepted * intermediate_stride_spec
        )
        dst = CURRENT_PTR + layer * current_stride_layer + slot * current_stride_slot
        elems = tile * BLOCK_ELEMS + tl.arange(0, BLOCK_ELEMS)  # [BLOCK_ELEMS] int64
        in_state = elems < state_size
        tl.store(dst + elems, tl.load(src + elems, mask=in_state), mask=in_state)


def _state_dims_contiguous(tensor: torch.Tensor, first_state_dim: int) -> bool:
    """True when the dims from ``first_state_dim`` on are laid out contiguously (size-1 dims may have any stride)."""
    expected = 1
    for size, stride in reversed(list(zip(tensor.shape[first_state_dim:], tensor.stride()[first_state_dim:]))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _check_args(intermediate_states, current_states, prefill_status, state_idx, accepted_counts, num_layers):
    check_tensor("intermediate_states", intermediate_states)
    if intermediate_states.dim() < 3:
        raise ValueError(
            f"intermediate_states must be (L, M, S + 1, *state_shape), got {tuple(intermediate_states.shape)}"
        )
    if intermediate_states.shape[2] < 1:
        raise ValueError(
            f"intermediate_states needs S + 1 >= 1 states per slot (dim 2), got {tuple(intermediate_states.shape)}"
        )
    num_layers_held, num_slots = intermediate_states.shape[:2]
    state_shape = tuple(intermediate_states.shape[3:])
    check_tensor(
        "current_states",
        current_states,
        dtypes=(intermediate_states.dtype,),
        shape=(num_layers_held, num_slots) + state_shape,
    )
    check_int("num_layers", num_layers)
    if num_layers != num_layers_held:
        raise ValueError(f"num_layers is {num_layers} but intermediate_states holds {num_layers_held} layers")
    for name, tensor, first_state_dim in (
        ("intermediate_states", intermediate_states, 3),
        ("current_states", current_states, 2),
    ):
        if not _state_dims_contiguous(tensor, first_state_dim):
            raise ValueError(f"{name} must be contiguous over its state dims {state_shape}")
    check_tensor("prefill_status", prefill_status, dtypes=INDEX_DTYPES, ndim=1)
    num_requests = prefill_status.shape[0]
    check_tensor("state_idx", state_idx, dtypes=INDEX_DTYPES, shape=(num_requests,))
    check_tensor("accepted_counts", accepted_counts, dtypes=INDEX_DTYPES, shape=(num_requests,))
    check_same_device(
        intermediate_states=intermediate_states,
        current_states=current_states,
        prefill_status=prefill_status,
        state_idx=state_idx,
        accepted_counts=accepted_counts,
    )


def mamba_state_selective_copy(
    intermediate_states: torch.Tensor,  # [L, M, S + 1, *state_shape], any strides on the first 3 dims
    current_states: torch.Tensor,  # [L, M, *state_shape], same dtype, in/out
    prefill_status: torch.Tensor,  # [N] int, 0 = decode, 1 = prefill
    state_idx: torch.Tensor,  # [N] int, Mamba state slot of each request
    accepted_counts: torch.Tensor,  # [N] int, accepted drafts of each request (0..S)
    num_layers: int,
) -> None:
    """``current[l, state_idx[r]] = intermediate[l, state_idx[r], accepted_counts[r]]`` for every
    layer ``l`` and decode request ``r``, in place; prefill requests are left alone.

    Example, S = 2: a decode request in slot 5 that accepted 1 draft gets the state after its
    base token and first draft, ``current[:, 5] = intermediate[:, 5, 1]``.
    The trailing state dims must be contiguous; ``num_layers`` must equal ``L``.
    """
    _check_args(intermediate_states, current_states, prefill_status, state_idx, accepted_counts, num_layers)
    if not use_triton(intermediate_states):
        return reference.mamba_state_selective_copy(
            intermediate_states, current_states, prefill_status, state_idx, accepted_counts, num_layers
        )
    num_requests = prefill_status.shape[0]
    state_size = math.prod(intermediate_states.shape[3:])
    if num_requests == 0 or num_layers == 0 or state_size == 0 or intermediate_states.shape[1] == 0:
        return None
    tile_elems = _TILE_BYTES // intermediate_states.element_size()
    block_elems = max(tile_elems, triton.next_power_of_2(triton.cdiv(state_size, _MAX_GRID_Z)))
    block_elems = min(block_elems, triton.next_power_of_2(state_size))
    grid = (num_requests, num_layers, triton.cdiv(state_size, block_elems))
    _mamba_state_selective_copy_kernel[grid](
        intermediate_states,
        current_states,
        prefill_status,
        prefill_status.stride(0),
        state_idx,
        state_idx.stride(0),
        accepted_counts,
        accepted_counts.stride(0),
        intermediate_states.stride(0),
        intermediate_states.stride(1),
        intermediate_states.stride(2),
        current_states.stride(0),
        current_states.stride(1),
        state_size,
        BLOCK_ELEMS=block_elems,
        num_warps=4,
    )
    return None
