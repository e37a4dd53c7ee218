"""RequestTable: row groups, moves mirrored on host (numpy) and device rows, the one staging copy."""

import random

import pytest
import torch

from mtp_ctrl.state import RequestTable, RowGroup
from mtp_ctrl.state.staging import StagingBuffers

GROUPS = (RowGroup.DECODE, RowGroup.PREFILL, RowGroup.PAUSED)


def make_table(max_requests=6, max_blocks=3, num_speculative_tokens=2):
    return RequestTable(max_requests, max_blocks, num_speculative_tokens, 4, torch.device("cpu"))


def fill_row(table, request_id):
    """Give a request's row distinct values on host and device (as admission and a step would)."""
    row = table.row_of(request_id)
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


def test_groups_are_contiguous_and_ordered():
    table = make_table()
    for request_id, group in ((10, RowGroup.PREFILL), (11, RowGroup.PREFILL), (12, RowGroup.DECODE)):
        table.insert(request_id, group)
    assert table.group_rows(RowGroup.DECODE) == (0, 1)
    assert table.group_rows(RowGroup.PREFILL) == (1, 3)
    assert table.request_ids_in(RowGroup.DECODE) == [12]
    assert sorted(table.request_ids_in(RowGroup.PREFILL)) == [10, 11]
    assert table.host.prefill_status[: 3].tolist() == [0, 1, 1]
    table.move(11, RowGroup.PAUSED)
    assert table.group_of(11) == RowGroup.PAUSED and table.row_of(11) == 2
    table.move(11, RowGroup.DECODE)  # joins the end of the decode group
    assert table.request_ids_in(RowGroup.DECODE) == [12, 11]
    assert table.request_ids_in(RowGroup.PREFILL) == [10]
    table.remove(12)
    assert table.num_live == 2 and 12 not in table
    assert table.host.request_ids[2].item() == -1  # the freed row is reset


def test_worked_example_of_move():
    """DECODE [a, b] | PREFILL [c, d]; move(a, PREFILL) -> DECODE [b] | PREFILL [a, c, d]."""
    table = make_table()
    for request_id in (1, 2):
        table.insert(request_id, RowGroup.DECODE)
    for request_id in (3, 4):
        table.insert(request_id, RowGroup.PREFILL)
    table.move(1, RowGroup.PREFILL)
    assert table.host.request_ids[:4].tolist() == [2, 1, 3, 4]
    assert table.group_rows(RowGroup.DECODE) == (0, 1)


def test_worked_example_of_remove():
    """DECODE [a, b, c] | PREFILL [d, e]; remove(a) -> DECODE [c, b] | PREFILL [e, d]: one row copy
    per group boundary, the removed row is not kept."""
    table = make_table()
    for request_id in (1, 2, 3):
        table.insert(request_id, RowGroup.DECODE)
    for request_id in (4, 5):
        table.insert(request_id, RowGroup.PREFILL)
    moves = table.num_moves
    table.remove(1)
    assert table.host.request_ids[:5].tolist() == [3, 2, 5, 4, -1]
    assert table.group_rows(RowGroup.DECODE) == (0, 2) and table.group_rows(RowGroup.PREFILL) == (2, 4)
    assert table.num_moves == moves + 3  # two row copies and the removal


def test_moves_carry_every_row_on_both_sides():
    rng = random.Random(0)
    table = make_table()
    table.host_rows_extra = table.add_host_rows("extra", ())  # caller rows move with their requests
    table.device_rows_extra = table.add_device_rows("extra", (), torch.int64)
    groups = {}
    next_id = 0
    for _ in range(300):
        live = list(groups)
        action = rng.random()
        if action < 0.3 and table.num_live < table.max_requests:
            group = rng.choice(GROUPS)
            table.insert(next_id, group)
            fill_row(table, next_id)
            groups[next_id] = group
            next_id += 1
        elif action < 0.8 and live:
            request_id, group = rng.choice(live), rng.choice(GROUPS)
            table.move(request_id, group)
            groups[request_id] = group
        elif live:
            request_id = rng.choice(live)
            table.remove(request_id)
            del groups[request_id]
        for group in GROUPS:
            assert sorted(table.request_ids_in(group)) == sorted(r for r, g in groups.items() if g == group)
        assert table.mismatched_rows() == []
        for request_id in groups:
            row = table.row_of(request_id)
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
    assert device.last_kv_block_id.tolist() == [-1, -1] and device.mamba_slot_ids.tolist() == [-1, -1]
    assert device.last_kv_block_offset.tolist() == [3, 3]  # (0 - 1) mod 4: the next row opens a block
    table.insert(1, RowGroup.PREFILL, mamba_slot_id=4)
    assert table.host.mamba_slot_ids[0] == 4 and device.mamba_slot_ids[0] == 4
    device.kv_length_offsets[0] = 9  # a step ran
    device.kv_block_ids[0, 0] = 7
    table.host.block_counts[0], table.host.block_ids[0, 0], table.host.known_lengths[0] = 1, 7, 9
    table.remove(1)
    assert table.host.request_ids[0] == -1 and table.host.block_counts[0] == 0
    assert table.host.block_ids[0].tolist() == [-1, -1, -1]
    table.insert(2, RowGroup.DECODE)  # the reused row starts fresh on both sides
    assert table.host.known_lengths[0] == 0 and table.host.prefill_status[0] == 0
    assert device.kv_length_offsets[0] == 0 and device.kv_block_ids[0].tolist() == [-1, -1, -1]
    assert device.last_kv_block_offset[0] == 3 and device.last_kv_block_id[0] == -1
    assert table.mismatched_rows() == []
    table.insert(3, RowGroup.PREFILL)
    with pytest.raises(RuntimeError, match="full"):
        table.insert(4, RowGroup.PREFILL)
