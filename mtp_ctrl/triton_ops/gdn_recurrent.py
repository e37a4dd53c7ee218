"""The gated delta rule (Gated DeltaNet) over the rows of a step, one launch per op, from each
request's state slot.

Letters: T packed rows, n prefill segments, nd decode requests, R = 1 + S rows each, L layers,
M slots, H value heads, Hk key heads (value head h reads key head ``h // (H / Hk)``), K key dim,
V value dim. One row of one head, from state ``S`` ``[K, V]`` (fp32)::

    S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q

One program per (request or segment, head, tile of ``BLOCK_V`` value dims) keeps its state tile
``[K, BLOCK_V]`` in registers and walks its rows in order (the recurrent form; the twin of the
prefill op is the chunked form, and the two agree to fp32 rounding). Each tile's columns of the
state are independent of the others', so no program reads what another writes.

- :func:`gdn_decode_rows`: request r owns rows ``r R .. r R + R - 1`` (rows at or past T read as
  zeros: a padded grid's decode requests may run past the step's rows); it starts from the slot's
  current state (only read) and writes the state after row ``j`` to ``intermediate[layer, slot, j]``.
  The controller commits the one after the last accepted row (``mamba_state_selective_copy``).
- :func:`gdn_varlen_scan`: segment g is rows ``[row_start[g], + row_count[g])`` (device tensors,
  so a CUDA graph replays any chunk lengths that fit); it starts from the slot's state and writes
  the state after its last row back; a segment of 0 rows touches nothing. Rows in no segment get 0.

Worked example (decode, R = 3, slots (5, 2)): request 1 reads rows 3, 4, 5 from ``states[layer, 2]``
and writes ``intermediate[layer, 2, 0..2]``; accepting 1 draft later commits
``intermediate[layer, 2, 1]`` (the state after rows 3 and 4).

Twins: :mod:`mtp_ctrl.triton_ops.reference.gdn`.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import FLOAT_DTYPES, ValidatedSignatures, check_int, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton

MAX_BLOCK_V = 32  # value dims per program: the state tile is [K, BLOCK_V] fp32 in registers

_DECODE_VALIDATED = ValidatedSignatures()  # argument signatures that passed _check_decode_args
_SCAN_VALIDATED = ValidatedSignatures()


@triton.jit
def _load_row(Q_PTR, K_PTR, V_PTR, G_PTR, BETA_PTR, row, num_rows, head, key_head, keys, is_key, values, is_value,
              q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, g_stride_t, g_stride_h,
              beta_stride_t, beta_stride_h):
    """One row's q, k ``[BLOCK_K]``, v ``[BLOCK_V]``, g, beta (``[BLOCK_V]``, one value each); a row at or
    past ``num_rows`` reads zeros (g = beta = 0: the state passes unchanged)."""
    key_row = keys * 0 + row < num_rows  # [BLOCK_K] bool, one value (a scalar mask is not portable)
    value_row = values * 0 + row < num_rows  # [BLOCK_V] bool
    q = tl.load(Q_PTR + row * q_stride_t + key_head * q_stride_h + keys, mask=is_key & key_row, other=0.0)
    k = tl.load(K_PTR + row * k_stride_t + key_head * k_stride_h + keys, mask=is_key & key_row, other=0.0)
    v = tl.load(V_PTR + row * v_stride_t + head * v_stride_h + values, mask=is_value & value_row, other=0.0)
    g = tl.load(G_PTR + row * g_stride_t + head * g_stride_h + values * 0, mask=value_row, other=0.0)
    beta = tl.load(BETA_PTR + row * beta_stride_t + head * beta_stride_h + values * 0, mask=value_row, other=0.0)
    return q, k, v, g, beta


@triton.jit
def _apply_delta(state, k, delta, g):
    """The state tile ``[BLOCK_K, BLOCK_V]`` after a row whose delta ``u`` (``delta`` ``[BLOCK_V]``) is
    known: ``exp(g) S + k u^T`` (k ``[BLOCK_K]``, g ``[BLOCK_V]``, one value). An explicit fused
    multiply-add, so a stepped row (:func:`_delta_rule_step`) and a stored row applied later compile
    to the same instructions whatever the compiler would contract: the same bits. g = 0 with k = 0
    (or u = 0) leaves the state as it was."""
    decayed = state * tl.exp(g)[None, :]
    return tl.fma(tl.broadcast_to(k[:, None], decayed.shape), tl.broadcast_to(delta[None, :], decayed.shape),
                  decayed)


@triton.jit
def _delta_rule_step(state, k, v, g, beta):
    """(state tile after one row, the row's delta ``u = beta (v - (exp(g) S)^T k)`` ``[BLOCK_V]``);
    k ``[BLOCK_K]``; v, g, beta ``[BLOCK_V]``. The new state is :func:`_apply_delta` of ``u``: the
    decay is recomputed there (one multiply an element; the same bits), so ``u`` stored and applied
    in a later step gives this state exactly."""
    decayed = state * tl.exp(g)[None, :]
    delta = beta * (v - tl.sum(decayed * k[:, None], axis=0))  # [BLOCK_V]
    return _apply_delta(state, k, delta, g), delta


@triton.jit
def _delta_rule_update(state, k, v, g, beta):
    """The state tile ``[BLOCK_K, BLOCK_V]`` after one row (k ``[BLOCK_K]``; v, g, beta ``[BLOCK_V]``).
    Every kernel that steps the rule calls this one function (or :func:`_delta_rule_step`), so a
    replayed row gives the state the verify row computed. g = beta = 0 (with k = v = 0) leaves the
    state exactly as it was."""
    state, _ = _delta_rule_step(state, k, v, g, beta)
    return state


@triton.jit
def _delta_rule_row(state, Q_PTR, K_PTR, V_PTR, G_PTR, BETA_PTR, row, num_rows, head, key_head, keys, is_key,
                    values, is_value, q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                    g_stride_t, g_stride_h, beta_stride_t, beta_stride_h):
    """One row through the rule: (new state [BLOCK_K, BLOCK_V], o [BLOCK_V])."""
    q, k, v, g, beta = _load_row(Q_PTR, K_PTR, V_PTR, G_PTR, BETA_PTR, row, num_rows, head, key_head, keys, is_key,
                                 values, is_value, q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t,
                                 v_stride_h, g_stride_t, g_stride_h, beta_stride_t, beta_stride_h)
    state = _delta_rule_update(state, k, v, g, beta)
    return state, tl.sum(state * q[:, None], axis=0)


@triton.jit
def _gdn_rows_kernel(
    STATES_PTR, INTER_PTR, SLOTS_PTR, ROW_START_PTR, ROW_COUNT_PTR, Q_PTR, K_PTR, V_PTR, G_PTR, BETA_PTR, OUT_PTR,
    num_rows, key_dim, value_dim, heads_per_key_head,
    states_s_slot, states_s_head, states_s_k, states_s_v,
    inter_s_slot, inter_s_row, inter_s_head, inter_s_k, inter_s_v,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, g_stride_t, g_stride_h,
    beta_stride_t, beta_stride_h, out_stride_t, out_stride_h,
    DECODE: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    request = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    key_head = head // heads_per_key_head
    keys = tl.arange(0, BLOCK_K).to(tl.int64)
    is_key = keys < key_dim
    values = (tile * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    is_value = values < value_dim
    tile_mask = is_key[:, None] & is_value[None, :]
    slot = tl.load(SLOTS_PTR + request)
    state_ptrs = STATES_PTR + slot * states_s_slot + head * states_s_head + keys[:, None] * states_s_k \
        + values[None, :] * states_s_v
    state = tl.load(state_ptrs, mask=tile_mask, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    if DECODE:
        first_row = request * ROWS
        for j in tl.static_range(ROWS):
            row = first_row + j
            state, o = _delta_rule_row(state, Q_PTR, K_PTR, V_PTR, G_PTR, BETA_PTR, row, num_rows, head, key_head,
                                       keys, is_key, values, is_value, q_stride_t, q_stride_h, k_stride_t,
                                       k_stride_h, v_stride_t, v_stride_h, g_stride_t, g_stride_h, beta_stride_t,
                                       beta_stride_h)
            tl.store(OUT_PTR + row * out_stride_t + head * out_stride_h + values, o, mask=is_value)
            tl.store(INTER_PTR + slot * inter_s_slot + j * inter_s_row + head * inter_s_head
                     + keys[:, None] * inter_s_k + values[None, :] * inter_s_v, state, mask=tile_mask)
    else:
        first_row = tl.load(ROW_START_PTR + request)
        count = tl.load(ROW_COUNT_PTR + request)
        for i in range(0, count):
            row = first_row + i
            state, o = _delta_rule_row(state, Q_PTR, K_PTR, V_PTR, G_PTR, BETA_PTR, row, num_rows, head, key_head,
                                       keys, is_key, values, is_value, q_stride_t, q_stride_h, k_stride_t,
                                       k_stride_h, v_stride_t, v_stride_h, g_stride_t, g_stride_h, beta_stride_t,
                                       beta_stride_h)
            tl.store(OUT_PTR + row * out_stride_t + head * out_stride_h + values, o,
                     mask=is_value & (values * 0 + row < num_rows))
        tl.store(state_ptrs, state, mask=tile_mask & (values[None, :] * 0 + count > 0))


def _check_rows(q, k, v, g, beta, heads: int, key_dim: int, value_dim: int) -> int:
    """Shapes of the per-row inputs; returns T."""
    check_tensor("q", q, dtypes=(torch.float32,), ndim=3)
    num_rows, key_heads = q.shape[0], q.shape[1]
    if key_heads < 1 or heads % key_heads:
        raise ValueError(f"q has {key_heads} key heads: they must divide the states' {heads} value heads")
    check_tensor("q", q, shape=(num_rows, key_heads, key_dim))
    check_tensor("k", k, dtypes=(torch.float32,), shape=(num_rows, key_heads, key_dim))
    check_tensor("v", v, dtypes=(torch.float32,), shape=(num_rows, heads, value_dim))
    check_tensor("g", g, dtypes=(torch.float32,), shape=(num_rows, heads))
    check_tensor("beta", beta, dtypes=(torch.float32,), shape=(num_rows, heads))
    return num_rows


def _check_decode_args(recurrent_states, intermediate_states, layer, slot_ids, q, k, v, g, beta) -> None:
    check_tensor("recurrent_states", recurrent_states, dtypes=FLOAT_DTYPES, ndim=5)
    num_layers, num_slots, heads, key_dim, value_dim = recurrent_states.shape
    check_tensor("intermediate_states", intermediate_states, dtypes=FLOAT_DTYPES,
                 shape=(num_layers, num_slots, None, heads, key_dim, value_dim))
    if intermediate_states.shape[2] < 1:
        raise ValueError("intermediate_states must hold >= 1 row per slot (1 + S) on dim 2")
    check_int("layer", layer, low=0, high=num_layers - 1)
    check_tensor("slot_ids", slot_ids, dtypes=(torch.int64,), ndim=1)
    _check_rows(q, k, v, g, beta, heads, key_dim, value_dim)
    check_same_device(q=q, recurrent_states=recurrent_states, intermediate_states=intermediate_states,
                      slot_ids=slot_ids, k=k, v=v, g=g, beta=beta)


def _check_scan_args(states, q, k, v, g, beta, row_start, row_count, chunk_size, slot_ids) -> None:
    check_tensor("states", states, dtypes=FLOAT_DTYPES, ndim=4)
    _, heads, key_dim, value_dim = states.shape
    _check_rows(q, k, v, g, beta, heads, key_dim, value_dim)
    check_tensor("row_start", row_start, dtypes=(torch.int64,), ndim=1)
    num_segments = row_start.shape[0]
    check_tensor("row_count", row_count, dtypes=(torch.int64,), shape=(num_segments,))
    check_int("chunk_size", chunk_size, low=1)
    if slot_ids is None:
        check_tensor("states", states, dtypes=(torch.float32,), shape=(num_segments, None, None, None))
    else:
        check_tensor("slot_ids", slot_ids, dtypes=(torch.int64,), shape=(num_segments,))
    check_same_device(q=q, states=states, k=k, v=v, g=g, beta=beta, row_start=row_start, row_count=row_count,
                      **({} if slot_ids is None else {"slot_ids": slot_ids}))


def _launch(states, intermediate, slot_ids, row_start, row_count, q, k, v, g, beta, out, rows_per_request: int,
            decode: bool) -> None:
    """One program per (request or segment, head, value tile); ``states`` ``[M, H, K, V]``,
    ``intermediate`` ``[M, R, H, K, V]`` (decode) or None."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):  # strides: checked per call (not cached)
        if tensor.stride(-1) != 1 and tensor.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got stride {tensor.stride(-1)}")
    num_programs = slot_ids.shape[0]
    heads, key_dim, value_dim = states.shape[1:]
    if num_programs == 0 or heads == 0 or value_dim == 0:
        return
    block_v = min(MAX_BLOCK_V, triton.next_power_of_2(value_dim))
    inter = intermediate if intermediate is not None else states.unsqueeze(1)  # unused by prefill programs
    starts = row_start if row_start is not None else slot_ids  # unused by decode programs
    counts = row_count if row_count is not None else slot_ids
    _gdn_rows_kernel[(num_programs, heads, triton.cdiv(value_dim, block_v))](
        states, inter, slot_ids, starts, counts, q, k, v, g, beta, out,
        q.shape[0], key_dim, value_dim, heads // q.shape[1],
        *states.stride(), *inter.stride(), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), *g.stride(), *beta.stride(), out.stride(0), out.stride(1),
        DECODE=decode, ROWS=rows_per_request, BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_v)


