"""shift_and_gather_cache(_hidden): kernel == reference == worked example; shifts 0..MAX_SHIFT, padding."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtp_ctrl.triton_ops import reference, shift_and_gather_cache, shift_and_gather_cache_hidden
from tests.unit.drafting_cases import shift_gather_case


def _example_args():
    """The docstring example: two windows (5 and 3 rows), one padding row, MAX_SHIFT = 3."""
    return [
        torch.tensor([10, 11, 12, 13, 14, 20, 21, 22, 99]),  # src
        torch.tensor([[1, 2, 3], [7, 8, 0]]),  # cached
        torch.tensor([0, 5, 8]),  # query_start_loc
        torch.tensor([2, 1]),  # shifts
        torch.tensor([3, 2]),  # cached_lens
        torch.tensor([2, 5]),  # store_starts
        torch.tensor([3, 2]),  # store_lens
    ]


@pytest.mark.parametrize("op", [shift_and_gather_cache, reference.shift_and_gather_cache])
def test_worked_example(op):
    dst, new_cached = op(*_example_args())
    assert dst.tolist() == [2, 3, 10, 11, 12, 8, 20, 21, 99]
    assert new_cached.tolist() == [[10, 11, 12], [8, 20, 0]]


@pytest.mark.parametrize("op", [shift_and_gather_cache_hidden, reference.shift_and_gather_cache_hidden])
def test_hidden_worked_example_moves_whole_rows(op):
    args = _example_args()
    scale = torch.tensor([1.0, -1.0, 0.5, 2.0, 3.0])  # H = 5
    args[0] = args[0].float()[:, None] * scale
    args[1] = args[1].float()[:, :, None] * scale
    dst, new_cached = op(*args)
    assert torch.equal(dst, torch.tensor([2.0, 3, 10, 11, 12, 8, 20, 21, 99])[:, None] * scale)
    assert torch.equal(new_cached, torch.tensor([[10.0, 11, 12], [8, 20, 0]])[:, :, None] * scale)


@pytest.mark.parametrize("op", [shift_and_gather_cache, reference.shift_and_gather_cache])
def test_inputs_are_not_modified(op):
    args = _example_args()
    before = [arg.clone() for arg in args]
    op(*args)
    assert all(torch.equal(arg, old) for arg, old in zip(args, before))


@pytest.mark.parametrize("max_shift", [1, 2, 3, 5])
@pytest.mark.parametrize(
    "num_seqs, max_rows, padding_rows", [(0, 1, 0), (0, 1, 4), (1, 1, 0), (1, 600, 3), (6, 9, 2), (40, 4, 0)]
)
def test_kernel_matches_reference_1d(max_shift, num_seqs, max_rows, padding_rows):
    generator = torch.Generator().manual_seed(max_shift * 100 + num_seqs + max_rows)
    args = shift_gather_case(generator, num_seqs=num_seqs, max_rows=max_rows, max_shift=max_shift,
                             padding_rows=padding_rows)
    for got, want in zip(shift_and_gather_cache(*args), reference.shift_and_gather_cache(*args)):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize(
    "hidden_size, max_shift, num_seqs, max_rows",
    [(1, 1, 1, 3), (7, 3, 5, 6), (64, 4, 3, 40), (1030, 2, 2, 5)],  # 1030: two tiles, the last one masked
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference_hidden(hidden_size, max_shift, num_seqs, max_rows, dtype):
    generator = torch.Generator().manual_seed(hidden_size + max_shift)
    args = shift_gather_case(generator, num_seqs=num_seqs, max_rows=max_rows, max_shift=max_shift,
                             hidden_size=hidden_size, dtype=dtype, padding_rows=2)
    for got, want in zip(shift_and_gather_cache_hidden(*args), reference.shift_and_gather_cache_hidden(*args)):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("shift", [0, 1, 2, 3])
def test_every_shift_up_to_max_shift(shift):
    args = _example_args()
    args[3] = torch.tensor([shift, 0])
    dst = shift_and_gather_cache(*args)[0]
    expected_front = [1, 2, 3][3 - shift:]  # the last `shift` cached rows, then the source rows
    assert dst[:5].tolist() == (expected_front + [10, 11, 12, 13, 14])[:5]


@pytest.mark.parametrize(
    "index, value, error, match",
    [
        (0, torch.zeros(9), TypeError, "src"),
        (1, torch.zeros(2, 3, dtype=torch.int32), TypeError, "cached"),
        (1, torch.zeros(2, 0, dtype=torch.int64), ValueError, "MAX_SHIFT"),
        (2, torch.tensor([0, 5]), ValueError, "query_start_loc"),
        (3, torch.tensor([2.0, 1.0]), TypeError, "shifts"),
        (4, torch.tensor([3]), ValueError, "cached_lens"),
        (5, torch.tensor([[2, 5]]), ValueError, "store_starts"),
        (6, torch.tensor([3, 2, 0]), ValueError, "store_lens"),
    ],
)
def test_bad_arguments_are_named(index, value, error, match):
    args = _example_args()
    args[index] = value
    with pytest.raises(error, match=match):
        shift_and_gather_cache(*args)


def test_hidden_bad_cached_width_is_named():
    args = _example_args()
    args[0] = torch.zeros(9, 4)
    args[1] = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match="cached"):
        shift_and_gather_cache_hidden(*args)


def test_one_program_per_window_walks_every_row_block(monkeypatch):
    monkeypatch.setattr("mtp_ctrl.triton_ops._span_programs.TARGET_PROGRAMS", 1)
    generator = torch.Generator().manual_seed(9)
    args = shift_gather_case(generator, num_seqs=2, max_rows=700, max_shift=3, padding_rows=600)
    for got, want in zip(shift_and_gather_cache(*args), reference.shift_and_gather_cache(*args)):
        assert torch.equal(got, want)
    args = shift_gather_case(generator, num_seqs=2, max_rows=9, max_shift=2, hidden_size=20, padding_rows=9)
    for got, want in zip(shift_and_gather_cache_hidden(*args), reference.shift_and_gather_cache_hidden(*args)):
        assert torch.equal(got, want)


# up to 100 rows a window: long windows (several row blocks a program) are the test above's
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_seqs=st.integers(0, 10), max_rows=st.integers(0, 100),
       max_shift=st.integers(1, 6), padding_rows=st.integers(0, 4), hidden_size=st.sampled_from([None, 1, 9, 130]))
def test_kernel_matches_reference_property(seed, num_seqs, max_rows, max_shift, padding_rows, hidden_size):
    generator = torch.Generator().manual_seed(seed)
    args = shift_gather_case(generator, num_seqs=num_seqs, max_rows=max_rows, max_shift=max_shift,
                             hidden_size=hidden_size, padding_rows=padding_rows)
    op, reference_op = ((shift_and_gather_cache, reference.shift_and_gather_cache) if hidden_size is None else
                        (shift_and_gather_cache_hidden, reference.shift_and_gather_cache_hidden))
    for got, want in zip(op(*args), reference_op(*args)):
        assert torch.equal(got, want)
