"""Verify rows of Gated DeltaNet layers without one state per row, and their commit deferred into
the slot's next step: store each row's small inputs; the next step applies the kept ones.

Letters as in :mod:`mtp_ctrl.triton_ops.gdn_recurrent` (nd decode requests of R = 1 + V rows, L
layers, M slots, H value heads, Hk key heads, K key dim, V value dim; the rule's state ``[H, K, V]``
fp32 per slot and layer; P = 1 + S stored rows a buffer). A request's state is ``H K V`` floats, its
row's ``F = Hk K + H V + H`` floats (:func:`gdn_row_input_width`), so writing one state per
verify row (:func:`gdn_decode_rows`) costs R state writes and a commit copy, and this costs none:

- :func:`gdn_verify_rows` reads the slot's state once and first applies the slot's
  ``pending_rows[slot]`` stored rows (``row_inputs[layer, slot, input_parity[slot]]``: the rows its
  last verify step kept), then keeps the state in registers through its own R rows (their
  outputs need the state after every row). With R > 1 it writes the committed state (the state
  before its rows) back and stores row ``j`` in the OTHER buffer, ``row_inputs[layer, slot, 1 -
  parity, j]``, as ``[k (Hk K) | u (H V) | g (H)]``, ``u = beta (v - (exp(g) S)^T k)`` the row's
  delta (computed to step the row anyway; each program stores its own value columns of it): the
  programs of one launch that share a key head's ``k`` may still be applying the old rows. With
  R = 1 (plain decoding, nothing to roll back) it writes the state after the row instead and
  stores nothing. One read and one write of the state per step, whatever R.
- :func:`gdn_mark_pending_rows` (the commit, after acceptance) touches no state: each decode
  request's slot records ``accepted_counts[r] + 1`` pending rows and flips its parity to the buffer
  just written (R = 1 and prefill requests: 0 pending; the scratch slot keeps 0). Zero accepted
  drafts leave the base row pending: the state one plain decode row leaves, once applied.

A pending row is applied as ``S = exp(g) S + k u^T``: elementwise, no reduction over K (a row
stepped costs two: ``S^T k`` for u, ``S^T q`` for its output). Every GDN kernel steps the rule with
:func:`mtp_ctrl.triton_ops.gdn_recurrent._delta_rule_step` under one launch shape and ends each row
with :func:`mtp_ctrl.triton_ops.gdn_recurrent._apply_delta` (an explicit fused multiply-add), as
the pending rows do, so the next step reloads the committed state the verify step computed u from
and applying u gives the state the verify row saw and a plain R = 1 row computes, bit for bit (the
order of the sums over K follows the shape: two shapes agree to fp32 rounding only). Rows past the
pending count are skipped (they would be exact no-ops: g = 0, k = u = 0).

Launch: one program per (value tile, head, request) holds a ``[K, BLOCK_V]`` state tile in
registers. It loads every row's inputs and the pending rows' first and the state after them, so
all its loads are in flight together and none waits behind a store or behind the serial rows
(:class:`mtp_ctrl.triton_ops.gdn_tiles.GDNRowSchedule` may load rows later or cap registers per R:
only when loads issue changes, never the arithmetic, so every schedule gives the same bits).
``BLOCK_V``, the warps and the schedule come from :mod:`mtp_ctrl.triton_ops.gdn_tiles`, or the
``tiles`` argument.

Worked example (S = 2, F for Hk = 1, K = 2, H = 2, V = 2 is 2 + 4 + 2 = 8): slot 5 holds 2
pending rows in buffer 1. A step verifying rows x, y, z loads ``state[l, 5]``, applies
``row_inputs[l, 5, 1, 0..1]``, writes the result to ``state[l, 5]``, steps x, y, z for their
outputs and stores each as ``(k, u, g)`` in ``row_inputs[l, 5, 0, 0..2]``; ``accepted_counts = 0`` then sets
``pending_rows[5] = 1``, ``input_parity[5] = 0``: the next step applies x only.

Twins: :mod:`mtp_ctrl.triton_ops.reference.gdn`.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import INDEX_DTYPES, ValidatedSignatures, check_int, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops.gdn_recurrent import _apply_delta, _check_rows, _delta_rule_step
from mtp_ctrl.triton_ops.gdn_tiles import GDNTiles, gdn_row_schedule, gdn_verify_tiles

_VERIFY_VALIDATED = ValidatedSignatures()
_MARK_VALIDATED = ValidatedSignatures()
_MAX_GRID_YZ = 65535  # CUDA's limit on the second and third grid dimensions (heads or layers x heads; requests)


def gdn_row_input_width(key_heads: int, key_dim: int, heads: int, value_dim: int) -> int:
    """F, the floats one verify row stores: ``[k (Hk K) | u (H V) | g (H)]`` (u: the row's delta)."""
    return key_heads * key_dim + heads * value_dim + heads


@triton.jit
def _load_q(Q_PTR, row, num_rows, key_head, keys, is_key, q_stride_t, q_stride_h):
    """Row ``row``'s q ``[BLOCK_K]`` (zeros at or past ``num_rows``), as :func:`_load_row` loads it."""
    key_row = keys * 0 + row < num_rows  # [BLOCK_K] bool, one value
    return tl.load(Q_PTR + row * q_stride_t + key_head * q_stride_h + keys, mask=is_key & key_row, other=0.0)


@triton.jit
def _load_update_inputs(K_PTR, V_PTR, G_PTR, BETA_PTR, row, num_rows, head, key_head, keys, is_key, values, is_value,
                        k_stride_t, k_stride_h, v_stride_t, v_stride_h, g_stride_t, g_stride_h, beta_stride_t,
                        beta_stride_h):
    """Row ``row``'s k ``[BLOCK_K]``, v, g, beta ``[BLOCK_V]`` (zeros at or past ``num_rows``), as
    :func:`mtp_ctrl.triton_ops.gdn_recurrent._load_row` loads them (same masks, same order)."""
    key_row = keys * 0 + row < num_rows  # [BLOCK_K] bool, one value
    value_row = values * 0 + row < num_rows  # [BLOCK_V] bool
    k = tl.load(K_PTR + row * k_stride_t + key_head * k_stride_h + keys, mask=is_key & key_row, other=0.0)
    v = tl.load(V_PTR + row * v_stride_t + head * v_stride_h + values, mask=is_value & value_row, other=0.0)
    g = tl.load(G_PTR + row * g_stride_t + head * g_stride_h + values * 0, mask=value_row, other=0.0)
    beta = tl.load(BETA_PTR + row * beta_stride_t + head * beta_stride_h + values * 0, mask=value_row, other=0.0)
    return k, v, g, beta


@triton.jit
def _load_pending_row(INPUTS_PTR, slot, parity, j, pending, inputs_s_slot, inputs_s_parity, inputs_s_row, key_head,
                      key_dim, keys, is_key, values, is_value, u_offset, g_offset):
    """Stored row ``j``'s (k ``[BLOCK_K]``, u, g ``[BLOCK_V]``) of the slot's pending buffer; zeros past
    the pending count."""
    kept_k = keys * 0 + j < pending  # [BLOCK_K] bool, one value
    kept_v = values * 0 + j < pending  # [BLOCK_V] bool
    row_ptr = INPUTS_PTR + slot * inputs_s_slot + parity * inputs_s_parity + j * inputs_s_row
    k = tl.load(row_ptr + key_head * key_dim + keys, mask=is_key & kept_k, other=0.0)
    u = tl.load(row_ptr + u_offset + values, mask=is_value & kept_v, other=0.0)
    g = tl.load(row_ptr + g_offset + values * 0, mask=kept_v, other=0.0)
    return k, u, g


@triton.jit
def _append_pending_row(pks, pus, pgs, INPUTS_PTR, slot, parity, j, pending, inputs_s_slot, inputs_s_parity,
                        inputs_s_row, key_head, key_dim, keys, is_key, values, is_value, u_offset, g_offset):
    """The tuples of the pending rows' (k, u, g) with stored row ``j``'s appended."""
    k, u, g = _load_pending_row(INPUTS_PTR, slot, parity, j, pending, inputs_s_slot, inputs_s_parity, inputs_s_row,
                                key_head, key_dim, keys, is_key, values, is_value, u_offset, g_offset)
    return pks + (k,), pus + (u,), pgs + (g,)


@triton.jit
def _append_own_row(qs, ks, vs, gs, betas, Q_PTR, K_PTR, V_PTR, G_PTR, BETA_PTR, row, num_rows, head, key_head, keys,
                    is_key, values, is_value, q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                    g_stride_t, g_stride_h, beta_stride_t, beta_stride_h, WITH_Q: tl.constexpr):
    """The tuples of the own rows' (q, k, v, g, beta) with row ``row``'s appended (q only ``WITH_Q``)."""
    if WITH_Q:
        qs = qs + (_load_q(Q_PTR, row, num_rows, key_head, keys, is_key, q_stride_t, q_stride_h),)
    k, v, g, beta = _load_update_inputs(K_PTR, V_PTR, G_PTR, BETA_PTR, row, num_rows, head, key_head, keys, is_key,
                                        values, is_value, k_stride_t, k_stride_h, v_stride_t, v_stride_h, g_stride_t,
                                        g_stride_h, beta_stride_t, beta_stride_h)
    return qs, ks + (k,), vs + (v,), gs + (g,), betas + (beta,)


@triton.jit
def _store_row(INPUTS_PTR, slot, parity, j, inputs_s_slot, inputs_s_parity, inputs_s_row, key_head, key_dim, keys,
               values, is_value, lanes, u_offset, g_offset, stores_k, stores_gate, k, u, g):
    """Own row ``j``'s (k, u, g) into the slot's other buffer (``1 - parity``): k by one program a key
    head, u by each program for its value columns, g by one lane of one program a head."""
    row_ptr = INPUTS_PTR + slot * inputs_s_slot + (1 - parity) * inputs_s_parity + j * inputs_s_row
    tl.store(row_ptr + u_offset + values, u, mask=is_value)
    tl.store(row_ptr + key_head * key_dim + keys, k, mask=stores_k)
    tl.store(row_ptr + g_offset + lanes * 0, g, mask=stores_gate)


# num_rows only bounds masks: not specialised, so one compiled kernel serves every batch size
@triton.jit(do_not_specialize=["num_rows"])
def _gdn_verify_rows_kernel(
    STATES_PTR, INPUTS_PTR, PENDING_PTR, PARITY_PTR, SLOTS_PTR, Q_PTR, K_PTR, V_PTR, G_PTR, BETA_PTR, OUT_PTR,
    num_rows, key_dim, value_dim, heads, key_heads,
    states_s_slot, states_s_head, states_s_k, states_s_v, inputs_s_slot, inputs_s_parity, inputs_s_row,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, g_stride_t, g_stride_h,
    beta_stride_t, beta_stride_h, out_stride_t, out_stride_h,
    ROWS: tl.constexpr, STORED_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    OWN_EARLY: tl.constexpr, PENDING_EARLY: tl.constexpr, AHEAD: tl.constexpr, Q_AT_ROW: tl.constexpr,
):
    """Grid ``(value tiles, H, nd)``: program (t, h, r) applies request r's pending rows and walks its
    R rows for head h, value dims of tile t (module docstring). The tiles of one head are neighbours
    in launch order. When inputs load (:class:`mtp_ctrl.triton_ops.gdn_tiles.GDNLoadOrder`): own rows
    ``< OWN_EARLY`` and pending rows ``< PENDING_EARLY`` before the state; every other row ``AHEAD``
    rows before its step in the sequence pending rows, then own rows (0: just before it); with
    ``Q_AT_ROW`` an own row's q just before its step. Only the loads move: the arithmetic is one."""
    tile = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    request = tl.program_id(2).to(tl.int64)
    heads_per_key_head = heads // key_heads
    key_head = head // heads_per_key_head
    keys = tl.arange(0, BLOCK_K).to(tl.int64)
    is_key = keys < key_dim
    lanes = tl.arange(0, BLOCK_V)
    values = (tile * BLOCK_V + lanes).to(tl.int64)
    is_value = values < value_dim
    tile_mask = is_key[:, None] & is_value[None, :]
    first_row = request * ROWS
    # the early rows' inputs first, then the early pending rows' and the state: all these loads in
    # flight together, none behind a store or behind the serial rows
    qs, ks, vs, gs, betas = (), (), (), (), ()
    for j in tl.static_range(ROWS):
        if j < OWN_EARLY:
            qs, ks, vs, gs, betas = _append_own_row(
                qs, ks, vs, gs, betas, Q_PTR, K_PTR, V_PTR, G_PTR, BETA_PTR, first_row + j, num_rows, head, key_head,
                keys, is_key, values, is_value, q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t,
                v_stride_h, g_stride_t, g_stride_h, beta_stride_t, beta_stride_h, not Q_AT_ROW)
    slot = tl.load(SLOTS_PTR + request).to(tl.int64)
    pending = tl.load(PENDING_PTR + slot)
    parity = tl.load(PARITY_PTR + slot).to(tl.int64)
    u_offset = key_heads * key_dim + head * value_dim
    g_offset = key_heads * key_dim + heads * value_dim + head
    # the deferred commit: rows 0 .. pending - 1 of the buffer the last verify step wrote (the rest: zeros)
    pks, pus, pgs = (), (), ()
    for j in tl.static_range(STORED_ROWS):
        if j < PENDING_EARLY:
            pks, pus, pgs = _append_pending_row(
                pks, pus, pgs, INPUTS_PTR, slot, parity, j, pending, inputs_s_slot, inputs_s_parity, inputs_s_row,
                key_head, key_dim, keys, is_key, values, is_value, u_offset, g_offset)
    state_ptrs = STATES_PTR + slot * states_s_slot + head * states_s_head + keys[:, None] * states_s_k \
        + values[None, :] * states_s_v
    state = tl.load(state_ptrs, mask=tile_mask, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    # late rows: row c of the sequence (pending rows 0 .. P - 1, then own rows P .. P + R - 1) loads
    # at step c - AHEAD of it (here: those before step 0), so before any store that follows it
    for c in tl.static_range(STORED_ROWS + ROWS):
        if c < AHEAD:
            if c < STORED_ROWS:
                if c >= PENDING_EARLY:
                    pks, pus, pgs = _append_pending_row(
                        pks, pus, pgs, INPUTS_PTR, slot, parity, c, pending, inputs_s_slot, inputs_s_parity,
                        inputs_s_row, key_head, key_dim, keys, is_key, values, is_value, u_offset, g_offset)
            elif c - STORED_ROWS >= OWN_EARLY:
                qs, ks, vs, gs, betas = _append_own_row(
                    qs, ks, vs, gs, betas, Q_PTR, K_PTR, V_PTR, G_PTR, BETA_PTR, first_row + c - STORED_ROWS,
                    num_rows, head, key_head, keys, is_key, values, is_value, q_stride_t, q_stride_h, k_stride_t,
                    k_stride_h, v_stride_t, v_stride_h, g_stride_t, g_stride_h, beta_stride_t, beta_stride_h,
                    not Q_AT_ROW)
    for j in tl.static_range(STORED_ROWS):  # row j + AHEAD of the sequence loads here (no local: a constexpr)
        if j + AHEAD < STORED_ROWS:
            if j + AHEAD >= PENDING_EARLY:
                pks, pus, pgs = _append_pending_row(
                    pks, pus, pgs, INPUTS_PTR, slot, parity, j + AHEAD, pending, inputs_s_slot, inputs_s_parity,
                    inputs_s_row, key_head, key_dim, keys, is_key, values, is_value, u_offset, g_offset)
        elif j + AHEAD - STORED_ROWS < ROWS:
            if j + AHEAD - STORED_ROWS >= OWN_EARLY:
                qs, ks, vs, gs, betas = _append_own_row(
                    qs, ks, vs, gs, betas, Q_PTR, K_PTR, V_PTR, G_PTR, BETA_PTR, first_row + j + AHEAD - STORED_ROWS,
                    num_rows, head, key_head, keys, is_key, values, is_value, q_stride_t, q_stride_h, k_stride_t,
                    k_stride_h, v_stride_t, v_stride_h, g_stride_t, g_stride_h, beta_stride_t, beta_stride_h,
                    not Q_AT_ROW)
        if j < pending:  # a stored row is its delta: applied with no reduction; rows past the count skipped
            state = _apply_delta(state, pks[j], pus[j], pgs[j])
    # the program that stores a head's shared inputs: k once per key head, g once per head
    stores_k = is_key & (keys * 0 + tile == 0) & (keys * 0 + head % heads_per_key_head == 0)  # [BLOCK_K]
    stores_gate = (lanes == 0) & (lanes * 0 + tile == 0)  # [BLOCK_V]
    if ROWS > 1:  # the committed state back
        tl.store(state_ptrs, state, mask=tile_mask & (values[None, :] * 0 + pending > 0))
    for j in tl.static_range(ROWS):  # own row j + AHEAD loads here
        if j + AHEAD < ROWS:
            if j + AHEAD >= OWN_EARLY:
                qs, ks, vs, gs, betas = _append_own_row(
                    qs, ks, vs, gs, betas, Q_PTR, K_PTR, V_PTR, G_PTR, BETA_PTR, first_row + j + AHEAD, num_rows,
                    head, key_head, keys, is_key, values, is_value, q_stride_t, q_stride_h, k_stride_t, k_stride_h,
                    v_stride_t, v_stride_h, g_stride_t, g_stride_h, beta_stride_t, beta_stride_h, not Q_AT_ROW)
        if Q_AT_ROW:
            q = _load_q(Q_PTR, first_row + j, num_rows, key_head, keys, is_key, q_stride_t, q_stride_h)
        else:
            q = qs[j]
        state, delta = _delta_rule_step(state, ks[j], vs[j], gs[j], betas[j])
        tl.store(OUT_PTR + (first_row + j) * out_stride_t + head * out_stride_h + values,
                 tl.sum(state * q[:, None], axis=0), mask=is_value)
        if ROWS > 1:  # the row as its (k, u, g) into the other buffer: the next step applies u, no reduction
            _store_row(INPUTS_PTR, slot, parity, j, inputs_s_slot, inputs_s_parity, inputs_s_row, key_head, key_dim,
                       keys, values, is_value, lanes, u_offset, g_offset, stores_k, stores_gate, ks[j], delta, gs[j])
    if ROWS == 1:  # plain decoding: the row is always kept
        tl.store(state_ptrs, state, mask=tile_mask)


@triton.jit
def _gdn_mark_pending_rows_kernel(PENDING_PTR, PARITY_PTR, PREFILL_STATUS_PTR, prefill_stride, SLOTS_PTR,
                                  slots_stride, ACCEPTED_PTR, accepted_stride, num_requests, scratch_slot,
                                  ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """One program: every request's slot gets its pending count (and, R > 1, its flipped parity)."""
    requests = tl.arange(0, BLOCK)
    for first in range(0, num_requests, BLOCK):
        index = first + requests
        inside = index < num_requests
        slot = tl.load(SLOTS_PTR + index * slots_stride, mask=inside, other=0).to(tl.int64)
        real = inside & (slot != scratch_slot)
        decoding = real & (tl.load(PREFILL_STATUS_PTR + index * prefill_stride, mask=inside, other=1) == 0)
        if ROWS > 1:
            accepted = tl.load(ACCEPTED_PTR + index * accepted_stride, mask=inside, other=0)
            tl.store(PENDING_PTR + slot, tl.where(decoding, accepted + 1, 0).to(tl.int32), mask=real)
            parity = tl.load(PARITY_PTR + slot, mask=decoding, other=0)
            tl.store(PARITY_PTR + slot, 1 - parity, mask=decoding)
        else:
            tl.store(PENDING_PTR + slot, tl.zeros_like(slot).to(tl.int32), mask=real)


def _check_layout(recurrent_states, row_inputs, pending_rows, input_parity, key_heads: int) -> None:
    check_tensor("recurrent_states", recurrent_states, dtypes=(torch.float32,), ndim=5)
    num_layers, num_slots, heads, key_dim, value_dim = recurrent_states.shape
    if key_heads < 1 or heads % key_heads:
        raise ValueError(f"{key_heads} key heads must divide the states' {heads} value heads")
    width = gdn_row_input_width(key_heads, key_dim, heads, value_dim)
    check_tensor("row_inputs", row_inputs, dtypes=(torch.float32,), shape=(num_layers, num_slots, 2, None, width))
    if row_inputs.shape[3] < 1:
        raise ValueError("row_inputs must hold >= 1 row per slot and buffer (1 + S) on dim 3")
    check_tensor("pending_rows", pending_rows, dtypes=(torch.int32,), shape=(num_slots,))
    check_tensor("input_parity", input_parity, dtypes=(torch.int32,), shape=(num_slots,))


def _check_verify_args(recurrent_states, row_inputs, pending_rows, input_parity, layer, slot_ids, q, k, v, g, beta,
                       rows_per_request) -> None:
    check_tensor("q", q, dtypes=(torch.float32,), ndim=3)
    _check_layout(recurrent_states, row_inputs, pending_rows, input_parity, q.shape[1])
    _, _, heads, key_dim, value_dim = recurrent_states.shape
    check_int("layer", layer, low=0, high=recurrent_states.shape[0] - 1)
    check_int("rows_per_request", rows_per_request, low=1, high=row_inputs.shape[3])
    check_tensor("slot_ids", slot_ids, dtypes=(torch.int64,), ndim=1)
    _check_rows(q, k, v, g, beta, heads, key_dim, value_dim)
    _check_grid(heads, slot_ids.shape[0])
    check_same_device(q=q, recurrent_states=recurrent_states, row_inputs=row_inputs, pending_rows=pending_rows,
                      input_parity=input_parity, slot_ids=slot_ids, k=k, v=v, g=g, beta=beta)


def _check_mark_args(pending_rows, input_parity, prefill_status, slot_ids, accepted_counts, rows_per_request,
                     scratch_slot) -> None:
    check_tensor("pending_rows", pending_rows, dtypes=(torch.int32,), ndim=1)
    check_tensor("input_parity", input_parity, dtypes=(torch.int32,), shape=pending_rows.shape)
    check_tensor("prefill_status", prefill_status, dtypes=INDEX_DTYPES, ndim=1)
    num_requests = prefill_status.shape[0]
    check_tensor("slot_ids", slot_ids, dtypes=INDEX_DTYPES, shape=(num_requests,))
    check_tensor("accepted_counts", accepted_counts, dtypes=INDEX_DTYPES, shape=(num_requests,))
    check_int("rows_per_request", rows_per_request, low=1)
    check_int("scratch_slot", scratch_slot, low=0, high=pending_rows.shape[0] - 1)
    check_same_device(pending_rows=pending_rows, input_parity=input_parity, prefill_status=prefill_status,
                      slot_ids=slot_ids, accepted_counts=accepted_counts)


def _check_grid(head_programs: int, num_requests: int) -> None:
    if head_programs > _MAX_GRID_YZ:
        raise ValueError(f"{head_programs} heads exceed the grid's {_MAX_GRID_YZ}")
    if num_requests > _MAX_GRID_YZ:
        raise ValueError(f"{num_requests} requests exceed the grid's {_MAX_GRID_YZ}")


def _check_tiles(tiles) -> None:
    if tiles is not None and not isinstance(tiles, GDNTiles):
        raise TypeError(f"tiles must be GDNTiles or None, got {type(tiles).__name__}")


def _launch_shape(key_dim: int, value_dim: int, tiles: GDNTiles):
    """(BLOCK_K, BLOCK_V, value tiles): the state tile a program keeps in registers."""
    block_v = min(tiles.block_v, triton.next_power_of_2(value_dim))
    return triton.next_power_of_2(key_dim), block_v, triton.cdiv(value_dim, block_v)


def gdn_verify_rows(
    recurrent_states: torch.Tensor,  # [L, M, H, K, V] fp32: gets the pending rows (and R = 1's row) in place
    row_inputs: torch.Tensor,  # [L, M, 2, P, F] fp32: pending rows at the slot's parity; R > 1 stores at 1 - parity
    pending_rows: torch.Tensor,  # [M] int32 on the device: stored rows each slot has not applied yet (0 .. P)
    input_parity: torch.Tensor,  # [M] int32 on the device: the buffer (0 or 1) that holds them
    layer: int,
    slot_ids: torch.Tensor,  # [nd] int64 on the device, each decode request's slot
    q: torch.Tensor,  # [T, Hk, K] fp32, l2-normalised and scaled by K ** -0.5
    k: torch.Tensor,  # [T, Hk, K] fp32, l2-normalised
    v: torch.Tensor,  # [T, H, V] fp32
    g: torch.Tensor,  # [T, H] fp32, log decay (<= 0)
    beta: torch.Tensor,  # [T, H] fp32
    rows_per_request: int,  # R = 1 + V (<= P)
    tiles: Optional[GDNTiles] = None,
) -> torch.Tensor:  # o [nd * R, H, V] fp32
    """The R rows of every decode request (request r owns rows ``r R .. r R + R - 1``; rows at or
    past T read as zeros) from its slot's state, after the slot's pending rows (the deferred commit
    of its last verify step): their outputs; with R > 1 the committed state goes back to the slot and
    each row's inputs to ``row_inputs[layer, slot, 1 - parity]``, with R = 1 the state after the row
    goes to the slot (module docstring). Slots should be distinct except a shared scratch slot,
    whose contents are then unspecified. ``tiles`` overrides the table's launch shape
    (:func:`mtp_ctrl.triton_ops.gdn_tiles.gdn_verify_tiles` of nd and R). No host sync."""
    args = (recurrent_states, row_inputs, pending_rows, input_parity, layer, slot_ids, q, k, v, g, beta,
            rows_per_request)
    _VERIFY_VALIDATED.validate(_check_verify_args, *args)
    _check_tiles(tiles)
    if not use_triton(q):
        return reference.gdn_verify_rows(*args, tiles=tiles)
    heads, key_dim, value_dim = recurrent_states.shape[2:]
    out = torch.empty(slot_ids.shape[0] * rows_per_request, heads, value_dim, dtype=torch.float32,
                      device=q.device)  # [nd * R, H, V] fp32
    # strides are not part of a cached signature (ValidatedSignatures): checked on every call
    if row_inputs.stride(4) != 1 or recurrent_states.stride(4) != 1:
        raise ValueError("recurrent_states and row_inputs must be contiguous in their last dim")
    for name, tensor in (("q", q), ("k", k), ("v", v), ("slot_ids", slot_ids)):
        if tensor.stride(-1) != 1 and tensor.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got stride {tensor.stride(-1)}")
    if slot_ids.shape[0] == 0:
        return out
    if tiles is None:
        tiles = gdn_verify_tiles(slot_ids.shape[0], rows_per_request)
    block_k, block_v, num_tiles = _launch_shape(key_dim, value_dim, tiles)
    schedule = tiles.schedule if tiles.schedule is not None else gdn_row_schedule(rows_per_request)
    states, inputs = recurrent_states[layer], row_inputs[layer]  # int64 layer offsets, computed here
    _gdn_verify_rows_kernel[(num_tiles, heads, slot_ids.shape[0])](
        states, inputs, pending_rows, input_parity, slot_ids, q, k, v, g, beta, out,
        q.shape[0], key_dim, value_dim, heads, q.shape[1],
        *states.stride(), *inputs.stride()[:3],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), *g.stride(), *beta.stride(),
        out.stride(0), out.stride(1),
        ROWS=rows_per_request, STORED_ROWS=row_inputs.shape[3], BLOCK_K=block_k, BLOCK_V=block_v,
        **schedule.constants(rows_per_request, row_inputs.shape[3]), num_warps=tiles.num_warps,
        **({"maxnreg": schedule.max_registers} if schedule.max_registers and q.is_cuda else {}))
    return out


def gdn_mark_pending_rows(
    pending_rows: torch.Tensor,  # [M] int32, set at slot_ids (the scratch slot excepted)
    input_parity: torch.Tensor,  # [M] int32, flipped at the decode requests' slots when R > 1
    prefill_status: torch.Tensor,  # [N] int, 0 = decode, 1 = prefill (keeps 0 pending rows)
    slot_ids: torch.Tensor,  # [N] int, each request's slot (padding: the scratch slot)
    accepted_counts: torch.Tensor,  # [N] int, accepted drafts of each request (0 .. R - 1)
    rows_per_request: int,  # R of the step's verify rows
    scratch_slot: int,
) -> None:
    """The commit after acceptance, deferred to the next verify step: each decode request's slot
    records ``accepted_counts[r] + 1`` pending rows in the buffer the step just wrote (its parity
    flips); with R = 1 (the row was written in place) and for prefill requests, 0. The scratch
    slot keeps 0 (padding requests share it). Touches no state. No host sync."""
    args = (pending_rows, input_parity, prefill_status, slot_ids, accepted_counts, rows_per_request, scratch_slot)
    _MARK_VALIDATED.validate(_check_mark_args, *args)
    if not use_triton(pending_rows):
        return reference.gdn_mark_pending_rows(*args)
    if prefill_status.shape[0] == 0:
        return None
    _gdn_mark_pending_rows_kernel[(1,)](
        pending_rows, input_parity, prefill_status, prefill_status.stride(0), slot_ids, slot_ids.stride(0),
        accepted_counts, accepted_counts.stride(0), prefill_status.shape[0], scratch_slot,
        ROWS=rows_per_request, BLOCK=128)
    return None
