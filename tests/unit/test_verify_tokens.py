"""verify_speculative_tokens: Triton kernel (interpreter) == torch reference == a per-row loop."""

import pytest
import torch

from mtp_ctrl.triton_ops import reference, verify_speculative_tokens
from tests.unit.step_cases import make_token_case

OPS = [verify_speculative_tokens, reference.verify_speculative_tokens]


def _verify_by_hand(input_tokens, output_tokens, num_decode, num_prefill, num_spec):
    """(last_one_indices, mask) by walking the rows one at a time."""
    inputs, outputs = input_tokens.tolist(), output_tokens.tolist()
    mask, last_one_indices = [False] * len(inputs), []
    for request in range(num_decode):
        base = request * (num_spec + 1)
        accepted = 1
        while accepted <= num_spec and inputs[base + accepted] == outputs[base + accepted - 1]:
            accepted += 1
        mask[base : base + accepted] = [True] * accepted
        last_one_indices.append(base + accepted - 1)
    for prefill in range(num_prefill):
        row = num_decode * (num_spec + 1) + prefill
        mask[row] = True
        last_one_indices.append(row)
    return torch.tensor(last_one_indices, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool)


@pytest.mark.parametrize("op", OPS)
def test_three_decode_requests_accepting_1_2_0_and_two_prefill_rows(op):
    # S = 2: request a accepts its 1st draft only, b both, c none (its 2nd draft matches, but
    # acceptance stops at the first mismatch); d and e are prefill rows.
    input_tokens = torch.tensor([105, 106, 107, 203, 204, 205, 306, 307, 308, 402, 504])
    output_tokens = torch.tensor([106, 999, 998, 204, 205, 206, 777, 308, 309, 403, 505])
    last_one_indices, mask, tokens = op(input_tokens, output_tokens, 3, 2, 2)
    assert last_one_indices.dtype == torch.int64
    assert last_one_indices.tolist() == [1, 5, 6, 9, 10]
    assert mask.tolist() == [True, True, False, True, True, True, True, False, False, True, True]
    assert tokens is input_tokens or torch.equal(tokens, input_tokens)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "num_decode,num_prefill,num_spec",
    [(0, 0, 3), (1, 0, 1), (0, 1, 2), (1, 1, 8), (4, 2, 0), (3, 2, 4), (7, 5, 3), (5, 0, 7), (40, 3, 3), (13, 0, 6)],
)
def test_random_cases_match_the_row_loop(op, num_decode, num_prefill, num_spec):
    for seed in range(3):
        case = make_token_case(num_decode, num_prefill, num_spec, seed=seed, extra_rows=seed * 2)
        want_last, want_mask = _verify_by_hand(case.input_tokens, case.output_tokens, num_decode, num_prefill, num_spec)
        last_one_indices, mask, _ = op(case.input_tokens, case.output_tokens, num_decode, num_prefill, num_spec)
        assert torch.equal(last_one_indices, want_last)
        assert torch.equal(mask, want_mask)  # rows past the packed region stay False


@pytest.mark.parametrize("op", OPS)
def test_2d_input_is_squeezed_and_int32_tokens_work(op):
    case = make_token_case(4, 2, 3, seed=11, extra_rows=3)
    want_last, want_mask = _verify_by_hand(case.input_tokens, case.output_tokens, 4, 2, 3)
    input_2d = case.input_tokens.int()[None, :]  # [1, T] int32
    last_one_indices, mask, tokens = op(input_2d, case.output_tokens.int(), 4, 2, 3)
    assert tokens.shape == (case.input_tokens.shape[0],)
    assert tokens.data_ptr() == input_2d.data_ptr()
    assert torch.equal(last_one_indices, want_last) and torch.equal(mask, want_mask)


def test_padded_request_counts_only_touch_their_own_rows():
    """Requests past the real ones (a bucket-padded count) read and write only inside their rows."""
    case = make_token_case(6, 0, 2, seed=3, extra_rows=0)
    real_last, real_mask = _verify_by_hand(case.input_tokens[:9], case.output_tokens[:9], 3, 0, 2)
    last_one_indices, mask, _ = verify_speculative_tokens(case.input_tokens, case.output_tokens, 6, 0, 2)
    assert torch.equal(last_one_indices[:3], real_last) and torch.equal(mask[:9], real_mask)


def _valid_args():
    case = make_token_case(2, 1, 2, seed=0)
    return [case.input_tokens, case.output_tokens, 2, 1, 2]


@pytest.mark.parametrize(
    "index,bad,error,match",
    [
        (0, lambda t: t.float(), TypeError, "input_tokens"),
        (0, lambda t: t.reshape(1, 1, -1), ValueError, "input_tokens"),
        (0, lambda t: torch.stack([t, t]), ValueError, "input_tokens"),
        (0, lambda t: t[:-1], ValueError, "input_tokens"),
        (0, lambda t: "tokens", TypeError, "input_tokens"),
        (1, lambda t: t.float(), TypeError, "output_tokens"),
        (1, lambda t: t[None, :], ValueError, "output_tokens"),
        (1, lambda t: t[:-1], ValueError, "output_tokens"),
        (1, lambda t: t.to("meta"), ValueError, "output_tokens"),
        (2, lambda n: -1, ValueError, "num_decode_requests"),
        (2, lambda n: 5, ValueError, "input_tokens"),
        (2, lambda n: 2.0, TypeError, "num_decode_requests"),
        (3, lambda n: -2, ValueError, "num_prefill_requests"),
        (3, lambda n: torch.tensor(1), TypeError, "num_prefill_requests"),
        (4, lambda s: -1, ValueError, "num_speculative_tokens"),
        (4, lambda s: True, TypeError, "num_speculative_tokens"),
    ],
)
def test_bad_arguments(index, bad, error, match):
    args = _valid_args()
    args[index] = bad(args[index])
    with pytest.raises(error, match=match):
        verify_speculative_tokens(*args)
