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
