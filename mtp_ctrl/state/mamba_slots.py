"""Mamba state slots: one per live request, allocated once for every Mamba layer.

Letters: L = Mamba layers, M = slots (max_requests), S = num_speculative_tokens.

A request holds one slot ``m`` for its whole life. Its current states are
``conv_states[:, m]`` / ``ssm_states[:, m]``; a decode step over ``1 + S`` rows writes the state
after each row to ``intermediate_*[:, m, i]`` (i = 0..S), and the commit copies (or swaps in)
the one after the last accepted row (``mamba_state_selective_copy``).

Gated DeltaNet layers (``MambaSpec.gdn_key_heads`` set) keep no intermediate recurrent states: a
verify row stores its ``(k, u, g)`` (u its delta) in ``verify_row_inputs[:, m, p, i]`` (a few KB,
against the ``[H, K, V]`` state; ``p`` one of two buffers), and the commit is deferred: it only records
``pending_rows[m] = accepted + 1`` and flips ``input_parity[m]`` to the buffer just written
(``gdn_mark_pending_rows``); the slot's next verify or decode step applies those rows to the state
it loads, writes the committed state back and stores its own rows' inputs in the other buffer
(``gdn_verify_rows``): one read and one write of the state per step, as with S = 0. Until then
``ssm_states[:, m]`` lags the request by its pending rows: a slot is read only by its request's
next step (prefill segments, prefix-cache snapshots and restores see slots with 0 pending: new,
recomputed, or still prefilling), and ``allocate_slot`` resets the count. With S = 0 (or a step
of V = 0) the decode row applies the pending rows and its own in place, leaving 0 pending. Conv
windows are copied as for Mamba.

One more slot, ``scratch_slot = M``, is never handed out: requests that only pad a CUDA-graph
batch read and write it, so a captured step needs no branch on the real batch size.
"""

import dataclasses
from typing import Optional, Tuple

import torch

from mtp_ctrl.triton_ops import gdn_mark_pending_rows, gdn_row_input_width, mamba_state_selective_copy


@dataclasses.dataclass(frozen=True)
class MambaSpec:
    num_layers: int  # L, Mamba layers of the model
    conv_state_shape: Tuple[int, ...]  # per layer and slot, e.g. (conv_channels, kernel_size - 1)
    ssm_state_shape: Tuple[int, ...]  # per layer and slot, e.g. (heads, head_dim, state_size)
    dtype: torch.dtype
    # Gated DeltaNet layers (ssm_state_shape (H, K, V)) with this many key heads per rank: their verify
    # rows store inputs and the slot's next step applies the kept ones (module docstring); None: one
    # state per row, copied
    gdn_key_heads: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {self.num_layers!r}")
        for name in ("conv_state_shape", "ssm_state_shape"):
            shape = tuple(getattr(self, name))
            if not shape or any(isinstance(size, bool) or not isinstance(size, int) or size < 1 for size in shape):
                raise ValueError(f"{name} must be a non-empty tuple of positive ints, got {shape}")
            object.__setattr__(self, name, shape)
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {self.dtype!r}")
        if self.gdn_key_heads is not None:
            heads = self.ssm_state_shape[0]
            if isinstance(self.gdn_key_heads, bool) or not isinstance(self.gdn_key_heads, int) \
                    or self.gdn_key_heads < 1 or heads % self.gdn_key_heads or len(self.ssm_state_shape) != 3:
                raise ValueError(f"gdn_key_heads must be an int >= 1 dividing the {heads} heads of an (H, K, V) "
                                 f"ssm_state_shape, got {self.gdn_key_heads!r} for {self.ssm_state_shape}")
            if self.dtype != torch.float32:
                raise TypeError(f"Gated DeltaNet state slots are fp32, got dtype {self.dtype}")


