"""eagle_prepare_inputs_padded / eagle_prepare_next_token_padded: kernel == reference == worked examples."""

import pytest
import torch

from mtp_ctrl.triton_ops import eagle_prepare_inputs_padded, eagle_prepare_next_token_padded, reference
from tests.unit.drafting_cases import prepare_inputs_padded_case, prepare_next_token_padded_case


def assert_pair_equal(actual, expected):
    for got, want in zip(actual, expected):
        assert got.dtype == want.dtype and torch.equal(got, want), (got, want)


@pytest.mark.parametrize("op", [eagle_prepare_inputs_padded, reference.eagle_prepare_inputs_padded])
def test_prepare_inputs_worked_example(op):
    # request 0: 3 drafts, 1 accepted (valid 2); request 1: a prefill; request 2: 2 drafts, all accepted
    cu_num_draft_tokens = torch.tensor([3, 3, 5], dtype=torch.int32)
    valid = torch.tensor([2, 1, 3], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 4, 5, 8], dtype=torch.int32)
    token_indices_to_sample, num_rejected = op(cu_num_draft_tokens, valid, query_start_loc)
    assert num_rejected.tolist() == [2, 0, 0]
    assert token_indices_to_sample.tolist() == [1, 4, 7]


@pytest.mark.parametrize("op", [eagle_prepare_next_token_padded, reference.eagle_prepare_next_token_padded])
def test_prepare_next_token_worked_example(op):
    sampled = torch.tensor([[5, 7, -1], [-1, -1, -1], [3, 120, 4], [3, 120, 100]])
    discard = torch.tensor([False, False, True, False])
    backup = torch.tensor([50, 60, 70, 80])
    next_token_ids, counts = op(sampled, discard, backup, 100)
    assert next_token_ids.tolist() == [7, 60, 70, 3]  # 120 and 100 are >= vocab_size: invalid
    assert counts.tolist() == [2, 0, 0, 1]


@pytest.mark.parametrize("num_requests, max_drafts", [(0, 3), (1, 0), (1, 4), (7, 3), (129, 5), (300, 1)])
def test_prepare_inputs_kernel_matches_reference(num_requests, max_drafts):
    generator = torch.Generator().manual_seed(num_requests + 17 * max_drafts)
    args = prepare_inputs_padded_case(generator, num_requests=num_requests, max_drafts=max_drafts)
    assert_pair_equal(eagle_prepare_inputs_padded(*args), reference.eagle_prepare_inputs_padded(*args))


@pytest.mark.parametrize("num_requests, num_sampled", [(0, 3), (1, 1), (1, 5), (9, 4), (130, 3), (200, 7)])
def test_prepare_next_token_kernel_matches_reference(num_requests, num_sampled):
    generator = torch.Generator().manual_seed(num_requests * 10 + num_sampled)
    args = prepare_next_token_padded_case(generator, num_requests=num_requests, num_sampled=num_sampled,
                                          vocab_size=11)
    assert_pair_equal(eagle_prepare_next_token_padded(*args), reference.eagle_prepare_next_token_padded(*args))


def test_all_discarded_batch_takes_every_backup():
    sampled = torch.randint(0, 10, (5, 4), dtype=torch.int32)
    backup = torch.arange(5, dtype=torch.int32) + 40
    next_token_ids, counts = eagle_prepare_next_token_padded(sampled, torch.ones(5, dtype=torch.bool), backup, 10)
    assert torch.equal(next_token_ids, backup) and counts.tolist() == [0] * 5


def test_strided_sampled_rows_are_read_with_their_stride():
    wide = torch.tensor([[1, 2, 9, 9], [3, -1, 9, 9]])
    args = (wide[:, :2], torch.tensor([False, False]), torch.tensor([0, 0]), 5)
    assert eagle_prepare_next_token_padded(*args)[0].tolist() == [2, 3]


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((torch.zeros(3), torch.ones(3, dtype=torch.int32), torch.arange(4)), TypeError, "cu_num_draft_tokens"),
        ((torch.zeros(3, dtype=torch.int32), torch.ones(2, dtype=torch.int32), torch.arange(4)), ValueError,
         "valid_sampled_tokens_count"),
        ((torch.zeros(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32), torch.arange(3)), ValueError,
         "query_start_loc"),
    ],
)
def test_prepare_inputs_bad_arguments_are_named(args, error, match):
    with pytest.raises(error, match=match):
        eagle_prepare_inputs_padded(*args)


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.bool), torch.zeros(3), 5), ValueError,
         "sampled_token_ids"),
        ((torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3), torch.zeros(3, dtype=torch.int32), 5), TypeError,
         "discard_request_mask"),
        ((torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, dtype=torch.bool), torch.zeros(2, dtype=torch.int32),
          5), ValueError, "backup_next_token_ids"),
        ((torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, dtype=torch.bool), torch.zeros(3, dtype=torch.int32),
          0), ValueError, "vocab_size"),
    ],
)
def test_prepare_next_token_bad_arguments_are_named(args, error, match):
    with pytest.raises(error, match=match):
        eagle_prepare_next_token_padded(*args)
