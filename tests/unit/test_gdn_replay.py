"""gdn_verify_rows with the deferred commit, and gdn_mark_pending_rows: the Triton kernels through
the interpreter == their torch twins on random slots (pending rows in either buffer, padding rows
past T, a shared scratch slot, GQA key heads, value tiles, empty batches, prefill requests, zero
drafts); a run of verify steps (the commit folded into the next step's rows) == plain R = 1
decoding bit for bit, outputs and states (all accepted, all rejected, zero drafts, mixed,
padding, slot reuse); errors name the argument."""

import pytest
import torch

from mtp_ctrl.triton_ops import gdn_mark_pending_rows, gdn_row_input_width, gdn_verify_rows, reference
from mtp_ctrl.triton_ops.reference.gdn import check_no_pending_rows
from mtp_ctrl.triton_ops.gdn_tiles import (CANDIDATE_SCHEDULES, CANDIDATE_TILES, DEFAULT_TILES, LATE_OWN_ROWS,
                                           PRELOAD_ALL, ROW_SCHEDULE_TABLE, VERIFY_TILE_TABLE, GDNRowSchedule, GDNTiles,
                                           gdn_row_schedule, gdn_verify_tiles)
from tests.unit.test_gdn_kernels import LAYERS, SLOTS, rows

TOLERANCE = dict(rtol=1e-5, atol=1e-5)
SCRATCH = SLOTS - 1


def pools(seed, stored_rows, key_heads=2, heads=4, key_dim=8, value_dim=6, pending=()):
    """(states [L, M, H, K, V], row inputs [L, M, 2, P, F], pending rows [M], parity [M]): random
    states and inputs (g <= 0), ``pending`` rows waiting in slots 0, 1, ... (random parity)."""
    generator = torch.Generator().manual_seed(seed + 100)
    states = torch.randn(LAYERS, SLOTS, heads, key_dim, value_dim, generator=generator) * 0.5
    width = gdn_row_input_width(key_heads, key_dim, heads, value_dim)
    row_inputs = torch.randn(LAYERS, SLOTS, 2, stored_rows, width, generator=generator) * 0.5
    row_inputs[..., -heads:] = -row_inputs[..., -heads:].abs()  # g <= 0 ([k | u | g])
    pending_rows = torch.zeros(SLOTS, dtype=torch.int32)
    pending_rows[:len(pending)] = torch.tensor(pending, dtype=torch.int32)
    parity = torch.randint(0, 2, (SLOTS,), generator=generator, dtype=torch.int32)
    return states, row_inputs, pending_rows, parity


VERIFY_CASES = {  # name: (slot ids, rows per request, stored rows P, T, pending per slot 0.., rows() arguments)
    "past_T": ([4, 1, 3], 3, 3, 8, (2, 3, 0, 1, 3), {}),  # 9 rows of 8: the last request's last row reads zeros
    "no_request": ([], 3, 3, 4, (1,), {}),
    "zero_drafts_flush": ([0, 4, 2], 1, 3, 3, (3, 0, 1, 0, 2), {}),  # R = 1: pending rows, then the row, in place
    "value_tiles_mha": ([2, 3], 4, 4, 8, (0, 0, 4, 1), dict(key_heads=4, value_dim=40)),  # 2 value tiles
    "narrow_step": ([1, 0], 2, 4, 4, (4, 3), {}),  # V < S: 2 rows of 4 stored
    "scratch_shared": ([1, SCRATCH, SCRATCH], 2, 3, 6, (0, 2), {}),  # padding requests on the scratch slot
}


