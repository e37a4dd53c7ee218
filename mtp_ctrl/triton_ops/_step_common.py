"""Argument helpers and the result type shared by the MTP step ops and their references.

Torch only (no Triton), so the references can import it. Like ``_checks``, nothing here reads
tensor values: a device-resident ``num_active_requests`` is checked by metadata only.
"""

from typing import NamedTuple, Optional, Union

import torch

from mtp_ctrl.triton_ops._checks import INDEX_DTYPES, check_int, check_tensor

ActiveCount = Union[int, torch.Tensor]  # a Python int, or a 1-element int tensor on the device


class StepCommit(NamedTuple):
    """What :func:`verify_and_commit` returns (and what its ``out=`` buffers hold)."""

    last_one_indices: torch.Tensor  # [N] int64, packed row of each request's last accepted token; -1 = padding
    accepted_tokens_mask: torch.Tensor  # [T] bool, accepted rows; False past the packed rows and for padding
    blocks_to_release: torch.Tensor  # [N] or [N, W] (see max_released_blocks), dtype of last_kv_block_id
    remove_mask: torch.Tensor  # same shape as blocks_to_release, bool: release blocks_to_release[remove_mask]


def max_released_blocks(num_speculative_tokens: int, block_size_tokens: int) -> int:
    """``W``: the most KV blocks one request can release when its rejected drafts are rewound.

    A request rewinds at most ``S`` tokens, so it frees at most ``ceil(S / block_size_tokens)``
    blocks: ``W == 1`` whenever ``S <= block_size_tokens`` (the reference API's one-block case),
    e.g. ``S = 3, block_size_tokens = 1 -> W = 3``.
    """
    return max(1, -(-num_speculative_tokens // block_size_tokens))


def request_row_tile(num_speculative_tokens: int) -> int:
    """``BLOCK_ROWS``: the power-of-two tile (at least 2) over one request's ``S + 1`` packed rows.

    E.g. ``S = 0 -> 2``, ``S = 3 -> 4``, ``S = 4 -> 8``.
    """
    return max(2, 1 << num_speculative_tokens.bit_length())  # next power of two >= S + 1


def release_shape(num_requests: int, release_width: int) -> tuple:
    """Shape of ``blocks_to_release``/``remove_mask``: ``[N]`` when ``W == 1``, else ``[N, W]``."""
    return (num_requests,) if release_width == 1 else (num_requests, release_width)


def check_token_rows(name: str, tokens) -> torch.Tensor:
    """Validate a packed token tensor of shape ``[T]`` or ``[1, T]``; return its ``[T]`` view."""
    check_tensor(name, tokens, dtypes=INDEX_DTYPES)
    if tokens.dim() == 2 and tokens.shape[0] == 1:
        return tokens.squeeze(0)
    if tokens.dim() != 1:
        raise ValueError(f"{name} must have shape [T] or [1, T], got {tuple(tokens.shape)}")
    return tokens


def check_min_rows(name: str, tensor: torch.Tensor, rows: int, what: str) -> None:
    """Raise ``ValueError`` unless ``tensor`` has at least ``rows`` rows (dim 0)."""
    if tensor.shape[0] < rows:
        raise ValueError(f"{name} has {tensor.shape[0]} rows, needs at least {rows} ({what})")


def check_num_active_requests(
    num_active_requests: Optional[ActiveCount], grid_size: int, device: torch.device
) -> ActiveCount:
    """Return the real request count of a launch over ``grid_size`` request slots.

    ``None`` means every slot is real. An int must lie in ``[0, grid_size]``. A tensor must be a
    1-element int32/int64 tensor on ``device``; its value is read by the kernel (so a CUDA graph
    can replay with a new count) and any value >= ``grid_size`` means every slot is real.
    """
    if num_active_requests is None:
        return grid_size
    if isinstance(num_active_requests, torch.Tensor):
        check_tensor("num_active_requests", num_active_requests, dtypes=INDEX_DTYPES, device=device)
        if num_active_requests.numel() != 1:
            raise ValueError(
                f"num_active_requests must hold one value, got shape {tuple(num_active_requests.shape)}"
            )
        return num_active_requests
    return check_int("num_active_requests", num_active_requests, low=0, high=grid_size)


def check_prepare_outputs(
    sampled_tokens_buf, last_accepted_seq_buf, accepted_tokens_per_request, accepted_token_counts,
    num_requests: int, num_decode_requests: int, num_speculative_tokens: int, device: torch.device,
) -> None:
    """Validate the caller's prepare-next-forward buffers (shared by the separate and the fused op)."""
    for name, buf in (("sampled_tokens_buf", sampled_tokens_buf), ("last_accepted_seq_buf", last_accepted_seq_buf)):
        check_tensor(name, buf, dtypes=INDEX_DTYPES, ndim=1, device=device)
        check_min_rows(name, buf, num_requests, "one per request")
    check_tensor("accepted_tokens_per_request", accepted_tokens_per_request, dtypes=INDEX_DTYPES,
                 shape=(None, num_speculative_tokens), device=device)
    check_min_rows("accepted_tokens_per_request", accepted_tokens_per_request, num_decode_requests, "decode requests")
    check_tensor("accepted_token_counts", accepted_token_counts, dtypes=INDEX_DTYPES, ndim=1, device=device)
    check_min_rows("accepted_token_counts", accepted_token_counts, num_decode_requests, "decode requests")
