"""prepare_next_forward_pass: Triton kernel (interpreter) == torch reference == a per-request loop."""

import pytest
import torch

from mtp_ctrl.triton_ops import prepare_next_forward_pass, reference
from tests.unit.step_cases import assert_all_equal, clone_all, make_token_case

OPS = [prepare_next_forward_pass, reference.prepare_next_forward_pass]
UNTOUCHED = 77  # what the caller left in the buffers; rows the op must not write keep it


def _buffers(num_rows, num_spec, dtype=torch.int64, strided=False):
    """(sampled_tokens_buf, last_accepted_seq_buf, accepted_tokens_per_request, accepted_token_counts)."""
    if strided:  # columns / row-strided views of larger tables
        table = torch.full((num_rows, 3), UNTOUCHED, dtype=dtype)
        drafts = torch.full((num_rows, 2 * num_spec + 1), UNTOUCHED, dtype=dtype)[:, 1 : 2 * num_spec + 1 : 2]
        return [table[:, 0], table[:, 2], drafts, torch.full((num_rows, 2), UNTOUCHED, dtype=dtype)[:, 1]]
    return [
        torch.full((num_rows,), UNTOUCHED, dtype=dtype),
        torch.full((num_rows,), UNTOUCHED, dtype=dtype),
        torch.full((num_rows, num_spec), UNTOUCHED, dtype=dtype),
        torch.full((num_rows,), UNTOUCHED, dtype=dtype),
    ]


def _prepare_by_hand(case, last_one_indices, mask, buffers):
    sampled, last_seq, drafts, counts = clone_all(buffers)
    stride = case.num_speculative_tokens + 1
    for request, row in enumerate(last_one_indices.tolist()):
        sampled[request] = case.output_tokens[row]
        last_seq[request] = case.required_logit_indices[row]
    for request in range(case.num_decode_requests):
        for draft in range(case.num_speculative_tokens):
            row = request * stride + 1 + draft
            drafts[request, draft] = case.input_tokens[row] if mask[row] else -1
        counts[request] = int(mask[request * stride + 1 : (request + 1) * stride].sum())
    return [sampled, last_seq, drafts, counts]


def _run(op, case, last_one_indices, mask, buffers):
    op(case.num_decode_requests, case.output_tokens, case.required_logit_indices, last_one_indices, mask,
       case.input_tokens, *buffers, case.num_speculative_tokens)
    return buffers


@pytest.mark.parametrize("op", OPS)
def test_known_answer_with_prefill_rows_left_alone(op):
    # S = 2; decode requests accept 1, 2 and 0 drafts; rows 9 and 10 are prefill.
    input_tokens = torch.tensor([105, 106, 107, 203, 204, 205, 306, 307, 308, 402, 504])
    output_tokens = torch.tensor([106, 999, 998, 204, 205, 206, 777, 308, 309, 403, 505])
    required_logit_indices = torch.arange(11) + 100
    last_one_indices = torch.tensor([1, 5, 6, 9, 10])
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    sampled, last_seq, drafts, counts = _buffers(6, 2)
    op(3, output_tokens, required_logit_indices, last_one_indices, mask, input_tokens, sampled, last_seq, drafts,
       counts, 2)
    assert sampled.tolist() == [999, 206, 777, 403, 505, UNTOUCHED]
    assert last_seq.tolist() == [101, 105, 106, 109, 110, UNTOUCHED]
    assert drafts[:3].tolist() == [[106, -1], [204, 205], [-1, -1]]
    assert counts[:3].tolist() == [1, 2, 0]
    assert (drafts[3:] == UNTOUCHED).all() and (counts[3:] == UNTOUCHED).all()


