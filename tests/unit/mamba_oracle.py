"""A test oracle: the Mamba-2 mixer's math in plain per-request torch (causal depthwise conv and
the selective state-space scan), against which the step-wide varlen ops and the decode kernel are
checked. Not on any product path (it lived in ``mtp_ctrl/models`` before).

Letters: q rows of one request (a prefill chunk), n requests, C conv channels, W conv width,
H heads, P head dim, N state size. Everything runs in fp32.

The SSM of one head, per row t (``dt_t > 0`` after softplus, ``A < 0``)::

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * outer(x_t, B_t)     # [P, N]
    y_t = h_t @ C_t + D * x_t                                   # [P]

:func:`ssm_step` applies it to one row of many requests (decode and verify rows);
:func:`ssm_chunk_scan` applies it to the rows of one request in chunks, where each chunk is a
masked quadratic form over its rows plus the decayed carry-in state. The two agree to fp32
rounding; the tests check that.

:func:`causal_conv_varlen` and :func:`ssm_varlen_scan` run the same math over the packed rows of
a whole step at once (segments: one per request, rows ``[row_start, row_start + row_count)``),
with fixed shapes and no host sync, so a CUDA graph can capture a step that carries prefill
chunks. They live in :mod:`mtp_ctrl.triton_ops.mamba_varlen` (one Triton launch each on CUDA;
their torch twins, :mod:`mtp_ctrl.triton_ops.reference.mamba_varlen`, on CPU); the per-request
functions below are their reference.

The conv state of a request is the last ``W - 1`` inputs of its causal conv (zeros for a new
request), ``[C, W - 1]``, oldest first.
"""

from typing import Tuple

import torch
import torch.nn.functional as F


def causal_conv_step(
    window: torch.Tensor,  # [n, C, W - 1] fp32, the previous W - 1 inputs
    inputs: torch.Tensor,  # [n, C] fp32, this row's input
    weight: torch.Tensor,  # [C, W] fp32 depthwise kernel
    bias: torch.Tensor,  # [C] fp32
) -> Tuple[torch.Tensor, torch.Tensor]:  # silu(conv) [n, C], new window [n, C, W - 1]
    full = torch.cat((window, inputs[:, :, None]), dim=2)  # [n, C, W]
    return F.silu((full * weight).sum(-1) + bias), full[:, :, 1:]


def causal_conv_chunk(
    window: torch.Tensor,  # [C, W - 1] fp32
    inputs: torch.Tensor,  # [q, C] fp32, q >= 1
    weight: torch.Tensor,  # [C, W] fp32
    bias: torch.Tensor,  # [C] fp32
) -> Tuple[torch.Tensor, torch.Tensor]:  # silu(conv) [q, C], new window [C, W - 1]
    full = torch.cat((window.t(), inputs), dim=0)  # [W - 1 + q, C]
    taps = full.unfold(0, weight.shape[1], 1)  # [q, C, W]: row t sees inputs t .. t + W - 1 of `full`
    new_window = full[full.shape[0] - window.shape[1]:].t()  # [C, W - 1]
    return F.silu((taps * weight).sum(-1) + bias), new_window


def ssm_step(
    state: torch.Tensor,  # [n, H, P, N] fp32
    x: torch.Tensor,  # [n, H, P] fp32
    dt: torch.Tensor,  # [n, H] fp32, after softplus
    A: torch.Tensor,  # [H] fp32, negative
    B: torch.Tensor,  # [n, H, N] fp32 (each head's group already expanded)
    C: torch.Tensor,  # [n, H, N] fp32
    D: torch.Tensor,  # [H] fp32
) -> Tuple[torch.Tensor, torch.Tensor]:  # y [n, H, P], new state [n, H, P, N]
    decay = torch.exp(dt * A)[:, :, None, None]  # [n, H, 1, 1]
    state = state * decay + (dt[:, :, None] * x)[..., None] * B[:, :, None, :]
    y = (state * C[:, :, None, :]).sum(-1) + D[:, None] * x
    return y, state


def ssm_chunk_scan(
    state: torch.Tensor,  # [H, P, N] fp32, the state before the first row
    x: torch.Tensor,  # [q, H, P] fp32
    dt: torch.Tensor,  # [q, H] fp32, after softplus
    A: torch.Tensor,  # [H] fp32
    B: torch.Tensor,  # [q, H, N] fp32
    C: torch.Tensor,  # [q, H, N] fp32
    D: torch.Tensor,  # [H] fp32
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, torch.Tensor]:  # y [q, H, P], final state [H, P, N]
    """The SSM over the q rows of one request, ``chunk_size`` rows per matrix product.

    Within a chunk, with ``L_t = sum_{i <= t} dt_i * A`` (non-increasing)::

        y_t = exp(L_t) * (state @ C_t) + sum_{s <= t} exp(L_t - L_s) * dt_s * (C_t . B_s) * x_s + D * x_t
        state' = exp(L_last) * state + sum_s exp(L_last - L_s) * dt_s * outer(x_s, B_s)

    Every exponent is <= 0, so nothing overflows.
    """
    outputs = []
    for start in range(0, x.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        x_c, dt_c, B_c, C_c = x[rows], dt[rows], B[rows], C[rows]  # q_c rows
        log_decay = torch.cumsum(dt_c * A, dim=0)  # [q_c, H]
        gaps = log_decay[:, None, :] - log_decay[None, :, :]  # [t, s, H]: L_t - L_s
        causal = torch.ones(gaps.shape[:2], dtype=torch.bool, device=x.device).tril()[:, :, None]  # [t, s, 1]
        weights = torch.exp(gaps.masked_fill(~causal, float("-inf")))  # [t, s, H], 0 above the diagonal
        weights = weights * torch.einsum("thn,shn->tsh", C_c, B_c) * dt_c[None, :, :]  # [t, s, H]
        y = torch.einsum("tsh,shp->thp", weights, x_c)  # [q_c, H, P]
        y = y + torch.exp(log_decay)[:, :, None] * torch.einsum("hpn,thn->thp", state, C_c)
        outputs.append(y + D[None, :, None] * x_c)
        to_end = torch.exp(log_decay[-1][None, :] - log_decay) * dt_c  # [q_c, H]
        state = torch.exp(log_decay[-1])[:, None, None] * state + torch.einsum("sh,shp,shn->hpn", to_end, x_c, B_c)
    return torch.cat(outputs, dim=0), state
