"""RequestTable: stable slots (taken at insert, kept until remove), ordered groups, host (numpy)
and device rows by slot, batched device writes, the one staging copy."""

import random

import pytest
import torch

from mtp_ctrl.state import RequestTable, RowGroup
from mtp_ctrl.state.engine_shape import EngineShape
from mtp_ctrl.state.staging import StagingBuffers

GROUPS = (RowGroup.DECODE, RowGroup.PREFILL, RowGroup.PAUSED)


def make_table(max_requests=6, max_blocks=3, num_speculative_tokens=2):
    # a max_model_len whose worst case is max_blocks blocks of 4: ceil((L + 2 (1 + S)) / 4)
    shape = EngineShape(max_requests=max_requests, max_model_len=4 * max_blocks - 2 * (num_speculative_tokens + 1),
                        block_size_tokens=4, num_speculative_tokens=num_speculative_tokens,
                        max_tokens_per_step=max_requests * (num_speculative_tokens + 1))
    assert shape.max_blocks_per_request == max_blocks
    return RequestTable(shape)


def fill_row(table, request_id):
    """Give a request's slot distinct values on host and device (as admission and a step would)."""
    row = table.slot_of(request_id)
    table.host.known_lengths[row] = 100 + request_id
    table.host.block_ids[row, 0] = request_id
    table.host_rows_extra[row] = 4000 + request_id
    table.device.kv_length_offsets[row] = 100 + request_id
    table.device.kv_block_ids[row, 0] = request_id
    table.next_tokens[row] = 1000 + request_id
    table.draft_tokens[row] = torch.tensor([2000, 3000]) + request_id
    table.device_rows_extra[row] = 5000 + request_id


def test_staging_buffers_one_copy_of_mixed_dtypes():
    buffers = StagingBuffers({"a": ((3,), torch.int64), "b": ((2, 2), torch.int32)}, torch.device("cpu"))
    buffers.host["a"][:] = torch.tensor([1, 2, 3])
    buffers.host["b"][:] = torch.tensor([[4, 5], [6, 7]], dtype=torch.int32)
    assert buffers.device["b"].dtype == torch.int32 and buffers.device["b"].shape == (2, 2)
    assert int(buffers.device["a"].sum()) == 0
    buffers.copy_to_device()
    assert torch.equal(buffers.device["a"], torch.tensor([1, 2, 3]))
    assert torch.equal(buffers.device["b"], torch.tensor([[4, 5], [6, 7]], dtype=torch.int32))
    assert buffers.nbytes == 128  # two 64-byte aligned sections
    # double-buffered: the next step writes the other host buffer; the device keeps the last copy
    buffers.wait_until_host_writable()
    assert int(buffers.host["a"].sum()) == 0
    buffers.host["a"][:] = torch.tensor([7, 8, 9])
    assert torch.equal(buffers.device["a"], torch.tensor([1, 2, 3]))
    buffers.copy_to_device()
    assert torch.equal(buffers.device["a"], torch.tensor([7, 8, 9]))
    assert torch.equal(buffers.host["a"], torch.tensor([1, 2, 3]))  # back to the first buffer


def test_groups_are_ordered_lists_of_stable_slots():
    table = make_table()
    for request_id, group in ((10, RowGroup.PREFILL), (11, RowGroup.PREFILL), (12, RowGroup.DECODE)):
        table.insert(request_id, group)
    assert [table.slot_of(request_id) for request_id in (10, 11, 12)] == [0, 1, 2]  # the lowest free slot
    assert table.slots_in(RowGroup.DECODE).tolist() == [2] and table.slots_in(RowGroup.PREFILL).tolist() == [0, 1]
    assert table.request_ids_in(RowGroup.DECODE) == [12]
    assert table.request_ids_in(RowGroup.PREFILL) == [10, 11]
    assert table.host.prefill_status[:3].tolist() == [1, 1, 0]
    table.move(11, RowGroup.PAUSED)
    assert table.group_of(11) == RowGroup.PAUSED and table.slot_of(11) == 1  # the slot stays
    table.move(11, RowGroup.DECODE)  # joins the end of the decode group
    assert table.request_ids_in(RowGroup.DECODE) == [12, 11]
    assert table.request_ids_in(RowGroup.PREFILL) == [10]
    table.remove([10])
    assert table.num_live == 2 and 10 not in table
    assert table.host.request_ids[0].item() == -1  # the freed slot is reset
    assert [table.slot_of(request_id) for request_id in (11, 12)] == [1, 2]  # nothing else moved
    assert table.live_slots().tolist() == [2, 1]  # decode order
    table.insert(13, RowGroup.PREFILL)
    assert table.slot_of(13) == 0  # the freed slot is reused


