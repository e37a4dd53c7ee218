"""Torch twins of :mod:`mtp_ctrl.triton_ops.gdn_recurrent`: the gated delta rule (Gated DeltaNet)
over the packed rows of a step, from each request's state slot.

Letters: T packed rows, n segments (prefill), nd decode requests, R = 1 + S rows each, L layers,
M slots, H value heads, Hk key heads (H a multiple of Hk; value head h reads key head
``h // (H / Hk)``), K key dim, V value dim; everything fp32. A request's state is ``[H, K, V]``.

One row ``t`` of one head, from state ``S`` (``q`` l2-normalised and scaled by ``K ** -0.5``,
``k`` l2-normalised, ``g <= 0`` the log decay, ``0 < beta < 1``)::

    S = exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S = S + k_t u^T;  o_t = S^T q_t

- :func:`gdn_decode_rows` steps the R rows of each decode request one after another and writes
  the state after every row to the slot's intermediate buffer (the controller commits one);
- :func:`gdn_verify_rows` first applies the slot's pending rows (the rows its last verify step
  kept: each ``exp(g) S + k u^T`` with its stored delta ``u``), writes that state back, then steps
  the rows and stores each row's ``(k, u, g)`` in the other buffer instead of its state (R = 1:
  writes the state after the row back); :func:`gdn_mark_pending_rows` is the commit, recording the
  kept rows (:mod:`mtp_ctrl.triton_ops.gdn_replay`);
- :func:`gdn_varlen_scan` runs each prefill segment in chunks of Q rows (the chunked form: one
  unit-triangular solve per chunk, states passed from chunk to chunk) from the slot's state and
  writes the state after the segment's last row back. Fixed shapes, no host sync: every segment
  is laid out as ``ceil(T / Q)`` chunks, rows past its count are zero (``g = beta = 0``: they
  change nothing).
"""

from typing import Optional, Tuple

import torch

from mtp_ctrl.triton_ops.reference.mamba_decode import _first_rows


def _per_value_head(keys: torch.Tensor, heads: int) -> torch.Tensor:
    """``[..., Hk, K]`` -> ``[..., H, K]``: value head h reads key head h // (H / Hk)."""
    ratio = heads // keys.shape[-2]
    return keys if ratio == 1 else keys.repeat_interleave(ratio, dim=-2)


