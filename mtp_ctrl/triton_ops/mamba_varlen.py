"""Mamba-2 prefill over the packed rows of a step: the causal conv and the SSM scan, one launch each.

Letters: T packed rows, n segments (one per request of the step's padded grid), C conv channels,
W conv width, H heads, P head dim, N state size; everything fp32. Segment g is the rows
``[row_start[g], row_start[g] + row_count[g])``; segments are in row order and disjoint
(``row_start[g + 1] >= row_start[g] + row_count[g]``), ``row_start``/``row_count`` live on the
device, so a CUDA graph replays the step for any chunk lengths that fit its T and n.

- :func:`causal_conv_varlen`: one program per (tile of rows or one segment, tile of channels).
  A row program finds each row's segment by a binary search over ``row_start`` (``ceil(log2(n+1))``
  vector loads) and reads its ``W`` taps from the packed rows, or, before the segment's first row,
  from the segment's window; a segment program writes the segment's new window.
- :func:`ssm_varlen_scan`: one program per (segment, head, tile of ``BLOCK_P`` head dims). It walks
  its segment's rows in order with the state tile ``[BLOCK_P, N]`` in registers
  (``h = exp(dt A) h + dt x outer B``, ``y = h . C + D x``), its row loads pipelined a few rows
  ahead, then writes the final state; it also zeroes y on the rows between its segment's end and
  the next segment's start (segment 0 also before its start), so every row of y is written once.
  A segment of 0 rows copies its state through and costs one load and one store. This is the
  recurrence itself, not the chunked form of the twin: the two agree to fp32 rounding, and
  ``chunk_size`` only shapes the twin's work.
- :func:`segment_of_rows`: the same binary search, as its twin's three outputs.

Worked example (``segment_of_rows``): starts (0, 3, 5, 7), counts (0, 2, 1, 0), T = 7 -> segment
(0, 0, 0, 1, 1, 2, 2), offset (0, 1, 2, 0, 1, 0, 1), inside (F, F, F, T, T, T, F). Row 4 lies in
segment 1 (offset 1); with W = 4 its conv taps read offsets -2, -1, 0, 1: window columns 1 and 2
of segment 1, then packed rows 3 and 4.

Twins: :mod:`mtp_ctrl.triton_ops.reference.mamba_varlen`.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import ValidatedSignatures, check_int, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import sm_count, use_triton

BLOCK_ROWS = 16  # conv rows per program (and y rows zeroed per store in the scan)
BLOCK_CHANNELS = 128  # conv channels per program
BLOCK_SEGMENT_ROWS = 128  # rows per program of segment_of_rows

_CONV_VALIDATED = ValidatedSignatures()  # argument signatures that passed _check_conv_args
_SCAN_VALIDATED = ValidatedSignatures()  # argument signatures that passed _check_scan_args


@triton.jit
def _find_segments(ROW_START_PTR, ROW_COUNT_PTR, rows, num_segments, SEARCH_STEPS: tl.constexpr):
    """rows [BLOCK] int64 -> (segment, offset, inside, has_segment): the last segment starting at or
    before each row (binary search, SEARCH_STEPS >= ceil(log2(n + 1))); has_segment is False before
    the first segment, where segment is 0 and offset the row itself."""
    low = tl.zeros_like(rows)  # segments [0, low) start at or before the row
    high = tl.zeros_like(rows) + num_segments
    for _ in tl.static_range(SEARCH_STEPS):
        middle = (low + high) // 2
        probe = middle < high
        start = tl.load(ROW_START_PTR + middle, mask=probe, other=0)
        after = probe & (start <= rows)
        low = tl.where(after, middle + 1, low)
        high = tl.where(probe & (start > rows), middle, high)
    has_segment = low > 0
    segment = tl.where(has_segment, low - 1, 0)
    start = tl.load(ROW_START_PTR + segment, mask=has_segment, other=0)
    count = tl.load(ROW_COUNT_PTR + segment, mask=has_segment, other=0)
    offset = rows - start
    inside = has_segment & (offset < count)
    return segment, offset, inside, has_segment


@triton.jit
def _segment_of_rows_kernel(ROW_START_PTR, ROW_COUNT_PTR, OUT_SEGMENT_PTR, OUT_OFFSET_PTR, OUT_INSIDE_PTR,
                            num_rows, num_segments, SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    is_row = rows < num_rows
    segment, offset, inside, _ = _find_segments(ROW_START_PTR, ROW_COUNT_PTR, rows, num_segments, SEARCH_STEPS)
    tl.store(OUT_SEGMENT_PTR + rows, segment, mask=is_row)
    tl.store(OUT_OFFSET_PTR + rows, tl.maximum(offset, 0), mask=is_row)
    tl.store(OUT_INSIDE_PTR + rows, inside, mask=is_row)


@triton.jit
def _conv_rows(WINDOWS_PTR, SLOT_IDS_PTR, INPUTS_PTR, ROW_START_PTR, ROW_COUNT_PTR, WEIGHT_PTR, BIAS_PTR, OUT_PTR,
               tile, channel, num_rows, num_segments, channels, window_stride_n, window_stride_c, window_stride_w,
               input_stride_t, input_stride_c, weight_stride_c, weight_stride_w, bias_stride,
               WIDTH: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
               BLOCK_CHANNELS: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """silu(bias + sum_k weight[:, k] * tap_k) of BLOCK_ROWS rows x BLOCK_CHANNELS channels."""
    HISTORY: tl.constexpr = WIDTH - 1
    is_channel = channel < channels
    channel64 = channel.to(tl.int64)
    rows = tile.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS] int64
    is_row = rows < num_rows
    segment, offset, _, has_segment = _find_segments(ROW_START_PTR, ROW_COUNT_PTR, rows, num_segments, SEARCH_STEPS)
    window_row = segment  # [BLOCK_ROWS]: where each row's segment keeps its window
    if HAS_SLOTS:
        window_row = tl.load(SLOT_IDS_PTR + segment, mask=has_segment, other=0).to(tl.int64)
    acc = tl.load(BIAS_PTR + channel64 * bias_stride, mask=is_channel, other=0.0)[None, :] + tl.zeros(
        (BLOCK_ROWS, BLOCK_CHANNELS), dtype=tl.float32)  # [BLOCK_ROWS, BLOCK_CHANNELS] fp32
    valid = is_row[:, None] & is_channel[None, :]
    for k in tl.static_range(WIDTH):
        back = HISTORY - k  # this tap reads `back` rows before the row
        j = offset - back  # [BLOCK_ROWS] offset of the tap in the segment
        source = rows - back
        from_rows = (j >= 0) | ~has_segment
        tap = tl.load(INPUTS_PTR + source[:, None] * input_stride_t + channel64[None, :] * input_stride_c,
                      mask=valid & (from_rows & (source >= 0))[:, None], other=0.0)
        column = HISTORY + j  # the window column of a tap before the segment's first row
        tap += tl.load(WINDOWS_PTR + window_row[:, None] * window_stride_n + channel64[None, :] * window_stride_c
                       + column[:, None] * window_stride_w,
                       mask=valid & (~from_rows & (column >= 0))[:, None], other=0.0)
        acc += tap * tl.load(WEIGHT_PTR + channel64 * weight_stride_c + k * weight_stride_w, mask=is_channel,
                             other=0.0)[None, :]
    out = acc / (1.0 + tl.exp(-acc))  # silu; exp overflow gives -0.0, still finite
    tl.store(OUT_PTR + rows[:, None] * channels + channel64[None, :], out, mask=valid)


@triton.jit
def _conv_window(WINDOWS_PTR, SLOT_IDS_PTR, INPUTS_PTR, ROW_START_PTR, ROW_COUNT_PTR, OUT_WINDOWS_PTR, segment,
                 channel, channels, window_stride_n, window_stride_c, window_stride_w, input_stride_t, input_stride_c,
                 WIDTH: tl.constexpr, BLOCK_HISTORY: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """New window column w of a segment is its offset count - (W - 1) + w: a row, or an old column."""
    HISTORY: tl.constexpr = WIDTH - 1
    is_channel = channel < channels
    channel64 = channel.to(tl.int64)
    start = tl.load(ROW_START_PTR + segment)
    count = tl.load(ROW_COUNT_PTR + segment)
    column = tl.arange(0, BLOCK_HISTORY)  # [BLOCK_HISTORY]
    j = count - HISTORY + column  # [BLOCK_HISTORY] int64
    mask = is_channel[:, None] & (column < HISTORY)[None, :]  # [BLOCK_CHANNELS, BLOCK_HISTORY]
    value = tl.load(INPUTS_PTR + (start + j)[None, :] * input_stride_t + channel64[:, None] * input_stride_c,
                    mask=mask & (j >= 0)[None, :], other=0.0)
    window_row = segment
    if HAS_SLOTS:
        window_row = tl.load(SLOT_IDS_PTR + segment).to(tl.int64)
    value += tl.load(WINDOWS_PTR + window_row * window_stride_n + channel64[:, None] * window_stride_c
                     + (HISTORY + j)[None, :] * window_stride_w, mask=mask & (j < 0)[None, :], other=0.0)
    tl.store(OUT_WINDOWS_PTR + segment * channels * HISTORY + channel64[:, None] * HISTORY + column[None, :],
             value, mask=mask)


@triton.jit
def _causal_conv_varlen_kernel(
    WINDOWS_PTR, SLOT_IDS_PTR, INPUTS_PTR, ROW_START_PTR, ROW_COUNT_PTR, WEIGHT_PTR, BIAS_PTR, OUT_PTR,
    OUT_WINDOWS_PTR, num_rows, num_segments, channels, num_row_tiles,
    window_stride_n, window_stride_c, window_stride_w, input_stride_t, input_stride_c,
    weight_stride_c, weight_stride_w, bias_stride,
    WIDTH: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_CHANNELS: tl.constexpr,
    BLOCK_HISTORY: tl.constexpr, HAS_SLOTS: tl.constexpr,
):
    # grid: (row tiles + segments, channel tiles); the first programs write rows, the rest windows
    tile = tl.program_id(0)
    channel = tl.program_id(1) * BLOCK_CHANNELS + tl.arange(0, BLOCK_CHANNELS)  # [BLOCK_CHANNELS] int32
    if tile < num_row_tiles:
        _conv_rows(WINDOWS_PTR, SLOT_IDS_PTR, INPUTS_PTR, ROW_START_PTR, ROW_COUNT_PTR, WEIGHT_PTR, BIAS_PTR, OUT_PTR,
                   tile, channel, num_rows, num_segments, channels, window_stride_n, window_stride_c, window_stride_w,
                   input_stride_t, input_stride_c, weight_stride_c, weight_stride_w, bias_stride,
                   WIDTH, SEARCH_STEPS, BLOCK_ROWS, BLOCK_CHANNELS, HAS_SLOTS)
    else:
        _conv_window(WINDOWS_PTR, SLOT_IDS_PTR, INPUTS_PTR, ROW_START_PTR, ROW_COUNT_PTR, OUT_WINDOWS_PTR,
                     (tile - num_row_tiles).to(tl.int64), channel, channels, window_stride_n, window_stride_c,
                     window_stride_w, input_stride_t, input_stride_c, WIDTH, BLOCK_HISTORY, HAS_SLOTS)


@triton.jit
def _ssm_varlen_scan_kernel(
    STATES_PTR, SLOT_IDS_PTR, X_PTR, DT_PTR, A_PTR, B_PTR, C_PTR, D_PTR, ROW_START_PTR, ROW_COUNT_PTR, OUT_Y_PTR,
    OUT_STATES_PTR, num_rows, num_segments, heads, head_dim, state_size, heads_per_group,
    state_stride_n, state_stride_h, state_stride_p, state_stride_s,
    out_state_stride_n, out_state_stride_h, out_state_stride_p, out_state_stride_s, x_stride_t, x_stride_h, x_stride_p,
    dt_stride_t, dt_stride_h, a_stride, d_stride, b_stride_t, b_stride_h, b_stride_s,
    c_stride_t, c_stride_h, c_stride_s,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr, IN_PLACE: tl.constexpr,
    STAGES: tl.constexpr,
):
    """IN_PLACE: STATES_PTR is the slot pool, OUT_STATES_PTR the same pool; segment g reads and
    writes slot SLOT_IDS[g], and a segment of 0 rows touches nothing (0-row segments may share a slot)."""
    segment = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    group = head // heads_per_group  # the B, C group this head reads
    dims = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P] this tile's head dims
    is_dim = dims < head_dim
    dims64 = dims.to(tl.int64)
    state_index = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    is_state = state_index < state_size
    tile_mask = is_dim[:, None] & is_state[None, :]
    start = tl.load(ROW_START_PTR + segment)
    count = tl.load(ROW_COUNT_PTR + segment)
    state_row = segment
    if IN_PLACE:
        state_row = tl.load(SLOT_IDS_PTR + segment).to(tl.int64)
    skip = count < 0  # never: out of place, a 0-row segment copies its state through
    if IN_PLACE:
        skip = count == 0  # in place, a 0-row segment's slot already holds its state
    if not skip:
        state = tl.load(STATES_PTR + state_row * state_stride_n + head * state_stride_h
                        + dims64[:, None] * state_stride_p + state_index[None, :] * state_stride_s,
                        mask=tile_mask, other=0.0)  # [BLOCK_P, BLOCK_N]
        decay_rate = tl.load(A_PTR + head * a_stride)
        skip_weight = tl.load(D_PTR + head * d_stride)
        y_rows = OUT_Y_PTR + head * head_dim + dims64  # [BLOCK_P] pointers; y is [T, H, P] contiguous
        # The rows' loads do not depend on the state: Triton's pipeliner issues them STAGES - 1 rows
        # ahead (cp.async), so a row waits on its arithmetic, not on a memory round trip
        for i in tl.range(0, count, num_stages=STAGES):
            row = start + i
            x = tl.load(X_PTR + row * x_stride_t + head * x_stride_h + dims64 * x_stride_p, mask=is_dim, other=0.0)
            dt = tl.load(DT_PTR + row * dt_stride_t + head * dt_stride_h)
            b = tl.load(B_PTR + row * b_stride_t + group * b_stride_h + state_index * b_stride_s, mask=is_state,
                        other=0.0)
            c = tl.load(C_PTR + row * c_stride_t + group * c_stride_h + state_index * c_stride_s, mask=is_state,
                        other=0.0)
            # explicit fma: which product the compiler would fuse depends on the loop's code
            # shape, and every tiling must round alike (a step's shape picks the tiling)
            state = tl.fma(state, tl.exp(dt * decay_rate), (dt * x)[:, None] * b[None, :])
            y = tl.fma(skip_weight, x, tl.sum(state * c[None, :], axis=1))  # [BLOCK_P]
            tl.store(y_rows + row * heads * head_dim, y, mask=is_dim)
        tl.store(OUT_STATES_PTR + state_row * out_state_stride_n + head * out_state_stride_h
                 + dims64[:, None] * out_state_stride_p + state_index[None, :] * out_state_stride_s,
                 state, mask=tile_mask)
    y_base = OUT_Y_PTR + head * head_dim + dims64  # [BLOCK_P] pointers
    # y = 0 on the rows in no segment: those after this segment, before the next one (or T); segment 0
    # also takes the rows before its start
    gap_begin = start + count
    next_segment = tl.minimum(segment + 1, num_segments - 1)
    gap_end = tl.where(segment + 1 < num_segments, tl.load(ROW_START_PTR + next_segment), num_rows)
    gap_end = tl.minimum(gap_end, num_rows)
    zeros = tl.zeros((BLOCK_ROWS, BLOCK_P), dtype=tl.float32)
    gap_rows = tl.arange(0, BLOCK_ROWS).to(tl.int64)
    for first in range(gap_begin, gap_end, BLOCK_ROWS):
        rows = first + gap_rows
        tl.store(y_base[None, :] + rows[:, None] * heads * head_dim, zeros,
                 mask=(rows < gap_end)[:, None] & is_dim[None, :])
    lead_end = tl.where(segment == 0, tl.minimum(start, num_rows), 0)
    for first in range(0, lead_end, BLOCK_ROWS):
        rows = first + gap_rows
        tl.store(y_base[None, :] + rows[:, None] * heads * head_dim, zeros,
                 mask=(rows < lead_end)[:, None] & is_dim[None, :])


def _scan_tiling(num_rows: int, num_segments: int, heads: int, head_dim: int,
                 device: torch.device) -> Tuple[int, int, int]:
    """(head dims, warps, pipeline stages) per scan program: 4 dims on one warp. Each program
    walks its segment's rows one after another, so while few programs have rows a step lasts one
    segment's walk, and loading rows three ahead (``tl.range(num_stages=4)``) halves it; once the
    busy programs give every SM 8 warps, their number hides the load latency and the pipeline
    only costs (H100, 32 heads of 64 x 128: one 2048-row prompt 1242 -> 494 us pipelined; 8 x 256
    rows 217 us plain vs 272 pipelined). Which segments have rows lives on the device (a graph's
    counts), and a mixed step's graph pads one chunk to a token bucket of hundreds of rows:
    assume one segment with rows per 512 rows. Every tiling rounds alike (explicit fma). The
    interpreter runs programs one by one: few, wide ones there."""
    if device.type != "cuda":
        return 16, 4, 1
    segments_with_rows = min(num_segments, max(1, num_rows // 512))
    busy_programs = segments_with_rows * heads * triton.cdiv(head_dim, 4)
    return (4, 1, 1) if busy_programs >= 8 * sm_count(device) else (4, 1, 4)


def _search_steps(num_segments: int) -> int:
    """Binary-search steps that find a row's segment among n: ceil(log2(n + 1))."""
    return max(1, int(num_segments).bit_length())


