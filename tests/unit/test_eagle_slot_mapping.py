"""eagle_step_update_slot_mapping_and_metadata: kernel == reference == worked example, in place."""

import pytest
import torch

from mtp_ctrl.triton_ops import eagle_step_update_slot_mapping_and_metadata, reference
from tests.unit.drafting_cases import step_slot_mapping_case

OPS = [eagle_step_update_slot_mapping_and_metadata, reference.eagle_step_update_slot_mapping_and_metadata]


def _example_args():
    positions = torch.tensor([4, 9, 2])
    block_table = torch.tensor([[7, 3, 5], [2, 8, 0], [6, 1, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([5, 10, 3], dtype=torch.int32)
    out_clamped_positions = torch.full((3,), -7)
    out_slot_mapping = torch.full((6,), -7)
    return [positions, block_table, seq_lens, 4, 10, out_clamped_positions, out_slot_mapping, 5]


@pytest.mark.parametrize("op", OPS)
def test_worked_example_with_overflow_and_padding_rows(op):
    args = _example_args()
    assert op(*args) is None
    _, _, seq_lens, _, _, clamped, slots, _ = args
    assert clamped.tolist() == [5, 0, 3]
    assert slots.tolist() == [13, -1, 27, -1, -1, -7]  # rows 3, 4 are padding; row 5 is past input_batch_size
    assert seq_lens.tolist() == [6, 1, 4]


@pytest.mark.parametrize("op", OPS)
def test_seq_len_is_capped_at_max_model_len(op):
    args = _example_args()
    args[0] = torch.tensor([4, 7, 2])
    args[2] = torch.tensor([10, 10, 9], dtype=torch.int32)
    op(*args)
    assert args[2].tolist() == [10, 10, 10]


@pytest.mark.parametrize("op", OPS)
def test_block_index_is_clamped_to_the_table(op):
    args = _example_args()
    args[1] = args[1][:, :1]  # a table narrower than max_model_len needs
    op(*args)
    assert args[6][:3].tolist() == [7 * 4 + 1, -1, 6 * 4 + 3]


@pytest.mark.parametrize("batch_size, padding_rows", [(0, 0), (0, 4), (1, 0), (5, 3), (130, 0), (200, 70)])
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_matches_reference(batch_size, padding_rows, seed):
    generator = torch.Generator().manual_seed(seed * 1000 + batch_size)
    kernel_args = step_slot_mapping_case(generator, batch_size=batch_size, padding_rows=padding_rows)
    reference_args = [arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in kernel_args]
    eagle_step_update_slot_mapping_and_metadata(*kernel_args)
    reference.eagle_step_update_slot_mapping_and_metadata(*reference_args)
    for got, want in zip(kernel_args, reference_args):
        if isinstance(got, torch.Tensor):
            assert torch.equal(got, want)


def test_input_batch_size_defaults_to_batch_size():
    args = _example_args()[:7]
    eagle_step_update_slot_mapping_and_metadata(*args)
    assert args[6].tolist() == [13, -1, 27, -7, -7, -7]


@pytest.mark.parametrize(
    "index, value, error, match",
    [
        (0, torch.zeros(3), TypeError, "positions_1d"),
        (1, torch.zeros(2, 3, dtype=torch.int32), ValueError, "block_table"),
        (2, torch.zeros(4, dtype=torch.int32), ValueError, "seq_lens"),
        (3, 0, ValueError, "block_size"),
        (4, 2.0, TypeError, "max_model_len"),
        (5, torch.zeros(2, dtype=torch.int64), ValueError, "out_clamped_positions"),
        (6, torch.zeros(4, dtype=torch.int64), ValueError, "out_slot_mapping"),
        (7, 2, ValueError, "input_batch_size"),
    ],
)
def test_bad_arguments_are_named(index, value, error, match):
    args = _example_args()
    args[index] = value
    with pytest.raises(error, match=match):
        eagle_step_update_slot_mapping_and_metadata(*args)
