"""Attention kernels of a step that admits requests among decodes: GPU time by torch.profiler.

    python bench/bench_join_attention.py [--batch 128] [--joins 0 1 16] [--prompt 64] [--rows 3]
    python bench/bench_join_attention.py --quick                        # CPU smoke run (interpreter)

``--batch`` requests: ``batch - k`` decode requests of ``--rows`` query rows (1 + S) over
``--context`` cached tokens, and ``k`` (``--joins``) prompts of ``--prompt`` rows each, packed as
a mixed step packs them, with a CUDA graph's bounds (``max_query_len`` = every row of the step,
``max_seq_len`` = the longest context): the launch a step with prefill chunks makes, for each
kernel shape below (the demo's GQA attention in fp32, a larger GQA in bf16, MLA at 16 and 128
heads in bf16). Printed: the summed kernel time a call (attention and its split-K combine),
median of ``--repeats`` calls. ``k = 0`` keeps the mixed step's bound (every row of the step), so it
is a mixed graph's launch with no prompt in it, not a decode-only step (whose bound is 1 + S).
"""

import argparse
import statistics

SHAPES = (  # label, kind, (query heads, kv heads or latent dim, head dim or rope dim), dtype name
    ("GQA 8/4 x 32 fp32 (demo)", "gqa", (8, 4, 32), "float32"),
    ("GQA 32/8 x 128 bf16", "gqa", (32, 8, 128), "bfloat16"),
    ("MLA 16 heads, 512 + 64, bf16", "mla", (16, 512, 64), "bfloat16"),
    ("MLA 128 heads, 512 + 64, bf16", "mla", (128, 512, 64), "bfloat16"),
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--joins", type=int, nargs="+", default=[0, 1, 16])
    parser.add_argument("--prompt", type=int, default=64, help="rows of each joining prompt")
    parser.add_argument("--rows", type=int, default=3, help="query rows of each decode request (1 + S)")
    parser.add_argument("--context", type=int, default=512, help="cached tokens of each decode request")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="CPU: batch 4, joins 0 1, tiny shapes, 2 repeats")
    parser.add_argument("--verbose", action="store_true",
                        help="(no megatron-core import here; accepted for uniformity)")
    return parser.parse_args(argv)


def step_inputs(torch, kind, dims, dtype, device, batch, joins, args):
    """The launch's arguments: decode requests first, then the joining prompts (fresh contexts)."""
    q_lens = [args.rows] * (batch - joins) + [args.prompt] * joins
    seq_lens = [args.context + args.rows] * (batch - joins) + [args.prompt] * joins
    blocks = [-(-s // args.block_size) for s in seq_lens]
    block_table = torch.full((batch, max(blocks) + 1), -1, dtype=torch.int32)
    ids = torch.randperm(sum(blocks)).int()
    taken = 0
    for request, count in enumerate(blocks):
        block_table[request, :count] = ids[taken:taken + count]
        taken += count
    tokens = sum(q_lens)
    query_start_loc = torch.tensor([0] + q_lens).cumsum(0).int()
    common = dict(block_table=block_table.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                  query_start_loc=query_start_loc.to(device))
    hints = dict(max_query_len=tokens, max_seq_len=max(seq_lens))
    if kind == "gqa":
        heads, kv_heads, head_dim = dims
        cache = torch.randn(2, sum(blocks), args.block_size, kv_heads, head_dim, dtype=dtype, device=device)
        query = torch.randn(tokens, heads, head_dim, dtype=dtype, device=device)
        return (query, cache[0], cache[1], common["block_table"], common["seq_lens"], common["query_start_loc"],
                head_dim ** -0.5), hints
    heads, latent, rope = dims
    cache = torch.randn(sum(blocks), args.block_size, latent + rope, dtype=dtype, device=device)
    query = torch.randn(tokens, heads, latent + rope, dtype=dtype, device=device)
    return (query[..., :latent].contiguous(), query[..., latent:].contiguous(), cache, common["block_table"],
            common["seq_lens"], common["query_start_loc"], (latent + rope) ** -0.5), hints


def kernel_ms(torch, op, op_args, hints, repeats, device):
    """Median summed kernel ms of one call (torch.profiler); the CPU: the call's wall ms."""
    import time

    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        op(*op_args, **hints)
    times = []
    for _ in range(repeats):
        if device.type != "cuda":
            started = time.perf_counter()
            op(*op_args, **hints)
            times.append((time.perf_counter() - started) * 1e3)
            continue
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            op(*op_args, **hints)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith("Memset")]
        times.append(sum(e.device_time for e in kernels) / 1e3)
    return statistics.median(times)


def main(args):
    import torch

    from mtp_ctrl.triton_ops import paged_attention, paged_mla_attention

    device = torch.device("cpu" if args.quick else "cuda")
    if args.quick:
        args.batch, args.joins, args.prompt, args.context, args.repeats = 4, [0, 1], 9, 20, 2
    shapes = ((f"{label} (quick: fp32, MLA dims / 8)", kind,
               tuple(max(1, d // 8) if kind == "mla" and i else d for i, d in enumerate(dims)), "float32")
              for label, kind, dims, _ in SHAPES) if args.quick else SHAPES
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (wall ms)"
    print(f"{name}; batch {args.batch}: decode requests of {args.rows} rows over {args.context} tokens, prompts of "
          f"{args.prompt} rows joining; kernel ms a call (median of {args.repeats})")
    print("| shape | " + " | ".join(f"{k} joining" for k in args.joins) + " |")
    print("|---|" + "---|" * len(args.joins))
    for label, kind, dims, dtype_name in shapes:
        op = paged_attention if kind == "gqa" else paged_mla_attention
        cells = []
        for joins in args.joins:
            op_args, hints = step_inputs(torch, kind, dims, getattr(torch, dtype_name), device, args.batch, joins, args)
            cells.append(f"{kernel_ms(torch, op, op_args, hints, args.repeats, device):.4f}")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main(parse_args())
