"""gdn_verify_rows and gdn_replay_accepted (verify rows store their inputs; the commit replays the
accepted rows): the Triton kernels through the interpreter == their torch twins on random slots
(padding rows past T, a shared scratch slot, GQA key heads, value tiles, empty batches, prefill
requests, zero drafts); verify then replay == the rule row by row over the kept rows, for none,
some and all drafts accepted; R = 1 is plain decoding in place; every launch shape of the tile
tables == the twins; errors name the argument."""

import pytest
import torch

from mtp_ctrl.triton_ops import gdn_replay_accepted, gdn_row_input_width, gdn_verify_rows, reference
from mtp_ctrl.triton_ops.gdn_tiles import (
    DEFAULT_TILES,
    REPLAY_TILE_TABLE,
    VERIFY_TILE_TABLE,
    GDNTiles,
    gdn_replay_tiles,
    gdn_verify_tiles,
)
from tests.unit.test_gdn_kernels import LAYERS, SLOTS, oracle, rows

TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def pools(seed, rows_per_request, key_heads=2, heads=4, key_dim=8, value_dim=6):
    """(states [L, M, H, K, V], row inputs [L, M, R, F]) fp32, random."""
    generator = torch.Generator().manual_seed(seed + 100)
    states = torch.randn(LAYERS, SLOTS, heads, key_dim, value_dim, generator=generator) * 0.5
    width = gdn_row_input_width(key_heads, key_dim, heads, value_dim)
    return states, torch.randn(LAYERS, SLOTS, rows_per_request, width, generator=generator)


VERIFY_CASES = {  # name: (slot ids, rows per request, T, rows() arguments)
    "past_T": ([4, 1, 3], 3, 8, {}),  # 9 rows of 8: the last request's last row reads zeros
    "no_request": ([], 3, 4, {}),
    "zero_drafts_in_place": ([0, 4, 2], 1, 3, {}),  # R = 1: the state is written, nothing stored
    "value_tiles_mha": ([2, 3], 4, 8, dict(key_heads=4, value_dim=40)),  # 2 value tiles, Hk == H
    "scratch_shared": ([1, 5, 5], 2, 6, {}),  # padding requests on scratch slot 5
}


@pytest.mark.parametrize("layer", [0, LAYERS - 1])
@pytest.mark.parametrize("case", list(VERIFY_CASES), ids=list(VERIFY_CASES))
def test_verify_kernel_equals_twin(case, layer):
    slot_list, stride, num_rows, arguments = VERIFY_CASES[case]
    inputs = rows(len(case), num_rows, **arguments)
    key_heads, key_dim = inputs["k"].shape[1:]
    heads, value_dim = inputs["v"].shape[1:]
    states, row_inputs = pools(len(case), stride, key_heads, heads, key_dim, value_dim)
    slot_ids = torch.tensor(slot_list, dtype=torch.int64)
    before_states, before_inputs = states.clone(), row_inputs.clone()
    want_states, want_inputs = states.clone(), row_inputs.clone()
    o = gdn_verify_rows(states, row_inputs, layer, slot_ids, **inputs)
    want = reference.gdn_verify_rows(want_states, want_inputs, layer, slot_ids, **inputs)
    assert o.shape == (len(slot_list) * stride, heads, value_dim)
    real = [index for index, slot in enumerate(slot_list) if slot_list.count(slot) == 1]
    for index in real:
        rows_of, slot = slice(index * stride, (index + 1) * stride), slot_list[index]
        torch.testing.assert_close(o[rows_of], want[rows_of], **TOLERANCE)
        torch.testing.assert_close(row_inputs[layer, slot], want_inputs[layer, slot], **TOLERANCE)
        torch.testing.assert_close(states[layer, slot], want_states[layer, slot], **TOLERANCE)
    touched = torch.zeros(LAYERS, SLOTS, dtype=torch.bool)
    touched[layer, slot_ids] = True
    assert torch.equal(states[~touched], before_states[~touched])
    assert torch.equal(row_inputs[~touched], before_inputs[~touched])
    if stride > 1:
        assert torch.equal(states, before_states)  # verify rows only read the state
    else:
        assert torch.equal(row_inputs, before_inputs)  # plain decoding stores nothing


