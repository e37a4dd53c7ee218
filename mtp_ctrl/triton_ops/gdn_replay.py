"""Verify rows of Gated DeltaNet layers without one state per row: store each row's small inputs,
then commit by replaying the accepted rows from the committed state.

Letters as in :mod:`mtp_ctrl.triton_ops.gdn_recurrent` (nd decode requests of R = 1 + S rows, L
layers, M slots, H value heads, Hk key heads, K key dim, V value dim; the rule's state ``[H, K, V]``
fp32 per slot and layer). A request's state is ``H K V`` floats, its row's inputs only
``F = Hk K + H V + 2 H`` (:func:`gdn_row_input_width`), so writing one state per verify row
(:func:`gdn_decode_rows`) costs R state writes and a commit copy, and this costs none:

- :func:`gdn_verify_rows` reads the slot's state once, keeps it in registers through the R rows
  (their outputs need the state after every row), and stores row ``j``'s ``(k, v, g, beta)`` in
  ``row_inputs[layer, slot, j]`` as ``[k (Hk K) | v (H V) | g (H) | beta (H)]``. The state is only
  read. With R = 1 (plain decoding, nothing to roll back) it writes the state after the row to the
  slot instead and stores nothing.
- :func:`gdn_replay_accepted` (the commit, after acceptance) steps rows ``0 .. accepted_counts[r]``
  of each decode request, every layer, from the slot's state and writes the result back: one read
  and one write of the state. Rows past the accepted count are skipped, so zero accepted drafts
  leave the state one plain decode row leaves. A prefill request keeps its state.

Both step the rule with :func:`mtp_ctrl.triton_ops.gdn_recurrent._delta_rule_update`, the one
function every GDN kernel uses, so a replayed row's state is the one the verify row saw (bit for
bit under the same launch shape; the order of the sums over K follows the shape, so two shapes
agree to fp32 rounding).

Launch: one program per (value tile, head, request) holds a ``[K, BLOCK_V]`` state tile in
registers. It loads every row's inputs first and the state after them, so all its loads are in
flight together and none waits behind a store or behind the serial rows (loaded in the row loop,
after the previous row's stores, each row cost a global-load wait). ``BLOCK_V`` and the warps come from
:mod:`mtp_ctrl.triton_ops.gdn_tiles` by the launch's request count and R, or the ``tiles`` argument.

Worked example (R = 3, F for Hk = 1, K = 2, H = 2, V = 2 is 2 + 4 + 2 + 2 = 10): request 0 in slot 5
verifies rows 0, 1, 2 and stores ``row_inputs[layer, 5, 0..2]``; ``accepted_counts[0] = 1`` then
replays rows 0 and 1: ``state[l, 5] <- rule(rule(state[l, 5], row 0), row 1)`` for every layer l.

Twins: :mod:`mtp_ctrl.triton_ops.reference.gdn`.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import INDEX_DTYPES, ValidatedSignatures, check_int, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops.gdn_recurrent import _check_rows, _delta_rule_update, _load_row
from mtp_ctrl.triton_ops.gdn_tiles import GDNTiles, gdn_replay_tiles, gdn_verify_tiles

_VERIFY_VALIDATED = ValidatedSignatures()
_REPLAY_VALIDATED = ValidatedSignatures()
_MAX_GRID_YZ = 65535  # CUDA's limit on the second and third grid dimensions (heads or layers x heads; requests)


def gdn_row_input_width(key_heads: int, key_dim: int, heads: int, value_dim: int) -> int:
    """F, the floats one verify row stores: ``[k (Hk K) | v (H V) | g (H) | beta (H)]``."""
    return key_heads * key_dim + heads * value_dim + 2 * heads


@triton.jit
def _load_rows(Q_PTR, K_PTR, V_PTR, G_PTR, BETA_PTR, first_row, num_rows, head, key_head, keys, is_key, values,
               is_value, q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, g_stride_t,
               g_stride_h, beta_stride_t, beta_stride_h, ROWS: tl.constexpr):
    """Rows ``first_row .. first_row + ROWS - 1``'s (q, k, v, g, beta), each a tuple of ROWS tensors
    (:func:`mtp_ctrl.triton_ops.gdn_recurrent._load_row`: rows at or past ``num_rows`` read zeros)."""
    qs, ks, vs, gs, betas = (), (), (), (), ()
    for j in tl.static_range(ROWS):
        q, k, v, g, beta = _load_row(Q_PTR, K_PTR, V_PTR, G_PTR, BETA_PTR, first_row + j, num_rows, head, key_head,
                                     keys, is_key, values, is_value, q_stride_t, q_stride_h, k_stride_t, k_stride_h,
                                     v_stride_t, v_stride_h, g_stride_t, g_stride_h, beta_stride_t, beta_stride_h)
        qs, ks, vs, gs, betas = qs + (q,), ks + (k,), vs + (v,), gs + (g,), betas + (beta,)
    return qs, ks, vs, gs, betas


# num_rows only bounds masks: not specialised, so one compiled kernel serves every batch size
@triton.jit(do_not_specialize=["num_rows"])
def _gdn_verify_rows_kernel(
    STATES_PTR, INPUTS_PTR, SLOTS_PTR, Q_PTR, K_PTR, V_PTR, G_PTR, BETA_PTR, OUT_PTR,
    num_rows, key_dim, value_dim, heads, key_heads,
    states_s_slot, states_s_head, states_s_k, states_s_v, inputs_s_slot, inputs_s_row,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, g_stride_t, g_stride_h,
    beta_stride_t, beta_stride_h, out_stride_t, out_stride_h,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Grid ``(value tiles, H, nd)``: program (t, h, r) walks request r's R rows for head h, value
    dims of tile t (module docstring). The tiles of one head are neighbours in launch order."""
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
    # every row's inputs first, then the state: all loads in flight together, none behind a store
    # or behind the serial rows
    qs, ks, vs, gs, betas = _load_rows(Q_PTR, K_PTR, V_PTR, G_PTR, BETA_PTR, first_row, num_rows, head, key_head,
                                       keys, is_key, values, is_value, q_stride_t, q_stride_h, k_stride_t,
                                       k_stride_h, v_stride_t, v_stride_h, g_stride_t, g_stride_h, beta_stride_t,
                                       beta_stride_h, ROWS)
    slot = tl.load(SLOTS_PTR + request).to(tl.int64)
    state_ptrs = STATES_PTR + slot * states_s_slot + head * states_s_head + keys[:, None] * states_s_k \
        + values[None, :] * states_s_v
    state = tl.load(state_ptrs, mask=tile_mask, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    if ROWS > 1:  # each row's (k, v, g, beta) for the replay (zeros past T)
        # the program that stores a head's shared inputs: k once per key head, g and beta once per head
        stores_k = is_key & (keys * 0 + tile == 0) & (keys * 0 + head % heads_per_key_head == 0)  # [BLOCK_K]
        stores_gate = (lanes == 0) & (lanes * 0 + tile == 0)  # [BLOCK_V]
        v_offset = key_heads * key_dim + head * value_dim
        g_offset = key_heads * key_dim + heads * value_dim + head
        for j in tl.static_range(ROWS):
            row_ptr = INPUTS_PTR + slot * inputs_s_slot + j * inputs_s_row
            tl.store(row_ptr + key_head * key_dim + keys, ks[j], mask=stores_k)
            tl.store(row_ptr + v_offset + values, vs[j], mask=is_value)
            tl.store(row_ptr + g_offset + lanes * 0, gs[j], mask=stores_gate)
            tl.store(row_ptr + g_offset + heads + lanes * 0, betas[j], mask=stores_gate)
    for j in tl.static_range(ROWS):
        state = _delta_rule_update(state, ks[j], vs[j], gs[j], betas[j])
        tl.store(OUT_PTR + (first_row + j) * out_stride_t + head * out_stride_h + values,
                 tl.sum(state * qs[j][:, None], axis=0), mask=is_value)
    if ROWS == 1:  # plain decoding: the row is always kept
        tl.store(state_ptrs, state, mask=tile_mask)


@triton.jit
def _gdn_replay_accepted_kernel(
    STATES_PTR, INPUTS_PTR, PREFILL_STATUS_PTR, prefill_stride, SLOTS_PTR, slots_stride, ACCEPTED_PTR,
    accepted_stride, key_dim, value_dim, heads, key_heads,
    states_s_layer, states_s_slot, states_s_head, states_s_k, states_s_v, inputs_s_layer, inputs_s_slot,
    inputs_s_row,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Grid ``(value tiles, L H, N)``: program (t, l H + h, r) replays request r's accepted rows of
    layer l, head h, value dims of tile t."""
    tile = tl.program_id(0)
    layer = (tl.program_id(1) // heads).to(tl.int64)
    head = (tl.program_id(1) % heads).to(tl.int64)
    request = tl.program_id(2).to(tl.int64)
    prefill = tl.load(PREFILL_STATUS_PTR + request * prefill_stride)
    if prefill == 0:
        slot = tl.load(SLOTS_PTR + request * slots_stride).to(tl.int64)
        accepted = tl.load(ACCEPTED_PTR + request * accepted_stride)
        key_head = head // (heads // key_heads)
        keys = tl.arange(0, BLOCK_K).to(tl.int64)
        is_key = keys < key_dim
        values = (tile * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
        is_value = values < value_dim
        tile_mask = is_key[:, None] & is_value[None, :]
        # the kept rows' inputs first, then the state (all loads in flight together); rows past the
        # accepted ones read zeros (g = beta = 0, k = v = 0: the state passes unchanged)
        g_offset = key_heads * key_dim + heads * value_dim + head
        ks, vs, gs, betas = (), (), (), ()
        for j in tl.static_range(ROWS):
            kept_k = keys * 0 + j <= accepted  # [BLOCK_K] bool, one value
            kept_v = values * 0 + j <= accepted  # [BLOCK_V] bool
            row_ptr = INPUTS_PTR + layer * inputs_s_layer + slot * inputs_s_slot + j * inputs_s_row
            ks = ks + (tl.load(row_ptr + key_head * key_dim + keys, mask=is_key & kept_k, other=0.0),)
            vs = vs + (tl.load(row_ptr + key_heads * key_dim + head * value_dim + values, mask=is_value & kept_v,
                               other=0.0),)
            gs = gs + (tl.load(row_ptr + g_offset + values * 0, mask=kept_v, other=0.0),)
            betas = betas + (tl.load(row_ptr + g_offset + heads + values * 0, mask=kept_v, other=0.0),)
        state_ptrs = STATES_PTR + layer * states_s_layer + slot * states_s_slot + head * states_s_head \
            + keys[:, None] * states_s_k + values[None, :] * states_s_v
        state = tl.load(state_ptrs, mask=tile_mask, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
        for j in tl.static_range(ROWS):
            state = _delta_rule_update(state, ks[j], vs[j], gs[j], betas[j])
        tl.store(state_ptrs, state, mask=tile_mask)


def _check_layout(recurrent_states, row_inputs, key_heads: int) -> None:
    check_tensor("recurrent_states", recurrent_states, dtypes=(torch.float32,), ndim=5)
    num_layers, num_slots, heads, key_dim, value_dim = recurrent_states.shape
    if key_heads < 1 or heads % key_heads:
        raise ValueError(f"{key_heads} key heads must divide the states' {heads} value heads")
    width = gdn_row_input_width(key_heads, key_dim, heads, value_dim)
    check_tensor("row_inputs", row_inputs, dtypes=(torch.float32,), shape=(num_layers, num_slots, None, width))
    if row_inputs.shape[2] < 1:
        raise ValueError("row_inputs must hold >= 1 row per slot (1 + S) on dim 2")
    if row_inputs.stride(3) != 1 or recurrent_states.stride(4) != 1:
        raise ValueError("recurrent_states and row_inputs must be contiguous in their last dim")


def _check_verify_args(recurrent_states, row_inputs, layer, slot_ids, q, k, v, g, beta) -> None:
    check_tensor("q", q, dtypes=(torch.float32,), ndim=3)
    _check_layout(recurrent_states, row_inputs, q.shape[1])
    _, _, heads, key_dim, value_dim = recurrent_states.shape
    check_int("layer", layer, low=0, high=recurrent_states.shape[0] - 1)
    check_tensor("slot_ids", slot_ids, dtypes=(torch.int64,), ndim=1)
    _check_rows(q, k, v, g, beta, heads, key_dim, value_dim)
    _check_grid(heads, slot_ids.shape[0])
    check_same_device(q=q, recurrent_states=recurrent_states, row_inputs=row_inputs, slot_ids=slot_ids, k=k, v=v,
                      g=g, beta=beta)


def _check_replay_args(recurrent_states, row_inputs, prefill_status, slot_ids, accepted_counts, key_heads) -> None:
    check_int("key_heads", key_heads, low=1)
    _check_layout(recurrent_states, row_inputs, key_heads)
    check_tensor("prefill_status", prefill_status, dtypes=INDEX_DTYPES, ndim=1)
    num_requests = prefill_status.shape[0]
    check_tensor("slot_ids", slot_ids, dtypes=INDEX_DTYPES, shape=(num_requests,))
    check_tensor("accepted_counts", accepted_counts, dtypes=INDEX_DTYPES, shape=(num_requests,))
    _check_grid(recurrent_states.shape[0] * recurrent_states.shape[2], num_requests)
    check_same_device(recurrent_states=recurrent_states, row_inputs=row_inputs, prefill_status=prefill_status,
                      slot_ids=slot_ids, accepted_counts=accepted_counts)


def _check_grid(head_programs: int, num_requests: int) -> None:
    if head_programs > _MAX_GRID_YZ:
        raise ValueError(f"{head_programs} heads (layers x heads for the replay) exceed the grid's {_MAX_GRID_YZ}")
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
    recurrent_states: torch.Tensor,  # [L, M, H, K, V] fp32: read (R > 1) or updated in place (R = 1)
    row_inputs: torch.Tensor,  # [L, M, R, F] fp32, written at [layer, slot_ids, :] when R > 1
    layer: int,
    slot_ids: torch.Tensor,  # [nd] int64 on the device, each decode request's slot
    q: torch.Tensor,  # [T, Hk, K] fp32, l2-normalised and scaled by K ** -0.5
    k: torch.Tensor,  # [T, Hk, K] fp32, l2-normalised
    v: torch.Tensor,  # [T, H, V] fp32
    g: torch.Tensor,  # [T, H] fp32, log decay (<= 0)
    beta: torch.Tensor,  # [T, H] fp32
    tiles: Optional[GDNTiles] = None,
) -> torch.Tensor:  # o [nd * R, H, V] fp32
    """The R = ``row_inputs.shape[2]`` rows of every decode request (request r owns rows
    ``r R .. r R + R - 1``; rows at or past T read as zeros) from its slot's state, which stays in
    registers: their outputs, and each row's inputs in ``row_inputs`` for :func:`gdn_replay_accepted`
    (module docstring). R = 1: the state after the row goes to the slot instead. Slots should be
    distinct except a shared scratch slot, whose contents are then unspecified. ``tiles`` overrides
    the table's launch shape (:func:`mtp_ctrl.triton_ops.gdn_tiles.gdn_verify_tiles` of nd and R).
    No host sync."""
    args = (recurrent_states, row_inputs, layer, slot_ids, q, k, v, g, beta)
    _VERIFY_VALIDATED.validate(_check_verify_args, *args)
    _check_tiles(tiles)
    if not use_triton(q):
        return reference.gdn_verify_rows(*args, tiles=tiles)
    rows_per_request = row_inputs.shape[2]
    heads, key_dim, value_dim = recurrent_states.shape[2:]
    out = torch.empty(slot_ids.shape[0] * rows_per_request, heads, value_dim, dtype=torch.float32,
                      device=q.device)  # [nd * R, H, V] fp32
    for name, tensor in (("q", q), ("k", k), ("v", v), ("slot_ids", slot_ids)):
        if tensor.stride(-1) != 1 and tensor.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got stride {tensor.stride(-1)}")
    if slot_ids.shape[0] == 0:
        return out
    if tiles is None:
        tiles = gdn_verify_tiles(slot_ids.shape[0], rows_per_request)
    block_k, block_v, num_tiles = _launch_shape(key_dim, value_dim, tiles)
    states, inputs = recurrent_states[layer], row_inputs[layer]  # int64 layer offsets, computed here
    _gdn_verify_rows_kernel[(num_tiles, heads, slot_ids.shape[0])](
        states, inputs, slot_ids, q, k, v, g, beta, out,
        q.shape[0], key_dim, value_dim, heads, q.shape[1],
        *states.stride(), inputs.stride(0), inputs.stride(1),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), *g.stride(), *beta.stride(),
        out.stride(0), out.stride(1),
        ROWS=rows_per_request, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=tiles.num_warps)
    return out


def gdn_replay_accepted(
    recurrent_states: torch.Tensor,  # [L, M, H, K, V] fp32, updated in place
    row_inputs: torch.Tensor,  # [L, M, R, F] fp32, what gdn_verify_rows stored
    prefill_status: torch.Tensor,  # [N] int, 0 = decode, 1 = prefill (keeps its state)
    slot_ids: torch.Tensor,  # [N] int, each request's slot
    accepted_counts: torch.Tensor,  # [N] int, accepted drafts of each request (0 .. R - 1)
    key_heads: int,  # Hk
    tiles: Optional[GDNTiles] = None,
) -> None:
    """The commit: ``state[l, slot_ids[r]] <- rows 0 .. accepted_counts[r]`` of ``row_inputs[l, slot_ids[r]]``
    stepped from it, for every layer l and decode request r (module docstring). Padding requests
    should use a scratch slot. ``tiles`` overrides the table's launch shape
    (:func:`mtp_ctrl.triton_ops.gdn_tiles.gdn_replay_tiles` of N and R). No host sync."""
    args = (recurrent_states, row_inputs, prefill_status, slot_ids, accepted_counts, key_heads)
    _REPLAY_VALIDATED.validate(_check_replay_args, *args)
    _check_tiles(tiles)
    if not use_triton(recurrent_states):
        return reference.gdn_replay_accepted(*args, tiles=tiles)
    num_layers, _, heads, key_dim, value_dim = recurrent_states.shape
    if prefill_status.shape[0] == 0:
        return None
    rows_per_request = row_inputs.shape[2]
    if tiles is None:
        tiles = gdn_replay_tiles(prefill_status.shape[0], rows_per_request)
    block_k, block_v, num_tiles = _launch_shape(key_dim, value_dim, tiles)
    _gdn_replay_accepted_kernel[(num_tiles, num_layers * heads, prefill_status.shape[0])](
        recurrent_states, row_inputs, prefill_status, prefill_status.stride(0), slot_ids, slot_ids.stride(0),
        accepted_counts, accepted_counts.stride(0), key_dim, value_dim, heads, key_heads,
        *recurrent_states.stride(), *row_inputs.stride()[:3],
        ROWS=rows_per_request, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=tiles.num_warps)
    return None
