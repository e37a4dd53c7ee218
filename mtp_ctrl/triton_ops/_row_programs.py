"""Grid sizing shared by the drafting kernels that walk each request's rows in row blocks.

Those kernels launch a ``(request, row program)`` grid: the ``P`` programs of one request visit
its row blocks ``p, p + P, p + 2P, ...`` in a loop bounded by that request's own row count, read
on the device. The grid therefore depends on shapes only (no host sync, CUDA-graph safe), a long
prefill is spread over many programs, and a batch of short decodes does not launch thousands of
programs that find nothing to do.
"""

import triton

# Programs per launch the sizing aims for: several waves on a large GPU, cheap when idle.
TARGET_PROGRAMS = 2048


def row_programs_per_request(num_requests: int, max_rows_per_request: int, block_rows: int) -> int:
    """Programs per request (grid dim 1) for ``num_requests`` spans of at most ``max_rows_per_request``.

    Example with ``block_rows = 128``: 1 request of up to 8192 rows -> 64 programs (one per row
    block); 1024 requests -> 2 programs each; 4096 requests -> 1 program each.
    """
    num_row_blocks = triton.cdiv(max(max_rows_per_request, 1), block_rows)
    return max(1, min(num_row_blocks, TARGET_PROGRAMS // max(num_requests, 1)))
