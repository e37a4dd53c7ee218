"""Torch twin of :mod:`mtp_ctrl.triton_ops.mamba_decode`: the ``1 + S`` rows of each decode request
through the Mamba-2 conv and SSM, one row after another, writing the state after every row."""

from typing import Tuple

import torch
import torch.nn.functional as F


def _first_rows(values: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` rows of ``values`` (``[T, ...]``), zero rows appended past ``T``."""
    if values.shape[0] >= count:
        return values[:count]
    return torch.cat((values, values.new_zeros(count - values.shape[0], *values.shape[1:])))


def _split_conv_output(conv_out: torch.Tensor, heads: int, head_dim: int,
                       state_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[n, C]`` -> x ``[n, H, P]``, B and C ``[n, H, N]`` (each head reads its group's B, C)."""
    num_requests = conv_out.shape[0]
    groups = (conv_out.shape[1] - heads * head_dim) // (2 * state_size)
    x, B, C = torch.split(conv_out, [heads * head_dim, groups * state_size, groups * state_size], dim=-1)
    B = B.reshape(num_requests, groups, state_size).repeat_interleave(heads // groups, dim=1)
    C = C.reshape(num_requests, groups, state_size).repeat_interleave(heads // groups, dim=1)
    return x.reshape(num_requests, heads, head_dim), B, C


def mamba_decode_rows(conv_states, ssm_states, intermediate_conv_states, intermediate_ssm_states, layer, slot_ids,
                      xbc, dt, weight, bias, A, D):
    """Twin of :func:`mtp_ctrl.triton_ops.mamba_decode_rows` (a loop over the ``1 + S`` rows of every
    request at once, not over requests)."""
    num_requests, stride = slot_ids.shape[0], intermediate_conv_states.shape[2]
    heads, head_dim, state_size = ssm_states.shape[2:]
    channels = xbc.shape[1]
    xbc = _first_rows(xbc, num_requests * stride).view(num_requests, stride, channels)  # [nd, 1 + S, C]
    dt = _first_rows(dt, num_requests * stride).view(num_requests, stride, heads)  # [nd, 1 + S, H]
    window = conv_states[layer, slot_ids].float()  # [nd, C, W - 1]
    state = ssm_states[layer, slot_ids].float()  # [nd, H, P, N]
    outputs = []
    for row in range(stride):
        full = torch.cat((window, xbc[:, row, :, None]), dim=2)  # [nd, C, W]
        conv_out = F.silu((full * weight).sum(-1) + bias)  # [nd, C]
        window = full[:, :, 1:]
        x, B, C = _split_conv_output(conv_out, heads, head_dim, state_size)
        step_dt = dt[:, row]  # [nd, H]
        decay = torch.exp(step_dt * A)[:, :, None, None]  # [nd, H, 1, 1]
        state = state * decay + (step_dt[:, :, None] * x)[..., None] * B[:, :, None, :]
        y = (state * C[:, :, None, :]).sum(-1) + D[:, None] * x  # [nd, H, P]
        intermediate_conv_states[layer, slot_ids, row] = window.to(intermediate_conv_states.dtype)
        intermediate_ssm_states[layer, slot_ids, row] = state.to(intermediate_ssm_states.dtype)
        outputs.append(y.reshape(num_requests, heads * head_dim))
    return torch.stack(outputs, dim=1).view(num_requests * stride, heads * head_dim)
