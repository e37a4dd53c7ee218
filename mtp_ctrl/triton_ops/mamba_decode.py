"""Mamba-2 decode rows of a step in one launch: each decode request's ``1 + S`` rows (base token, then
S drafts) through the causal conv and the SSM, one row after another, from the request's current
state, writing the state after every row to the intermediate buffers (the controller later commits
the one after the last accepted row; the current state is only read).

Letters: nd decode requests, R = 1 + S rows each, T packed rows, L layers, M slots, C conv channels
(x: H * P, then B: G * N, then C: G * N), W conv width, H heads, P head dim, G groups, N state size.
Decode request r owns the packed rows ``r * R .. r * R + R - 1``; rows at or past T (a padded grid's
decode requests may run past the step's rows) read as zeros.

One program per (request, head, tile of ``BLOCK_P`` head dims) walks the R rows with the state tile
``[BLOCK_P, N]`` in registers. Row ``j``'s conv tap ``k`` reads offset ``o = j - (W - 1) + k`` of
the request: packed row ``r * R + o`` when ``o >= 0``, else column ``W - 1 + o`` of the slot's
current window; the window after row ``j`` is offsets ``j + 1 - (W - 1) .. j`` read the same way.
The program computes its head dims' x channels and its group's B and C channels (those are
recomputed by each head of a group: W multiply-adds per channel), writes y and the state of its
tile, the window of its x channels, and, for the first head of a group and the first tile, the
window of the group's B and C channels: every intermediate element is written by one program.

Example, W = 4, R = 3: row 1 of a request reads window columns 1, 2, then its rows 0 and 1; the
window after row 1 is (window column 2, row 0, row 1).

Twin: :mod:`mtp_ctrl.triton_ops.reference.mamba_decode`.
"""

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import FLOAT_DTYPES, ValidatedSignatures, check_int, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton

MAX_BLOCK_P = 16  # head dims per program: the state tile is [BLOCK_P, N] fp32 in registers

_VALIDATED = ValidatedSignatures()  # argument signatures that passed _check_args


@triton.jit
def _conv_tap_sum(XBC_PTR, WINDOW_PTR, WEIGHT_PTR, BIAS_PTR, channels64, is_channel, first_row, j: tl.constexpr,
                  num_rows, xbc_stride_t, xbc_stride_c, window_stride_c, window_stride_w, weight_stride_c,
                  weight_stride_w, bias_stride, WIDTH: tl.constexpr):
    """silu(conv) of row j of a request at the given channels [BLOCK] (fp32)."""
    HISTORY: tl.constexpr = WIDTH - 1
    acc = tl.load(BIAS_PTR + channels64 * bias_stride, mask=is_channel, other=0.0)
    for k in tl.static_range(WIDTH):
        offset = j - HISTORY + k  # constexpr (j and k are unrolled): a static branch below
        if offset >= 0:
            row = first_row + offset
            tap = tl.load(XBC_PTR + row * xbc_stride_t + channels64 * xbc_stride_c,
                          mask=is_channel & (channels64 * 0 + row < num_rows), other=0.0)
        else:
            tap = tl.load(WINDOW_PTR + channels64 * window_stride_c + (HISTORY + offset) * window_stride_w,
                          mask=is_channel, other=0.0).to(tl.float32)
        acc += tap * tl.load(WEIGHT_PTR + channels64 * weight_stride_c + k * weight_stride_w, mask=is_channel,
                             other=0.0)
    return acc / (1.0 + tl.exp(-acc))


