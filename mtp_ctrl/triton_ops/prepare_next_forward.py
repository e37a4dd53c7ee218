"""Gather what the next forward pass needs from a verified step (contract: docs/kernels.md).

For every request: the token sampled after its last accepted row (the next input token) and
that row's position in the forward pass. For decode requests also: the accepted drafts (-1
where rejected) and how many were accepted.
"""

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import INDEX_DTYPES, ValidatedSignatures, check_int, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._step_common import (
    check_min_rows,
    check_prepare_outputs,
    check_token_rows,
    request_row_tile,
)

_VALIDATED = ValidatedSignatures()  # argument signatures that passed _check_args


@triton.jit
def _store_last_accepted(
    OUTPUT_TOKENS_PTR,
    output_stride,
    REQUIRED_LOGIT_INDICES_PTR,
    required_stride,
    SAMPLED_TOKEN_PTR,
    LAST_ACCEPTED_SEQ_PTR,
    last_row,
    enabled,
):
    """``*SAMPLED_TOKEN_PTR = output_tokens[last_row]`` and
    ``*LAST_ACCEPTED_SEQ_PTR = required_logit_indices[last_row]``, if ``enabled``."""
    sampled = tl.load(OUTPUT_TOKENS_PTR + last_row * output_stride, mask=enabled)
    sequence_index = tl.load(REQUIRED_LOGIT_INDICES_PTR + last_row * required_stride, mask=enabled)
    tl.store(SAMPLED_TOKEN_PTR, sampled, mask=enabled)
    tl.store(LAST_ACCEPTED_SEQ_PTR, sequence_index, mask=enabled)


@triton.jit
def _store_accepted_drafts(
    ACCEPTED_TOKENS_PTR,
    accepted_tokens_stride,
    ACCEPTED_COUNT_PTR,
    rows,
    tokens,
    accepted,
    is_draft,
    enabled,
):
    """Row ``i`` (1 <= i <= S) of a decode request holds draft ``i - 1``: store it (-1 if rejected)
    at ``ACCEPTED_TOKENS_PTR[(i - 1) * accepted_tokens_stride]`` for the rows in ``is_draft``, and
    the accepted count at ``*ACCEPTED_COUNT_PTR`` if ``enabled``; return that count."""
    drafts = tl.where(accepted, tokens, -1)
    tl.store(ACCEPTED_TOKENS_PTR + (rows - 1) * accepted_tokens_stride, drafts, mask=is_draft)
    accepted_draft_count = tl.sum((is_draft & accepted).to(tl.int32), axis=0)
    tl.store(ACCEPTED_COUNT_PTR, accepted_draft_count, mask=enabled)
    return accepted_draft_count


