"""Per-request bookkeeping of the padded EAGLE batch after verification (contract: docs/kernels.md).

In the padded batch every request keeps all of its ``1 + num_draft`` verified rows, rejected
ones included; these two ops find, without a host sync, which row each request samples its
next draft from and which token feeds it.
"""

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import INDEX_DTYPES, check_int, check_same_device, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._layout_checks import check_contiguous, check_unit_last_stride

BLOCK_REQUESTS = 128


@triton.jit
def _eagle_prepare_inputs_padded_kernel(
    CU_NUM_DRAFT_TOKENS_PTR,
    VALID_SAMPLED_TOKENS_COUNT_PTR,
    QUERY_START_LOC_PTR,
    TOKEN_INDICES_TO_SAMPLE_PTR,
    NUM_REJECTED_TOKENS_PTR,
    num_requests,
    BLOCK_REQUESTS: tl.constexpr,
):
    """One program per ``BLOCK_REQUESTS`` requests; lanes past ``num_requests`` do nothing."""
    requests = tl.program_id(0) * BLOCK_REQUESTS + tl.arange(0, BLOCK_REQUESTS)
    is_real = requests < num_requests
    cumulative = tl.load(CU_NUM_DRAFT_TOKENS_PTR + requests, mask=is_real, other=0).to(tl.int64)
    previous = tl.load(CU_NUM_DRAFT_TOKENS_PTR + requests - 1, mask=is_real & (requests > 0), other=0).to(tl.int64)
    num_draft = cumulative - previous
    valid_count = tl.load(VALID_SAMPLED_TOKENS_COUNT_PTR + requests, mask=is_real, other=0).to(tl.int64)
    num_rejected = tl.where(num_draft > 0, num_draft + 1 - valid_count, 0)
    last_row = tl.load(QUERY_START_LOC_PTR + requests + 1, mask=is_real, other=0).to(tl.int64) - 1
    tl.store(TOKEN_INDICES_TO_SAMPLE_PTR + requests, last_row - num_rejected, mask=is_real)
    tl.store(NUM_REJECTED_TOKENS_PTR + requests, num_rejected, mask=is_real)


@triton.jit
def _eagle_prepare_next_token_padded_kernel(
    SAMPLED_TOKEN_IDS_PTR,
    DISCARD_REQUEST_MASK_PTR,
    BACKUP_NEXT_TOKEN_IDS_PTR,
    NEXT_TOKEN_IDS_PTR,
    VALID_SAMPLED_TOKENS_COUNT_PTR,
    sampled_stride,
    num_requests,
    num_sampled_per_request,
    vocab_size,
    BLOCK_REQUESTS: tl.constexpr,
    BLOCK_SAMPLED: tl.constexpr,
):
    """One program per ``BLOCK_REQUESTS`` requests, each a row of ``S + 1`` sampled tokens."""
    requests = tl.program_id(0) * BLOCK_REQUESTS + tl.arange(0, BLOCK_REQUESTS)  # [BLOCK_REQUESTS]
    columns = tl.arange(0, BLOCK_SAMPLED)  # [BLOCK_SAMPLED]
    is_real = requests < num_requests
    in_row = is_real[:, None] & (columns[None, :] < num_sampled_per_request)
    row_offsets = requests.to(tl.int64)[:, None] * sampled_stride + columns[None, :]
    tokens = tl.load(SAMPLED_TOKEN_IDS_PTR + row_offsets, mask=in_row, other=-1).to(tl.int64)
    is_valid = in_row & (tokens >= 0) & (tokens < vocab_size)  # rejected rows hold -1
    valid_count = tl.sum(is_valid.to(tl.int64), axis=1)  # [BLOCK_REQUESTS]
    last_valid = tl.max(tl.where(is_valid, columns[None, :], -1), axis=1)  # [BLOCK_REQUESTS], -1 if none
    last_token = tl.sum(tl.where(columns[None, :] == last_valid[:, None], tokens, 0), axis=1)
    is_discarded = tl.load(DISCARD_REQUEST_MASK_PTR + requests, mask=is_real, other=1) != 0
    backup = tl.load(BACKUP_NEXT_TOKEN_IDS_PTR + requests, mask=is_real, other=0).to(tl.int64)
    next_token = tl.where(is_discarded | (valid_count == 0), backup, last_token)
    tl.store(NEXT_TOKEN_IDS_PTR + requests, next_token.to(NEXT_TOKEN_IDS_PTR.dtype.element_ty), mask=is_real)
    tl.store(VALID_SAMPLED_TOKENS_COUNT_PTR + requests, tl.where(is_discarded, 0, valid_count), mask=is_real)