@triton.jit
def _store_window(XBC_PTR, WINDOW_PTR, OUT_PTR, channels64, is_channel, first_row, j: tl.constexpr, num_rows,
                  xbc_stride_t, xbc_stride_c, window_stride_c, window_stride_w, out_stride_c, out_stride_w,
                  WIDTH: tl.constexpr):
    """The window after row j (offsets j + 1 - (W - 1) .. j) at the given channels."""
    HISTORY: tl.constexpr = WIDTH - 1
    for w in tl.static_range(HISTORY):
        offset = j + 1 - HISTORY + w  # constexpr
        if offset >= 0:
            row = first_row + offset
            value = tl.load(XBC_PTR + row * xbc_stride_t + channels64 * xbc_stride_c,
                            mask=is_channel & (channels64 * 0 + row < num_rows), other=0.0)
        else:
            value = tl.load(WINDOW_PTR + channels64 * window_stride_c + (HISTORY + offset) * window_stride_w,
                            mask=is_channel, other=0.0).to(tl.float32)
        tl.store(OUT_PTR + channels64 * out_stride_c + w * out_stride_w, value, mask=is_channel)


@triton.jit
def _mamba_decode_rows_kernel(
    CONV_PTR, SSM_PTR, INTER_CONV_PTR, INTER_SSM_PTR, SLOTS_PTR, XBC_PTR, DT_PTR, WEIGHT_PTR, BIAS_PTR, A_PTR,
    D_PTR, OUT_Y_PTR, num_rows, heads, head_dim, state_size, heads_per_group,
    conv_s1, conv_s2, conv_s3, ssm_s1, ssm_s2, ssm_s3, ssm_s4,
    iconv_s1, iconv_s2, iconv_s3, iconv_s4, issm_s1, issm_s2, issm_s3, issm_s4, issm_s5,
    xbc_stride_t, xbc_stride_c, dt_stride_t, dt_stride_h, weight_stride_c, weight_stride_w, bias_stride,
    a_stride, d_stride,
    ROWS: tl.constexpr, WIDTH: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    request = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    slot = tl.load(SLOTS_PTR + request)
    group = head // heads_per_group
    num_groups = heads // heads_per_group
    dims = (tile * BLOCK_P + tl.arange(0, BLOCK_P)).to(tl.int64)  # [BLOCK_P] this tile's head dims
    is_dim = dims < head_dim
    state_index = tl.arange(0, BLOCK_N).to(tl.int64)  # [BLOCK_N]
    is_state = state_index < state_size
    x_channels = head * head_dim + dims  # [BLOCK_P]
    b_channels = heads * head_dim + group * state_size + state_index  # [BLOCK_N]
    c_channels = b_channels + num_groups * state_size
    window = CONV_PTR + slot * conv_s1  # this slot's [C, W - 1] current window
    tile_offsets = dims[:, None] * ssm_s3 + state_index[None, :] * ssm_s4
    tile_mask = is_dim[:, None] & is_state[None, :]
    state = tl.load(SSM_PTR + slot * ssm_s1 + head * ssm_s2 + tile_offsets, mask=tile_mask,
                    other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_N]
    decay_rate = tl.load(A_PTR + head * a_stride)
    skip = tl.load(D_PTR + head * d_stride)
    first_row = request * ROWS
    writes_group = (head % heads_per_group == 0) & (tile == 0)  # this program writes the B, C windows
    for j in tl.static_range(ROWS):
        row = first_row + j
        x = _conv_tap_sum(XBC_PTR, window, WEIGHT_PTR, BIAS_PTR, x_channels, is_dim, first_row, j, num_rows,
                          xbc_stride_t, xbc_stride_c, conv_s2, conv_s3, weight_stride_c, weight_stride_w, bias_stride,
                          WIDTH)
        b = _conv_tap_sum(XBC_PTR, window, WEIGHT_PTR, BIAS_PTR, b_channels, is_state, first_row, j, num_rows,
                          xbc_stride_t, xbc_stride_c, conv_s2, conv_s3, weight_stride_c, weight_stride_w, bias_stride,
                          WIDTH)
        c = _conv_tap_sum(XBC_PTR, window, WEIGHT_PTR, BIAS_PTR, c_channels, is_state, first_row, j, num_rows,
                          xbc_stride_t, xbc_stride_c, conv_s2, conv_s3, weight_stride_c, weight_stride_w, bias_stride,
                          WIDTH)
        dt = tl.load(DT_PTR + row * dt_stride_t + head * dt_stride_h + 0 * dims, mask=row + 0 * dims < num_rows,
                     other=0.0)  # [BLOCK_P], one value
        state = state * tl.exp(dt * decay_rate)[:, None] + (dt * x)[:, None] * b[None, :]
        y = tl.sum(state * c[None, :], axis=1) + skip * x  # [BLOCK_P]
        tl.store(OUT_Y_PTR + row * heads * head_dim + x_channels, y, mask=is_dim)
        inter = slot * iconv_s1 + j * iconv_s2
        tl.store(INTER_SSM_PTR + slot * issm_s1 + j * issm_s2 + head * issm_s3
                 + dims[:, None] * issm_s4 + state_index[None, :] * issm_s5, state, mask=tile_mask)
        _store_window(XBC_PTR, window, INTER_CONV_PTR + inter, x_channels, is_dim, first_row, j, num_rows,
                      xbc_stride_t, xbc_stride_c, conv_s2, conv_s3, iconv_s3, iconv_s4, WIDTH)
        if writes_group:
            _store_window(XBC_PTR, window, INTER_CONV_PTR + inter, b_channels, is_state, first_row, j, num_rows,
                          xbc_stride_t, xbc_stride_c, conv_s2, conv_s3, iconv_s3, iconv_s4, WIDTH)
            _store_window(XBC_PTR, window, INTER_CONV_PTR + inter, c_channels, is_state, first_row, j, num_rows,
                          xbc_stride_t, xbc_stride_c, conv_s2, conv_s3, iconv_s3, iconv_s4, WIDTH)


def _check_args(conv_states, ssm_states, intermediate_conv_states, intermediate_ssm_states, layer, slot_ids, xbc,
                dt, weight, bias, A, D) -> None:
    check_tensor("ssm_states", ssm_states, dtypes=FLOAT_DTYPES, ndim=5)
    num_layers, num_slots, heads, head_dim, state_size = ssm_states.shape
    check_tensor("xbc", xbc, dtypes=(torch.float32,), ndim=2)
    num_rows, channels = xbc.shape
    groups_channels = channels - heads * head_dim
    if state_size == 0 or groups_channels <= 0 or groups_channels % (2 * state_size):
        raise ValueError(f"xbc has {channels} channels: expected H * P + 2 * G * N = {heads} * {head_dim} "
                         f"+ 2 * G * {state_size} for some G >= 1")
    groups = groups_channels // (2 * state_size)
    if heads % groups:
        raise ValueError(f"xbc's {groups} groups do not divide the {heads} heads of ssm_states")
    check_tensor("weight", weight, dtypes=(torch.float32,), shape=(channels, None))
    width = weight.shape[1]
    if width < 2:
        raise ValueError(f"weight must have a conv width >= 2 on dim 1, got shape {tuple(weight.shape)}")
    check_tensor("conv_states", conv_states, dtypes=FLOAT_DTYPES, shape=(num_layers, num_slots, channels, width - 1))
    check_tensor("intermediate_conv_states", intermediate_conv_states, dtypes=FLOAT_DTYPES,
                 shape=(num_layers, num_slots, None, channels, width - 1))
    rows_per_request = intermediate_conv_states.shape[2]
    if rows_per_request < 1:
        raise ValueError("intermediate_conv_states must hold >= 1 row per slot (1 + S) on dim 2")
    check_tensor("intermediate_ssm_states", intermediate_ssm_states, dtypes=FLOAT_DTYPES,
                 shape=(num_layers, num_slots, rows_per_request, heads, head_dim, state_size))
    check_int("layer", layer, low=0, high=num_layers - 1)
    check_tensor("slot_ids", slot_ids, dtypes=(torch.int64,), ndim=1)
    check_tensor("dt", dt, dtypes=(torch.float32,), shape=(num_rows, heads))
    check_tensor("bias", bias, dtypes=(torch.float32,), shape=(channels,))
    check_tensor("A", A, dtypes=(torch.float32,), shape=(heads,))
    check_tensor("D", D, dtypes=(torch.float32,), shape=(heads,))
    check_same_device(xbc=xbc, conv_states=conv_states, ssm_states=ssm_states,
                      intermediate_conv_states=intermediate_conv_states,
                      intermediate_ssm_states=intermediate_ssm_states, slot_ids=slot_ids, dt=dt, weight=weight,
                      bias=bias, A=A, D=D)


def mamba_decode_rows(
    conv_states: torch.Tensor,  # [L, M, C, W - 1] float, current windows (read only)
    ssm_states: torch.Tensor,  # [L, M, H, P, N] float, current states (read only)
    intermediate_conv_states: torch.Tensor,  # [L, M, R, C, W - 1] float, written at [layer, slot_ids, :]
    intermediate_ssm_states: torch.Tensor,  # [L, M, R, H, P, N] float, written at [layer, slot_ids, :]
    layer: int,
    slot_ids: torch.Tensor,  # [nd] int64 on the device, each decode request's slot
    xbc: torch.Tensor,  # [T, C] fp32 packed conv inputs (x, B, C channels); request r owns rows r R .. r R + R - 1
    dt: torch.Tensor,  # [T, H] fp32, after softplus
    weight: torch.Tensor,  # [C, W] fp32 depthwise conv kernel
    bias: torch.Tensor,  # [C] fp32
    A: torch.Tensor,  # [H] fp32, negative
    D: torch.Tensor,  # [H] fp32
) -> torch.Tensor:  # y [nd * R, H * P] fp32
    """The R = ``intermediate_conv_states.shape[2]`` rows of every decode request, in order, from its
    slot's current state (module docstring: the layout and an example). After row ``j`` the window
    and the SSM state go to ``intermediate_*[layer, slot, j]``; rows at or past T read as zeros
    (their y and states belong to padding requests). Slots should be distinct except a shared
    scratch slot, whose intermediate contents are then unspecified. No host sync."""
    args = (conv_states, ssm_states, intermediate_conv_states, intermediate_ssm_states, layer, slot_ids, xbc, dt,
            weight, bias, A, D)
    _VALIDATED.validate(_check_args, *args)
    if not use_triton(xbc):
        return reference.mamba_decode_rows(*args)
    num_requests, rows_per_request = slot_ids.shape[0], intermediate_conv_states.shape[2]
    heads, head_dim, state_size = ssm_states.shape[2:]
    num_groups = (xbc.shape[1] - heads * head_dim) // (2 * state_size)
    y = torch.empty(num_requests * rows_per_request, heads * head_dim, dtype=torch.float32,
                    device=xbc.device)  # [nd * R, H * P] fp32
    if num_requests == 0 or head_dim == 0:
        return y
    block_p = min(MAX_BLOCK_P, triton.next_power_of_2(head_dim))
    if slot_ids.stride(0) != 1 and num_requests > 1:
        raise ValueError(f"slot_ids must be contiguous, got stride {slot_ids.stride(0)}")
    # the layer's views: their offsets are computed here in int64 (a layer index times a layer
    # stride overflows int32 inside the kernel for big models)
    layer_states = (conv_states[layer], ssm_states[layer], intermediate_conv_states[layer], intermediate_ssm_states[layer])
    _mamba_decode_rows_kernel[(num_requests, heads, triton.cdiv(head_dim, block_p))](
        *layer_states, slot_ids, xbc, dt, weight, bias,
        A, D, y, xbc.shape[0], heads, head_dim, state_size, heads // num_groups,
        *(stride for states in layer_states for stride in states.stride()), *xbc.stride(), *dt.stride(), *weight.stride(), bias.stride(0),
        A.stride(0), D.stride(0),
        ROWS=rows_per_request, WIDTH=weight.shape[1], BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(state_size))
    return y
