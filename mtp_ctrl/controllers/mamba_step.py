"""The Mamba side of a controller step: where each request's state lives during the forward,
and the commit of the state after each decode request's last accepted row."""

from typing import Optional

import torch

from mtp_ctrl.models.forward_context import MambaForward
from mtp_ctrl.state import DynamicInferenceContext, StepMetadata
from mtp_ctrl.triton_ops import mamba_state_selective_copy


def mamba_forward(context: DynamicInferenceContext, step: StepMetadata, num_decode: int,
                  num_active: Optional[torch.Tensor]) -> MambaForward:
    """Decode slots on the device (requests padding a graph batch, at or past ``num_active``, use
    the scratch slot); prefill slots and packed row ranges as host ints (prefill steps are eager)."""
    slots, table = context.mamba, context.table
    decode_slot_ids = table.device.mamba_slot_ids[:num_decode]  # [nd] int64
    if num_active is not None:
        request_index = torch.arange(num_decode, device=decode_slot_ids.device)
        decode_slot_ids = torch.where(request_index < num_active, decode_slot_ids, slots.scratch_slot)
    starts = step.host_query_start_loc.tolist()  # host-ok: host tensor
    prefill_rows = range(step.num_decode, step.num_requests)
    return MambaForward(
        conv_states=slots.conv_states, ssm_states=slots.ssm_states,
        intermediate_conv_states=slots.intermediate_conv_states,
        intermediate_ssm_states=slots.intermediate_ssm_states,
        decode_slot_ids=decode_slot_ids,
        prefill_row_ranges=tuple((starts[row], starts[row + 1]) for row in prefill_rows),
        prefill_slot_ids=tuple(int(table.host.mamba_slot_ids[row]) for row in prefill_rows),
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