def test_remove_frees_slots_and_resets_them_on_the_device():
    """DECODE [a, b, c] | PREFILL [d, e]; remove(a, d) -> DECODE [b, c] | PREFILL [e], every other
    slot unchanged; with the next row writes the freed slots point at the scratch block and Mamba
    slot (one taken again in between is written as its new request's)."""
    table = make_table()
    table.set_free_row_targets(scratch_block=50, scratch_slot=7)
    for request_id in (1, 2, 3):
        table.insert(request_id, RowGroup.DECODE, mamba_slot_id=request_id)
    for request_id in (4, 5):
        table.insert(request_id, RowGroup.PREFILL, mamba_slot_id=request_id)
    table.write_inserted_rows()
    table.remove([1, 4])
    assert table.host.request_ids[:5].tolist() == [-1, 2, 3, -1, 5]
    assert table.request_ids_in(RowGroup.DECODE) == [2, 3] and table.request_ids_in(RowGroup.PREFILL) == [5]
    device = table.device
    table.write_inserted_rows()
    assert device.kv_block_ids[[0, 3]].unique().tolist() == [50] and device.mamba_slot_ids[[0, 3]].tolist() == [7, 7]
    assert device.mamba_slot_ids[[1, 2, 4]].tolist() == [2, 3, 5]
    assert device.kv_block_ids[table.scratch_row].unique().tolist() == [50]  # padding's slot too
    # freed, then taken again before the writes: written once, as the new request's (no KV, its Mamba slot)
    table.remove([2, 5])
    assert table.insert(6, RowGroup.DECODE, mamba_slot_id=9) == 0  # slot 0 (free since before): the lowest
    assert table.insert(7, RowGroup.DECODE, mamba_slot_id=8) == 1  # request 2's slot
    table.write_inserted_rows()
    assert device.mamba_slot_ids[:5].tolist() == [9, 8, 3, 7, 7]  # slot 4 (request 5's) reset, 3 still free
    assert device.kv_block_ids[[0, 1]].unique().tolist() == [-1] and device.kv_length_offsets[[0, 1]].tolist() == [0, 0]
    assert device.kv_block_ids[[3, 4]].unique().tolist() == [50] and table.mismatched_rows() == []


