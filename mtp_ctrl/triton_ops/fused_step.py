"""One kernel launch for a step's bookkeeping: verify + prepare-next-forward + KV rewind.

The fused op writes exactly what ``verify_speculative_tokens``, ``prepare_next_forward_pass``
and ``rewind_kv_cache`` write when run in a row on the real requests (the decode/prefill split
comes from the packed layout: requests ``r < num_decode_requests`` decode). Each program keeps
its request's accepted count in registers and feeds it straight into the rewind, so nothing
round-trips through memory between the three stages.

Worked example, S = 2, ``block_size_tokens = 4``, one decode request then one prefill request
(``N = 2``). Decode request 0 has logits rows 0..2 with input tokens ``[5, 7, 9]`` (its base
token, then drafts 7 and 9) and the target sampled ``[7, 8, 3]`` there: draft 7 equals the sample
at row 0 (accepted), draft 9 differs from the 8 at row 1 (rejected). The prefill request's final
chunk ended at packed token row 12: its one logits row is row 3 (``required_logit_indices =
[0, 1, 2, 12]``) and the target sampled 4 there. The op writes::

    accepted_tokens_mask         [T, T, F, T]   rows kept
    last_one_indices             [1, 3]         each request's last kept row
    sampled_tokens_buf           [8, 4]         the next input token of each request (the bonus 8)
    last_accepted_seq_buf        [1, 12]        the packed token row of that last kept row
    accepted_tokens_per_request  [[7, -1]]      decode requests only
    accepted_token_counts        [1]

and rewinds request 0 by ``S - 1 = 1`` row: the step grew its KV from 7 to 10 tokens (3 blocks,
last offset 1), so it ends at 9 tokens, last offset 0, still 3 blocks, nothing released. Had
it accepted no draft (rewind 2), it would end at 8 tokens in 2 blocks and report its third block
in ``blocks_to_release`` (with ``keep_released_blocks=True``: kept, nothing reported). The
prefill request is not rewound.

Called every step, eagerly for steps with prefill chunks and under tensor parallelism, so the
host side is kept short: arguments are validated once per signature (:class:`ValidatedSignatures`),
the launch constants are computed once per ``(S, block_size_tokens)``, and the per-step counts are
not specialised on (one compiled kernel serves every batch).
"""

import functools
import types
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import INDEX_DTYPES, ValidatedSignatures, check_int, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton
from mtp_ctrl.triton_ops._step_common import (
    ActiveCount,
    StepCommit,
    check_min_rows,
    check_num_active_requests,
    check_prepare_outputs,
    check_token_rows,
    max_released_blocks,
    release_shape,
    request_row_tile,
)
from mtp_ctrl.triton_ops.kv_rewind import (
    _load_active_count,
    _rewind_request,
    active_count_launch_args,
    check_kv_state,
    release_strides,
    rewind_constants,
)
from mtp_ctrl.triton_ops.prepare_next_forward import _store_accepted_drafts, _store_last_accepted
from mtp_ctrl.triton_ops.verify_tokens import _accepted_rows, _request_rows

_BLOCK_TAIL = 128  # mask rows past the packed region that one program clears per loop step
_VALIDATED = ValidatedSignatures()  # argument signatures that passed _check_args


