"""logits_row_requests / draft_batch_rows: kernel == reference on random padded grids, the
module's worked example, named errors."""

import pytest
import torch

from mtp_ctrl.triton_ops import draft_batch_rows, logits_row_requests, reference


def logits_rows_case(generator, num_requests, num_decode, S):
    K, T = num_requests * (S + 1), num_requests * (S + 1) + 5
    return dict(logits_indices=torch.randint(0, T, (K,), generator=generator),
                positions=torch.randint(0, 500, (T,), generator=generator), num_decode=torch.tensor([num_decode]),
                num_speculative_tokens=S, num_requests=num_requests,
                slot_ids=torch.randperm(num_requests + 3, generator=generator)[:num_requests], out_row_slots=torch.full((K,), -7),
                out_token_positions=torch.full((K,), -7))


def draft_rows_case(generator, num_requests, counts, S):
    lengths = torch.randint(0, 9, (num_requests,), generator=generator, dtype=torch.int32)
    starts = torch.zeros(num_requests + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(lengths, 0)
    return dict(query_start_loc=starts, seq_lens=lengths + torch.randint(0, 300, (num_requests,), generator=generator,
                                                                          dtype=torch.int32),
                accepted_counts=torch.randint(0, S + 1, (num_requests + 2,), generator=generator),
                counts=torch.tensor(counts), slot_ids=torch.randperm(num_requests + 3, generator=generator)[:num_requests],
                num_speculative_tokens=S, padding_row=999,
                out_write_rows=torch.full((num_requests,), -7), out_samples=torch.zeros(num_requests, dtype=torch.bool),
                out_first_positions=torch.full((num_requests,), -7), out_bonus_positions=torch.full((num_requests,), -7))


def _run_both(op, twin, case):
    want = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in case.items()}
    op(**case)
    twin(**want)
    for name, value in case.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, want[name]), name


@pytest.mark.parametrize("S", [0, 1, 3])
@pytest.mark.parametrize("num_requests, num_decode", [(1, 0), (1, 1), (5, 2), (40, 40), (200, 13)])
def test_logits_row_requests_matches_reference(S, num_requests, num_decode):
    case = logits_rows_case(torch.Generator().manual_seed(S * 1000 + num_requests), num_requests, num_decode, S)
    _run_both(logits_row_requests, reference.logits_row_requests, case)


@pytest.mark.parametrize("S", [0, 2])
@pytest.mark.parametrize("num_requests, counts", [(0, (0, 0, 0)), (1, (1, 1, 1)), (6, (4, 2, 3)), (8, (0, 0, 0)),
                                                  (150, (140, 100, 120))])
@pytest.mark.parametrize("lengths", [False, True])
def test_draft_batch_rows_matches_reference(S, num_requests, counts, lengths):
    generator = torch.Generator().manual_seed(S * 1000 + num_requests)
    case = draft_rows_case(generator, num_requests, counts, S)
    if lengths:  # each sampling request's draft length to its table row; the rest (and padding's row) untouched
        case.update(draft_lengths=torch.randint(0, S + 1, (num_requests + 2,), generator=generator),
                    out_draft_length_rows=torch.full((1000,), -7))
    _run_both(draft_batch_rows, reference.draft_batch_rows, case)
    if lengths:
        rows = case["out_draft_length_rows"]
        sampling = case["slot_ids"][: counts[2]]
        assert torch.equal(rows[sampling], case["draft_lengths"][: counts[2]])
        assert int((rows != -7).sum()) == counts[2]  # nothing else written (the padding row 999 included)


@pytest.mark.parametrize("op", [logits_row_requests, reference.logits_row_requests])
def test_logits_rows_worked_example(op):
    case = logits_rows_case(torch.Generator().manual_seed(0), 3, 2, 1)
    case["slot_ids"] = torch.tensor([4, 0, 2])
    op(**case)
    assert case["out_row_slots"].tolist() == [4, 4, 0, 0, 2, 2]
    assert torch.equal(case["out_token_positions"], case["positions"][case["logits_indices"]] + 1)


@pytest.mark.parametrize("op", [draft_batch_rows, reference.draft_batch_rows])
def test_draft_rows_example(op):
    """S = 2: a decode request that accepted 1 draft, a final chunk of 4 rows, a padding request."""
    case = draft_rows_case(torch.Generator().manual_seed(0), 3, (2, 1, 2), 2)
    case.update(query_start_loc=torch.tensor([0, 3, 7, 7], dtype=torch.int32),
                seq_lens=torch.tensor([13, 4, 0], dtype=torch.int32), accepted_counts=torch.tensor([1, 0, 0]),
                slot_ids=torch.tensor([5, 2, 9]))
    op(**case)
    assert case["out_write_rows"].tolist() == [5, 2, 999] and case["out_samples"].tolist() == [True, True, False]
    assert case["out_first_positions"].tolist() == [10, 0, 0] and case["out_bonus_positions"].tolist() == [12, 4, 0]


def test_bad_arguments_are_named():
    case = logits_rows_case(torch.Generator().manual_seed(1), 2, 1, 1)
    case["num_decode"] = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="num_decode"):
        logits_row_requests(**case)
    case = draft_rows_case(torch.Generator().manual_seed(1), 2, (1, 1, 1), 1)
    case["out_samples"] = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(TypeError, match="out_samples"):
        draft_batch_rows(**case)
    case["out_samples"], case["counts"] = torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="counts"):
        draft_batch_rows(**case)
    case["counts"] = torch.tensor([1, 1, 1])
    with pytest.raises(ValueError, match="out_draft_length_rows"):  # one without the other
        draft_batch_rows(**case, draft_lengths=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="out_draft_length_rows"):  # too short for the padding row
        draft_batch_rows(**case, draft_lengths=torch.zeros(2, dtype=torch.int64),
                         out_draft_length_rows=torch.zeros(5, dtype=torch.int64))
    with pytest.raises(TypeError, match="draft_lengths"):
        draft_batch_rows(**case, draft_lengths=torch.zeros(2, dtype=torch.int32),
                         out_draft_length_rows=torch.zeros(1000, dtype=torch.int64))


@pytest.mark.parametrize("op", [draft_batch_rows, reference.draft_batch_rows])
def test_draft_rows_ragged_decode_rows(op):
    """Ragged rows (S = 3): decode requests of 1, 2 and 4 rows (s = 0, 1, 3) that accepted 0, 1, 1
    drafts: each bonus position rewinds its own rows, ``e = seq_len - (q - 1 - accepted)``."""
    case = draft_rows_case(torch.Generator().manual_seed(0), 3, (3, 3, 3), 3)
    case.update(query_start_loc=torch.tensor([0, 1, 3, 7], dtype=torch.int32),
                seq_lens=torch.tensor([9, 20, 30], dtype=torch.int32), accepted_counts=torch.tensor([0, 1, 1]))
    op(**case)
    assert case["out_first_positions"].tolist() == [8, 18, 26] and case["out_bonus_positions"].tolist() == [9, 20, 28]