def test_slots_keep_every_row_on_both_sides_through_moves_and_removals():
    rng = random.Random(0)
    table = make_table()
    table.host_rows_extra = table.add_host_rows("extra", ())  # caller rows stay with their requests
    table.device_rows_extra = table.add_device_rows("extra", (), torch.int64)
    groups, first_slot = {}, {}
    next_id = 0
    for _ in range(300):
        live = list(groups)
        action = rng.random()
        if action < 0.3 and table.num_live < table.shape.max_requests:
            group = rng.choice(GROUPS)
            table.insert(next_id, group)
            table.write_inserted_rows()
            fill_row(table, next_id)
            groups[next_id] = group
            next_id += 1
        elif action < 0.8 and live:
            request_id, group = rng.choice(live), rng.choice(GROUPS)
            table.move(request_id, group)
            groups[request_id] = group
        elif live:  # one or several leave at once
            leaving = rng.sample(live, rng.randint(1, len(live)))
            table.remove(leaving)
            for request_id in leaving:
                del groups[request_id]
        slots = {request_id: table.slot_of(request_id) for request_id in groups}
        for group in GROUPS:
            assert sorted(table.request_ids_in(group)) == sorted(r for r, g in groups.items() if g == group)
        assert table.mismatched_rows() == []
        for request_id in groups:
            row = first_slot.setdefault(request_id, slots[request_id])
            assert row == slots[request_id]  # a request never changes slot
            assert table.host.request_ids[row] == request_id
            assert table.host.known_lengths[row] == 100 + request_id
            assert table.host_rows_extra[row] == 4000 + request_id
            assert table.device.kv_length_offsets[row] == 100 + request_id
            assert table.device.kv_block_ids[row, 0] == request_id
            assert table.next_tokens[row] == 1000 + request_id
            assert table.draft_tokens[row].tolist() == [2000 + request_id, 3000 + request_id]
            assert table.device_rows_extra[row] == 5000 + request_id
    with pytest.raises(ValueError, match="already exist"):
        table.add_host_rows("extra", ())
    with pytest.raises(ValueError, match="already exist"):
        table.add_device_rows("extra", (), torch.int64)


def test_mismatch_check_names_fields():
    table = make_table()
    table.insert(5, RowGroup.DECODE)
    table.write_inserted_rows()
    assert table.mismatched_rows() == []
    table.device.kv_block_ids[0, 1] = 9
    assert table.mismatched_rows() == ["kv_block_ids"]
    table.host.block_ids[0, 1] = 9
    table.device.kv_length_offsets[0] = 3
    assert table.mismatched_rows() == ["kv_length_offsets"]
    table.host.known_lengths[0] = 3
    assert table.mismatched_rows() == []
    table.set_prefill_status(0, 1)
    assert table.host.prefill_status[0] == 1 and table.device.prefill_status[0] == 1


def test_free_rows_and_full_table():
    table = make_table(max_requests=2)
    device = table.device
    assert device.last_kv_block_id.tolist() == [-1, -1, -1] and device.mamba_slot_ids.tolist() == [-1, -1, -1]
    assert device.last_kv_block_offset.tolist() == [3, 3, 3]  # (0 - 1) mod 4: the next row opens a block
    table.insert(1, RowGroup.PREFILL, mamba_slot_id=4)
    table.write_inserted_rows()
    assert table.host.mamba_slot_ids[0] == 4 and device.mamba_slot_ids[0] == 4
    device.kv_length_offsets[0] = 9  # a step ran
    device.kv_block_ids[0, 0] = 7
    table.host.block_counts[0], table.host.block_ids[0, 0], table.host.known_lengths[0] = 1, 7, 9
    table.remove([1])
    assert table.host.request_ids[0] == -1 and table.host.block_counts[0] == 0
    assert table.host.block_ids[0].tolist() == [-1, -1, -1]
    table.insert(2, RowGroup.DECODE)  # the reused row starts fresh on both sides
    table.write_inserted_rows()
    assert table.host.known_lengths[0] == 0 and table.host.prefill_status[0] == 0
    assert device.kv_length_offsets[0] == 0 and device.kv_block_ids[0].tolist() == [-1, -1, -1]
    assert device.last_kv_block_offset[0] == 3 and device.last_kv_block_id[0] == -1
    assert table.mismatched_rows() == []
    table.insert(3, RowGroup.PREFILL)
    with pytest.raises(RuntimeError, match="full"):
        table.insert(4, RowGroup.PREFILL)


