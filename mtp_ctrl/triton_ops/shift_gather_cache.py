"""Shift each sequence's rows right and refill the front from a small per-sequence cache (contract: docs/kernels.md).

Multi-layer EAGLE re-runs the drafter over a window whose first ``shift`` rows come from the
previous step. Sequence ``n`` owns rows ``[start, end) = [qsl[n], qsl[n + 1])``, a shift ``s`` and
a cache of ``c >= s`` valid rows: ``dst[start + i] = cached[n, c - s + i]`` for ``i < s``, else
``src[start + i - s]``. The refreshed cache holds ``dst[store_start : store_start + store_len]``
(zero past ``store_len``), computed from ``src`` and ``cached`` directly. ``dst`` and
``new_cached`` are new tensors, so no program reads a row another program of the launch writes.
"""

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._layout_checks import check_contiguous, check_unit_last_stride
from mtp_ctrl.triton_ops._span_programs import programs_per_span

BLOCK_ROWS_1D = 256  # a tile of 1-D values: BLOCK_ROWS_1D rows of width 1
BLOCK_ROWS_HIDDEN = 4  # a tile of hidden rows: BLOCK_ROWS_HIDDEN x up to MAX_BLOCK_HIDDEN values
MAX_BLOCK_HIDDEN = 1024


@triton.jit
def _shifted_rows(
    SRC_PTR,
    CACHE_PTR,
    index,
    is_wanted,
    start,
    shift,
    cached_len,
    columns,
    in_width,
    src_stride,
    cached_stride_row,
    num_rows,
    MAX_SHIFT: tl.constexpr,
):
    """``[len(index), BLOCK_WIDTH]`` values of window rows ``index`` after the shift (0 where not wanted)."""
    from_cache = index < shift
    cache_row = cached_len - shift + index
    src_row = start + index - shift
    read_cache = is_wanted & from_cache & (cache_row >= 0) & (cache_row < MAX_SHIFT)
    read_src = is_wanted & ~from_cache & (src_row >= 0) & (src_row < num_rows)
    cached_values = tl.load(
        CACHE_PTR + cache_row[:, None] * cached_stride_row + columns[None, :],
        mask=read_cache[:, None] & in_width[None, :],
        other=0,
    )
    src_values = tl.load(
        SRC_PTR + src_row[:, None] * src_stride + columns[None, :],
        mask=read_src[:, None] & in_width[None, :],
        other=0,
    )
    return tl.where(from_cache[:, None], cached_values, src_values)