@pytest.mark.parametrize("case", list(VERIFY_CASES), ids=list(VERIFY_CASES))
def test_verify_kernel_equals_twin(case):
    slot_list, stride, stored, num_rows, pending, arguments = VERIFY_CASES[case]
    layer = len(case) % LAYERS
    inputs = rows(len(case), num_rows, **arguments)
    key_heads, key_dim = inputs["k"].shape[1:]
    heads, value_dim = inputs["v"].shape[1:]
    states, row_inputs, pending_rows, parity = pools(len(case), stored, key_heads, heads, key_dim, value_dim, pending)
    slot_ids = torch.tensor(slot_list, dtype=torch.int64)
    before_states, before_inputs = states.clone(), row_inputs.clone()
    want_states, want_inputs = states.clone(), row_inputs.clone()
    o = gdn_verify_rows(states, row_inputs, pending_rows, parity, layer, slot_ids, **inputs, rows_per_request=stride)
    want = reference.gdn_verify_rows(want_states, want_inputs, pending_rows, parity, layer, slot_ids, **inputs,
                                     rows_per_request=stride)
    assert o.shape == (len(slot_list) * stride, heads, value_dim)
    for index, slot in enumerate(slot_list):
        if slot_list.count(slot) > 1:
            continue
        rows_of = slice(index * stride, (index + 1) * stride)
        torch.testing.assert_close(o[rows_of], want[rows_of], **TOLERANCE)
        torch.testing.assert_close(row_inputs[layer, slot], want_inputs[layer, slot], **TOLERANCE)
        torch.testing.assert_close(states[layer, slot], want_states[layer, slot], **TOLERANCE)
        # the pending rows' buffer is only read
        assert torch.equal(row_inputs[layer, slot, parity[slot]], before_inputs[layer, slot, parity[slot]])
        if stride > 1 and pending_rows[slot] == 0:
            assert torch.equal(states[layer, slot], before_states[layer, slot])  # nothing to commit
    touched = torch.zeros(LAYERS, SLOTS, dtype=torch.bool)
    touched[layer, slot_ids] = True
    assert torch.equal(states[~touched], before_states[~touched])
    assert torch.equal(row_inputs[~touched], before_inputs[~touched])
    if stride == 1:
        assert torch.equal(row_inputs, before_inputs)  # plain decoding stores nothing


MARK_CASES = {  # name: (slot ids, prefill status, accepted counts, rows per request)
    "mixed": ([4, 1, 3, 0], [0, 0, 1, 0], [2, 0, 1, 1], 3),  # slot 3 prefills: 0 pending
    "zero_drafts": ([1, 3], [0, 0], [0, 0], 1),
    "padding_on_scratch": ([1, SCRATCH, SCRATCH, 2], [0, 0, 1, 0], [1, 2, 0, 1], 3),
    "no_request": ([], [], [], 2),
}


@pytest.mark.parametrize("case", list(MARK_CASES), ids=list(MARK_CASES))
def test_mark_kernel_equals_twin(case):
    slot_list, status, counts, stride = MARK_CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    pending = torch.randint(0, 3, (SLOTS,), generator=generator, dtype=torch.int32)
    pending[SCRATCH] = 0
    parity = torch.randint(0, 2, (SLOTS,), generator=generator, dtype=torch.int32)
    want_pending, want_parity = pending.clone(), parity.clone()
    args = (torch.tensor(status, dtype=torch.int64), torch.tensor(slot_list, dtype=torch.int64),
            torch.tensor(counts, dtype=torch.int64), stride, SCRATCH)
    gdn_mark_pending_rows(pending, parity, *args)
    reference.gdn_mark_pending_rows(want_pending, want_parity, *args)
    assert torch.equal(pending, want_pending) and torch.equal(parity, want_parity)
    assert pending[SCRATCH] == 0
    for slot, prefill, count in zip(slot_list, status, counts):
        if slot != SCRATCH:
            assert pending[slot] == (count + 1 if stride > 1 and not prefill else 0)


class PlainDecoding:
    """The oracle: each kept row as an R = 1 step of its own (nothing pending, nothing stored)."""

    def __init__(self, states, key_heads, verify):
        self.states, self.verify = states, verify
        self.pending, self.parity = torch.zeros(SLOTS, dtype=torch.int32), torch.zeros(SLOTS, dtype=torch.int32)
        width = gdn_row_input_width(key_heads, *states.shape[3:4], states.shape[2], states.shape[4])
        self.row_inputs = torch.zeros(LAYERS, SLOTS, 2, 1, width)

    def row(self, layer, slot, one_row):
        return self.verify(self.states, self.row_inputs, self.pending, self.parity, layer, torch.tensor([slot]),
                           **one_row, rows_per_request=1)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "twin"])