def _device_op_count(fn) -> int:
    """How many torch ops ``fn`` runs (each is one device launch on a GPU)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for event in prof.events() if event.name.startswith("aten::") and event.cpu_parent is None
               and event.name not in ("aten::slice", "aten::select", "aten::view", "aten::t", "aten::transpose",
                                      "aten::as_strided", "aten::numpy_T", "aten::permute", "aten::expand"))


def _table_with_sampling_rows(max_requests=8):
    table = make_table(max_requests=max_requests)
    table.add_device_rows("temperature", (), torch.float32, set_on_insert=True)
    table.add_device_rows("seed", (), torch.int64, set_on_insert=True)
    return table


def _assert_fresh(table, request_id, group, mamba_slot_id=-1):
    row = table.slot_of(request_id)
    device = table.device
    assert device.kv_length_offsets[row] == 0 and device.kv_block_counts[row] == 0
    assert device.last_kv_block_offset[row] == 3 and device.last_kv_block_id[row] == -1
    assert device.prefill_status[row] == int(group == RowGroup.PREFILL)
    assert device.mamba_slot_ids[row] == mamba_slot_id
    assert device.kv_block_ids[row].tolist() == [-1, -1, -1]
    assert table.device_rows_with_scratch("temperature")[row] == request_id / 10
    assert table.device_rows_with_scratch("seed")[row] == 7000 + request_id


@pytest.mark.parametrize("seed", range(6))
def test_inserted_rows_are_written_in_one_batch(seed):
    """Inserts only write the host; write_inserted_rows resets every pending request's device rows
    in its slot, after moves and removals in between (a freed slot's stale rows are overwritten),
    and costs the same number of device ops for one request as for many."""
    rng = random.Random(seed)
    table = _table_with_sampling_rows()
    table.host_rows_extra = table.add_host_rows("extra", ())
    table.device_rows_extra = table.add_device_rows("extra", (), torch.int64)
    for request_id in (90, 91):  # older requests with a step's worth of state
        table.insert(request_id, rng.choice(GROUPS), row_values={"temperature": request_id / 10, "seed": 7000 + request_id})
    table.write_inserted_rows()
    for request_id in (90, 91):
        fill_row(table, request_id)
    # stale device content in the free rows, as finished requests leave it
    table.device.kv_length_offsets[2:] = 55
    table.device.kv_block_ids[2:] = 9
    groups, pending, inserted_as, freed = {90: table.group_of(90), 91: table.group_of(91)}, [], {}, set()
    for request_id in range(rng.randint(1, 5)):
        group = rng.choice(GROUPS)
        table.insert(request_id, group, mamba_slot_id=request_id + 20,
                     row_values={"temperature": request_id / 10, "seed": 7000 + request_id})
        groups[request_id] = inserted_as[request_id] = group  # prefill status: the insert's (a move keeps it)
        pending.append(request_id)
        if rng.random() < 0.5:  # a move of a pending or an older request
            moved = rng.choice(list(groups))
            groups[moved] = rng.choice(GROUPS)
            table.move(moved, groups[moved])
        if rng.random() < 0.3:  # a pending request leaves before its row was ever written
            gone = rng.choice(pending)
            freed.add(table.slot_of(gone))
            table.remove([gone])
            pending.remove(gone)
            del groups[gone]
    ops = _device_op_count(table.write_inserted_rows)
    for request_id in pending:
        _assert_fresh(table, request_id, inserted_as[request_id], request_id + 20)
    for request_id in (90, 91):
        row = table.slot_of(request_id)
        assert table.device.kv_length_offsets[row] == 100 + request_id
        assert table.device_rows_extra[row] == 5000 + request_id
    still_free = sorted(freed - set(table.live_slots().tolist()))  # freed in between and not taken again
    assert table.device.kv_length_offsets[still_free].tolist() == [0] * len(still_free)  # reset, stale 55 gone
    if pending:  # the staged copy, fields and block ids, one per set_on_insert row (and the resets' two)
        assert ops == 1 + 2 + 2 + (2 if still_free else 0)
    assert _device_op_count(table.write_inserted_rows) == 0  # nothing pending


def test_remove_costs_one_batch_of_device_writes_and_moves_nothing():
    """Leaving writes the host only; the next row writes reset every slot freed since with one
    staged copy and two indexed writes, however many left; the survivors' rows are untouched."""
    table = _table_with_sampling_rows()
    for request_id in range(8):
        table.insert(request_id, GROUPS[request_id % 3], row_values={"temperature": request_id / 10,
                                                                      "seed": 7000 + request_id})
    table.write_inserted_rows()
    for request_id in range(8):
        row = table.slot_of(request_id)
        table.next_tokens[row] = 1000 + request_id
        table.device.kv_length_offsets[row] = 100 + request_id
    assert _device_op_count(lambda: table.remove([0, 3, 4, 6])) == 0
    assert _device_op_count(lambda: table.remove([1])) == 0
    assert _device_op_count(table.write_inserted_rows) == 1 + 2
    assert table.device.kv_length_offsets[[0, 1, 3, 4, 6]].tolist() == [0] * 5
    for request_id in (2, 5, 7):
        row = table.slot_of(request_id)
        assert row == request_id
        assert table.next_tokens[row] == 1000 + request_id and table.device.kv_length_offsets[row] == 100 + request_id
        assert table.device_rows_with_scratch("seed")[row] == 7000 + request_id


def test_remove_checks_every_id_before_changing_anything():
    table = make_table()
    for request_id in (1, 2, 3):
        table.insert(request_id, RowGroup.DECODE)
    for bad in ([2, 9], [1, 1]):
        with pytest.raises(ValueError, match="distinct live requests"):
            table.remove(bad)
        assert table.num_live == 3 and table.host.request_ids[:3].tolist() == [1, 2, 3]


def test_insert_values_are_checked():
    table = _table_with_sampling_rows()
    with pytest.raises(ValueError, match="row_values must name"):
        table.insert(1, RowGroup.PREFILL, row_values={"temperature": 1.0})
    with pytest.raises(ValueError, match="row_values must name"):
        table.insert(1, RowGroup.PREFILL)
    assert 1 not in table and table.num_live == 0  # nothing changed
    with pytest.raises(ValueError, match="scalar rows"):
        table.add_device_rows("history", (3,), torch.int64, set_on_insert=True)
    table.insert(1, RowGroup.PREFILL, row_values={"temperature": 1.0, "seed": 3})
    with pytest.raises(RuntimeError, match="not written yet"):
        table.add_device_rows("top_k", (), torch.int64, set_on_insert=True)
    table.write_inserted_rows()
    table.add_device_rows("top_k", (), torch.int64, set_on_insert=True)  # the staging layout grows
    table.insert(2, RowGroup.PREFILL, row_values={"temperature": 0.5, "seed": 4, "top_k": 8})
    table.write_inserted_rows()
    assert table.device_rows_with_scratch("top_k")[table.slot_of(2)] == 8


def test_insert_with_cached_blocks_starts_past_them():
    """A request that attaches cached blocks (prefix caching): host and device rows hold them,
    its KV length starts past them, ``kv_start`` rows take that length; others start at 0."""
    table = make_table()
    start = table.add_device_rows("start", (), torch.int64, kv_start=True)
    with pytest.raises(ValueError, match="enable_cached_prefixes"):
        table.insert(7, RowGroup.PREFILL, cached_block_ids=[5, 2])
    table.enable_cached_prefixes()
    table.insert(7, RowGroup.PREFILL, cached_block_ids=[5, 2])
    table.insert(8, RowGroup.PREFILL)
    table.write_inserted_rows()
    row, fresh = table.slot_of(7), table.slot_of(8)
    assert table.host.known_lengths[row] == 8 and table.host.block_counts[row] == 2
    assert table.host.block_ids[row].tolist() == [5, 2, -1]
    assert table.device.kv_block_ids[row].tolist() == [5, 2, -1] and int(table.device.kv_length_offsets[row]) == 8
    assert int(start[row]) == 8 and int(start[fresh]) == 0 and int(table.device.kv_length_offsets[fresh]) == 0
    assert table.mismatched_rows() == []
    with pytest.raises(ValueError, match="cached_block_ids"):
        table.insert(9, RowGroup.PREFILL, cached_block_ids=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="row_values"):
        table.insert(9, RowGroup.PREFILL, row_values={"start": 3})