@triton.jit(do_not_specialize=["num_decode_requests"])
def _prepare_next_forward_pass_kernel(
    OUTPUT_TOKENS_PTR,
    output_stride,
    REQUIRED_LOGIT_INDICES_PTR,
    required_stride,
    LAST_ONE_INDICES_PTR,
    last_one_stride,
    ACCEPTED_MASK_PTR,
    mask_stride,
    INPUT_TOKENS_PTR,
    input_stride,
    SAMPLED_TOKENS_PTR,
    sampled_stride,
    LAST_ACCEPTED_SEQ_PTR,
    last_seq_stride,
    ACCEPTED_TOKENS_PTR,
    accepted_tokens_stride_request,
    accepted_tokens_stride_draft,
    ACCEPTED_COUNTS_PTR,
    accepted_counts_stride,
    num_decode_requests,
    STRIDE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """One program per request; prefill programs skip the draft outputs."""
    request = tl.program_id(0).to(tl.int64)
    last_row = tl.load(LAST_ONE_INDICES_PTR + request * last_one_stride).to(tl.int64)
    _store_last_accepted(
        OUTPUT_TOKENS_PTR,
        output_stride,
        REQUIRED_LOGIT_INDICES_PTR,
        required_stride,
        SAMPLED_TOKENS_PTR + request * sampled_stride,
        LAST_ACCEPTED_SEQ_PTR + request * last_seq_stride,
        last_row,
        True,
    )
    is_decode = request < num_decode_requests
    rows = tl.arange(0, BLOCK_ROWS)
    packed_rows = request * STRIDE + rows  # [BLOCK_ROWS] int64
    is_draft = (rows > 0) & (rows < tl.where(is_decode, STRIDE, 1))  # no draft rows for prefill
    tokens = tl.load(INPUT_TOKENS_PTR + packed_rows * input_stride, mask=is_draft, other=0)
    accepted = tl.load(ACCEPTED_MASK_PTR + packed_rows * mask_stride, mask=is_draft, other=0) != 0
    _store_accepted_drafts(
        ACCEPTED_TOKENS_PTR + request * accepted_tokens_stride_request,
        accepted_tokens_stride_draft,
        ACCEPTED_COUNTS_PTR + request * accepted_counts_stride,
        rows,
        tokens,
        accepted,
        is_draft,
        is_decode,
    )


def _check_args(
    num_decode_requests,
    output_tokens,
    required_logit_indices,
    last_one_indices,
    accepted_tokens_mask,
    input_tokens,
    sampled_tokens_buf,
    last_accepted_seq_buf,
    accepted_tokens_per_request,
    accepted_token_counts,
    num_speculative_tokens,
):
    """Validate every argument (metadata only, so cacheable per signature)."""
    check_int("num_speculative_tokens", num_speculative_tokens, low=0)
    check_tensor("last_one_indices", last_one_indices, dtypes=INDEX_DTYPES, ndim=1)
    num_requests = last_one_indices.shape[0]
    check_int("num_decode_requests", num_decode_requests, low=0, high=num_requests)
    device = last_one_indices.device
    decode_rows = num_decode_requests * (num_speculative_tokens + 1)
    # last_one_indices (from verify) index the packed rows: Nd * (S + 1) decode rows, then one per prefill
    packed_rows = decode_rows + (num_requests - num_decode_requests)
    what = f"{num_decode_requests} decode x (1 + {num_speculative_tokens}) + {num_requests - num_decode_requests} prefill rows"
    check_tensor("output_tokens", output_tokens, dtypes=INDEX_DTYPES, ndim=1, device=device)
    check_min_rows("output_tokens", output_tokens, packed_rows, what)
    check_tensor("required_logit_indices", required_logit_indices, dtypes=INDEX_DTYPES, ndim=1, device=device)
    check_min_rows("required_logit_indices", required_logit_indices, packed_rows, what)
    check_tensor("accepted_tokens_mask", accepted_tokens_mask, dtypes=(torch.bool,), ndim=1, device=device)
    check_min_rows("accepted_tokens_mask", accepted_tokens_mask, decode_rows, "decode rows")
    tokens = check_token_rows("input_tokens", input_tokens)
    check_tensor("input_tokens", tokens, device=device)
    check_min_rows("input_tokens", tokens, decode_rows, "decode rows")
    check_prepare_outputs(sampled_tokens_buf, last_accepted_seq_buf, accepted_tokens_per_request,
                          accepted_token_counts, num_requests, num_decode_requests, num_speculative_tokens, device)


def prepare_next_forward_pass(
    num_decode_requests: int,
    output_tokens: torch.Tensor,  # [T] int, the target's sample at each packed row
    required_logit_indices: torch.Tensor,  # [T] int, forward-pass position of each packed row
    last_one_indices: torch.Tensor,  # [N] int64, from verify_speculative_tokens
    accepted_tokens_mask: torch.Tensor,  # [T] bool, from verify_speculative_tokens
    input_tokens: torch.Tensor,  # [T] or [1, T] int, packed input rows
    sampled_tokens_buf: torch.Tensor,  # [>= N] int, out
    last_accepted_seq_buf: torch.Tensor,  # [>= N] int, out
    accepted_tokens_per_request: torch.Tensor,  # [>= Nd, S] int, out (decode rows only)
    accepted_token_counts: torch.Tensor,  # [>= Nd] int, out (decode rows only)
    num_speculative_tokens: int,
) -> None:
    """Write the next step's inputs into the caller's buffers, in place.

    For every request ``r`` with ``k = last_one_indices[r]``: ``sampled_tokens_buf[r] =
    output_tokens[k]``, ``last_accepted_seq_buf[r] = required_logit_indices[k]``. For decode
    request ``r`` only: ``accepted_tokens_per_request[r, s]`` is draft ``s`` if accepted, else -1,
    and ``accepted_token_counts[r]`` the number accepted. Prefill rows of those two buffers (and
    rows past N of all four) are left as they were.

    Example, S = 2, one decode request with mask ``[1 1 0]`` over inputs ``[a5 a6 a7]`` and
    samples ``[a6 a8 a9]``: ``last_one_indices = [1]`` -> sampled ``a8``;
    accepted tokens ``[a6, -1]``, count ``1``. Arguments are checked once per signature (dtypes,
    shapes, devices, ints); see ``ValidatedSignatures``.
    """
    _VALIDATED.validate(
        _check_args,
        num_decode_requests,
        output_tokens,
        required_logit_indices,
        last_one_indices,
        accepted_tokens_mask,
        input_tokens,
        sampled_tokens_buf,
        last_accepted_seq_buf,
        accepted_tokens_per_request,
        accepted_token_counts,
        num_speculative_tokens,
    )
    tokens = input_tokens if input_tokens.dim() == 1 else input_tokens[0]  # [T]
    if not use_triton(tokens):
        return reference.prepare_next_forward_pass(
            num_decode_requests,
            output_tokens,
            required_logit_indices,
            last_one_indices,
            accepted_tokens_mask,
            tokens,
            sampled_tokens_buf,
            last_accepted_seq_buf,
            accepted_tokens_per_request,
            accepted_token_counts,
            num_speculative_tokens,
        )
    num_requests = last_one_indices.shape[0]
    if num_requests == 0:
        return None
    _prepare_next_forward_pass_kernel[(num_requests,)](
        output_tokens,
        output_tokens.stride(0),
        required_logit_indices,
        required_logit_indices.stride(0),
        last_one_indices,
        last_one_indices.stride(0),
        accepted_tokens_mask,
        accepted_tokens_mask.stride(0),
        tokens,
        tokens.stride(0),
        sampled_tokens_buf,
        sampled_tokens_buf.stride(0),
        last_accepted_seq_buf,
        last_accepted_seq_buf.stride(0),
        accepted_tokens_per_request,
        accepted_tokens_per_request.stride(0),
        accepted_tokens_per_request.stride(1),
        accepted_token_counts,
        accepted_token_counts.stride(0),
        num_decode_requests,
        STRIDE=num_speculative_tokens + 1,
        BLOCK_ROWS=request_row_tile(num_speculative_tokens),
        num_warps=1,
    )
    return None