def gdn_decode_rows(
    recurrent_states: torch.Tensor,  # [L, M, H, K, V] float, current states (read only)
    intermediate_states: torch.Tensor,  # [L, M, R, H, K, V] float, written at [layer, slot_ids, :]
    layer: int,
    slot_ids: torch.Tensor,  # [nd] int64 on the device, each decode request's slot
    q: torch.Tensor,  # [T, Hk, K] fp32, l2-normalised and scaled by K ** -0.5
    k: torch.Tensor,  # [T, Hk, K] fp32, l2-normalised
    v: torch.Tensor,  # [T, H, V] fp32
    g: torch.Tensor,  # [T, H] fp32, log decay (<= 0)
    beta: torch.Tensor,  # [T, H] fp32
) -> torch.Tensor:  # o [nd * R, H, V] fp32
    """The R = ``intermediate_states.shape[2]`` rows of every decode request, in order, from its
    slot's current state; the state after row ``j`` goes to ``intermediate_states[layer, slot, j]``
    (module docstring: layout and a worked example). Slots should be distinct except a shared
    scratch slot, whose intermediate contents are then unspecified. No host sync."""
    args = (recurrent_states, intermediate_states, layer, slot_ids, q, k, v, g, beta)
    _DECODE_VALIDATED.validate(_check_decode_args, *args)
    if not use_triton(q):
        return reference.gdn_decode_rows(*args)
    rows_per_request = intermediate_states.shape[2]
    heads, value_dim = recurrent_states.shape[2], recurrent_states.shape[4]
    out = torch.empty(slot_ids.shape[0] * rows_per_request, heads, value_dim, dtype=torch.float32,
                      device=q.device)  # [nd * R, H, V] fp32
    if slot_ids.stride(0) != 1 and slot_ids.shape[0] > 1:
        raise ValueError(f"slot_ids must be contiguous, got stride {slot_ids.stride(0)}")
    # the layer's views: offsets computed here in int64 (layer * layer stride overflows int32 in big models)
    _launch(recurrent_states[layer], intermediate_states[layer], slot_ids, None, None, q, k, v, g, beta, out,
            rows_per_request, decode=True)
    return out