def test_verify_steps_with_deferred_commits_are_plain_decoding(kernels):
    """Steps of R = 3 (S = 2) and R = 1 rows over two layers and three slots: all drafts accepted,
    none, some, a zero-draft step, a padding request on the scratch slot, a prefill request in a
    decode row's place, a released slot taken by a new request (its state and pending count reset)
    == the rule row by row over the kept rows, bit for bit: every kept row's output and, after a
    last R = 1 step that applies what is pending, every state."""
    verify, mark = (gdn_verify_rows, gdn_mark_pending_rows) if kernels else (reference.gdn_verify_rows,
                                                                          reference.gdn_mark_pending_rows)
    S, key_heads = 2, 2
    states, row_inputs, pending, parity = pools(5, 1 + S)
    pending.zero_()
    plain = PlainDecoding(states.clone(), key_heads, verify)
    # (slots of the step's requests, R, accepted counts, prefill status); -1 accepted: a padding request
    steps = [([0, 1, 2], 3, [2, 0, 1], [0, 0, 0]),
             ([2, 0, 1], 3, [0, 2, 2], [0, 0, 0]),
             ([1, 0, 2], 1, [0, 0, 0], [0, 0, 0]),  # zero drafts: pending rows flushed, the row in place
             ([0, 1, SCRATCH], 3, [1, 2, 0], [0, 0, 0]),
             ([0, 1, 2], 3, [2, 1, 0], [0, 0, 1]),  # slot 2 prefills elsewhere: its decode row is not kept
             "reuse 1",  # slot 1's request ends; a new request takes the slot (zero state, 0 pending)
             ([1, 0, SCRATCH], 3, [0, 0, 2], [0, 0, 0]),
             ([0, 1, 2], 1, [0, 0, 0], [0, 0, 0])]  # the last: every slot committed
    generator = torch.Generator().manual_seed(3)
    for number, step in enumerate(steps):
        if isinstance(step, str):
            slot = int(step.split()[1])
            for pool in (states, plain.states):
                pool[:, slot] = 0.0
            pending[slot] = 0  # as MambaStateSlots.allocate_slot
            continue
        slots, stride, accepted, prefill = step
        inputs = rows(number, len(slots) * stride, key_heads=key_heads)
        slot_ids = torch.tensor(slots)
        for layer in range(LAYERS) if not kernels else (1,):  # interpreted: one layer (the kernel's cost)
            o = verify(states, row_inputs, pending, parity, layer, slot_ids, **inputs, rows_per_request=stride)
            for index, slot in enumerate(slots):
                if slot == SCRATCH or prefill[index]:
                    continue
                for row in range(1 + accepted[index]):  # the kept rows; later rows' outputs are not used
                    at = index * stride + row
                    want = plain.row(layer, slot, {name: value[at:at + 1] for name, value in inputs.items()})
                    assert torch.equal(o[at:at + 1], want), (number, layer, slot, row)
        mark(pending, parity, torch.tensor(prefill), slot_ids, torch.tensor(accepted), stride, SCRATCH)
    assert int(pending[:SCRATCH].sum()) == 0
    assert torch.equal(states[:, :SCRATCH], plain.states[:, :SCRATCH])


def test_prefill_twin_check_refuses_pending_rows():
    pending = torch.tensor([0, 2, 0], dtype=torch.int32)
    check_no_pending_rows(pending, torch.tensor([0, 1]), torch.tensor([4, 0]))  # slot 1: no rows
    with pytest.raises(AssertionError, match="pending"):
        check_no_pending_rows(pending, torch.tensor([0, 1]), torch.tensor([4, 3]))


@pytest.mark.parametrize("block_v", sorted({min(tiles.block_v, 64) for _, tiles in VERIFY_TILE_TABLE}
                                           | {DEFAULT_TILES.block_v}))
