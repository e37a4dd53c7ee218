"""Split-K paged attention: the attention kernel and the split combine, GPU us per launch.

The shapes of a prefix-cache hit and of the decode steps around it on the ~1B GPT of
``bench_prefix_cache.py`` (Hq = 16, Hkv = 4, D = 128, bf16, 16-token blocks), plus MLA decode
(128 heads, C = 512, R = 64), each with the split count the launcher picks. Per shape: the whole op
replayed from a CUDA graph (median us), and each kernel's mean us per launch from torch.profiler
(``_paged_attention_kernel`` / ``_paged_mla_kernel`` and ``_combine_kv_splits_kernel``: the names
are the same on older checkouts, so the same script times another tree's package on its
PYTHONPATH in the same device call). The output is checked against the torch reference.

    python bench/bench_split_combine.py            # GPU
    python bench/bench_split_combine.py --quick    # two shapes (a smoke run; CPU runs the twins)
"""

import argparse
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small shapes (smoke run)")
    parser.add_argument("--label", default="this tree", help="printed in the table's title")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


# name, query rows per request, requests, context, max_query_len (a graph's padded rows), max_seq_len
DENSE_SHAPES = [
    ("2k hit chunk (graph sized 2.4k)", 48, 1, 2080, 64, 2432),
    ("2k hit chunk (graph sized 16k)", 48, 1, 2080, 64, 16480),
    ("16k hit chunk", 48, 1, 16432, 64, 16480),
    ("decode b1, 2k (1 + S = 3 rows)", 3, 1, 2083, 3, 2432),
    ("decode b8, 2k", 3, 8, 2083, 3, 2432),
    ("decode b1, 16k", 3, 1, 16435, 3, 16480),
    ("64 hits, 42 chunks of 48 (2k)", 48, 42, 2080, 48, 2432),
]
MLA_SHAPES = [("MLA 128 heads, decode b1, 8k", 1, 1, 8192, 1, 8192), ("MLA 128 heads, b8 verify 3 rows, 8k", 3, 8, 8192, 3, 8192)]
QUICK_SHAPES = [("hit chunk", 12, 1, 300, 16, 512), ("decode b2", 3, 2, 200, 3, 512)]


def _paged_inputs(torch, rows, requests, context, padded_rows, block_size, cache_dims, device, dtype):
    """Random cache blocks in random order; rows packed per request, padded to padded_rows each."""
    blocks_per_request = -(-context // block_size)
    num_blocks = requests * blocks_per_request
    cache = [torch.randn((num_blocks, block_size, *dims), device=device, dtype=dtype) for dims in cache_dims]
    block_table = torch.randperm(num_blocks, device=device).int().view(requests, blocks_per_request)
    seq_lens = torch.full((requests,), context, dtype=torch.int32, device=device)  # [B]
    query_start_loc = torch.arange(0, (requests + 1) * rows, rows, dtype=torch.int32, device=device)  # [B + 1]
    num_tokens = requests * rows + (padded_rows - rows)  # a graph's padding rows at the end
    return cache, block_table, seq_lens, query_start_loc, num_tokens


def kernel_us(torch, fn, names, repeats=20):
    """Mean GPU us per launch of each kernel whose name contains one of ``names``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    totals = {name: [0.0, 0] for name in names}
    for event in prof.key_averages():
        for name in names:
            if name in event.key:
                totals[name][0] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
                totals[name][1] += event.count
    return {name: (total / count if count else 0.0, count // repeats) for name, (total, count) in totals.items()}


def main(args):
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)
    import torch

    from mtp_ctrl.triton_ops import paged_attention, paged_mla_attention, reference

    cuda = torch.cuda.is_available() and not args.quick
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)
    rows_out = []
    shapes = [("dense", shape) for shape in (QUICK_SHAPES if args.quick else DENSE_SHAPES)]
    shapes += [] if args.quick else [("mla", shape) for shape in MLA_SHAPES]
    for kind, (name, rows, requests, context, max_query_len, max_seq_len) in shapes:
        if kind == "dense":
            heads, kv_heads, dim = (16, 4, 128) if not args.quick else (4, 2, 32)
            (key_cache, value_cache), block_table, seq_lens, query_start_loc, num_tokens = _paged_inputs(
                torch, rows, requests, context, max_query_len, 16, [(kv_heads, dim), (kv_heads, dim)], device, dtype)
            query = torch.randn((num_tokens, heads, dim), device=device, dtype=dtype)
            args_ = (query, key_cache, value_cache, block_table, seq_lens, query_start_loc, dim ** -0.5)
            op, twin, attention_name = paged_attention, reference.paged_attention, "_paged_attention_kernel"
        else:
            heads, latent, rope = 128, 512, 64
            (latent_cache,), block_table, seq_lens, query_start_loc, num_tokens = _paged_inputs(
                torch, rows, requests, context, max_query_len, 64, [(latent + rope,)], device, dtype)
            query_latent = torch.randn((num_tokens, heads, latent), device=device, dtype=dtype)
            query_rope = torch.randn((num_tokens, heads, rope), device=device, dtype=dtype)
            args_ = (query_latent, query_rope, latent_cache, block_table, seq_lens, query_start_loc, (latent + rope) ** -0.5)
            op, twin, attention_name = paged_mla_attention, reference.paged_mla_attention, "_paged_mla_kernel"
        hints = dict(max_query_len=max_query_len, max_seq_len=max_seq_len)

        def call():
            return op(*args_, **hints)

        error = (call().float() - twin(*args_, **hints).float()).abs().max().item()
        if cuda:
            import triton.testing

            torch.cuda.synchronize()
            graph_us = 1e3 * triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median")
            kernels = kernel_us(torch, call, [attention_name, "_combine_kv_splits_kernel"])
            attention_us, _ = kernels[attention_name]
            combine_us, combine_launches = kernels["_combine_kv_splits_kernel"]
        else:
            graph_us = attention_us = combine_us = float("nan")
            combine_launches = 0
        rows_out.append((name, graph_us, attention_us, combine_us if combine_launches else 0.0, error))
    device_name = torch.cuda.get_device_name() if cuda else "cpu (torch twins)"
    print(f"\n{args.label} on {device_name}: split-K paged attention, GPU us (op: graph replay, median; "
          "kernels: profiler mean per launch; combine 0 = one split, no combine)")
    print(f"| {'shape':<38} | {'op us':>7} | {'attention us':>12} | {'combine us':>10} | {'max |err|':>9} |")
    print(f"|{'-' * 40}|{'-' * 9}|{'-' * 14}|{'-' * 12}|{'-' * 11}|")
    for name, graph_us, attention_us, combine_us, error in rows_out:
        print(f"| {name:<38} | {graph_us:>7.1f} | {attention_us:>12.1f} | {combine_us:>10.1f} | {error:>9.2g} |")
    if max(row[-1] for row in rows_out) > (5e-2 if cuda else 1e-4):
        sys.exit("the op differs from its torch twin")


if __name__ == "__main__":
    main(parse_args())