REPLAY_CASES = {  # name: (slot ids, prefill status, accepted counts, rows per request, rows() arguments)
    "mixed": ([4, 1, 3, 0], [0, 0, 1, 0], [2, 0, 1, 1], 3, {}),  # slot 3 prefills: kept as it is
    "all_rejected": ([2, 0], [0, 0], [0, 0], 3, {}),
    "all_accepted": ([2, 0, 4], [0, 0, 0], [3, 3, 3], 4, dict(key_heads=4, value_dim=40)),
    "zero_drafts": ([1, 3], [0, 0], [0, 0], 1, {}),
    "padding_on_scratch": ([1, 5, 5, 5], [0, 0, 0, 0], [1, 2, 0, 1], 3, {}),
    "no_request": ([], [], [], 2, {}),
}


@pytest.mark.parametrize("case", list(REPLAY_CASES), ids=list(REPLAY_CASES))
def test_replay_kernel_equals_twin(case):
    slot_list, status, counts, stride, arguments = REPLAY_CASES[case]
    shapes = rows(0, 1, **arguments)
    key_heads, key_dim = shapes["k"].shape[1:]
    heads, value_dim = shapes["v"].shape[1:]
    states, row_inputs = pools(len(case), stride, key_heads, heads, key_dim, value_dim)
    row_inputs[..., -2 * heads:-heads] = -row_inputs[..., -2 * heads:-heads].abs()  # g <= 0
    before, want = states.clone(), states.clone()
    args = (torch.tensor(status, dtype=torch.int64), torch.tensor(slot_list, dtype=torch.int64),
            torch.tensor(counts, dtype=torch.int64), key_heads)
    gdn_replay_accepted(states, row_inputs, *args)
    reference.gdn_replay_accepted(want, row_inputs, *args)
    changed = torch.zeros(SLOTS, dtype=torch.bool)
    for slot, prefill in zip(slot_list, status):
        changed[slot] |= prefill == 0
    real = [slot for slot in slot_list if slot_list.count(slot) == 1]
    torch.testing.assert_close(states[:, real], want[:, real], **TOLERANCE)
    assert torch.equal(states[:, ~changed], before[:, ~changed])  # prefill and unused slots keep their state


@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "twin"])
@pytest.mark.parametrize("accepted", ["none", "all", "mixed"])
def test_verify_then_replay_is_plain_decoding(accepted, kernels):
    """Verify rows then the replay commit == the rule row by row over the kept rows, outputs too:
    0 accepted leaves the state after the base row (what one plain decode row leaves, and what
    R = 1 writes in place), all accepted the state after the last draft."""
    ops = (gdn_verify_rows, gdn_replay_accepted) if kernels else (reference.gdn_verify_rows,
                                                                  reference.gdn_replay_accepted)
    stride = 3
    inputs = rows(11, 2 * stride)
    states, row_inputs = pools(11, stride)
    slot_list = [3, 1]
    counts = {"none": [0, 0], "all": [2, 2], "mixed": [2, 0]}[accepted]
    start = states.clone()
    o = ops[0](states, row_inputs, 1, torch.tensor(slot_list), **inputs)
    ops[1](states, row_inputs, torch.zeros(2, dtype=torch.int64), torch.tensor(slot_list), torch.tensor(counts), 2)
    plain_states = start.clone()
    for index, slot in enumerate(slot_list):
        every_row = {name: value[index * stride:(index + 1) * stride] for name, value in inputs.items()}
        want_o, _ = oracle(start[1, slot], **every_row)
        torch.testing.assert_close(o[index * stride:(index + 1) * stride], want_o, **TOLERANCE)
        kept = {name: value[:1 + counts[index]] for name, value in every_row.items()}
        torch.testing.assert_close(states[1, slot], oracle(start[1, slot], **kept)[1], **TOLERANCE)
        for row in range(1 + counts[index]):  # plain decoding: R = 1 steps, each in place
            one = {name: value[row:row + 1] for name, value in kept.items()}
            ops[0](plain_states, row_inputs[:, :, :1], 1, torch.tensor([slot]), **one)
        torch.testing.assert_close(states[1, slot], plain_states[1, slot], rtol=1e-6, atol=1e-6)
    # layer 0 replays rows that layer 0's verify never wrote: here random inputs; only layer 1 is checked