@triton.jit(do_not_specialize=["num_decode_requests", "total_row_count", "num_active_requests"])
def _verify_and_commit_kernel(
    INPUT_TOKENS_PTR,
    input_stride,
    OUTPUT_TOKENS_PTR,
    output_stride,
    REQUIRED_LOGIT_INDICES_PTR,
    required_stride,
    ACCEPTED_MASK_PTR,
    mask_stride,
    LAST_ONE_INDICES_PTR,
    last_one_stride,
    SAMPLED_TOKENS_PTR,
    sampled_stride,
    LAST_ACCEPTED_SEQ_PTR,
    last_seq_stride,
    ACCEPTED_TOKENS_PTR,
    accepted_tokens_stride_request,
    accepted_tokens_stride_draft,
    ACCEPTED_COUNTS_PTR,
    accepted_counts_stride,
    LAST_KV_BLOCK_OFFSET_PTR,
    offset_stride,
    KV_LENGTH_OFFSETS_PTR,
    length_stride,
    KV_BLOCK_COUNTS_PTR,
    count_stride,
    LAST_KV_BLOCK_ID_PTR,
    last_id_stride,
    KV_BLOCK_IDS_PTR,
    block_ids_stride_request,
    block_ids_stride_block,
    max_blocks,
    BLOCKS_TO_RELEASE_PTR,
    REMOVE_MASK_PTR,
    release_stride_request,
    release_stride_block,
    num_decode_requests,
    total_row_count,
    num_active_requests,
    NUM_ACTIVE_PTR,
    NUM_DECODE_PTR,
    REQUEST_SLOTS_PTR,
    QUERY_START_LOC_PTR,
    NUM_SPEC_TOKENS: tl.constexpr,
    BLOCK_SIZE_TOKENS: tl.constexpr,
    RELEASE_WIDTH: tl.constexpr,
    BLOCK_BACK: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    COUNT_IN_MEMORY: tl.constexpr,
    DECODE_COUNT_IN_MEMORY: tl.constexpr,
    KEEP_RELEASED_BLOCKS: tl.constexpr,
    HAS_REQUEST_SLOTS: tl.constexpr,
    HAS_QUERY_START_LOC: tl.constexpr,
):
    """One program per request of the grid (decode, then prefill). A padding request (``r >=``
    the real count) writes False over its mask rows, -1 as its last index and "release nothing",
    and leaves the caller's buffers and the KV state alone. With ``HAS_REQUEST_SLOTS`` request r's
    KV state is row ``request_slots[r]`` of the state tensors. With ``HAS_QUERY_START_LOC`` a decode
    request rewinds the rows it ran (``query_start_loc``) past its accepted ones, not S past them."""
    request = tl.program_id(0)
    num_requests = tl.num_programs(0)
    if DECODE_COUNT_IN_MEMORY:  # a graph replays with a changing decode/prefill split
        num_decode_requests = tl.load(NUM_DECODE_PTR)
    packed_row_count = num_decode_requests * NUM_SPEC_TOKENS + num_requests  # Nd * (S + 1) + Np
    request64 = request.to(tl.int64)
    is_real = request < _load_active_count(num_active_requests, NUM_ACTIVE_PTR, COUNT_IN_MEMORY)
    is_decode = request < num_decode_requests

    # verify
    first_row, row_count = _request_rows(request, num_decode_requests, NUM_SPEC_TOKENS + 1)
    rows, tokens, accepted = _accepted_rows(
        INPUT_TOKENS_PTR, input_stride, OUTPUT_TOKENS_PTR, output_stride, first_row, row_count, BLOCK_ROWS
    )
    accepted = tl.where(is_real, accepted, False)
    tl.store(ACCEPTED_MASK_PTR + (first_row + rows) * mask_stride, accepted, mask=rows < row_count)
    last_row = first_row + tl.sum(accepted.to(tl.int32), axis=0) - 1
    tl.store(LAST_ONE_INDICES_PTR + request64 * last_one_stride, tl.where(is_real, last_row, -1))

    # prepare next forward pass
    _store_last_accepted(
        OUTPUT_TOKENS_PTR,
        output_stride,
        REQUIRED_LOGIT_INDICES_PTR,
        required_stride,
        SAMPLED_TOKENS_PTR + request64 * sampled_stride,
        LAST_ACCEPTED_SEQ_PTR + request64 * last_seq_stride,
        last_row,
        is_real,
    )
    writes_drafts = is_decode & is_real
    accepted_draft_count = _store_accepted_drafts(
        ACCEPTED_TOKENS_PTR + request64 * accepted_tokens_stride_request,
        accepted_tokens_stride_draft,
        ACCEPTED_COUNTS_PTR + request64 * accepted_counts_stride,
        rows,
        tokens,
        accepted,
        (rows > 0) & (rows < tl.where(writes_drafts, NUM_SPEC_TOKENS + 1, 1)),
        writes_drafts,
    )

    # rewind KV bookkeeping past the rejected drafts
    if HAS_REQUEST_SLOTS:
        state_row = tl.load(REQUEST_SLOTS_PTR + request64)
    else:
        state_row = request64
    if HAS_QUERY_START_LOC:  # ragged rows: the request ran 1 + s_r rows, s_r <= S
        drafts_run = (tl.load(QUERY_START_LOC_PTR + request64 + 1) - tl.load(QUERY_START_LOC_PTR + request64) - 1)
        drafts_run = drafts_run.to(tl.int64)
    else:
        drafts_run = NUM_SPEC_TOKENS
    _rewind_request(
        request,
        state_row,
        tl.where(is_decode, drafts_run - accepted_draft_count, 0),
        is_real,
        LAST_KV_BLOCK_OFFSET_PTR,
        offset_stride,
        KV_LENGTH_OFFSETS_PTR,
        length_stride,
        KV_BLOCK_COUNTS_PTR,
        count_stride,
        LAST_KV_BLOCK_ID_PTR,
        last_id_stride,
        KV_BLOCK_IDS_PTR,
        block_ids_stride_request,
        block_ids_stride_block,
        max_blocks,
        BLOCKS_TO_RELEASE_PTR,
        REMOVE_MASK_PTR,
        release_stride_request,
        release_stride_block,
        BLOCK_SIZE_TOKENS,
        RELEASE_WIDTH,
        BLOCK_BACK,
        KEEP_RELEASED_BLOCKS,
    )

    # mask rows past the packed region, shared out over the programs
    for start in range(packed_row_count + request * BLOCK_TAIL, total_row_count, num_requests * BLOCK_TAIL):
        tail_rows = start + tl.arange(0, BLOCK_TAIL)
        tl.store(
            ACCEPTED_MASK_PTR + tail_rows.to(tl.int64) * mask_stride,
            tl.zeros([BLOCK_TAIL], dtype=tl.int1),
            mask=tail_rows < total_row_count,
        )


