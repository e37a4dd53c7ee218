"""The shape of one forward pass, and the rounding that maps a batch onto a CUDA graph.

A CUDA graph replays fixed shapes, so a step is padded up to a captured shape: its request
count to the next of the batch buckets and, for a step with prefill chunks, its token count to
the next token bucket. With ``S = 2`` drafts and batch buckets ``(1, 2, 4, 8)``, a step of 3
decode requests (9 rows) runs the graph of ``BatchDimensions(token_count=12, request_count=4,
has_prefill=False)``: request 3 and rows 9..11 are padding. A step of 3 decode requests and a
20-token prefill chunk (29 rows), with token buckets ``(64, 128, 256)``, runs the graph of
``BatchDimensions(64, 4, True)``. Inside, the step reads its real counts (requests, decode
requests, requests that sample) on the device, so one graph serves every split of its shape.
Shapes above every bucket run eagerly at their exact dimensions.
"""

import dataclasses
import functools
from typing import Optional, Sequence, Tuple


@dataclasses.dataclass(frozen=True, order=True)
class BatchDimensions:
    """Ordered by token count first, so ``sorted(...)`` lists graphs from small to large."""

    token_count: int  # T, query rows of the pass (padding included)
    request_count: int  # G, requests of the grid (padding included)
    has_prefill: bool  # some rows are prefill chunks (else every request has 1 + S rows)

    @classmethod
    def decode_only(cls, batch_size: int, num_speculative_tokens: int) -> "BatchDimensions":
        return cls(batch_size * (num_speculative_tokens + 1), batch_size, False)

    def is_ragged(self, verify_width: int) -> bool:
        """A decode-only grid whose rows are not ``1 + verify_width`` per request: a ragged token count
        (``ragged_token_counts``), below the tier's ``G (1 + V)``."""
        return not self.has_prefill and self.token_count != self.request_count * (1 + verify_width)


def check_batch_sizes(batch_sizes: Sequence[int], max_requests: int) -> Tuple[int, ...]:
    """Validate CUDA-graph batch sizes: strictly increasing ints in ``[1, max_requests]``."""
    return _increasing_ints("cuda_graph_batch_sizes", batch_sizes, max_requests)


def _increasing_ints(name: str, values: Sequence[int], most: int) -> Tuple[int, ...]:
    """``values`` as a tuple of strictly increasing ints in ``[1, most]``, else a ValueError naming ``name``."""
    values = tuple(values)
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise ValueError(f"{name} entries must be ints in [1, {most}], got {value!r}")
    if list(values) != sorted(set(values)):
        raise ValueError(f"{name} must be strictly increasing, got {values}")
    return values


def round_up_batch_size(batch_size: int, batch_sizes: Sequence[int]) -> Optional[int]:
    """The smallest of the (increasing) ``batch_sizes`` that holds ``batch_size``, or None.

    ``round_up_batch_size(3, (1, 2, 4, 8)) == 4``; ``round_up_batch_size(9, (1, 2, 4, 8)) is None``.
    Token counts round up to the token buckets the same way.
    """
    for size in batch_sizes:
        if size >= batch_size:
            return size
    return None


FINE_TOKEN_RANGE = (256, 4096)  # token counts of mixed-step graphs in quarter-octave steps (token_buckets)


def token_buckets(max_tokens_per_step: int, smallest: int = 64, per_octave: int = 4,
                  fine_range: Tuple[int, int] = FINE_TOKEN_RANGE) -> Tuple[int, ...]:
    """Token counts of the mixed-step graphs: powers of two from ``smallest``, the octaves inside
    ``fine_range`` split into ``per_octave`` even steps, then the step's maximum.

    In a queue a freed slot takes the next request at once, so most steps carry the decode rows
    plus a few prompt chunks: they land between the powers of two (the 1B model at batch 256, S = 1:
    ~1250 rows a mixed step, padded 26 % on average to powers of two, 6 % in quarter steps; the
    queue's tokens/s +28 %). Below 256 rows a step costs about the same whatever its rows; above
    4096 it is mostly a prompt's chunks, which fill the budget. Each count is a graph per verify
    tier and draft depth, so the steps are kept to that range.
    ``token_buckets(256) == (64, 128, 256)``; ``token_buckets(48) == (48,)``;
    ``token_buckets(1024) == (64, 128, 256, 320, 384, 448, 512, 640, 768, 896, 1024)``."""
    buckets, size = [], smallest
    low, high = fine_range
    while size < max_tokens_per_step:
        steps = per_octave if low <= size < high else 1
        buckets += [count for count in range(size, 2 * size, max(size // steps, 1)) if count < max_tokens_per_step]
        size *= 2
    return tuple(buckets) + (max_tokens_per_step,)


def check_token_counts(token_counts: Sequence[int], max_tokens_per_step: int) -> Tuple[int, ...]:
    """Validate mixed-step graph token counts: strictly increasing ints in ``[1, max_tokens_per_step]``."""
    return _increasing_ints("cuda_graph_token_counts", token_counts, max_tokens_per_step)


RAGGED_ROW_FRACTION = 4  # ragged decode-only graphs: token counts every ceil(G / 4) rows


@functools.lru_cache(maxsize=None)  # read on every ragged decode step; a few (G, V) pairs an engine
def ragged_token_counts(batch_size: int, verify_width: int) -> Tuple[int, ...]:
    """Token counts of the decode-only graphs of grid ``batch_size`` (G) at verify width V when
    decode requests run ``1 + s_r`` rows each (ragged rows, ``s_r <= V``): from ``G`` up in steps of
    ``ceil(G / RAGGED_ROW_FRACTION)`` rows, then ``G (1 + V)`` (the strided tier's shape, the last);
    ``(G,)`` at V = 0. ``ragged_token_counts(8, 2) == (10, 12, 14, 16, 18, 20, 22, 24)``."""
    full = batch_size * (1 + verify_width)
    step = -(-batch_size // RAGGED_ROW_FRACTION)
    return tuple(range(batch_size + step, full, step)) + (full,)