def eagle_prepare_inputs_padded(
    cu_num_draft_tokens: torch.Tensor,  # [R] int32/int64, inclusive cumsum of drafts per request
    valid_sampled_tokens_count: torch.Tensor,  # [R] int32/int64, 1 + accepted drafts (0 if discarded)
    query_start_loc: torch.Tensor,  # [R + 1] int32/int64, padded rows of each request
):
    """Row to sample each request's next draft from, and how many of its rows were rejected.

    ``num_draft[r] = cu[r] - cu[r - 1]`` (``cu[-1] = 0``); ``num_rejected = num_draft + 1 - valid``
    if ``num_draft > 0`` else 0; ``token_indices_to_sample[r] = query_start_loc[r + 1] - 1 - num_rejected``.

    Example: ``cu = [3, 3, 5]``, ``valid = [2, 1, 3]``, ``query_start_loc = [0, 4, 5, 8]``
    -> ``num_rejected = [2, 0, 0]``, ``token_indices_to_sample = [1, 4, 7]``.

    Returns ``(token_indices_to_sample [R] int64, num_rejected_tokens [R] int64)``. Padding
    requests of a CUDA-graph bucket (no drafts, ``query_start_loc`` repeated) get 0 rejected.
    """
    check_tensor("cu_num_draft_tokens", cu_num_draft_tokens, dtypes=INDEX_DTYPES, ndim=1)
    num_requests = cu_num_draft_tokens.shape[0]
    check_tensor(
        "valid_sampled_tokens_count", valid_sampled_tokens_count, dtypes=INDEX_DTYPES, shape=(num_requests,)
    )
    check_tensor("query_start_loc", query_start_loc, dtypes=INDEX_DTYPES, shape=(num_requests + 1,))
    tensors = dict(
        cu_num_draft_tokens=cu_num_draft_tokens,
        valid_sampled_tokens_count=valid_sampled_tokens_count,
        query_start_loc=query_start_loc,
    )
    check_same_device(**tensors)
    check_contiguous(**tensors)
    if not use_triton(cu_num_draft_tokens):
        return reference.eagle_prepare_inputs_padded(cu_num_draft_tokens, valid_sampled_tokens_count, query_start_loc)

    device = cu_num_draft_tokens.device
    token_indices_to_sample = torch.empty(num_requests, dtype=torch.int64, device=device)  # [R]
    num_rejected_tokens = torch.empty(num_requests, dtype=torch.int64, device=device)  # [R]
    if num_requests > 0:
        _eagle_prepare_inputs_padded_kernel[(triton.cdiv(num_requests, BLOCK_REQUESTS),)](
            cu_num_draft_tokens,
            valid_sampled_tokens_count,
            query_start_loc,
            token_indices_to_sample,
            num_rejected_tokens,
            num_requests,
            BLOCK_REQUESTS=BLOCK_REQUESTS,
        )
    return token_indices_to_sample, num_rejected_tokens


def eagle_prepare_next_token_padded(
    sampled_token_ids: torch.Tensor,  # [R, S + 1] int32/int64, -1 where a row was rejected
    discard_request_mask: torch.Tensor,  # [R] bool, True for requests whose sample is thrown away
    backup_next_token_ids: torch.Tensor,  # [R] int32/int64, token to use when none is valid
    vocab_size: int,
):
    """Token that feeds each request's next draft, and how many sampled tokens are valid.

    A sampled token is valid iff ``0 <= token < vocab_size``. A discarded request (e.g. a
    partial prefill) gets its backup token and count 0; otherwise the count is the number of
    valid tokens and the next token is the one at the last valid column, or the backup when
    none is valid.

    Example, ``vocab_size = 100``: rows ``[[5, 7, -1], [-1, -1, -1], [3, 120, 4]]``, discard
    ``[F, F, T]``, backup ``[50, 60, 70]`` -> ``next_token_ids = [7, 60, 70]``, counts ``[2, 0, 0]``.

    Returns ``(next_token_ids [R] (dtype of sampled_token_ids), valid_sampled_tokens_count [R] int64)``.
    Pad a CUDA-graph bucket with discarded requests.
    """
    check_tensor("sampled_token_ids", sampled_token_ids, dtypes=INDEX_DTYPES, ndim=2)
    num_requests, num_sampled_per_request = sampled_token_ids.shape
    check_tensor("discard_request_mask", discard_request_mask, dtypes=(torch.bool,), shape=(num_requests,))
    check_tensor("backup_next_token_ids", backup_next_token_ids, dtypes=INDEX_DTYPES, shape=(num_requests,))
    check_int("vocab_size", vocab_size, low=1)
    check_same_device(
        sampled_token_ids=sampled_token_ids,
        discard_request_mask=discard_request_mask,
        backup_next_token_ids=backup_next_token_ids,
    )
    check_unit_last_stride(sampled_token_ids=sampled_token_ids)
    check_contiguous(discard_request_mask=discard_request_mask, backup_next_token_ids=backup_next_token_ids)
    if not use_triton(sampled_token_ids):
        return reference.eagle_prepare_next_token_padded(
            sampled_token_ids, discard_request_mask, backup_next_token_ids, vocab_size
        )

    device = sampled_token_ids.device
    next_token_ids = torch.empty(num_requests, dtype=sampled_token_ids.dtype, device=device)  # [R]
    valid_sampled_tokens_count = torch.empty(num_requests, dtype=torch.int64, device=device)  # [R]
    if num_requests > 0:
        _eagle_prepare_next_token_padded_kernel[(triton.cdiv(num_requests, BLOCK_REQUESTS),)](
            sampled_token_ids,
            discard_request_mask,
            backup_next_token_ids,
            next_token_ids,
            valid_sampled_tokens_count,
            sampled_token_ids.stride(0),
            num_requests,
            num_sampled_per_request,
            vocab_size,
            BLOCK_REQUESTS=BLOCK_REQUESTS,
            BLOCK_SAMPLED=triton.next_power_of_2(max(num_sampled_per_request, 1)),
        )
    return next_token_ids, valid_sampled_tokens_count
