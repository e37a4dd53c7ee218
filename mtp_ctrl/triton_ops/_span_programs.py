"""Grid sizing shared by the drafting kernels that walk spans of work in blocks.

A span is one request's rows (EAGLE expand, shift-and-gather) or one row tile's hidden columns
(parallel drafting). Such kernels launch a ``(span, program)`` grid: the ``P`` programs of one
span visit its blocks ``p, p + P, p + 2P, ...`` in a loop bounded by the span's own length, read
on the device. The grid therefore depends on shapes only (no host sync, CUDA-graph safe), one
long span (a long prefill, a wide hidden row) is spread over many programs, and many short
spans do not launch thousands of programs that find nothing to do.
"""

import triton

# Programs per launch the sizing aims for: several waves on a large GPU, cheap when idle.
TARGET_PROGRAMS = 2048


def programs_per_span(num_spans: int, max_span_len: int, block: int) -> int:
    """Programs per span (grid dim 1) for ``num_spans`` spans of at most ``max_span_len`` items.

    Example with ``block = 128``: 1 span of up to 8192 rows -> 64 programs (one per block);
    1024 spans -> 2 programs each; 4096 spans -> 1 program each.
    """
    num_blocks = triton.cdiv(max(max_span_len, 1), block)
    return max(1, min(num_blocks, TARGET_PROGRAMS // max(num_spans, 1)))
