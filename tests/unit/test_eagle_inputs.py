"""copy_and_expand_eagle_inputs: Triton kernel (interpreter) == torch reference == worked examples."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtp_ctrl.triton_ops import copy_and_expand_eagle_inputs, reference
from tests.unit.drafting_cases import eagle_inputs_case


def _example_args(shift):
    """Two requests ``[a0 a1 a2 | b0 b1 b2]``; request 1's last row was rejected."""
    target_token_ids = torch.tensor([10, 11, 12, 20, 21, 22], dtype=torch.int32)
    target_positions = torch.tensor([5, 6, 7, 9, 10, 11])
    next_token_ids = torch.tensor([100, 200], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 3, 6], dtype=torch.int32)
    query_end_loc = torch.tensor([2, 4], dtype=torch.int32)
    return (target_token_ids, target_positions, next_token_ids, query_start_loc, query_end_loc, 0, 7, 2, shift)


def assert_outputs_equal(actual, expected):
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        if want is None:
            assert got is None
        else:
            assert got.dtype == want.dtype and torch.equal(got, want), (got, want)


@pytest.mark.parametrize("op", [copy_and_expand_eagle_inputs, reference.copy_and_expand_eagle_inputs])
def test_shift_mode_worked_example(op):
    input_ids, positions, is_rejected, is_masked, new_token_indices, mapping = op(*_example_args(True))
    assert input_ids.tolist() == [11, 12, 100, 7, 21, 200, 7, 0]
    assert positions.tolist() == [5, 6, 7, 8, 9, 10, 11, 0]
    assert is_rejected.tolist() == [False] * 7 + [True]
    assert is_masked.tolist() == [False, False, False, True, False, False, True, False]
    assert new_token_indices.tolist() == [2, 3, 5, 6]
    assert mapping.tolist() == [0, 1, 2, 4, 5, 6]


@pytest.mark.parametrize("op", [copy_and_expand_eagle_inputs, reference.copy_and_expand_eagle_inputs])
def test_non_shift_mode_worked_example(op):
    input_ids, positions, is_rejected, is_masked, new_token_indices, mapping = op(*_example_args(False))
    assert input_ids.tolist() == [10, 11, 12, 100, 7, 20, 21, 200, 7, 0]
    assert positions.tolist() == [5, 6, 7, 8, 9, 9, 10, 11, 12, 0]
    assert is_rejected.tolist() == [False] * 9 + [True]
    assert is_masked.tolist() == [False, False, False, False, True, False, False, False, True, False]
    assert new_token_indices.tolist() == [3, 4, 7, 8]
    assert mapping is None


@pytest.mark.parametrize("op", [copy_and_expand_eagle_inputs, reference.copy_and_expand_eagle_inputs])
def test_padding_input_rows_become_rejected_tail_rows(op):
    args = list(_example_args(True))
    args[0] = torch.cat([args[0], torch.tensor([55, 56], dtype=torch.int32)])  # two CUDA-graph padding rows
    args[1] = torch.cat([args[1], torch.tensor([3, 4])])
    input_ids, positions, is_rejected, is_masked, _, mapping = op(*args)
    assert input_ids[8:].tolist() == [0, 0] and positions[8:].tolist() == [0, 0]
    assert is_rejected[8:].all() and not is_masked[8:].any()
    assert mapping.tolist() == [0, 1, 2, 4, 5, 6, 8, 9]


@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize(
    "num_requests, max_rows, padding_rows",
    [(0, 1, 0), (0, 1, 3), (1, 1, 0), (1, 300, 2), (3, 260, 0), (17, 6, 5), (40, 3, 1)],
)
def test_kernel_matches_reference_on_random_batches(shift, num_requests, max_rows, padding_rows):
    generator = torch.Generator().manual_seed(num_requests * 1000 + max_rows + shift)
    args = eagle_inputs_case(generator, num_requests=num_requests, max_rows=max_rows, shift=shift,
                             padding_rows=padding_rows)
    assert_outputs_equal(copy_and_expand_eagle_inputs(*args), reference.copy_and_expand_eagle_inputs(*args))


def test_long_prefill_is_copied_across_row_blocks():
    num_rows = 700  # spans several 128-row blocks
    tokens = torch.arange(num_rows, dtype=torch.int64)
    args = (tokens, tokens + 10, torch.tensor([777]), torch.tensor([0, num_rows]),
            torch.tensor([num_rows - 1]), 0, 9, 3, False)
    input_ids, positions, *_ = copy_and_expand_eagle_inputs(*args)
    assert torch.equal(input_ids[:num_rows], tokens) and torch.equal(positions, torch.arange(num_rows + 3) + 10)
    assert input_ids[num_rows:].tolist() == [777, 9, 9]


@pytest.mark.parametrize(
    "index, value, error, match",
    [
        (0, torch.zeros(6), TypeError, "target_token_ids"),
        (1, torch.zeros(5, dtype=torch.int64), ValueError, "target_positions"),
        (3, torch.tensor([0, 3], dtype=torch.int32), ValueError, "query_start_loc"),
        (4, torch.tensor([2, 4, 5], dtype=torch.int32), ValueError, "query_end_loc"),
        (5, -1, ValueError, "padding_token_id"),
        (6, 1.5, TypeError, "parallel_drafting_token_id"),
        (7, 0, ValueError, "num_padding_slots_per_request"),
        (8, 1, TypeError, "shift_input_ids"),
    ],
)
def test_bad_arguments_are_named(index, value, error, match):
    args = list(_example_args(True))
    args[index] = value
    with pytest.raises(error, match=match):
        copy_and_expand_eagle_inputs(*args)


def test_non_contiguous_input_is_rejected():
    args = list(_example_args(True))
    args[0] = torch.arange(12, dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match="target_token_ids must be contiguous"):
        copy_and_expand_eagle_inputs(*args)


@pytest.mark.parametrize("shift", [True, False])
def test_one_program_per_request_walks_every_row_block(monkeypatch, shift):
    monkeypatch.setattr("mtp_ctrl.triton_ops._span_programs.TARGET_PROGRAMS", 1)
    generator = torch.Generator().manual_seed(3)
    args = eagle_inputs_case(generator, num_requests=2, max_rows=400, shift=shift, padding_rows=300)
    assert_outputs_equal(copy_and_expand_eagle_inputs(*args), reference.copy_and_expand_eagle_inputs(*args))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_requests=st.integers(0, 12), max_rows=st.integers(1, 140),
       padding_rows=st.integers(0, 4), shift=st.booleans())
def test_kernel_matches_reference_property(seed, num_requests, max_rows, padding_rows, shift):
    generator = torch.Generator().manual_seed(seed)
    args = eagle_inputs_case(generator, num_requests=num_requests, max_rows=max_rows, shift=shift,
                             padding_rows=padding_rows)
    assert_outputs_equal(copy_and_expand_eagle_inputs(*args), reference.copy_and_expand_eagle_inputs(*args))