def _apply_delta(state: torch.Tensor, k: torch.Tensor, delta: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``[n, H, K, V]`` state after a row of known delta ``u`` (``delta`` ``[n, H, V]``): ``exp(g) S + k u^T``
    (k ``[n, H, K]``, g ``[n, H]``). A stepped row ends with this one function too, so a stored u
    applied later gives the verify row's state."""
    return state * torch.exp(g)[:, :, None, None] + k[:, :, :, None] * delta[:, :, None, :]


def _delta_rule_row(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(``[n, H, K, V]`` state after one row, its delta ``u = beta (v - (exp(g) S)^T k)`` ``[n, H, V]``)
    (k ``[n, H, K]``, v ``[n, H, V]``, g and beta ``[n, H]``)."""
    remembered = torch.einsum("nhk,nhkv->nhv", k, state * torch.exp(g)[:, :, None, None])  # (exp(g) S)^T k
    delta = beta[:, :, None] * (v - remembered)  # [n, H, V]
    return _apply_delta(state, k, delta, g), delta


def _delta_rule_step(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor) -> torch.Tensor:
    """``[n, H, K, V]`` state after one row; every recurrent twin steps through :func:`_delta_rule_row`,
    so a replayed row gives the verify row's state."""
    return _delta_rule_row(state, k, v, g, beta)[0]


def gdn_decode_rows(
    recurrent_states: torch.Tensor,  # [L, M, H, K, V] float, current states (read only)
    intermediate_states: torch.Tensor,  # [L, M, R, H, K, V] float, written at [layer, slot_ids, :]
    layer: int,
    slot_ids: torch.Tensor,  # [nd] int64, each decode request's slot
    q: torch.Tensor,  # [T, Hk, K] fp32, l2-normalised and scaled; request r owns rows r R .. r R + R - 1
    k: torch.Tensor,  # [T, Hk, K] fp32, l2-normalised
    v: torch.Tensor,  # [T, H, V] fp32
    g: torch.Tensor,  # [T, H] fp32, log decay (<= 0)
    beta: torch.Tensor,  # [T, H] fp32
) -> torch.Tensor:  # o [nd * R, H, V] fp32
    """Twin of :func:`mtp_ctrl.triton_ops.gdn_decode_rows` (a loop over the R rows of every request
    at once, not over requests)."""
    num_requests, stride = slot_ids.shape[0], intermediate_states.shape[2]
    heads = recurrent_states.shape[2]
    count = num_requests * stride

    def rows(values):  # [T, ...] -> [nd, R, ...], zero rows past T
        return _first_rows(values, count).view(num_requests, stride, *values.shape[1:])

    q, k = rows(_per_value_head(q, heads)), rows(_per_value_head(k, heads))  # [nd, R, H, K]
    v, g, beta = rows(v), rows(g), rows(beta)
    state = recurrent_states[layer, slot_ids].float()  # [nd, H, K, V]
    outputs = []
    for row in range(stride):
        state = _delta_rule_step(state, k[:, row], v[:, row], g[:, row], beta[:, row])
        outputs.append(torch.einsum("nhk,nhkv->nhv", q[:, row], state))
        intermediate_states[layer, slot_ids, row] = state.to(intermediate_states.dtype)
    return torch.stack(outputs, dim=1).view(count, heads, v.shape[-1])


def gdn_varlen_scan(
    states: torch.Tensor,  # [n, H, K, V] fp32, each segment's state before its first row
    q: torch.Tensor,  # [T, Hk, K] fp32, l2-normalised and scaled
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
    """Every segment of the packed rows through the gated delta rule, in chunks of ``Q = chunk_size``.

    Chunk ``c`` of a segment, rows ``t = 1 .. Q`` with ``G_t`` the cumulative log decay inside the
    chunk and ``S0`` the state entering it: the deltas ``u`` solve the unit lower-triangular system
    ``u_t + beta_t sum_{s<t} exp(G_t - G_s) (k_t . k_s) u_s = beta_t (v_t - exp(G_t) S0^T k_t)``;
    then ``o_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) u_s`` and the state
    leaving it is ``exp(G_Q) S0 + sum_s exp(G_Q - G_s) k_s u_s^T``. A segment of 0 rows keeps its
    state.
    """
    if slot_ids is not None:  # the pool's slots in, the final states back into them (0-row segments unchanged)
        pool, states = states, states[slot_ids]  # [n, H, K, V]
        o, final = gdn_varlen_scan(states, q, k, v, g, beta, row_start, row_count, chunk_size)
        pool[slot_ids] = torch.where((row_count > 0)[:, None, None, None], final, states).to(pool.dtype)
        return o, None
    num_rows, heads, value_dim = v.shape
    num_segments, device = states.shape[0], v.device
    if num_rows == 0 or num_segments == 0:
        return torch.zeros_like(v), states.float().clone()
    Q = chunk_size
    num_chunks = -(-num_rows // Q)  # a segment has at most T rows
    local = torch.arange(num_chunks * Q, device=device)  # [C Q] offset in the segment
    used = local[None, :] < row_count[:, None]  # [n, C Q] bool
    source = torch.where(used, row_start[:, None] + local[None, :], num_rows)  # row T: zeros

    def chunked(values):  # [T, H, ...] -> [n, H, C, Q, ...], zero on unused rows
        padded = torch.cat((values, values.new_zeros(1, *values.shape[1:])))[source]  # [n, C Q, H, ...]
        padded = padded.view(num_segments, num_chunks, Q, *values.shape[1:]).movedim(3, 1)
        return padded

    q_c = chunked(_per_value_head(q, heads))  # [n, H, C, Q, K]
    k_c = chunked(_per_value_head(k, heads))
    v_c, g_c, beta_c = chunked(v), chunked(g), chunked(beta)  # [n, H, C, Q, V], [n, H, C, Q] x2
    log_decay = torch.cumsum(g_c, dim=-1)  # [n, H, C, Q], G_t
    gaps = log_decay[..., :, None] - log_decay[..., None, :]  # [n, H, C, t, s]
    causal = torch.ones(Q, Q, dtype=torch.bool, device=device).tril()
    decay = torch.exp(gaps.masked_fill(~causal, float("-inf")))  # exp(G_t - G_s), s <= t
    strictly = torch.eye(Q, dtype=torch.bool, device=device)
    key_mix = (beta_c[..., None] * decay * (k_c @ k_c.transpose(-1, -2))).masked_fill(strictly, 0.0)
    system = key_mix + torch.eye(Q, device=device)  # [n, H, C, Q, Q] unit lower triangular
    attend = decay * (q_c @ k_c.transpose(-1, -2))  # [n, H, C, t, s]
    to_end = torch.exp(log_decay[..., -1:] - log_decay)  # [n, H, C, Q]
    state = states.float()  # [n, H, K, V]
    outputs = []
    for chunk in range(num_chunks):  # the states pass from chunk to chunk: a loop over chunks, not requests
        grown = torch.exp(log_decay[:, :, chunk])[..., None]  # [n, H, Q, 1]
        rhs = beta_c[:, :, chunk, :, None] * (v_c[:, :, chunk] - grown * (k_c[:, :, chunk] @ state))
        deltas = torch.linalg.solve_triangular(system[:, :, chunk], rhs, upper=False, unitriangular=True)
        outputs.append(grown * (q_c[:, :, chunk] @ state) + attend[:, :, chunk] @ deltas)  # [n, H, Q, V]
        state = (torch.exp(log_decay[:, :, chunk, -1])[..., None, None] * state
                 + (k_c[:, :, chunk] * to_end[:, :, chunk, :, None]).transpose(-1, -2) @ deltas)
    o_c = torch.stack(outputs, dim=2).movedim(1, 3).reshape(num_segments * num_chunks * Q, heads, value_dim)
    # scatter back to the packed rows: row start + i of segment g is o_c[g, i]
    flat = torch.arange(num_segments, device=device)[:, None] * (num_chunks * Q) + local[None, :]  # [n, C Q]
    target = torch.where(used, source, num_rows)
    o = v.new_zeros(num_rows + 1, heads, value_dim)
    o[target.reshape(-1)] = o_c[flat.reshape(-1)]
    final = torch.where((row_count > 0)[:, None, None, None], state, states.float())
    return o[:num_rows], final


def _row_input_sections(key_heads: int, key_dim: int, heads: int, value_dim: int):
    """The sizes of ``[k | u | g]`` in one stored row (``gdn_row_input_width`` sums them)."""
    return [key_heads * key_dim, heads * value_dim, heads]


def _stored_rows(row_inputs: torch.Tensor, layer: int, slots: torch.Tensor, parity: torch.Tensor, key_heads: int,
                 heads: int, key_dim: int, value_dim: int):
    """The stored ``(k [n, P, H, K], u [n, P, H, V], g [n, P, H])`` of each slot's buffer ``parity``
    (``[n]``) at ``layer``."""
    count, stored = slots.shape[0], row_inputs.shape[3]
    sections = _row_input_sections(key_heads, key_dim, heads, value_dim)
    k, u, g = torch.split(row_inputs[layer, slots, parity], sections, dim=2)  # [n, P, ...]
    k = _per_value_head(k.reshape(count, stored, key_heads, key_dim), heads)
    return k, u.reshape(count, stored, heads, value_dim), g


def gdn_verify_rows(
    recurrent_states: torch.Tensor,  # [L, M, H, K, V] fp32: the pending rows applied, and R = 1's row
    row_inputs: torch.Tensor,  # [L, M, 2, P, F] fp32: pending rows at the slot's parity; R > 1 stores at 1 - parity
    pending_rows: torch.Tensor,  # [M] int32: stored rows each slot has not yet applied (0 .. P)
    input_parity: torch.Tensor,  # [M] int32: the buffer (0 or 1) holding them
    layer: int,
    slot_ids: torch.Tensor,  # [nd] int64
    q: torch.Tensor,  # [T, Hk, K] fp32
    k: torch.Tensor,  # [T, Hk, K] fp32
    v: torch.Tensor,  # [T, H, V] fp32
    g: torch.Tensor,  # [T, H] fp32
    beta: torch.Tensor,  # [T, H] fp32
    rows_per_request: int,  # R = 1 + V <= P
    tiles=None,
) -> torch.Tensor:  # o [nd * R, H, V] fp32
    """Twin of :func:`mtp_ctrl.triton_ops.gdn_verify_rows` (``tiles``, a launch shape, is ignored)."""
    num_requests, stride = slot_ids.shape[0], rows_per_request
    _, _, heads, key_dim, value_dim = recurrent_states.shape
    key_heads = q.shape[1]
    count = num_requests * stride

    def rows(values):  # [T, ...] -> [nd, R, ...], zero rows past T
        return _first_rows(values, count).view(num_requests, stride, *values.shape[1:])

    q_rows, k_rows = rows(q), rows(k)  # [nd, R, Hk, K]
    v_rows, g_rows, beta_rows = rows(v), rows(g), rows(beta)
    q_heads, k_heads = _per_value_head(q_rows, heads), _per_value_head(k_rows, heads)  # [nd, R, H, K]
    parity, pending = input_parity[slot_ids].long(), pending_rows[slot_ids]  # [nd] each
    state = recurrent_states[layer, slot_ids].float()  # [nd, H, K, V]
    # the deferred commit: the rows the slot kept at its last verify step (none past its pending count)
    stored_k, stored_u, stored_g = _stored_rows(row_inputs, layer, slot_ids, parity, key_heads, heads, key_dim,
                                                value_dim)
    for row in range(row_inputs.shape[3]):  # each a stored delta: no reduction
        applied = _apply_delta(state, stored_k[:, row], stored_u[:, row], stored_g[:, row])
        state = torch.where((pending > row)[:, None, None, None], applied, state)
    outputs, deltas = [], []
    committed = state
    for row in range(stride):
        state, delta = _delta_rule_row(state, k_heads[:, row], v_rows[:, row], g_rows[:, row], beta_rows[:, row])
        outputs.append(torch.einsum("nhk,nhkv->nhv", q_heads[:, row], state))
        deltas.append(delta)  # [nd, H, V]
    if stride == 1:
        recurrent_states[layer, slot_ids] = state.to(recurrent_states.dtype)
    else:  # the committed state back; [nd, R, F]: [k | u | g] into the other buffer
        recurrent_states[layer, slot_ids] = committed.to(recurrent_states.dtype)
        row_inputs[layer, slot_ids, 1 - parity, :stride] = torch.cat(
            (k_rows.flatten(2), torch.stack(deltas, dim=1).flatten(2), g_rows), dim=2)
    return torch.stack(outputs, dim=1).view(count, heads, v.shape[-1])


def gdn_mark_pending_rows(
    pending_rows: torch.Tensor,  # [M] int32, set at slot_ids (the scratch slot excepted)
    input_parity: torch.Tensor,  # [M] int32, flipped where rows were stored
    prefill_status: torch.Tensor,  # [N] int, 0 = decode
    slot_ids: torch.Tensor,  # [N] int
    accepted_counts: torch.Tensor,  # [N] int, 0 .. R - 1
    rows_per_request: int,  # R of the step's verify rows
    scratch_slot: int,
) -> None:
    """Twin of :func:`mtp_ctrl.triton_ops.gdn_mark_pending_rows`."""
    slots = slot_ids.long()
    real = slots != scratch_slot  # padding requests share the scratch slot: left alone
    decoding = real & (prefill_status == 0)
    if rows_per_request > 1:  # the kept rows wait in the buffer the step wrote
        pending = torch.where(decoding, accepted_counts + 1, 0).to(pending_rows.dtype)
        input_parity[slots[decoding]] = 1 - input_parity[slots[decoding]]
    else:  # R = 1 wrote its state in place
        pending = torch.zeros_like(slots, dtype=pending_rows.dtype)
    pending_rows[slots[real]] = pending[real]
    return None


def check_no_pending_rows(pending_rows: torch.Tensor, slot_ids: torch.Tensor, row_count: torch.Tensor) -> None:
    """A prefill segment (``row_count > 0``) starts from a committed state: its slot is new (or
    recomputed after preemption), so no verify rows wait for it (host check, for the twins' path)."""
    waiting = (row_count > 0) & (pending_rows[slot_ids] > 0)
    if bool(waiting.any()):
        raise AssertionError(f"prefill segments {waiting.nonzero().flatten().tolist()} have pending verify rows")