@pytest.mark.parametrize(
    "num_decode,num_prefill,num_spec",
    [(0, 0, 2), (1, 0, 1), (0, 3, 4), (2, 1, 8), (3, 2, 0), (5, 4, 3), (40, 2, 3), (9, 0, 5)],
)
@pytest.mark.parametrize("dtype,strided", [(torch.int64, False), (torch.int32, True)])
def test_random_cases_match_the_request_loop(num_decode, num_prefill, num_spec, dtype, strided):
    for seed in range(2):
        case = make_token_case(num_decode, num_prefill, num_spec, seed=seed, extra_rows=seed)
        last_one_indices, mask, _ = reference.verify_speculative_tokens(
            case.input_tokens, case.output_tokens, num_decode, num_prefill, num_spec)
        buffers = _buffers(case.num_requests + 2, num_spec, dtype, strided)
        want = _prepare_by_hand(case, last_one_indices, mask, buffers)
        for op in OPS:
            assert_all_equal(_run(op, case, last_one_indices, mask, clone_all(buffers)), want)


def test_accepts_the_1xT_input_tokens_of_the_forward_pass():
    case = make_token_case(3, 1, 2, seed=5)
    last_one_indices, mask, _ = reference.verify_speculative_tokens(case.input_tokens, case.output_tokens, 3, 1, 2)
    want = _run(reference.prepare_next_forward_pass, case, last_one_indices, mask, _buffers(4, 2))
    got = _buffers(4, 2)
    prepare_next_forward_pass(3, case.output_tokens, case.required_logit_indices, last_one_indices, mask,
                              case.input_tokens[None, :], *got, 2)
    assert_all_equal(got, want)


def _valid_args():
    case = make_token_case(2, 1, 2, seed=0)
    last_one_indices, mask, _ = reference.verify_speculative_tokens(case.input_tokens, case.output_tokens, 2, 1, 2)
    return [2, case.output_tokens, case.required_logit_indices, last_one_indices, mask, case.input_tokens,
            *_buffers(3, 2), 2]


@pytest.mark.parametrize(
    "index,bad,error,match",
    [
        (0, lambda n: 4, ValueError, "num_decode_requests"),
        (0, lambda n: -1, ValueError, "num_decode_requests"),
        (1, lambda t: t.float(), TypeError, "output_tokens"),
        (1, lambda t: t.to("meta"), ValueError, "output_tokens"),
        (1, lambda t: t[:6], ValueError, "output_tokens"),  # 2 x 3 decode rows + 1 prefill row needed
        (2, lambda t: t[None, :], ValueError, "required_logit_indices"),
        (2, lambda t: t[:6], ValueError, "required_logit_indices"),
        (3, lambda t: t.float(), TypeError, "last_one_indices"),
        (3, lambda t: t[:, None], ValueError, "last_one_indices"),
        (4, lambda t: t.to("meta"), ValueError, "accepted_tokens_mask"),
        (4, lambda t: t.long(), TypeError, "accepted_tokens_mask"),
        (4, lambda t: t[:5], ValueError, "accepted_tokens_mask"),
        (5, lambda t: t[:5], ValueError, "input_tokens"),
        (5, lambda t: t.to("meta"), ValueError, "input_tokens"),
        (6, lambda t: t[:2], ValueError, "sampled_tokens_buf"),
        (7, lambda t: t.float(), TypeError, "last_accepted_seq_buf"),
        (8, lambda t: t[:, :1], ValueError, "accepted_tokens_per_request"),
        (8, lambda t: t[:1], ValueError, "accepted_tokens_per_request"),
        (9, lambda t: t[:, None], ValueError, "accepted_token_counts"),
        (9, lambda t: t[:1], ValueError, "accepted_token_counts"),
        (10, lambda s: -1, ValueError, "num_speculative_tokens"),
        (10, lambda s: 2.0, TypeError, "num_speculative_tokens"),
    ],
)
def test_bad_arguments(index, bad, error, match):
    args = _valid_args()
    args[index] = bad(args[index])
    with pytest.raises(error, match=match):
        prepare_next_forward_pass(*args)
