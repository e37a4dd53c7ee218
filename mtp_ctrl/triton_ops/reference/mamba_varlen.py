"""Torch twins of :mod:`mtp_ctrl.triton_ops.mamba_varlen`: the Mamba-2 causal conv and SSM scan over
the packed rows of a whole step (segments: one per prefill request, rows
``[row_start, row_start + row_count)``), fixed shapes, no host sync.

Letters: T packed rows, n segments, C conv channels, W conv width, H heads, P head dim, N state
size; everything fp32. The per-request functions of ``tests/unit/mamba_oracle.py``
(``causal_conv_chunk``, ``ssm_chunk_scan``) are these functions' own reference in the tests.
The conv state of a request is the last ``W - 1`` inputs of its causal conv, ``[C, W - 1]``, oldest first.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def segment_of_rows(
    row_start: torch.Tensor,  # [n] int64, non-decreasing; segment g is rows [row_start[g], + row_count[g])
    row_count: torch.Tensor,  # [n] int64 >= 0, the segments disjoint
    num_rows: int,  # T
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # segment [T], offset in it [T] (int64), inside [T] bool
    """Which segment each packed row lies in. Segments are in row order:
    ``row_start[g + 1] >= row_start[g] + row_count[g]``. Rows in no segment (decode rows,
    padding) get ``inside`` False and a segment and offset that mean nothing.

    Example: starts (0, 3, 5, 7), counts (0, 2, 1, 0), T = 7 -> segment (0, 0, 0, 1, 1, 2, 2),
    offset (0, 1, 2, 0, 1, 0, 1), inside (F, F, F, T, T, T, F): a row takes the last segment that
    starts at or before it.
    """
    rows = torch.arange(num_rows, device=row_start.device)  # [T] int64
    if row_start.shape[0] == 0:
        zeros = torch.zeros_like(rows)
        return zeros, zeros, torch.zeros(num_rows, dtype=torch.bool, device=rows.device)
    segment = (torch.searchsorted(row_start, rows, right=True) - 1).clamp(min=0)  # [T] int64
    offset = rows - row_start[segment]  # [T] int64, negative before the first segment
    inside = (offset >= 0) & (offset < row_count[segment])
    return segment, offset.clamp(min=0), inside


def causal_conv_varlen(
    windows: torch.Tensor,  # [n, C, W - 1] fp32, each segment's conv state before its first row
    inputs: torch.Tensor,  # [T, C] fp32, packed rows
    row_start: torch.Tensor,  # [n] int64 on the device (see segment_of_rows)
    row_count: torch.Tensor,  # [n] int64 on the device
    weight: torch.Tensor,  # [C, W] fp32
    bias: torch.Tensor,  # [C] fp32
    *,
    slot_ids: Optional[torch.Tensor] = None,  # [n] int64: windows is a slot pool [num_slots, C, W - 1]
) -> Tuple[torch.Tensor, torch.Tensor]:  # silu(conv) [T, C], new windows [n, C, W - 1]
    """``causal_conv_chunk`` over every segment of the packed rows at once: a row's taps
    before its segment's first row come from the segment's window. A segment of 0 rows keeps its
    window; rows in no segment get unspecified (finite) outputs. Fixed shapes, no host sync.

    Tap ``k`` of row ``t`` (offset ``i`` in its segment) reads offset ``j = i - (W - 1) + k``:
    the packed row ``t - (W - 1) + k`` when ``j >= 0``, else the window's column ``W - 1 + j``.
    """
    if slot_ids is not None:
        windows = windows[slot_ids]  # [n, C, W - 1]
    num_rows, channels = inputs.shape
    num_segments, width = windows.shape[0], weight.shape[1]
    history = width - 1
    segment, offset, _ = segment_of_rows(row_start, row_count, num_rows)
    # one table to gather taps from: the packed rows, then each segment's window columns, oldest first
    table = torch.cat((inputs, windows.transpose(1, 2).reshape(num_segments * history, channels)))  # [T + n (W-1), C]
    window_base = num_rows + segment * history + history  # [T]: + j (< 0) is window column W - 1 + j
    rows = torch.arange(num_rows, device=inputs.device)
    acc = bias.expand(num_rows, channels)
    for k in range(width):  # W taps: a fixed, small loop
        back = history - k  # this tap reads `back` rows before the row
        j = offset - back  # [T] int64
        source = torch.where(j >= 0, rows - back, window_base + j) if num_segments else (rows - back).clamp(min=0)
        acc = acc + table[source] * weight[:, k]
    # new window column w holds offset count - (W - 1) + w: a row of the segment, or an old column
    column = torch.arange(history, device=inputs.device)
    j = row_count[:, None] - history + column  # [n, W - 1] int64
    segments = torch.arange(num_segments, device=inputs.device)[:, None]
    source = torch.where(j >= 0, row_start[:, None] + j, num_rows + segments * history + history + j)
    new_windows = table[source].transpose(1, 2)  # [n, C, W - 1]
    return F.silu(acc), new_windows


def ssm_varlen_scan(
    states: torch.Tensor,  # [n, H, P, N] fp32, each segment's state before its first row
    x: torch.Tensor,  # [T, H, P] fp32, packed rows
    dt: torch.Tensor,  # [T, H] fp32, after softplus
    A: torch.Tensor,  # [H] fp32
    B: torch.Tensor,  # [T, H, N] fp32
    C: torch.Tensor,  # [T, H, N] fp32
    D: torch.Tensor,  # [H] fp32
    row_start: torch.Tensor,  # [n] int64 on the device (see segment_of_rows)
    row_count: torch.Tensor,  # [n] int64 on the device
    chunk_size: int = 64,
    *,
    slot_ids: Optional[torch.Tensor] = None,  # [n] int64: states is a slot pool, updated in place
    heads_per_group: int = 1,  # B, C are [T, H / heads_per_group, N]: head h reads group h // heads_per_group
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:  # y [T, H, P] (0 in no segment), final [n, H, P, N] or None
    """``ssm_chunk_scan`` over every segment of the packed rows at once, with fixed shapes
    and no host sync (a segment of 0 rows keeps its state).

    Each segment is cut into chunks of ``Q = chunk_size`` rows from its first row, exactly as the
    per-request scan cuts it, and the chunks of all segments are laid side by side: at most
    ``K = min(T, ceil((T + n (Q - 1)) / Q))`` of them, ``[K, Q]`` rows, unused rows zero. Then

    1. within each chunk, the masked quadratic form of ``ssm_chunk_scan`` (from zero state),
       and the chunk's own end state ``s_c``;
    2. the state entering chunk ``c`` is its segment's initial state when ``c`` is the segment's
       first chunk, else ``sum_d exp(a_{d+1} + .. + a_{c-1}) s'_d`` over the segment's earlier
       chunks ``d`` (``a`` = a chunk's total log decay, ``s'`` = ``s`` plus the decayed initial
       state on the first chunk), a ``[K, K]`` matrix per head whose exponents are summed from
       ``d + 1`` on, never as a difference of two long sums (fp32 keeps them exact enough);
    3. each row adds ``exp(L_t) C_t . state_in``; each segment's final state is its last chunk's.

    Memory: about ``K Q H (P + 2 N) + 3 K Q^2 H + 4 K H P N`` fp32 at its peak; e.g. T = 2048,
    n = 64, Q = 64, H = 32, P = 64, N = 128 (K = 95): about 0.8 GB, freed after each layer (a CUDA
    graph keeps it in its pool); ``bench/bench_mamba_prefill.py`` measures it.
    """
    if heads_per_group > 1:
        B, C = B.repeat_interleave(heads_per_group, dim=1), C.repeat_interleave(heads_per_group, dim=1)  # [T, H, N]
    if slot_ids is not None:  # the pool's slots in, the final states back into them (0-row segments unchanged)
        pool, states = states, states[slot_ids]  # [n, H, P, N]
        y, final = ssm_varlen_scan(states, x, dt, A, B, C, D, row_start, row_count, chunk_size)
        pool[slot_ids] = torch.where((row_count > 0)[:, None, None, None], final, states)  # duplicates agree
        return y, None
    num_rows, heads, head_dim = x.shape
    num_segments, device = states.shape[0], x.device
    if num_rows == 0 or num_segments == 0:
        return torch.zeros_like(x), states.clone()
    Q = chunk_size
    K = min(num_rows, -(-(num_rows + num_segments * (Q - 1)) // Q))
    chunks_of = (row_count + Q - 1) // Q  # [n] int64
    chunk_end = torch.cumsum(chunks_of, 0)  # [n] int64, one past each segment's last chunk
    chunk_begin = chunk_end - chunks_of
    chunk = torch.arange(K, device=device)
    chunk_segment = torch.searchsorted(chunk_end, chunk, right=True).clamp(max=num_segments - 1)  # [K] int64
    chunk_index = chunk - chunk_begin[chunk_segment]  # [K] int64, 0 on a segment's first chunk
    local = chunk_index[:, None] * Q + torch.arange(Q, device=device)  # [K, Q] offset in the segment
    used = (chunk < chunk_end[-1])[:, None] & (local < row_count[chunk_segment][:, None])  # [K, Q] bool
    source = torch.where(used, row_start[chunk_segment][:, None] + local, num_rows)  # row T: zeros

    def chunked(values):  # [T, ...] -> [K, Q, ...], zero on unused rows (so dt = 0: they change nothing)
        return torch.cat((values, values.new_zeros(1, *values.shape[1:])))[source]

    x_c, dt_c, B_c, C_c = chunked(x), chunked(dt), chunked(B), chunked(C)
    log_decay = torch.cumsum(dt_c * A, dim=1)  # [K, Q, H]
    gaps = log_decay[:, :, None, :] - log_decay[:, None, :, :]  # [K, t, s, H]
    causal = torch.ones(Q, Q, dtype=torch.bool, device=device).tril()[None, :, :, None]
    weights = torch.exp(gaps.masked_fill(~causal, float("-inf")))
    weights = weights * torch.einsum("kthn,kshn->ktsh", C_c, B_c) * dt_c[:, None, :, :]  # [K, t, s, H]
    y = torch.einsum("ktsh,kshp->kthp", weights, x_c)  # [K, Q, H, P]
    chunk_decay = log_decay[:, -1]  # [K, H], a_c
    to_end = torch.exp(chunk_decay[:, None, :] - log_decay) * dt_c  # [K, Q, H]
    chunk_states = torch.einsum("ksh,kshp,kshn->khpn", to_end, x_c, B_c)  # [K, H, P, N], s_c from zero

    # state passing, in place where it can (four [K, H, P, N] tensors live at most)
    first = (chunk_index == 0)[:, None, None, None]  # [K, 1, 1, 1]: a segment's first chunk
    initial = states[chunk_segment]  # [K, H, P, N]
    carried = (torch.exp(chunk_decay)[:, :, None, None] * initial).masked_fill_(~first, 0.0).add_(chunk_states)  # s'
    # span[c, d] = a_{d+1} + .. + a_c for d < c (a cumulative sum that starts at d + 1)
    later = torch.ones(K, K, dtype=torch.bool, device=device).tril(-1)[:, :, None]  # [c, d, 1]: d < c
    span = torch.cumsum(torch.where(later, chunk_decay[:, None, :], 0.0), dim=0)  # [K, K, H]
    incoming = torch.cat((span.new_zeros(1, K, heads), span[:-1]))  # [c, d, H] = a_{d+1} + .. + a_{c-1}
    same = (chunk_segment[:, None] == chunk_segment[None, :])[:, :, None] & later
    passing = torch.exp(incoming.masked_fill(~same, float("-inf")))  # [K, K, H]
    state_in = torch.einsum("cdh,dhpn->chpn", passing, carried)  # [K, H, P, N], the state entering each chunk
    del carried
    state_in.masked_fill_(first, 0.0).add_(initial.masked_fill_(~first, 0.0))  # first chunks: the segment's state
    del initial
    y = y + torch.exp(log_decay)[..., None] * torch.einsum("khpn,kthn->kthp", state_in, C_c)
    last = (chunk_end - 1).clamp(min=0)  # [n] each segment's last chunk
    final = torch.exp(chunk_decay[last])[:, :, None, None] * state_in[last] + chunk_states[last]  # [n, H, P, N]
    final = torch.where((chunks_of > 0)[:, None, None, None], final, states)

    segment, offset, inside = segment_of_rows(row_start, row_count, num_rows)
    aligned = (chunk_begin[segment] * Q + offset).clamp(max=K * Q - 1)  # [T] row of the chunk layout
    y = y.reshape(K * Q, heads, head_dim)[aligned] + D[None, :, None] * x
    return torch.where(inside[:, None, None], y, 0.0), final