def _check_out(out, num_requests, total_row_count, release_width, release_dtype, device) -> None:
    if not isinstance(out, Sequence) or len(out) != 4:
        raise TypeError("out must be a StepCommit (or a sequence of 4 tensors)")
    out = StepCommit(*out)
    shape = release_shape(num_requests, release_width)
    for name, dtype, expected_shape in (
        ("last_one_indices", torch.int64, (num_requests,)),
        ("accepted_tokens_mask", torch.bool, (total_row_count,)),
        ("blocks_to_release", release_dtype, shape),
        ("remove_mask", torch.bool, shape),
    ):
        check_tensor(f"out.{name}", getattr(out, name), dtypes=(dtype,), shape=expected_shape, device=device)


def _check_args(
    input_tokens,
    output_tokens,
    required_logit_indices,
    sampled_tokens_buf,
    last_accepted_seq_buf,
    accepted_tokens_per_request,
    accepted_token_counts,
    last_kv_block_offset,
    kv_length_offsets,
    kv_block_counts,
    last_kv_block_id,
    kv_block_ids,
    num_decode_requests,
    num_prefill_requests,
    num_speculative_tokens,
    block_size_tokens,
    num_active_requests,
    out,
    request_slots,
    query_start_loc,
) -> None:
    """Validate every argument of :func:`verify_and_commit` (metadata only, so cacheable per signature)."""
    tokens = check_token_rows("input_tokens", input_tokens)
    device = tokens.device
    check_int("num_decode_requests", num_decode_requests, low=0)
    check_int("num_prefill_requests", num_prefill_requests, low=0)
    check_int("num_speculative_tokens", num_speculative_tokens, low=0)
    check_int("block_size_tokens", block_size_tokens, low=1)
    num_requests = num_decode_requests + num_prefill_requests
    packed_row_count = num_decode_requests * (num_speculative_tokens + 1) + num_prefill_requests
    for name, tensor in (
        ("input_tokens", tokens),
        ("output_tokens", output_tokens),
        ("required_logit_indices", required_logit_indices),
    ):
        check_tensor(name, tensor, dtypes=INDEX_DTYPES, ndim=1, device=device)
        check_min_rows(name, tensor, packed_row_count, "packed rows")
    check_prepare_outputs(sampled_tokens_buf, last_accepted_seq_buf, accepted_tokens_per_request,
                          accepted_token_counts, num_requests, num_decode_requests, num_speculative_tokens, device)
    if request_slots is None:
        check_kv_state(last_kv_block_offset, kv_length_offsets, kv_block_counts, last_kv_block_id, kv_block_ids,
                       num_requests, device)
    else:  # the state has a row per table slot; request r's is row request_slots[r]
        check_tensor("request_slots", request_slots, dtypes=(torch.int64,), ndim=1, device=device)
        check_min_rows("request_slots", request_slots, num_requests, "requests")
        check_tensor("kv_length_offsets", kv_length_offsets, dtypes=INDEX_DTYPES, ndim=1, device=device)
        check_kv_state(last_kv_block_offset, kv_length_offsets, kv_block_counts, last_kv_block_id, kv_block_ids,
                       kv_length_offsets.shape[0], device)
    if query_start_loc is not None:
        check_tensor("query_start_loc", query_start_loc, dtypes=INDEX_DTYPES, ndim=1, device=device)
        check_min_rows("query_start_loc", query_start_loc, num_requests + 1, "requests + 1")
    check_num_active_requests(num_active_requests, num_requests, device)
    if out is not None:
        release_width = max_released_blocks(num_speculative_tokens, block_size_tokens)
        _check_out(out, num_requests, tokens.shape[0], release_width, last_kv_block_id.dtype, device)


