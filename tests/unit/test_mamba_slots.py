"""MambaStateSlots: shapes, zeroed slots on allocation, clear errors."""

import pytest
import torch

from mtp_ctrl.state import MambaSpec, MambaStateSlots


def make_slots(num_slots=3, num_speculative_tokens=2):
    spec = MambaSpec(num_layers=2, conv_state_shape=(4, 3), ssm_state_shape=(2, 5, 6), dtype=torch.float32)
    return MambaStateSlots(spec, num_slots, num_speculative_tokens, torch.device("cpu"))


def test_shapes_include_the_scratch_slot():
    slots = make_slots()
    assert slots.scratch_slot == 3
    assert slots.conv_states.shape == (2, 4, 4, 3)
    assert slots.ssm_states.shape == (2, 4, 2, 5, 6)
    assert slots.intermediate_conv_states.shape == (2, 4, 3, 4, 3)
    assert slots.intermediate_ssm_states.shape == (2, 4, 3, 2, 5, 6)
    assert sorted(slots.allocate_slot() for _ in range(3)) == [0, 1, 2]  # never the scratch slot


def test_allocate_zeroes_the_slot_and_release_reuses_it():
    slots = make_slots()
    first = slots.allocate_slot()
    assert first == 0
    slots.conv_states[:, first] = 1.0
    slots.ssm_states[:, first] = 2.0
    slots.release_slot(first)
    again = slots.allocate_slot()
    assert again == first
    assert int(slots.conv_states[:, again].count_nonzero()) == 0
    assert int(slots.ssm_states[:, again].count_nonzero()) == 0


def test_errors():
    slots = make_slots(num_slots=2)
    taken = [slots.allocate_slot(), slots.allocate_slot()]
    assert slots.num_free_slots == 0
    with pytest.raises(RuntimeError, match="all 2 Mamba state slots are in use"):
        slots.allocate_slot()
    slots.release_slot(taken[0])
    with pytest.raises(ValueError, match="double release"):
        slots.release_slot(taken[0])
    with pytest.raises(ValueError, match="outside"):
        slots.release_slot(2)
    with pytest.raises(TypeError, match="slot must be an int"):
        slots.release_slot(1.0)
    assert slots.num_free_slots == 1


def test_spec_validation():
    with pytest.raises(ValueError, match="conv_state_shape"):
        MambaSpec(num_layers=1, conv_state_shape=(), ssm_state_shape=(2,), dtype=torch.float32)
    with pytest.raises(ValueError, match="ssm_state_shape"):
        MambaSpec(num_layers=1, conv_state_shape=(2,), ssm_state_shape=(0,), dtype=torch.float32)
    with pytest.raises(ValueError, match="num_layers"):
        MambaSpec(num_layers=0, conv_state_shape=(2,), ssm_state_shape=(2,), dtype=torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        MambaSpec(num_layers=1, conv_state_shape=(2,), ssm_state_shape=(2,), dtype=torch.int32)
    spec = MambaSpec(num_layers=1, conv_state_shape=[2], ssm_state_shape=[3], dtype=torch.float32)
    with pytest.raises(ValueError, match="num_slots"):
        MambaStateSlots(spec, 0, 1, torch.device("cpu"))


def make_gdn_slots(num_speculative_tokens):
    """Gated DeltaNet slots: 2 layers, H = 4 value heads, Hk = 2, K = 8, V = 6 (F = 16 + 24 + 4: [k | u | g])."""
    spec = MambaSpec(num_layers=2, conv_state_shape=(4, 3), ssm_state_shape=(4, 8, 6), dtype=torch.float32,
                     gdn_key_heads=2)
    return MambaStateSlots(spec, 3, num_speculative_tokens, torch.device("cpu"))


def test_gdn_slots_store_row_inputs_and_defer_the_commit():
    """No intermediate recurrent states: row inputs [L, M + 1, 2, 1 + S, F] (two buffers) and a
    pending count and parity per slot; the commit copies the conv window and only records the kept
    rows (the state is the next step's to update); a new request's slot starts with 0 pending."""
    slots = make_gdn_slots(2)
    assert slots.intermediate_ssm_states is None
    assert slots.verify_row_inputs.shape == (2, 4, 2, 3, 44)
    generator = torch.Generator().manual_seed(3)
    for tensor in (slots.ssm_states, slots.intermediate_conv_states):
        tensor.copy_(torch.rand(tensor.shape, generator=generator) * 0.5)
    before = slots.ssm_states.clone()
    status, slot_ids, counts = torch.tensor([0, 1, 0]), torch.tensor([2, 0, 1]), torch.tensor([1, 2, 0])
    slots.commit_accepted(status, slot_ids, counts)
    assert torch.equal(slots.ssm_states, before)
    assert slots.pending_rows.tolist() == [0, 1, 2, 0]  # slot 0 prefills; the scratch slot keeps 0
    assert slots.input_parity.tolist() == [0, 1, 1, 0]
    assert torch.equal(slots.conv_states[:, 2], slots.intermediate_conv_states[:, 2, 1])
    slot = slots.allocate_slot()
    slots.release_slot(slot)
    slots.pending_rows[slot] = 3
    assert slots.allocate_slot() == slot and slots.pending_rows[slot] == 0


def test_gdn_slots_without_drafts_leave_the_recurrent_state_to_the_decode_row():
    slots = make_gdn_slots(0)
    slots.ssm_states.fill_(1.0)
    slots.commit_accepted(torch.tensor([0]), torch.tensor([1]), torch.tensor([0]))
    assert bool((slots.ssm_states == 1.0).all())  # the S = 0 decode row wrote it in place
    assert int(slots.pending_rows.sum()) == 0  # S = 0 stores no rows
    wide = make_gdn_slots(2)
    wide.pending_rows[1] = 2  # kept by a wider step; a step of V = 0 (one row) applied them in place
    wide.commit_accepted(torch.tensor([0]), torch.tensor([1]), torch.tensor([0]), rows_per_request=1)
    assert wide.pending_rows[1] == 0


def test_gdn_spec_validation():
    with pytest.raises(ValueError, match="gdn_key_heads"):
        MambaSpec(num_layers=1, conv_state_shape=(2,), ssm_state_shape=(4, 8, 6), dtype=torch.float32,
                  gdn_key_heads=3)
    with pytest.raises(TypeError, match="fp32"):
        MambaSpec(num_layers=1, conv_state_shape=(2,), ssm_state_shape=(4, 8, 6), dtype=torch.bfloat16,
                  gdn_key_heads=2)