def _check_segments(row_start, row_count, num_segments, device) -> None:
    check_tensor("row_start", row_start, dtypes=(torch.int64,), shape=(num_segments,))
    check_tensor("row_count", row_count, dtypes=(torch.int64,), shape=(num_segments,))
    check_same_device(row_start=row_start, row_count=row_count)
    if row_start.device != device:
        raise ValueError(f"row_start is on {row_start.device}, the rows on {device}")


def _check_unit_strides(row_start, row_count) -> None:
    """Strides are not part of a cached signature: checked on every call (two attribute reads)."""
    for name, tensor in (("row_start", row_start), ("row_count", row_count)):
        if tensor.shape[0] > 1 and tensor.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {tensor.stride(0)}")


def segment_of_rows(
    row_start: torch.Tensor,  # [n] int64, non-decreasing; segment g is rows [row_start[g], + row_count[g])
    row_count: torch.Tensor,  # [n] int64 >= 0, the segments disjoint
    num_rows: int,  # T
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # segment [T], offset in it [T] (int64), inside [T] bool
    """Which segment each packed row lies in (module docstring: a worked example). Rows in no
    segment (decode rows, padding) get ``inside`` False and a segment and offset that mean nothing."""
    check_tensor("row_start", row_start, dtypes=(torch.int64,), ndim=1)
    _check_segments(row_start, row_count, row_start.shape[0], row_start.device)
    _check_unit_strides(row_start, row_count)
    check_int("num_rows", num_rows, low=0)
    if not use_triton(row_start):
        return reference.segment_of_rows(row_start, row_count, num_rows)
    device = row_start.device
    segment = torch.empty(num_rows, dtype=torch.int64, device=device)  # [T] int64
    offset = torch.empty(num_rows, dtype=torch.int64, device=device)  # [T] int64
    inside = torch.empty(num_rows, dtype=torch.bool, device=device)  # [T] bool
    if num_rows:
        _segment_of_rows_kernel[(triton.cdiv(num_rows, BLOCK_SEGMENT_ROWS),)](
            row_start, row_count, segment, offset, inside, num_rows, row_start.shape[0],
            SEARCH_STEPS=_search_steps(row_start.shape[0]), BLOCK=BLOCK_SEGMENT_ROWS)
    return segment, offset, inside


def _num_segments(pool_or_states, row_start, slot_ids) -> int:
    """n: the states' first dim, or with slot ids (the states are then a slot pool) row_start's length."""
    if slot_ids is None:
        return pool_or_states.shape[0]
    check_tensor("row_start", row_start, dtypes=(torch.int64,), ndim=1)
    return row_start.shape[0]


def _check_slot_ids(slot_ids, num_segments, device) -> None:
    if slot_ids is not None:
        check_tensor("slot_ids", slot_ids, dtypes=(torch.int64,), shape=(num_segments,))
        if slot_ids.device != device:
            raise ValueError(f"slot_ids is on {slot_ids.device}, the rows on {device}")


def _check_conv_args(windows, inputs, row_start, row_count, weight, bias, slot_ids) -> None:
    check_tensor("inputs", inputs, dtypes=(torch.float32,), ndim=2)
    num_rows, channels = inputs.shape
    check_tensor("weight", weight, dtypes=(torch.float32,), shape=(channels, None))
    width = weight.shape[1]
    if width < 2:
        raise ValueError(f"weight must have a conv width >= 2 on dim 1, got shape {tuple(weight.shape)}")
    check_tensor("windows", windows, dtypes=(torch.float32,), shape=(None, channels, width - 1))
    check_tensor("bias", bias, dtypes=(torch.float32,), shape=(channels,))
    check_same_device(inputs=inputs, windows=windows, weight=weight, bias=bias)
    num_segments = _num_segments(windows, row_start, slot_ids)
    _check_segments(row_start, row_count, num_segments, inputs.device)
    _check_slot_ids(slot_ids, num_segments, inputs.device)


def causal_conv_varlen(
    windows: torch.Tensor,  # [n, C, W - 1] fp32, each segment's conv state before its first row
    inputs: torch.Tensor,  # [T, C] fp32, packed rows (any strides)
    row_start: torch.Tensor,  # [n] int64 on the device (see segment_of_rows)
    row_count: torch.Tensor,  # [n] int64 on the device
    weight: torch.Tensor,  # [C, W] fp32 depthwise kernel
    bias: torch.Tensor,  # [C] fp32
    *,
    slot_ids: Optional[torch.Tensor] = None,  # [n] int64 on the device: windows is a slot pool, see below
) -> Tuple[torch.Tensor, torch.Tensor]:  # silu(conv) [T, C], new windows [n, C, W - 1] (both contiguous)
    """The causal depthwise conv of every segment of the packed rows in one launch: a row's taps
    before its segment's first row come from the segment's window. A segment of 0 rows keeps its
    window; rows in no segment get unspecified (finite) outputs. Fixed shapes, no host sync.
    With ``slot_ids``, ``windows`` is a pool ``[num_slots, C, W - 1]`` and segment ``g`` reads its
    window at ``windows[slot_ids[g]]`` (no gather); the new windows are returned as without.

    Tap ``k`` of row ``t`` (offset ``i`` in its segment) reads offset ``j = i - (W - 1) + k``:
    the packed row ``t - (W - 1) + k`` when ``j >= 0``, else the window's column ``W - 1 + j``.
    """
    _CONV_VALIDATED.validate(_check_conv_args, windows, inputs, row_start, row_count, weight, bias, slot_ids)
    _check_unit_strides(row_start, row_count)
    if not use_triton(inputs):
        return reference.causal_conv_varlen(windows, inputs, row_start, row_count, weight, bias, slot_ids=slot_ids)
    num_rows, channels = inputs.shape
    num_segments, width = row_start.shape[0], weight.shape[1]
    out = torch.empty(num_rows, channels, dtype=torch.float32, device=inputs.device)  # [T, C] fp32
    new_windows = torch.empty(num_segments, channels, width - 1, dtype=torch.float32,
                              device=inputs.device)  # [n, C, W - 1] fp32
    num_row_tiles = triton.cdiv(num_rows, BLOCK_ROWS)
    if num_row_tiles + num_segments == 0 or channels == 0:
        return out, new_windows
    grid = (num_row_tiles + num_segments, triton.cdiv(channels, BLOCK_CHANNELS))
    _causal_conv_varlen_kernel[grid](
        windows, windows if slot_ids is None else slot_ids, inputs, row_start, row_count, weight, bias, out, new_windows,
        num_rows, num_segments, channels, num_row_tiles,
        windows.stride(0), windows.stride(1), windows.stride(2), inputs.stride(0), inputs.stride(1),
        weight.stride(0), weight.stride(1), bias.stride(0),
        WIDTH=width, SEARCH_STEPS=_search_steps(num_segments), BLOCK_ROWS=BLOCK_ROWS,
        BLOCK_CHANNELS=BLOCK_CHANNELS, BLOCK_HISTORY=triton.next_power_of_2(width - 1), HAS_SLOTS=slot_ids is not None)
    return out, new_windows


def _check_scan_args(states, x, dt, A, B, C, D, row_start, row_count, chunk_size, slot_ids, heads_per_group) -> None:
    check_tensor("x", x, dtypes=(torch.float32,), ndim=3)
    num_rows, heads, head_dim = x.shape
    check_tensor("states", states, dtypes=(torch.float32,), shape=(None, heads, head_dim, None))
    state_size = states.shape[3]
    check_tensor("dt", dt, dtypes=(torch.float32,), shape=(num_rows, heads))
    check_tensor("A", A, dtypes=(torch.float32,), shape=(heads,))
    check_int("heads_per_group", heads_per_group, low=1)
    if heads % heads_per_group:
        raise ValueError(f"heads_per_group={heads_per_group} does not divide the {heads} heads")
    groups = heads // heads_per_group
    check_tensor("B", B, dtypes=(torch.float32,), shape=(num_rows, groups, state_size))
    check_tensor("C", C, dtypes=(torch.float32,), shape=(num_rows, groups, state_size))
    check_tensor("D", D, dtypes=(torch.float32,), shape=(heads,))
    check_same_device(x=x, states=states, dt=dt, A=A, B=B, C=C, D=D)
    num_segments = _num_segments(states, row_start, slot_ids)
    _check_segments(row_start, row_count, num_segments, x.device)
    _check_slot_ids(slot_ids, num_segments, x.device)
    check_int("chunk_size", chunk_size, low=1)


def ssm_varlen_scan(
    states: torch.Tensor,  # [n, H, P, N] fp32, each segment's state before its first row (any strides)
    x: torch.Tensor,  # [T, H, P] fp32, packed rows (any strides)
    dt: torch.Tensor,  # [T, H] fp32, after softplus
    A: torch.Tensor,  # [H] fp32, negative
    B: torch.Tensor,  # [T, H / heads_per_group, N] fp32: head h reads group h // heads_per_group
    C: torch.Tensor,  # [T, H / heads_per_group, N] fp32
    D: torch.Tensor,  # [H] fp32
    row_start: torch.Tensor,  # [n] int64 on the device (see segment_of_rows)
    row_count: torch.Tensor,  # [n] int64 on the device
    chunk_size: int = 64,  # the twin's chunk length; the kernel steps row by row
    *,
    slot_ids: Optional[torch.Tensor] = None,  # [n] int64 on the device: states is a slot pool, see below
    heads_per_group: int = 1,  # Mamba-2's heads sharing one B, C group (read in place, not expanded)
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:  # y [T, H, P] (0 in no segment), final [n, H, P, N] or None
    """The SSM recurrence over every segment of the packed rows in one launch, per row ``t``::

        h_t = exp(dt_t * A) * h_{t-1} + dt_t * outer(x_t, B_t)     # [P, N] per head
        y_t = h_t @ C_t + D * x_t

    from the segment's state; its final state is returned (a segment of 0 rows keeps its state,
    bit for bit). Fixed shapes, no host sync. Equal to the twin's chunked form up to fp32 rounding.

    With ``slot_ids``, ``states`` is a pool ``[num_slots, H, P, N]`` updated in place: segment ``g``
    starts from ``states[slot_ids[g]]`` and leaves its final state there, and None is returned in
    place of the final states (no gather, no scatter). Segments with rows must have distinct
    slots; segments of 0 rows touch nothing, so they may share one (a scratch slot).
    """
    _SCAN_VALIDATED.validate(_check_scan_args, states, x, dt, A, B, C, D, row_start, row_count, chunk_size,
                             slot_ids, heads_per_group)
    _check_unit_strides(row_start, row_count)
    num_rows, heads, head_dim = x.shape
    num_segments, state_size = row_start.shape[0], states.shape[3]
    if not use_triton(x) or num_rows == 0 or num_segments == 0 or heads == 0 or head_dim == 0 or state_size == 0:
        return reference.ssm_varlen_scan(states, x, dt, A, B, C, D, row_start, row_count, chunk_size,
                                         slot_ids=slot_ids, heads_per_group=heads_per_group)
    y = torch.empty(num_rows, heads, head_dim, dtype=torch.float32, device=x.device)  # [T, H, P] fp32
    final = states if slot_ids is not None else torch.empty(
        num_segments, heads, head_dim, state_size, dtype=torch.float32, device=x.device)  # [n, H, P, N] fp32
    block_p, num_warps, stages = _scan_tiling(num_rows, num_segments, heads, head_dim, x.device)
    block_p = min(block_p, triton.next_power_of_2(head_dim))
    grid = (num_segments, heads, triton.cdiv(head_dim, block_p))
    _ssm_varlen_scan_kernel[grid](
        states, states if slot_ids is None else slot_ids, x, dt, A, B, C, D, row_start, row_count, y, final,
        num_rows, num_segments, heads, head_dim, state_size, heads_per_group, *states.stride(), *final.stride(),
        *x.stride(), *dt.stride(), A.stride(0), D.stride(0), *B.stride(), *C.stride(),
        BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(state_size), BLOCK_ROWS=BLOCK_ROWS,
        IN_PLACE=slot_ids is not None, STAGES=stages, num_warps=num_warps)
    return y, (None if slot_ids is not None else final)