def _check_decode_count(decode_count, num_decode_requests: int, device: torch.device) -> None:
    """``decode_count``: a 1-element int tensor on the tokens' device (its value, read on the device,
    must not exceed ``num_decode_requests``: the kernel cannot check it without a sync)."""
    check_tensor("decode_count", decode_count, dtypes=INDEX_DTYPES, device=device)
    if decode_count.numel() != 1:
        raise ValueError(f"decode_count must hold one element, got shape {tuple(decode_count.shape)}")


@functools.lru_cache(maxsize=64)
def _launch_constants(num_speculative_tokens: int, block_size_tokens: int) -> types.MappingProxyType:
    """The kernel's compile-time arguments and launch options for one ``(S, block_size_tokens)`` (read-only)."""
    return types.MappingProxyType(dict(
        rewind_constants(num_speculative_tokens, block_size_tokens),
        BLOCK_ROWS=request_row_tile(num_speculative_tokens),
        BLOCK_TAIL=_BLOCK_TAIL,
        num_warps=1,
    ))


def verify_and_commit(
    input_tokens: torch.Tensor,  # [T] or [1, T] int, packed input rows
    output_tokens: torch.Tensor,  # [>= packed rows] int, the target's sample at each row
    required_logit_indices: torch.Tensor,  # [>= packed rows] int, forward-pass position of each row
    sampled_tokens_buf: torch.Tensor,  # [>= N] int, out: next input token per request
    last_accepted_seq_buf: torch.Tensor,  # [>= N] int, out: forward position of the last accepted row
    accepted_tokens_per_request: torch.Tensor,  # [>= Nd, S] int, out: accepted drafts, -1 = rejected
    accepted_token_counts: torch.Tensor,  # [>= Nd] int, out: accepted drafts per decode request
    last_kv_block_offset: torch.Tensor,  # [N] int, in/out
    kv_length_offsets: torch.Tensor,  # [N] int, in/out
    kv_block_counts: torch.Tensor,  # [N] int, in/out
    last_kv_block_id: torch.Tensor,  # [N] int, in/out
    kv_block_ids: torch.Tensor,  # [N, max_blocks] int, in/out
    num_decode_requests: int,
    num_prefill_requests: int,
    num_speculative_tokens: int,
    block_size_tokens: int,
    num_active_requests: Optional[ActiveCount] = None,
    out: Optional[StepCommit] = None,
    keep_released_blocks: bool = False,
    decode_count: Optional[torch.Tensor] = None,
    request_slots: Optional[torch.Tensor] = None,
    query_start_loc: Optional[torch.Tensor] = None,
) -> StepCommit:
    """Verify the drafts, write the next step's inputs and rewind the KV bookkeeping, in one launch.

    Same results as, on the real requests::

        last, mask, tokens = verify_speculative_tokens(input_tokens, output_tokens, Nd, Np, S)
        prepare_next_forward_pass(Nd, output_tokens, required_logit_indices, last, mask, tokens,
                                  sampled_tokens_buf, last_accepted_seq_buf,
                                  accepted_tokens_per_request, accepted_token_counts, S)
        blocks, remove = rewind_kv_cache(accepted_token_counts[:N] (0 for prefill), r >= Nd,
                                         <the KV state>, S, block_size_tokens, num_active_requests)

    Returns :class:`StepCommit` ``(last_one_indices, accepted_tokens_mask, blocks_to_release,
    remove_mask)``; the caller releases ``blocks_to_release[remove_mask]`` (``[N]``, or ``[N, W]``
    when ``S > block_size_tokens``: see :func:`rewind_kv_cache`).

    Use it for the decode step's bookkeeping: one launch instead of three, and inside a CUDA graph
    captured once per batch bucket. ``N = num_decode_requests + num_prefill_requests`` is the
    (padded) grid; ``num_active_requests`` (int, or a 1-element int tensor on the device that the
    kernel reads, so a graph replays with a changing real batch) marks slots ``r >= count`` as
    padding: their mask rows are False, ``last_one_indices`` -1, nothing released, and the caller's
    buffers and the KV state are untouched. Pass ``out`` (four preallocated tensors) to allocate
    nothing per step; it is filled and returned.

    ``keep_released_blocks=True``: the rewind updates lengths, offsets, counts and last block ids
    as usual but leaves every id in ``kv_block_ids`` and reports nothing released (``remove_mask``
    all False). The overlapped controller uses it: a request keeps the blocks past its length as
    the reserve its next step grows into, and the host, which reserved them, frees them when the
    request ends.

    ``decode_count`` (a 1-element int tensor on the device): the kernel reads the number of
    decode requests from it, so one CUDA graph serves every decode/prefill split of a mixed
    step. ``num_decode_requests`` is then only its upper bound: the grid is still
    ``N = num_decode_requests + num_prefill_requests`` programs, and requests
    ``decode_count <= r < N`` are prefill requests of one row each (packed after the decode rows).

    ``request_slots`` (``[>= N]`` int64 on the device): the KV state tensors (``last_kv_block_offset``
    .. ``kv_block_ids``) hold one row per table slot rather than per request, and request r's is
    row ``request_slots[r]`` (values are not checked: that would need a sync). The other buffers
    stay indexed by request. The controller passes its step's slot ids; padding requests may
    share a slot, whose state they leave alone.

    ``query_start_loc`` (``[>= N + 1]`` int on the device; ragged rows): decode request r ran the
    packed rows ``[qsl[r], qsl[r + 1])``, its base token and ``s_r <= S`` drafts, and rewinds
    ``s_r - accepted`` (not ``S - accepted``); its logits rows stay strided (``1 + S`` each, those
    past ``s_r`` repeating row ``s_r`` with a masked draft, so it accepts at most ``s_r``). None:
    every decode request ran ``1 + S`` rows.

    Arguments are validated on the first call of each signature (every tensor's dtype, shape and
    device, every int): a call that repeats a validated signature skips the checks, one that
    differs in any checked property is checked again.
    """
    _VALIDATED.validate(
        _check_args,
        input_tokens,
        output_tokens,
        required_logit_indices,
        sampled_tokens_buf,
        last_accepted_seq_buf,
        accepted_tokens_per_request,
        accepted_token_counts,
        last_kv_block_offset,
        kv_length_offsets,
        kv_block_counts,
        last_kv_block_id,
        kv_block_ids,
        num_decode_requests,
        num_prefill_requests,
        num_speculative_tokens,
        block_size_tokens,
        num_active_requests,
        out,
        request_slots,
        query_start_loc,
    )
    if decode_count is not None:
        _check_decode_count(decode_count, num_decode_requests, input_tokens.device)
    if not isinstance(keep_released_blocks, bool):
        raise TypeError(f"keep_released_blocks must be a bool, got {type(keep_released_blocks).__name__}")
    tokens = input_tokens if input_tokens.dim() == 1 else input_tokens[0]  # [T]; the forward pass has [1, T]
    num_requests = num_decode_requests + num_prefill_requests
    num_active = num_requests if num_active_requests is None else num_active_requests
    if out is not None and not isinstance(out, StepCommit):
        out = StepCommit(*out)
    if not use_triton(tokens):
        return reference.verify_and_commit(
            tokens,
            output_tokens,
            required_logit_indices,
            sampled_tokens_buf,
            last_accepted_seq_buf,
            accepted_tokens_per_request,
            accepted_token_counts,
            last_kv_block_offset,
            kv_length_offsets,
            kv_block_counts,
            last_kv_block_id,
            kv_block_ids,
            num_decode_requests,
            num_prefill_requests,
            num_speculative_tokens,
            block_size_tokens,
            num_active,
            out,
            keep_released_blocks,
            decode_count,
            request_slots,
            query_start_loc,
        )
    constants = _launch_constants(num_speculative_tokens, block_size_tokens)
    if out is None:
        shape = release_shape(num_requests, constants["RELEASE_WIDTH"])
        out = StepCommit(
            torch.empty(num_requests, dtype=torch.int64, device=tokens.device),
            torch.empty(tokens.shape[0], dtype=torch.bool, device=tokens.device),
            torch.empty(shape, dtype=last_kv_block_id.dtype, device=tokens.device),
            torch.empty(shape, dtype=torch.bool, device=tokens.device),
        )
    if num_requests == 0:
        out.accepted_tokens_mask.zero_()
        return out
    active_count, active_count_ptr, count_in_memory = active_count_launch_args(num_active, kv_block_counts)
    # each tensor is followed by its strides: `*t.stride()` is one stride for a 1-D tensor, two for a 2-D one
    _verify_and_commit_kernel[(num_requests,)](
        tokens,
        *tokens.stride(),
        output_tokens,
        *output_tokens.stride(),
        required_logit_indices,
        *required_logit_indices.stride(),
        out.accepted_tokens_mask,
        *out.accepted_tokens_mask.stride(),
        out.last_one_indices,
        *out.last_one_indices.stride(),
        sampled_tokens_buf,
        *sampled_tokens_buf.stride(),
        last_accepted_seq_buf,
        *last_accepted_seq_buf.stride(),
        accepted_tokens_per_request,
        *accepted_tokens_per_request.stride(),
        accepted_token_counts,
        *accepted_token_counts.stride(),
        last_kv_block_offset,
        *last_kv_block_offset.stride(),
        kv_length_offsets,
        *kv_length_offsets.stride(),
        kv_block_counts,
        *kv_block_counts.stride(),
        last_kv_block_id,
        *last_kv_block_id.stride(),
        kv_block_ids,
        *kv_block_ids.stride(),
        kv_block_ids.shape[1],
        out.blocks_to_release,
        out.remove_mask,
        *release_strides(out.blocks_to_release),
        num_decode_requests,
        tokens.shape[0],
        active_count,
        active_count_ptr,
        active_count_ptr if decode_count is None else decode_count,
        active_count_ptr if request_slots is None else request_slots,
        active_count_ptr if query_start_loc is None else query_start_loc,
        COUNT_IN_MEMORY=count_in_memory,
        DECODE_COUNT_IN_MEMORY=decode_count is not None,
        KEEP_RELEASED_BLOCKS=keep_released_blocks,
        HAS_REQUEST_SLOTS=request_slots is not None,
        HAS_QUERY_START_LOC=query_start_loc is not None,
        **constants,
    )
    return out
