"""Verify speculative tokens: which packed rows did the target model accept? (contract: docs/kernels.md)

Packed layout: ``num_decode_requests`` decode requests of ``S + 1`` rows each (base token, then
drafts ``d_1 .. d_S``), then one row per prefill request. ``output_tokens[k]`` is what the target
sampled at row ``k``, so draft ``i`` (row ``i`` of its request) is checked against the sample of
row ``i - 1``.
"""

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import INDEX_DTYPES, ValidatedSignatures, check_int, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._step_common import check_min_rows, check_token_rows, request_row_tile

_VALIDATED = ValidatedSignatures()  # argument signatures that passed _check_args


@triton.jit
def _request_rows(request, num_decode_requests, STRIDE: tl.constexpr):
    """(first packed row as int64, row count) of ``request``: S + 1 rows for decode, 1 for prefill."""
    request64 = request.to(tl.int64)
    is_decode = request < num_decode_requests
    first_row = tl.where(is_decode, request64 * STRIDE, request64 + (STRIDE - 1) * num_decode_requests)
    row_count = tl.where(is_decode, STRIDE, 1)
    return first_row, row_count


@triton.jit
def _accepted_rows(
    INPUT_TOKENS_PTR,
    input_stride,
    OUTPUT_TOKENS_PTR,
    output_stride,
    first_row,
    row_count,
    BLOCK_ROWS: tl.constexpr,
):
    """Acceptance of one request's rows: (rows [BLOCK_ROWS] int32, input tokens, accepted bool).

    Row 0 (base token or prefill row) is always accepted; row ``i >= 1`` is accepted iff every row
    ``1..i`` matches the target's sample one row earlier. Example, S = 3: inputs ``[a, b, c, d]``,
    samples ``[b, x, d, e]`` -> matches ``[-, yes, no, yes]`` -> accepted ``[1, 1, 0, 0]``.
    """
    rows = tl.arange(0, BLOCK_ROWS)
    in_request = rows < row_count
    is_draft = in_request & (rows > 0)
    packed_rows = first_row + rows  # [BLOCK_ROWS] int64
    tokens = tl.load(INPUT_TOKENS_PTR + packed_rows * input_stride, mask=in_request, other=0)
    targets = tl.load(OUTPUT_TOKENS_PTR + (packed_rows - 1) * output_stride, mask=is_draft, other=0)
    mismatches_so_far = tl.cumsum((is_draft & (tokens != targets)).to(tl.int32), axis=0)
    accepted = in_request & (mismatches_so_far == 0)
    return rows, tokens, accepted


@triton.jit(do_not_specialize=["num_decode_requests"])
def _verify_speculative_tokens_kernel(
    INPUT_TOKENS_PTR,
    input_stride,
    OUTPUT_TOKENS_PTR,
    output_stride,
    ACCEPTED_MASK_PTR,
    LAST_ONE_INDICES_PTR,
    num_decode_requests,
    STRIDE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """One program per request (decode first, then prefill); each writes only its own rows."""
    request = tl.program_id(0)
    first_row, row_count = _request_rows(request, num_decode_requests, STRIDE)
    rows, _, accepted = _accepted_rows(
        INPUT_TOKENS_PTR, input_stride, OUTPUT_TOKENS_PTR, output_stride, first_row, row_count, BLOCK_ROWS
    )
    tl.store(ACCEPTED_MASK_PTR + first_row + rows, accepted, mask=rows < row_count)
    accepted_row_count = tl.sum(accepted.to(tl.int32), axis=0)
    tl.store(LAST_ONE_INDICES_PTR + request, first_row + accepted_row_count - 1)


def _check_args(input_tokens, output_tokens, num_decode_requests, num_prefill_requests, num_speculative_tokens):
    """Validate every argument (metadata only, so cacheable per signature)."""
    tokens = check_token_rows("input_tokens", input_tokens)
    check_tensor("output_tokens", output_tokens, dtypes=INDEX_DTYPES, ndim=1, device=tokens.device)
    check_int("num_decode_requests", num_decode_requests, low=0)
    check_int("num_prefill_requests", num_prefill_requests, low=0)
    check_int("num_speculative_tokens", num_speculative_tokens, low=0)
    packed_rows = num_decode_requests * (num_speculative_tokens + 1) + num_prefill_requests
    what = "num_decode_requests * (num_speculative_tokens + 1) + num_prefill_requests packed rows"
    check_min_rows("input_tokens", tokens, packed_rows, what)
    check_min_rows("output_tokens", output_tokens, packed_rows, what)


def verify_speculative_tokens(
    input_tokens: torch.Tensor,  # [T] or [1, T] int, packed input rows
    output_tokens: torch.Tensor,  # [>= packed rows] int, the target's sample at each row
    num_decode_requests: int,
    num_prefill_requests: int,
    num_speculative_tokens: int,
):
    """Accept each decode request's longest prefix of drafts that the target sampled too.

    Returns ``(last_one_indices, accepted_tokens_mask, input_tokens)``:
    ``last_one_indices`` ``[N] int64`` (N = decode + prefill requests) is the packed row of each
    request's last accepted token, ``accepted_tokens_mask`` ``[T] bool`` marks accepted rows
    (rows past the packed region are False), and ``input_tokens`` is returned as ``[T]``.

    Example, S = 2, two decode requests and one prefill request (T = 7)::

        input_tokens  = [a5 a6 a7 | b3 b4 b5 | d2]     rows 0-2, 3-5, 6
        output_tokens = [a6 a8 a9 | b4 b5 b6 | d3]
        mask          = [ 1  1  0 |  1  1  1 |  1]     (a7 != a8: the 2nd draft of a is rejected)
        last_one_indices = [1, 5, 6]

    Padded request counts are safe: every request reads and writes only its own rows. Arguments
    are checked once per signature (dtypes, shapes, devices, ints); see ``ValidatedSignatures``.
    """
    _VALIDATED.validate(
        _check_args, input_tokens, output_tokens, num_decode_requests, num_prefill_requests, num_speculative_tokens
    )
    tokens = input_tokens if input_tokens.dim() == 1 else input_tokens[0]  # [T]
    if not use_triton(tokens):
        return reference.verify_speculative_tokens(
            input_tokens, output_tokens, num_decode_requests, num_prefill_requests, num_speculative_tokens
        )
    num_requests = num_decode_requests + num_prefill_requests
    accepted_tokens_mask = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)  # [T]
    last_one_indices = torch.empty(num_requests, dtype=torch.int64, device=tokens.device)  # [N]
    if num_requests > 0:
        _verify_speculative_tokens_kernel[(num_requests,)](
            tokens,
            tokens.stride(0),
            output_tokens,
            output_tokens.stride(0),
            accepted_tokens_mask,
            last_one_indices,
            num_decode_requests,
            STRIDE=num_speculative_tokens + 1,
            BLOCK_ROWS=request_row_tile(num_speculative_tokens),
            num_warps=1,
        )
    return last_one_indices, accepted_tokens_mask, tokens