def gdn_varlen_scan(
    states: torch.Tensor,  # [n, H, K, V] fp32 (or, with slot_ids, a slot pool [M, H, K, V] float)
    q: torch.Tensor,  # [T, Hk, K] fp32, l2-normalised and scaled by K ** -0.5
    k: torch.Tensor,  # [T, Hk, K] fp32, l2-normalised
    v: torch.Tensor,  # [T, H, V] fp32
    g: torch.Tensor,  # [T, H] fp32, log decay (<= 0)
    beta: torch.Tensor,  # [T, H] fp32
    row_start: torch.Tensor,  # [n] int64 on the device, segments in row order and disjoint
    row_count: torch.Tensor,  # [n] int64 on the device
    chunk_size: int = 64,
    *,
    slot_ids: Optional[torch.Tensor] = None,  # [n] int64: states is a slot pool, updated in place
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:  # o [T, H, V] (0 in no segment), final [n, H, K, V] or None
    """Every prefill segment through the rule from its state (module docstring). Without
    ``slot_ids`` the final states are returned and ``states`` is left alone; with them the
    pool's slots are read and updated in place (None returned). ``chunk_size`` only shapes the
    twin's work. No host sync."""
    args = (states, q, k, v, g, beta, row_start, row_count, chunk_size)
    _SCAN_VALIDATED.validate(_check_scan_args, *args, slot_ids)
    if not use_triton(q):
        return reference.gdn_varlen_scan(*args, slot_ids=slot_ids)
    num_rows, heads, value_dim = v.shape
    out = torch.zeros(num_rows, heads, value_dim, dtype=torch.float32, device=q.device)  # [T, H, V] fp32
    if slot_ids is not None:
        _launch(states, None, slot_ids.contiguous(), row_start.contiguous(), row_count.contiguous(), q, k, v, g,
                beta, out, 1, decode=False)
        return out, None
    final = states.clone()  # [n, H, K, V] fp32: each segment's program updates its own row
    segments = torch.arange(states.shape[0], device=states.device)
    _launch(final, None, segments, row_start.contiguous(), row_count.contiguous(), q, k, v, g, beta, out, 1,
            decode=False)
    return out, final