def _value_tile_widths():
    """The distinct value tiles of the tables' launch shapes at V = 40 (warps: no effect when interpreted)."""
    shapes = [tiles for _, tiles in VERIFY_TILE_TABLE + REPLAY_TILE_TABLE] + [DEFAULT_TILES]
    return sorted({min(tiles.block_v, 64) for tiles in shapes})


@pytest.mark.parametrize("block_v", _value_tile_widths())
def test_every_table_launch_shape_equals_twin(block_v):
    """Verify rows (R = 3 past T, then R = 1 in place) and the replay (some accepted, a prefill
    request) with each value-tile width of the tables == the twins (GQA, V = 40: 1-5 value tiles)."""
    tiles = GDNTiles(block_v, 1)
    inputs = rows(21, 8, value_dim=40)
    states, row_inputs = pools(21, 3, value_dim=40)
    want_states, want_inputs = states.clone(), row_inputs.clone()
    slots = torch.tensor([4, 1, 3])
    o = gdn_verify_rows(states, row_inputs, 1, slots, **inputs, tiles=tiles)
    torch.testing.assert_close(o, reference.gdn_verify_rows(want_states, want_inputs, 1, slots, **inputs), **TOLERANCE)
    torch.testing.assert_close(row_inputs, want_inputs, **TOLERANCE)
    replay = (torch.tensor([0, 1, 0]), slots, torch.tensor([2, 0, 1]), 2)
    gdn_replay_accepted(states, row_inputs, *replay, tiles=tiles)
    reference.gdn_replay_accepted(want_states, want_inputs, *replay)
    torch.testing.assert_close(states, want_states, **TOLERANCE)
    one = {name: value[:3] for name, value in inputs.items()}
    o = gdn_verify_rows(states, row_inputs[:, :, :1], 0, slots, **one, tiles=tiles)
    want = reference.gdn_verify_rows(want_states, want_inputs[:, :, :1], 0, slots, **one)
    torch.testing.assert_close(o, want, **TOLERANCE)
    torch.testing.assert_close(states, want_states, **TOLERANCE)


def test_tile_tables_cover_every_launch():
    """Each table ends with an unbounded entry, and a launch takes the first entry whose bounds hold."""
    for table, lookup in ((VERIFY_TILE_TABLE, gdn_verify_tiles), (REPLAY_TILE_TABLE, gdn_replay_tiles)):
        assert table[-1][0] == (None, None)
        for (max_requests, max_rows), tiles in table:
            requests, rows_per_request = max_requests or 10_000, max_rows or 9
            first = next(t for (b, r), t in table if (b is None or requests <= b) and (r is None or rows_per_request <= r))
            assert lookup(requests, rows_per_request) is first
    with pytest.raises(ValueError, match="block_v"):
        GDNTiles(24, 4)
    with pytest.raises(ValueError, match="block_v"):
        GDNTiles(True, 2)  # a bool is not a width
    with pytest.raises(TypeError, match="tiles"):
        gdn_verify_rows(*pools(1, 3), 0, torch.tensor([0, 1]), **rows(1, 6), tiles=(32, 4))


def test_errors_name_the_argument():
    inputs = rows(1, 6)
    states, row_inputs = pools(1, 3)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="row_inputs"):
        gdn_verify_rows(states, row_inputs[..., :-1], 0, slots, **inputs)
    with pytest.raises(ValueError, match="layer"):
        gdn_verify_rows(states, row_inputs, LAYERS, slots, **inputs)
    with pytest.raises(TypeError, match="recurrent_states"):
        gdn_verify_rows(states.double(), row_inputs, 0, slots, **inputs)
    with pytest.raises(ValueError, match="key heads"):
        gdn_replay_accepted(states, row_inputs, torch.zeros(2), slots, slots, 3)
    with pytest.raises(TypeError, match="prefill_status"):
        gdn_replay_accepted(states, row_inputs, torch.zeros(2), slots, slots, 2)
    with pytest.raises(ValueError, match="accepted_counts"):
        gdn_replay_accepted(states, row_inputs, slots, slots, slots[:1], 2)