def test_every_table_launch_shape_equals_twin(block_v):
    """Verify rows (R = 3 past T with pending rows, then R = 1) with each value-tile width of the
    table == the twin (GQA, V = 40: 1-5 value tiles)."""
    tiles = GDNTiles(block_v, 1)
    inputs = rows(21, 8, value_dim=40)
    states, row_inputs, pending, parity = pools(21, 3, value_dim=40, pending=(3, 1, 0, 2, 1))
    want_states, want_inputs = states.clone(), row_inputs.clone()
    slots = torch.tensor([4, 1, 3])
    for stride, inputs_now in ((3, inputs), (1, {name: value[:3] for name, value in inputs.items()})):
        o = gdn_verify_rows(states, row_inputs, pending, parity, 1, slots, **inputs_now, rows_per_request=stride,
                            tiles=tiles)
        want = reference.gdn_verify_rows(want_states, want_inputs, pending, parity, 1, slots, **inputs_now,
                                         rows_per_request=stride)
        torch.testing.assert_close(o, want, **TOLERANCE)
        torch.testing.assert_close(states, want_states, **TOLERANCE)
        torch.testing.assert_close(row_inputs, want_inputs, **TOLERANCE)


# one schedule per load order (the interpreter ignores the register cap)
SCHEDULES = tuple({str(schedule.constants(5, 5)): schedule for schedule in reversed(
    CANDIDATE_SCHEDULES + tuple(schedule for _, schedule in ROW_SCHEDULE_TABLE)
    + (GDNRowSchedule(own_early=1, pending_early=2, ahead=3), GDNRowSchedule(own_early=0, pending_early=0, ahead=0)))
}.values())


def test_every_row_schedule_is_the_preload_bit_for_bit():
    """A row schedule only moves loads: under each (candidates, the table's, and a few corners:
    every row late with no lookahead, a lookahead past the pending rows) a step of R = 5 after
    5 and 2 pending rows (the last row past T) and an R = 1 step give main's schedule's outputs,
    states and stored rows, torch.equal (the interpreter: the arithmetic's order; the GPU test and
    ``bench_gdn.py --tune --schedules`` check the compiled kernels)."""
    inputs = rows(31, 9, key_heads=1, heads=2, key_dim=8, value_dim=4)
    start = pools(31, 5, key_heads=1, heads=2, key_dim=8, value_dim=4, pending=(5, 2))
    slots = torch.tensor([0, 1])
    results = {}
    for schedule in SCHEDULES:
        states, row_inputs, pending, parity = (tensor.clone() for tensor in start)
        tiles = GDNTiles(DEFAULT_TILES.block_v, DEFAULT_TILES.num_warps, schedule)
        o = gdn_verify_rows(states, row_inputs, pending, parity, 1, slots, **inputs, rows_per_request=5, tiles=tiles)
        plain = gdn_verify_rows(states, row_inputs, pending, parity, 0, slots[:2],
                                **{name: value[:2] for name, value in inputs.items()}, rows_per_request=1,
                                tiles=tiles)
        results[schedule] = (o, plain, states, row_inputs)
    want = results[PRELOAD_ALL]
    for schedule, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(got, want)), schedule.label()


def test_row_schedule_table_and_errors():
    """Every R keeps every row's inputs before the state (with the stored deltas the fastest at
    R = 3, 4, 5 and within noise at R = 1); every table entry is a candidate (checked bit for bit on
    the GPU); the table ends unbounded; labels name what the bench parses; bad fields are refused by
    name."""
    assert ROW_SCHEDULE_TABLE[-1][0] is None
    for rows_per_request in (1, 2, 3, 4, 5, 9):
        assert gdn_row_schedule(rows_per_request) == PRELOAD_ALL
    assert LATE_OWN_ROWS in CANDIDATE_SCHEDULES  # gdn6's R = 5 choice, slower since (kept to compare)
    assert {schedule for _, schedule in ROW_SCHEDULE_TABLE} <= set(CANDIDATE_SCHEDULES)
    assert GDNRowSchedule(own_early=0, ahead=2, q_at_row=True, max_registers=168).label() == "0/all/2/1/168"
    assert GDNRowSchedule().constants(3, 5) == dict(OWN_EARLY=3, PENDING_EARLY=5, AHEAD=1, Q_AT_ROW=False)
    with pytest.raises(ValueError, match="own_early"):
        GDNRowSchedule(own_early=-1)
    with pytest.raises(ValueError, match="max_registers"):
        GDNRowSchedule(max_registers=300)
    with pytest.raises(ValueError, match="q_at_row"):
        GDNRowSchedule(q_at_row=1)
    with pytest.raises(TypeError, match="schedule"):
        GDNTiles(32, 2, schedule="0/0/1/1/0")