@triton.jit
def _shift_and_gather_kernel(
    SRC_PTR,
    CACHED_PTR,
    QUERY_START_LOC_PTR,
    SHIFTS_PTR,
    CACHED_LENS_PTR,
    STORE_STARTS_PTR,
    STORE_LENS_PTR,
    DST_PTR,
    NEW_CACHED_PTR,
    src_stride,
    cached_stride_seq,
    cached_stride_row,
    num_seqs,
    num_rows,
    row_width,
    MAX_SHIFT: tl.constexpr,
    BLOCK_SHIFT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_WIDTH: tl.constexpr,
):
    """Grid ``(N + 1, programs per sequence, cdiv(W, BLOCK_WIDTH))`` over rows of width ``W``.

    Program ``(n < N, p, w)`` writes row blocks ``p, p + P, ...`` of sequence ``n``'s window, and
    for ``p == 0`` its refreshed cache; program ``(N, p, w)`` copies the rows past the last window
    (CUDA-graph padding) unchanged. ``dst`` and ``new_cached`` are contiguous.
    """
    seq = tl.program_id(0)
    first_block = tl.program_id(1).to(tl.int64) * BLOCK_ROWS
    row_stride = tl.num_programs(1).to(tl.int64) * BLOCK_ROWS
    offsets = tl.arange(0, BLOCK_ROWS)
    columns = tl.program_id(2) * BLOCK_WIDTH + tl.arange(0, BLOCK_WIDTH)  # [BLOCK_WIDTH]
    in_width = columns < row_width
    if seq < num_seqs:
        start = tl.load(QUERY_START_LOC_PTR + seq).to(tl.int64)
        window_len = tl.load(QUERY_START_LOC_PTR + seq + 1).to(tl.int64) - start
        shift = tl.load(SHIFTS_PTR + seq).to(tl.int64)
        cached_len = tl.load(CACHED_LENS_PTR + seq).to(tl.int64)
        cache = CACHED_PTR + seq.to(tl.int64) * cached_stride_seq
        for block_start in range(first_block, window_len, row_stride):
            index = block_start + offsets  # [BLOCK_ROWS] row index inside the window
            in_window = index < window_len
            values = _shifted_rows(
                SRC_PTR, cache, index, in_window, start, shift, cached_len, columns, in_width,
                src_stride, cached_stride_row, num_rows, MAX_SHIFT,
            )
            dst_rows = start + index
            tl.store(
                DST_PTR + dst_rows[:, None] * row_width + columns[None, :],
                values,
                mask=in_window[:, None] & in_width[None, :],
            )
        if tl.program_id(1) == 0:
            kept = tl.arange(0, BLOCK_SHIFT)  # [BLOCK_SHIFT] row of the refreshed cache
            store_start = tl.load(STORE_STARTS_PTR + seq).to(tl.int64)
            store_len = tl.load(STORE_LENS_PTR + seq).to(tl.int64)
            is_stored = kept < store_len
            values = _shifted_rows(
                SRC_PTR, cache, store_start - start + kept, is_stored, start, shift, cached_len, columns,
                in_width, src_stride, cached_stride_row, num_rows, MAX_SHIFT,
            )
            values = tl.where(is_stored[:, None], values, tl.zeros_like(values))
            new_cache = NEW_CACHED_PTR + seq.to(tl.int64) * MAX_SHIFT * row_width
            tl.store(
                new_cache + kept[:, None] * row_width + columns[None, :],
                values,
                mask=(kept < MAX_SHIFT)[:, None] & in_width[None, :],
            )
    else:
        tail_start = tl.load(QUERY_START_LOC_PTR + num_seqs).to(tl.int64)
        for block_start in range(first_block, num_rows - tail_start, row_stride):
            rows = tail_start + block_start + offsets
            mask = (rows < num_rows)[:, None] & in_width[None, :]
            values = tl.load(SRC_PTR + rows[:, None] * src_stride + columns[None, :], mask=mask)
            tl.store(DST_PTR + rows[:, None] * row_width + columns[None, :], values, mask=mask)


def _check_windows(num_seqs, query_start_loc, shifts, cached_lens, store_starts, store_lens):
    windows = dict(
        query_start_loc=query_start_loc,
        shifts=shifts,
        cached_lens=cached_lens,
        store_starts=store_starts,
        store_lens=store_lens,
    )
    for name, tensor in windows.items():
        length = num_seqs + 1 if name == "query_start_loc" else num_seqs
        check_tensor(name, tensor, dtypes=INDEX_DTYPES, shape=(length,))
    check_contiguous(**windows)
    return windows


def _launch(src, cached, query_start_loc, shifts, cached_lens, store_starts, store_lens, block_rows, block_width):
    """Run the kernel over ``src [T, W]`` and ``cached [N, MAX_SHIFT, W]``; returns new ``(dst, new_cached)``."""
    num_rows, row_width = src.shape
    num_seqs, max_shift = cached.shape[0], cached.shape[1]
    dst = torch.empty((num_rows, row_width), dtype=src.dtype, device=src.device)  # [T, W]
    new_cached = torch.empty((num_seqs, max_shift, row_width), dtype=src.dtype, device=src.device)  # [N, MAX_SHIFT, W]
    if row_width == 0 or num_rows + num_seqs == 0:
        return dst, new_cached
    programs = programs_per_span(num_seqs + 1, num_rows, block_rows)
    grid = (num_seqs + 1, programs, triton.cdiv(row_width, block_width))
    _shift_and_gather_kernel[grid](
        src,
        cached,
        query_start_loc,
        shifts,
        cached_lens,
        store_starts,
        store_lens,
        dst,
        new_cached,
        src.stride(0),
        cached.stride(0),
        cached.stride(1),
        num_seqs,
        num_rows,
        row_width,
        MAX_SHIFT=max_shift,
        BLOCK_SHIFT=triton.next_power_of_2(max_shift),
        BLOCK_ROWS=block_rows,
        BLOCK_WIDTH=block_width,
    )
    return dst, new_cached