class MambaStateSlots:
    def __init__(self, spec: MambaSpec, num_slots: int, num_speculative_tokens: int, device: torch.device):
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        num_layers, conv_state_shape, ssm_state_shape = spec.num_layers, spec.conv_state_shape, spec.ssm_state_shape
        stride = num_speculative_tokens + 1
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.scratch_slot = num_slots
        options = dict(dtype=spec.dtype, device=device)
        total = num_slots + 1  # the scratch slot last
        self.conv_states = torch.zeros(num_layers, total, *conv_state_shape, **options)  # [L, M + 1, *conv]
        self.ssm_states = torch.zeros(num_layers, total, *ssm_state_shape, **options)  # [L, M + 1, *ssm]
        self.intermediate_conv_states = torch.zeros(  # [L, M + 1, S + 1, *conv]
            num_layers, total, stride, *conv_state_shape, **options
        )
        self.gdn_key_heads = spec.gdn_key_heads
        self.intermediate_ssm_states: Optional[torch.Tensor] = None  # [L, M + 1, S + 1, *ssm]; None for GDN
        # Gated DeltaNet (else None): two buffers of each slot's stored verify rows, and per slot how many of
        # them wait to be applied to its state and in which buffer (module docstring)
        self.verify_row_inputs: Optional[torch.Tensor] = None  # [L, M + 1, 2, S + 1, F] fp32
        self.pending_rows: Optional[torch.Tensor] = None  # [M + 1] int32, 0 .. S + 1 (the scratch slot: 0)
        self.input_parity: Optional[torch.Tensor] = None  # [M + 1] int32, 0 or 1
        if spec.gdn_key_heads is None:
            self.intermediate_ssm_states = torch.zeros(num_layers, total, stride, *ssm_state_shape, **options)
        else:
            heads, key_dim, value_dim = ssm_state_shape
            width = gdn_row_input_width(spec.gdn_key_heads, key_dim, heads, value_dim)
            self.verify_row_inputs = torch.zeros(num_layers, total, 2, stride, width, **options)
            self.pending_rows = torch.zeros(total, dtype=torch.int32, device=device)
            self.input_parity = torch.zeros(total, dtype=torch.int32, device=device)
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._is_allocated = bytearray(num_slots)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def allocate_slot(self) -> int:
        """Take a free slot and zero its current states (a new request starts from zero state)."""
        if not self._free_slots:
            raise RuntimeError(f"all {self.num_slots} Mamba state slots are in use")
        slot = self._free_slots.pop()
        self._is_allocated[slot] = 1
        self.conv_states[:, slot].zero_()
        self.ssm_states[:, slot].zero_()
        if self.pending_rows is not None:  # the last request's uncommitted rows are not this one's
            self.pending_rows[slot:slot + 1].zero_()  # a fill, not a host scalar's copy: admission stays sync-free
        return slot

    def release_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise TypeError(f"slot must be an int, got {type(slot).__name__}")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is outside [0, {self.num_slots})")
        if not self._is_allocated[slot]:
            raise ValueError(f"slot {slot} is not allocated (double release)")
        self._is_allocated[slot] = 0
        self._free_slots.append(slot)

    def commit_accepted(self, prefill_status: torch.Tensor, decode_slot_ids: torch.Tensor,
                        accepted_counts: torch.Tensor, rows_per_request: Optional[int] = None) -> None:
        """Each of ``nd`` decode requests keeps the conv and recurrent state after its last accepted row
        (``prefill_status``, ``decode_slot_ids``, ``accepted_counts``: ``[nd]`` on the device; a
        request still prefilling keeps its state): ``mamba_state_selective_copy`` of the conv windows,
        and of the SSM states or, for Gated DeltaNet, ``gdn_mark_pending_rows``: the kept rows wait
        for the slot's next step (module docstring).
        ``rows_per_request``: the step's verify rows per decode request, ``1 + V`` (default ``1 + S``)."""
        rows = self.intermediate_conv_states.shape[2] if rows_per_request is None else rows_per_request
        mamba_state_selective_copy(self.intermediate_conv_states, self.conv_states, prefill_status, decode_slot_ids,
                                   accepted_counts, self.num_layers)
        if self.intermediate_ssm_states is not None:
            mamba_state_selective_copy(self.intermediate_ssm_states, self.ssm_states, prefill_status, decode_slot_ids,
                                       accepted_counts, self.num_layers)
        elif self.verify_row_inputs.shape[3] > 1:  # S = 0 stores no rows: nothing is ever pending
            gdn_mark_pending_rows(self.pending_rows, self.input_parity, prefill_status, decode_slot_ids,
                                  accepted_counts, rows, self.scratch_slot)