def test_every_launch_takes_the_one_shape():
    """A pending row is applied under the next step's launch shape, and an S = 0 row under R = 1's:
    plain and speculative decoding commit the same state bit for bit only if every (nd, R) takes
    one shape (the order of the sums over K follows it), so a table entry with another shape would
    break losslessness (gdn_tiles' comment)."""
    assert {(tiles.block_v, tiles.num_warps) for _, tiles in VERIFY_TILE_TABLE} \
        == {(DEFAULT_TILES.block_v, DEFAULT_TILES.num_warps)}
    for requests in (1, 7, 64, 1000):
        for rows_per_request in (1, 2, 3, 5, 9):
            assert gdn_verify_tiles(requests, rows_per_request) == DEFAULT_TILES
    assert DEFAULT_TILES in CANDIDATE_TILES  # the GPU test checks S = 4 steps bit for bit under each candidate


def test_tile_table_covers_every_launch():
    """The table ends with an unbounded entry, and a launch takes the first entry whose bounds hold."""
    assert VERIFY_TILE_TABLE[-1][0] == (None, None)
    for (max_requests, max_rows), tiles in VERIFY_TILE_TABLE:
        requests, rows_per_request = max_requests or 10_000, max_rows or 9
        first = next(t for (b, r), t in VERIFY_TILE_TABLE
                     if (b is None or requests <= b) and (r is None or rows_per_request <= r))
        assert gdn_verify_tiles(requests, rows_per_request) is first
    with pytest.raises(ValueError, match="block_v"):
        GDNTiles(24, 4)
    with pytest.raises(ValueError, match="block_v"):
        GDNTiles(True, 2)  # a bool is not a width
    with pytest.raises(TypeError, match="tiles"):
        gdn_verify_rows(*pools(1, 3), 0, torch.tensor([0, 1]), **rows(1, 6), rows_per_request=3, tiles=(32, 4))


def test_errors_name_the_argument():
    inputs = rows(1, 6)
    states, row_inputs, pending, parity = pools(1, 3)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="row_inputs"):
        gdn_verify_rows(states, row_inputs[..., :-1], pending, parity, 0, slots, **inputs, rows_per_request=3)
    with pytest.raises(ValueError, match="layer"):
        gdn_verify_rows(states, row_inputs, pending, parity, LAYERS, slots, **inputs, rows_per_request=3)
    with pytest.raises(ValueError, match="rows_per_request"):
        gdn_verify_rows(states, row_inputs, pending, parity, 0, slots, **inputs, rows_per_request=4)
    with pytest.raises(TypeError, match="recurrent_states"):
        gdn_verify_rows(states.double(), row_inputs, pending, parity, 0, slots, **inputs, rows_per_request=3)
    with pytest.raises(TypeError, match="pending_rows"):
        gdn_verify_rows(states, row_inputs, pending.long(), parity, 0, slots, **inputs, rows_per_request=3)
    with pytest.raises(TypeError, match="prefill_status"):
        gdn_mark_pending_rows(pending, parity, torch.zeros(2), slots, slots, 3, SCRATCH)
    with pytest.raises(ValueError, match="accepted_counts"):
        gdn_mark_pending_rows(pending, parity, slots, slots, slots[:1], 3, SCRATCH)
    with pytest.raises(ValueError, match="scratch_slot"):
        gdn_mark_pending_rows(pending, parity, slots, slots, slots, 3, SLOTS)
