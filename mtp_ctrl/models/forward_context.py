"""The one side channel through which a forward pass's paged-attention inputs reach core attention.

megatron-core calls core attention with ``(query, key, value, attention_mask, ...)`` only, so
the step's :class:`AttentionMetadata` and the KV caches travel through a context variable that
exactly one context manager sets and always resets::

    with paged_forward_context(metadata, kv_caches):
        hidden = model.decoder(...)          # every PagedCoreAttention reads them here
"""

import contextlib
import contextvars
import dataclasses
from typing import Iterator, Optional, Sequence, Tuple

import torch

from mtp_ctrl.state.attention_metadata import AttentionMetadata

KVCachePair = Tuple[torch.Tensor, torch.Tensor]  # ([num_blocks, block_size_tokens, Hkv_local, D],) * 2


@dataclasses.dataclass(frozen=True)
class PagedForward:
    metadata: AttentionMetadata
    kv_caches: Sequence[KVCachePair]  # index: decoder layer 0..L-1, then MTP depth k at L + k


_CURRENT: contextvars.ContextVar[Optional[PagedForward]] = contextvars.ContextVar("mtp_ctrl_paged_forward", default=None)


@contextlib.contextmanager
def paged_forward_context(metadata: AttentionMetadata, kv_caches: Sequence[KVCachePair]) -> Iterator[PagedForward]:
    """Make ``metadata`` and ``kv_caches`` visible to paged core attention inside the block."""
    if not isinstance(metadata, AttentionMetadata):
        raise TypeError(f"metadata must be an AttentionMetadata, got {type(metadata).__name__}")
    if isinstance(kv_caches, torch.Tensor) or not isinstance(kv_caches, Sequence):
        raise TypeError("kv_caches must be a sequence of (key_cache, value_cache) pairs, one per attention layer")
    if _CURRENT.get() is not None:
        raise RuntimeError("paged_forward_context is already active; forwards do not nest")
    token = _CURRENT.set(PagedForward(metadata, kv_caches))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def current_paged_forward() -> PagedForward:
    """The active forward's inputs; raises outside :func:`paged_forward_context`."""
    forward = _CURRENT.get()
    if forward is None:
        raise RuntimeError(
            "paged core attention ran outside paged_forward_context(metadata, kv_caches); "
            "run the model through mtp_ctrl.models.PagedGPTRunner"
        )
    return forward
