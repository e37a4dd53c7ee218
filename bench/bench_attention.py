"""Decode paged attention: KV bandwidth against a same-run device copy, and time against dense SDPA.

Every request has 1 + S = 4 query rows (a decode with three drafts) over ``context`` cached
tokens; Hq = 32, Hkv = 8, D = 128, bf16. Bandwidth counts the K and V bytes the kernel must
read (``batch * context * Hkv * D * 2 tensors * 2 bytes``); the copy figure is a
``dst.copy_(src)`` of the same byte count, counted as read + write. Both are timed from CUDA
graphs (``triton.testing.do_bench_cudagraph``, median). SDPA runs on dense ``[B, Hkv, context, D]``
K/V with ``enable_gqa`` and no mask (the same bytes, a little less masking work).

    python bench/bench_attention.py            # full grid
    python bench/bench_attention.py --quick    # a few points
"""

import argparse
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few points only")
    parser.add_argument("--block-size", type=int, default=64, help="KV block size in tokens")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help answers before torch loads
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)  # before megatron-core is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton.testing  # noqa: E402
from tqdm import tqdm  # noqa: E402

from mtp_ctrl.triton_ops import paged_attention  # noqa: E402

NUM_QUERY_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
ROWS_PER_REQUEST = 4
MAX_KV_TOKENS = 1 << 22  # batch * context cap: 16 GiB of bf16 K + V, plus a dense copy for SDPA


def _time_us(fn, graph=True):
    """Median time of ``fn`` in us: replayed from a CUDA graph, or eager (launch included).

    Synchronize first: triton's timers run ``fn`` on a side stream that does not wait for the
    default stream, so without it the first call can read inputs that are still being written
    (that race, not the kernel, caused the illegal memory accesses seen in earlier runs).
    """
    torch.cuda.synchronize()
    if graph:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _copy_gbps(num_bytes):
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    seconds = _time_us(lambda: dst.copy_(src)) * 1e-6
    return 2 * num_bytes / seconds / 1e9


def bench_point(batch, context, block_size_tokens):
    blocks_per_request = -(-context // block_size_tokens)
    num_blocks = batch * blocks_per_request
    cache_shape = (num_blocks, block_size_tokens, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device="cuda")
    value_cache = torch.randn_like(key_cache)
    block_table = torch.randperm(num_blocks, device="cuda").int().view(batch, blocks_per_request)  # [B, blocks]
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")  # [B]
    query_start_loc = torch.arange(0, (batch + 1) * ROWS_PER_REQUEST, ROWS_PER_REQUEST,
                                   dtype=torch.int32, device="cuda")  # [B + 1]
    query = torch.randn(batch * ROWS_PER_REQUEST, NUM_QUERY_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    scale = HEAD_DIM ** -0.5
    def paged():
        return paged_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                               max_query_len=ROWS_PER_REQUEST, max_seq_len=context)

    paged_eager_us = _time_us(paged, graph=False)
    paged_us = _time_us(paged)
    kv_bytes = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * 2
    del key_cache, value_cache

    dense_query = query.view(batch, ROWS_PER_REQUEST, NUM_QUERY_HEADS, HEAD_DIM).transpose(1, 2)
    dense_key = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    dense_value = torch.randn_like(dense_key)
    sdpa_us = _time_us(lambda: F.scaled_dot_product_attention(dense_query, dense_key, dense_value,
                                                              scale=scale, enable_gqa=True))
    del dense_key, dense_value
    torch.cuda.empty_cache()
    return paged_eager_us, paged_us, kv_bytes / (paged_us * 1e-6) / 1e9, sdpa_us


def main(args=None):
    args = args or parse_args()
    batches = [1, 32, 256] if args.quick else [1, 8, 32, 64, 128, 256]
    contexts = [512, 8192, 32768] if args.quick else [512, 2048, 8192, 32768]
    copy_gbps = _copy_gbps(1 << 30)
    rows = []
    points = [(batch, context) for batch in batches for context in contexts if batch * context <= MAX_KV_TOKENS]
    progress = tqdm(points, desc="points", unit="point", disable=not sys.stdout.isatty())
    for batch, context in progress:
        eager_us, paged_us, gbps, sdpa_us = bench_point(batch, context, args.block_size)
        rows.append((batch, context, eager_us, paged_us, gbps, 100 * gbps / copy_gbps, sdpa_us, sdpa_us / paged_us))
        progress.set_postfix_str(f"batch {batch} context {context}: {paged_us:.1f} us, {gbps:.0f} GB/s")

    print(f"\n{torch.cuda.get_device_name()}, bf16, Hq={NUM_QUERY_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM}, "
          f"{ROWS_PER_REQUEST} query rows per request, block size {args.block_size}; "
          f"device copy (1 GiB, read + write): {copy_gbps:.0f} GB/s")
    print("times: median us; 'graph' = replayed from a CUDA graph (KV GB/s and SDPA from graphs too), 'eager' = launch included")
    print(f"{'batch':>5} {'context':>7} {'eager us':>9} {'graph us':>9} {'KV GB/s':>8} {'% copy':>7} {'SDPA us':>9} {'vs SDPA':>8}")
    for batch, context, eager_us, paged_us, gbps, percent, sdpa_us, speedup in rows:
        print(f"{batch:5d} {context:7d} {eager_us:9.1f} {paged_us:9.1f} {gbps:8.0f} {percent:6.0f}% {sdpa_us:9.1f} {speedup:7.2f}x")


if __name__ == "__main__":
    main(ARGS)
