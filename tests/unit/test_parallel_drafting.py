"""ptd_prepare_inputs: kernel == reference == worked example; padding rows, overflow, hidden tiles."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtp_ctrl.triton_ops import ptd_prepare_inputs, reference
from tests.unit.drafting_cases import ptd_case

OPS = [ptd_prepare_inputs, reference.ptd_prepare_inputs]
HIDDEN = 3


def _example_args():
    """The docstring example: inputs [a0 a1 a2 | b0 b1], row 2 rejected, 2 draft rows, 1 padding row."""
    return [
        torch.tensor([100, 101, 102, 200, 201]),  # target_token_ids
        torch.tensor([10, 11, 12, 20, 21]),  # target_positions
        torch.arange(5 * HIDDEN, dtype=torch.float32).view(5, HIDDEN),  # target_hidden: row k = h_k
        torch.tensor([40, 41, 42, 60, 61]),  # target_slot_mapping
        torch.tensor([7, 8]),  # next_token_ids: A, B
        torch.tensor([1, 4]),  # last_token_indices
        torch.tensor([0, 3, 5]),  # in_query_start_loc
        torch.tensor([0, 4, 8]),  # out_query_start_loc
        torch.tensor([[3, 5, 6], [7, 8, 2]], dtype=torch.int32),  # block_table
        8,  # block_size
        23,  # max_model_len
        99,  # mask_token_id
        torch.full((HIDDEN,), -1.0),  # mask_hidden
        9,  # num_output_rows
    ]


@pytest.mark.parametrize("op", OPS)
def test_worked_example(op):
    args = _example_args()
    input_ids, positions, hidden, slot_mapping = op(*args)
    assert input_ids.tolist() == [101, 7, 99, 99, 201, 8, 99, 99, 99]
    assert positions.tolist() == [10, 11, 12, 13, 20, 21, 22, 0, 0]
    assert slot_mapping.tolist() == [40, 41, 44, 45, 60, 61, 22, -1, -1]
    target_hidden, mask_hidden = args[2], args[12]
    expected_hidden = torch.stack([target_hidden[0], target_hidden[1], mask_hidden, mask_hidden,
                                   target_hidden[3], target_hidden[4], mask_hidden, mask_hidden, mask_hidden])
    assert torch.equal(hidden, expected_hidden)
    assert slot_mapping.dtype == torch.int64 and input_ids.dtype == torch.int64


@pytest.mark.parametrize("op", OPS)
def test_no_requests_gives_padding_rows_only(op):
    args = _example_args()
    args[4] = args[5] = torch.zeros(0, dtype=torch.int64)  # next_token_ids, last_token_indices
    args[6] = args[7] = torch.zeros(1, dtype=torch.int64)  # in/out query start locations
    args[8] = torch.zeros(0, 3, dtype=torch.int32)  # block_table
    input_ids, positions, hidden, slot_mapping = op(*args)
    assert input_ids.tolist() == [99] * 9 and positions.tolist() == [0] * 9 and slot_mapping.tolist() == [-1] * 9
    assert torch.equal(hidden, args[12].expand(9, -1))


@pytest.mark.parametrize(
    "num_requests, max_rows, hidden_size, num_drafts, padding_rows",
    [
        (1, 1, 1, 1, 0),
        (1, 9, 5, 4, 3),
        (2, 5, 33, 2, 1),
        (7, 6, 100, 3, 0),
        (33, 4, 16, 4, 5),
        (3, 4, 1100, 3, 2),  # two hidden tiles, the last one partly masked
    ],
)
def test_kernel_matches_reference_on_random_batches(num_requests, max_rows, hidden_size, num_drafts, padding_rows):
    generator = torch.Generator().manual_seed(num_requests * 31 + hidden_size)
    args = ptd_case(generator, num_requests=num_requests, max_rows=max_rows, hidden_size=hidden_size,
                    num_drafts=num_drafts, padding_rows=padding_rows)
    for got, want in zip(ptd_prepare_inputs(*args), reference.ptd_prepare_inputs(*args)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_bf16_hidden_rows_are_copied_exactly():
    generator = torch.Generator().manual_seed(5)
    args = ptd_case(generator, num_requests=4, max_rows=5, hidden_size=48, num_drafts=3, dtype=torch.bfloat16)
    got, want = ptd_prepare_inputs(*args)[2], reference.ptd_prepare_inputs(*args)[2]
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize(
    "index, value, error, match",
    [
        (0, torch.zeros(5), TypeError, "target_token_ids"),
        (2, torch.zeros(4, HIDDEN), ValueError, "target_hidden"),
        (3, torch.zeros(5, dtype=torch.int64)[None], ValueError, "target_slot_mapping"),
        (5, torch.tensor([1, 4, 4]), ValueError, "last_token_indices"),
        (7, torch.tensor([0, 4]), ValueError, "out_query_start_loc"),
        (8, torch.zeros(1, 3, dtype=torch.int32), ValueError, "block_table"),
        (9, 0, ValueError, "block_size"),
        (11, -3, ValueError, "mask_token_id"),
        (12, torch.zeros(HIDDEN, dtype=torch.float16), TypeError, "mask_hidden"),
        (13, None, TypeError, "num_output_rows"),
    ],
)
def test_bad_arguments_are_named(index, value, error, match):
    args = _example_args()
    args[index] = value
    with pytest.raises(error, match=match):
        ptd_prepare_inputs(*args)


def test_one_program_per_row_tile_walks_every_hidden_tile(monkeypatch):
    monkeypatch.setattr("mtp_ctrl.triton_ops._span_programs.TARGET_PROGRAMS", 1)
    generator = torch.Generator().manual_seed(11)
    args = ptd_case(generator, num_requests=3, max_rows=4, hidden_size=2100, num_drafts=2, padding_rows=1)
    for got, want in zip(ptd_prepare_inputs(*args), reference.ptd_prepare_inputs(*args)):
        assert torch.equal(got, want)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_requests=st.integers(0, 12), max_rows=st.integers(1, 8),
       hidden_size=st.integers(1, 70), num_drafts=st.integers(1, 5), padding_rows=st.integers(0, 4))
def test_kernel_matches_reference_property(seed, num_requests, max_rows, hidden_size, num_drafts, padding_rows):
    generator = torch.Generator().manual_seed(seed)
    args = ptd_case(generator, num_requests=num_requests, max_rows=max_rows, hidden_size=hidden_size,
                    num_drafts=num_drafts, padding_rows=padding_rows)
    for got, want in zip(ptd_prepare_inputs(*args), reference.ptd_prepare_inputs(*args)):
        assert torch.equal(got, want)
