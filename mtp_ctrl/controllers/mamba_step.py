"""The Mamba side of a controller step: where each request's state lives during the forward,
and the commit of the state after each decode request's last accepted row."""

from typing import Optional

import torch

from mtp_ctrl.models.forward_context import MambaForward
from mtp_ctrl.state import DynamicInferenceContext, StepMetadata
from mtp_ctrl.triton_ops import mamba_state_selective_copy


def mamba_forward(context: DynamicInferenceContext, step: StepMetadata, num_decode: int,
                  decode_limit: Optional[torch.Tensor]) -> MambaForward:
    """The step's Mamba layout, device tensors only (a CUDA graph captures it with the step).

    Decode: the first ``num_decode`` requests of the grid; those at or past ``decode_limit``
    (``[1]`` int64 on the device, or None: all decode) use the scratch slot. Prefill (a step with
    prefill chunks): one segment per request of the grid, of its rows when it is a prefill
    request and of 0 rows in the scratch slot otherwise (decode and padding requests)."""
    slots, table = context.mamba, context.table
    slot_ids = table.device.mamba_slot_ids  # [R] int64
    decode_slot_ids = slot_ids[:num_decode]  # [nd] int64
    if decode_limit is not None:
        request_index = torch.arange(num_decode, device=decode_slot_ids.device)
        decode_slot_ids = torch.where(request_index < decode_limit, decode_slot_ids, slots.scratch_slot)
    prefill = {}
    if not step.decode_only:
        grid = step.attention.batch_size  # G
        query_start_loc = step.attention.query_start_loc[: grid + 1].long()  # [G + 1] int64
        request_index = torch.arange(grid, device=query_start_loc.device)
        prefilling = (request_index >= step.device_num_decode) & (request_index < step.num_active)  # [G] bool
        prefill = dict(
            prefill_row_start=query_start_loc[:-1],
            prefill_row_count=torch.where(prefilling, query_start_loc[1:] - query_start_loc[:-1], 0),
            prefill_slot_ids=torch.where(prefilling, slot_ids[:grid], slots.scratch_slot),
        )
    return MambaForward(
        conv_states=slots.conv_states, ssm_states=slots.ssm_states,
        intermediate_conv_states=slots.intermediate_conv_states,
        intermediate_ssm_states=slots.intermediate_ssm_states,
        decode_slot_ids=decode_slot_ids, **prefill,
    )


def commit_mamba_states(context: DynamicInferenceContext, decode_slot_ids: torch.Tensor,
                        accepted_counts: torch.Tensor, num_decode: int) -> None:
    """Each decode request keeps the conv and SSM state after its last accepted row
    (``accepted_counts``: ``[>= nd]`` int64 on the device)."""
    slots, prefill_status = context.mamba, context.table.device.prefill_status[:num_decode]
    for intermediate, current in ((slots.intermediate_conv_states, slots.conv_states),
                                  (slots.intermediate_ssm_states, slots.ssm_states)):
        mamba_state_selective_copy(intermediate, current, prefill_status, decode_slot_ids,
                                   accepted_counts[:num_decode], slots.num_layers)
