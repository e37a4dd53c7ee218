"""The shape of one forward pass, and the rounding that maps a decode batch onto a CUDA graph.

A CUDA graph replays fixed shapes, so decode-only steps are padded up to the next captured
batch size. With ``S = 2`` drafts and buckets ``(1, 2, 4, 8)``, a step of 3 decode requests
(9 rows) runs the graph of ``BatchDimensions(token_count=12, decode_request_count=4,
prefill_request_count=0)``: requests 3 and rows 9..11 are padding. Steps with prefill rows
run eagerly at their exact dimensions.
"""

import dataclasses
from typing import Optional, Sequence, Tuple


@dataclasses.dataclass(frozen=True, order=True)
class BatchDimensions:
    """Ordered by token count first, so ``sorted(...)`` lists graphs from small to large."""

    token_count: int  # T, query rows of the pass (padding included)
    decode_request_count: int  # requests with 1 + S rows (padding requests included)
    prefill_request_count: int  # requests with a prefill chunk

    @property
    def request_count(self) -> int:
        return self.decode_request_count + self.prefill_request_count

    @classmethod
    def decode_only(cls, batch_size: int, num_speculative_tokens: int) -> "BatchDimensions":
        return cls(batch_size * (num_speculative_tokens + 1), batch_size, 0)


def check_batch_sizes(batch_sizes: Sequence[int], max_requests: int) -> Tuple[int, ...]:
    """Validate CUDA-graph batch sizes: strictly increasing ints in ``[1, max_requests]``."""
    sizes = tuple(batch_sizes)
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= max_requests:
            raise ValueError(f"cuda_graph_batch_sizes entries must be ints in [1, {max_requests}], got {size!r}")
    if list(sizes) != sorted(set(sizes)):
        raise ValueError(f"cuda_graph_batch_sizes must be strictly increasing, got {sizes}")
    return sizes


def round_up_batch_size(batch_size: int, batch_sizes: Sequence[int]) -> Optional[int]:
    """The smallest of the (increasing) ``batch_sizes`` that holds ``batch_size``, or None.

    ``round_up_batch_size(3, (1, 2, 4, 8)) == 4``; ``round_up_batch_size(9, (1, 2, 4, 8)) is None``.
    """
    for size in batch_sizes:
        if size >= batch_size:
            return size
    return None