def shift_and_gather_cache(
    src: torch.Tensor,  # [T] int32/int64: token ids, positions or slots of the packed rows
    cached: torch.Tensor,  # [N, MAX_SHIFT], dtype of src: the last rows of each sequence's previous window
    query_start_loc: torch.Tensor,  # [N + 1] int32/int64, sequence n owns rows [qsl[n], qsl[n + 1]); qsl[0] = 0
    shifts: torch.Tensor,  # [N] int32/int64, 0 <= shift <= cached_lens
    cached_lens: torch.Tensor,  # [N] int32/int64, valid rows of each cache, <= MAX_SHIFT
    store_starts: torch.Tensor,  # [N] int32/int64, first dst row kept in the refreshed cache (inside the window)
    store_lens: torch.Tensor,  # [N] int32/int64, rows kept, <= MAX_SHIFT and inside the window
):
    """Shift every window right by its ``shift`` and refill the front from the cache (1-D values).

    Returns new tensors ``(dst [T], new_cached [N, MAX_SHIFT])``; rows past ``qsl[N]`` are copied
    from ``src`` unchanged. ``new_cached`` replaces ``cached`` for the next call, with
    ``store_lens`` as its new ``cached_lens``. A padding sequence (empty window, ``store_len =
    0``) writes no ``dst`` row and a zero cache row.

    Example, ``MAX_SHIFT = 3``: ``src = [10 11 12 13 14 | 20 21 22 | 99]``, ``qsl = [0, 5, 8]``
    (row 8 is padding), ``cached = [[1, 2, 3], [7, 8, 0]]``, ``cached_lens = [3, 2]``,
    ``shifts = [2, 1]``, ``store_starts = [2, 5]``, ``store_lens = [3, 2]``::

        dst        = [2 3 10 11 12 | 8 20 21 | 99]
        new_cached = [[10, 11, 12], [8, 20, 0]]
    """
    check_tensor("src", src, dtypes=INDEX_DTYPES, ndim=1)
    check_tensor("cached", cached, dtypes=(src.dtype,), ndim=2)
    num_seqs = cached.shape[0]
    if cached.shape[1] < 1:
        raise ValueError(f"cached needs MAX_SHIFT >= 1 rows per sequence, got shape {tuple(cached.shape)}")
    windows = _check_windows(num_seqs, query_start_loc, shifts, cached_lens, store_starts, store_lens)
    check_same_device(src=src, cached=cached, **windows)
    check_contiguous(src=src, cached=cached)
    if not use_triton(src):
        return reference.shift_and_gather_cache(
            src, cached, query_start_loc, shifts, cached_lens, store_starts, store_lens
        )
    dst, new_cached = _launch(
        src[:, None], cached[:, :, None], query_start_loc, shifts, cached_lens, store_starts, store_lens,
        block_rows=BLOCK_ROWS_1D, block_width=1,
    )
    return dst[:, 0], new_cached[:, :, 0]


def shift_and_gather_cache_hidden(
    src: torch.Tensor,  # [T, H] float: hidden states of the packed rows
    cached: torch.Tensor,  # [N, MAX_SHIFT, H], dtype of src
    query_start_loc: torch.Tensor,  # [N + 1] int32/int64
    shifts: torch.Tensor,  # [N] int32/int64
    cached_lens: torch.Tensor,  # [N] int32/int64
    store_starts: torch.Tensor,  # [N] int32/int64
    store_lens: torch.Tensor,  # [N] int32/int64
):
    """:func:`shift_and_gather_cache` over hidden rows: returns new ``(dst [T, H], new_cached [N, MAX_SHIFT, H])``.

    Same windows and example as the 1-D op, with every value a row of ``H`` (any ``H``; the last
    tile is masked). Bound by memory bandwidth: each output row is read once and written once.
    """
    check_tensor("src", src, dtypes=FLOAT_DTYPES, ndim=2)
    hidden_size = src.shape[1]
    check_tensor("cached", cached, dtypes=(src.dtype,), shape=(None, None, hidden_size))
    num_seqs = cached.shape[0]
    if cached.shape[1] < 1:
        raise ValueError(f"cached needs MAX_SHIFT >= 1 rows per sequence, got shape {tuple(cached.shape)}")
    windows = _check_windows(num_seqs, query_start_loc, shifts, cached_lens, store_starts, store_lens)
    check_same_device(src=src, cached=cached, **windows)
    check_unit_last_stride(src=src, cached=cached)
    if not use_triton(src):
        return reference.shift_and_gather_cache_hidden(
            src, cached, query_start_loc, shifts, cached_lens, store_starts, store_lens
        )
    block_width = min(triton.next_power_of_2(max(hidden_size, 1)), MAX_BLOCK_HIDDEN)
    return _launch(
        src, cached, query_start_loc, shifts, cached_lens, store_starts, store_lens,
        block_rows=BLOCK_ROWS_HIDDEN, block_width=block_width,
    )
