"""check_prompt / check_prompts: every bad prompt raises TypeError/ValueError naming the argument."""

import numpy as np
import pytest
import torch

from mtp_ctrl.controllers.request_checks import check_prompt, check_prompts, checked_prompt

VOCAB, MAX_LEN = 10, 6


@pytest.mark.parametrize(
    "prompt, want",
    [
        ([1, 2, 3], [1, 2, 3]),
        ((0, 9), [0, 9]),
        (range(4), [0, 1, 2, 3]),
        ([np.int64(3), np.int32(4)], [3, 4]),
        ([torch.tensor(5)], [5]),  # a 0-d int tensor is an int
        (np.array([1, 2], dtype=np.int32), [1, 2]),
        (np.array([7], dtype=np.uint8), [7]),
        (torch.tensor([4, 5], dtype=torch.int32), [4, 5]),
        (torch.tensor([4, 5], dtype=torch.int64)[::2], [4]),  # strided view
        (torch.tensor([1, 2], dtype=torch.uint8), [1, 2]),
        ([1] * (MAX_LEN - 1), [1] * (MAX_LEN - 1)),  # leaves exactly one token of room
    ],
)
def test_accepted_prompts_become_lists_of_ints(prompt, want):
    got = check_prompt(prompt, VOCAB, MAX_LEN)
    assert got == want and all(type(token) is int for token in got)


@pytest.mark.parametrize(
    "prompt, error, match",
    [
        (None, TypeError, "prompt_tokens is None"),
        (5, TypeError, "prompt_tokens must be"),
        (5.0, TypeError, "prompt_tokens must be"),
        ("hello", TypeError, "tokenize"),
        (b"\x01\x02", TypeError, "prompt_tokens"),
        (bytearray(b"\x01"), TypeError, "prompt_tokens"),
        ({1, 2}, TypeError, "order is arbitrary"),
        (frozenset({1}), TypeError, "order is arbitrary"),
        ({1: 2}, TypeError, "order is arbitrary"),
        (iter([1, 2]), TypeError, "prompt_tokens must be"),
        ([1, True], TypeError, r"prompt_tokens\[1\] is a bool"),
        ([np.True_], TypeError, r"prompt_tokens\[0\] is a bool"),
        ([1, 2.0], TypeError, r"prompt_tokens\[1\] must be an int"),
        ([1, None], TypeError, r"prompt_tokens\[1\] must be an int"),
        ([[1, 2]], TypeError, r"prompt_tokens\[0\] must be an int"),
        ([torch.tensor([1, 2])], TypeError, r"prompt_tokens\[0\] must be an int"),
        ([torch.tensor(1.0)], TypeError, r"prompt_tokens\[0\] must be an int"),
        (torch.tensor([1, 2], device="meta"), ValueError, "meta device"),
        (torch.tensor([1, 2]).to_sparse(), TypeError, "dense"),
        (torch.tensor([[1, 2]]), ValueError, "1-D"),
        (torch.tensor(3), ValueError, "1-D"),
        (torch.tensor([1.0, 2.0]), TypeError, "integer dtype"),
        (torch.tensor([True, False]), TypeError, "integer dtype"),
        (np.array([1.0]), TypeError, "integer dtype"),
        (np.array([True]), TypeError, "integer dtype"),
        (np.array([[1, 2]]), ValueError, "1-D"),
        ([], ValueError, "empty"),
        (torch.zeros(0, dtype=torch.int64), ValueError, "empty"),
        ([1] * MAX_LEN, ValueError, "no room"),
        ([1, VOCAB], ValueError, r"prompt_tokens\[1\] = 10 is outside the vocabulary"),
        ([3, -1], ValueError, r"prompt_tokens\[1\] = -1 is outside"),
        (torch.tensor([2, 2**40]), ValueError, "outside the vocabulary"),
        ([2, 2**70], ValueError, r"prompt_tokens\[1\] = 1180591620717411303424 is outside"),  # past int64
        ([-2**70, 2], ValueError, r"prompt_tokens\[0\] = -1180591620717411303424 is outside"),
    ],
)
def test_rejected_prompts_name_the_argument(prompt, error, match):
    with pytest.raises(error, match=match):
        check_prompt(prompt, VOCAB, MAX_LEN)


def test_checked_prompt_gives_the_list_and_a_read_only_int64_array():
    prompt, array = checked_prompt((np.int32(4), 0, 9), VOCAB, MAX_LEN)
    assert prompt == [4, 0, 9] and array.dtype == np.int64 and array.tolist() == prompt
    with pytest.raises(ValueError, match="read-only"):
        array[0] = 1


def test_the_caller_names_the_argument_and_sizes_are_checked():
    with pytest.raises(ValueError, match=r"prompts\[2\]\[0\] = 11"):
        check_prompt([11], VOCAB, MAX_LEN, name="prompts[2]")
    with pytest.raises(ValueError, match="vocab_size"):
        check_prompt([1], 0, MAX_LEN)
    with pytest.raises(ValueError, match="max_model_len"):
        check_prompt([1], VOCAB, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prompt_tensor():
    assert check_prompt(torch.tensor([1, 2], device="cuda"), VOCAB, MAX_LEN) == [1, 2]


@pytest.mark.parametrize(
    "prompts, want",
    [
        ([[1, 2], (3,), range(2)], [[1, 2], (3,), range(2)]),
        (([1],), [[1]]),
        ([], []),
        ([torch.tensor([1, 2]), np.array([3])], None),  # rows kept as given
    ],
)
def test_check_prompts_accepts_lists_of_prompts(prompts, want):
    got = check_prompts(prompts)
    assert isinstance(got, list) and len(got) == len(prompts)
    if want is not None:
        assert got == want


def test_check_prompts_accepts_a_2d_array_one_prompt_per_row():
    rows = check_prompts(torch.tensor([[1, 2], [3, 4]]))
    assert [row.tolist() for row in rows] == [[1, 2], [3, 4]]
    assert [row.tolist() for row in check_prompts(np.array([[5, 6]]))] == [[5, 6]]


@pytest.mark.parametrize(
    "prompts, error, match",
    [
        ([1, 2, 3], TypeError, "prompts must be a sequence of prompts"),  # generate([1, 2, 3])
        ([[1, 2], 3], TypeError, "wrap it"),
        ([np.int64(1)], TypeError, "flat sequence"),
        ([1.0, 2.0], TypeError, "flat sequence"),
        (torch.tensor([1, 2, 3]), TypeError, "flat sequence"),
        (np.array([1, 2]), TypeError, "flat sequence"),
        (torch.zeros(2, 2, 2, dtype=torch.int64), ValueError, "2-D"),
        (None, TypeError, "prompts must be a list"),
        (7, TypeError, "prompts must be a list"),
        ("abc", TypeError, "prompts must be a list"),
        ({(1, 2)}, TypeError, "prompts must be a list"),
        ({"a": [1]}, TypeError, "prompts must be a list"),
        (range(3), TypeError, "prompts must be a list"),
        ((p for p in [[1]]), TypeError, "prompts must be a list"),
    ],
)
def test_check_prompts_rejects(prompts, error, match):
    with pytest.raises(error, match=match):
        check_prompts(prompts)
