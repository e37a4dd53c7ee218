"""Split-K paged attention: the attention kernel and the split combine, GPU us per launch.

The shapes of a prefix-cache hit and of the decode steps around it on the ~1B GPT of
``bench_prefix_cache.py`` (Hq = 16, Hkv = 4, D = 128, bf16, 16-token blocks), plus MLA decode
(128 heads, C = 512, R = 64), each with the split count the launcher picks. Per shape: the whole op
replayed from a CUDA graph (median us), and each kernel's mean us per launch from torch.profiler
(``_paged_attention_kernel`` / ``_paged_mla_kernel`` and ``_combine_kv_splits_kernel``: the names
are the same on older checkouts, so the same script times another tree's package on its
PYTHONPATH in the same device call). The output is checked against the torch reference.
``--baseline DIR`` also times DIR's ``paged_attn.py`` and ``mla_attention.py`` (e.g. main's) in the
same process, loaded beside this tree's, and prints both.

    python bench/bench_split_combine.py                      # GPU
    python bench/bench_split_combine.py --baseline ../main   # GPU, this tree and main's kernels
    python bench/bench_split_combine.py --quick              # two shapes (a smoke run; CPU runs the twins)
    python bench/bench_split_combine.py --combine-sweep --baseline DIR   # the combine's tiles at MLA's shapes

``--combine-sweep`` (GPU; ``--quick``: the interpreter on tiny shapes) times the combine alone on
MLA's large partials (``COMBINE_SWEEP_SHAPES``: splits x B rows x H heads x 512 fp32 dims) in its
own graph: ``--baseline``'s ``combine_kv_splits`` (main's), this tree's (``combine_tile``'s
choice) and each of ``SWEEP_TILES``, as us, GB/s (partials read + output written) and % of a
same-run device copy; then the whole MLA op at ``MLA_OP_POINTS`` with this tree's combine and with
``--baseline``'s in its place (timed alternately, twice each): us and latent bytes / us as % of the
copy (the issue's measure).
"""

import argparse
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small shapes (smoke run)")
    parser.add_argument("--baseline", default=None, help="a checkout whose attention kernels are timed too")
    parser.add_argument("--combine-sweep", action="store_true", help="the combine's tiles at MLA's large partials")
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
# splits, B, heads, dims: MLA decode's partials at 128 heads (2 splits: the table's at batch 32 / 8k)
COMBINE_SWEEP_SHAPES = [(2, 32, 128, 512), (2, 128, 128, 512), (4, 32, 128, 512), (4, 32, 64, 512), (2, 8, 128, 512)]
# (BLOCK_R, BLOCK_DC, num_warps): main's small tile first, then larger ones (mla8's call also timed
# these with the padding rows read before query_start_loc came: no gain, dropped)
SWEEP_TILES = [(8, 128, 4), (4, 512, 4), (8, 512, 4), (8, 512, 8), (16, 512, 8), (16, 512, 16), (32, 128, 8),
               (16, 256, 8), (2, 512, 4)]
MLA_OP_POINTS = [(128, 32, 8192), (128, 32, 32768), (128, 128, 8192)]  # heads, B, context (decode rows)
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
                totals[name][0] += getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
                totals[name][1] += event.count
    return {name: (total / count if count else 0.0, count // repeats) for name, (total, count) in totals.items()}


def load_baseline(directory):
    """``paged_attention`` and ``paged_mla_attention`` of another checkout's kernel files, loaded
    as separate modules (the rest of the package is this tree's); MLA None if it does not load."""
    import importlib.util
    import os

    import mtp_ctrl.triton_ops.paged_attn  # noqa: F401  (this tree's, restored below)

    def load(name, file):
        spec = importlib.util.spec_from_file_location(name, os.path.join(directory, "mtp_ctrl", "triton_ops", file))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    paged = load("baseline_paged_attn", "paged_attn.py")
    ours = sys.modules["mtp_ctrl.triton_ops.paged_attn"]
    sys.modules["mtp_ctrl.triton_ops.paged_attn"] = paged  # the baseline MLA imports its own combine
    try:
        mla = load("baseline_mla_attention", "mla_attention.py").paged_mla_attention
    except Exception as error:  # noqa: BLE001  (another tree's imports may not resolve here)
        print(f"baseline MLA not loaded: {error!r}")
        mla = None
    finally:
        sys.modules["mtp_ctrl.triton_ops.paged_attn"] = ours
    return paged.paged_attention, mla


def measure(torch, ops, shapes, cuda, device, dtype, quick):
    """Per shape: (name, graph us, attention us, combine us, max |error| against the twin)."""
    from mtp_ctrl.triton_ops import reference

    dense_op, mla_op = ops
    rows_out = []
    for kind, (name, rows, requests, context, max_query_len, max_seq_len) in shapes:
        torch.manual_seed(0)
        if kind == "dense":
            heads, kv_heads, dim = (16, 4, 128) if not quick else (4, 2, 32)
            (key_cache, value_cache), block_table, seq_lens, query_start_loc, num_tokens = _paged_inputs(
                torch, rows, requests, context, max_query_len, 16, [(kv_heads, dim), (kv_heads, dim)], device, dtype)
            query = torch.randn((num_tokens, heads, dim), device=device, dtype=dtype)
            args_ = (query, key_cache, value_cache, block_table, seq_lens, query_start_loc, dim ** -0.5)
            op, twin, attention_name = dense_op, reference.paged_attention, "_paged_attention_kernel"
        else:
            if mla_op is None:
                rows_out.append((name, float("nan"), float("nan"), float("nan"), 0.0))
                continue
            heads, latent, rope = 128, 512, 64
            (latent_cache,), block_table, seq_lens, query_start_loc, num_tokens = _paged_inputs(
                torch, rows, requests, context, max_query_len, 64, [(latent + rope,)], device, dtype)
            query_latent = torch.randn((num_tokens, heads, latent), device=device, dtype=dtype)
            query_rope = torch.randn((num_tokens, heads, rope), device=device, dtype=dtype)
            args_ = (query_latent, query_rope, latent_cache, block_table, seq_lens, query_start_loc, (latent + rope) ** -0.5)
            op, twin, attention_name = mla_op, reference.paged_mla_attention, "_paged_mla_kernel"
        hints = dict(max_query_len=max_query_len, max_seq_len=max_seq_len)

        def call():
            return op(*args_, **hints)

        error = (call().float() - twin(*args_, **hints).float()).abs().max().item()
        graph_us = attention_us = combine_us = float("nan")
        if cuda:
            import triton.testing

            torch.cuda.synchronize()
            graph_us = 1e3 * triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median")
            kernels = kernel_us(torch, call, [attention_name, "_combine_kv_splits_kernel"])
            attention_us = kernels[attention_name][0]
            combine_us = kernels["_combine_kv_splits_kernel"][0]
        rows_out.append((name, graph_us, attention_us, combine_us, error))
    return rows_out


def combine_sweep(torch, baseline_dir, quick):
    """``--combine-sweep``: the combine's tiles on the first of MLA's partials, the MLA op with main's
    combine, this tree's and (if another) that fastest tile's, then the tiles on the other partials."""
    import os

    from mtp_ctrl.triton_ops.paged_attn import combine_tile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_forward import copy_bandwidth, graph_time_us

    cuda = torch.cuda.is_available() and not quick
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        print("--combine-sweep off CUDA needs TRITON_INTERPRET=1 (the kernels on the CPU interpreter)")
        return
    device = torch.device("cuda" if cuda else "cpu")
    bandwidth = copy_bandwidth(device) if cuda else 1e11
    timed = (lambda fn: graph_time_us(fn, replays=20)) if cuda else (lambda fn: (fn(), 0.0)[1])
    baseline = None
    if baseline_dir:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "baseline_combine", os.path.join(baseline_dir, "mtp_ctrl", "triton_ops", "paged_attn.py"))
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
    wanted = 2 * torch.cuda.get_device_properties(device).multi_processor_count if cuda else 1
    print(f"\ncombine alone on {torch.cuda.get_device_name() if cuda else 'CPU (interpreter)'}: device copy "
          f"{bandwidth / 1e9:.0f} GB/s; us of one launch replayed from a graph (median of 20); GB/s = (fp32 "
          "partials read + bf16 output written) / us; tiles (BLOCK_R, BLOCK_DC, SPLIT_CHUNK, warps)")
    shapes = [(2, 3, 4, 512), (3, 2, 2, 40)] if quick else COMBINE_SWEEP_SHAPES
    tiles = SWEEP_TILES[:3] + SWEEP_TILES[-1:] if quick else SWEEP_TILES
    sweep = dict(torch=torch, device=device, cuda=cuda, timed=timed, bandwidth=bandwidth, baseline=baseline,
                 wanted=wanted, tiles=tiles, combine_tile=combine_tile)
    best_tile = _sweep_shape(shapes[0], **sweep)
    if cuda:
        _mla_op_ab(torch, device, timed, bandwidth, baseline, best_tile)
    for shape in shapes[1:]:
        _sweep_shape(shape, **sweep)


def _sweep_shape(shape, torch, device, cuda, timed, bandwidth, baseline, wanted, tiles, combine_tile):
    """Time the combine on random partials of ``shape`` with each tile; the fastest sweep tile
    (None where main's or this tree's own choice is fastest)."""
    from mtp_ctrl.triton_ops.paged_attn import combine_kv_splits, launch_combine

    splits, batch, heads, dims = shape
    partial_acc = torch.randn(splits, batch, heads, dims, device=device)
    partial_max = 4 * torch.randn(splits, batch, heads, device=device)
    partial_sum = torch.rand(splits, batch, heads, device=device) + 1
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    output = torch.empty(batch, heads, dims, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    weight = torch.exp2(partial_max - partial_max.amax(0))[..., None]
    expected = (partial_acc * weight).sum(0) / (partial_sum[..., None] * weight).sum(0)
    moved = partial_acc.numel() * 4 + 2 * partial_max.numel() * 4 + output.numel() * output.element_size()
    print(f"\n{splits} splits x B {batch} x {heads} heads x {dims} dims ({moved / 1e6:.1f} MB); "
          f"this tree's tile {combine_tile(splits, batch * heads, dims, wanted)}")
    args_ = (partial_acc, partial_max, partial_sum, starts, output)
    runs = [("main", None, lambda: baseline.combine_kv_splits(*args_))] if baseline is not None else []
    runs.append(("this tree", None, lambda: combine_kv_splits(*args_)))
    for block_r, block_dc, warps in tiles:
        tile = (block_r, block_dc, max(1, min(triton_p2(splits), 2048 * warps // (block_r * block_dc))), warps)
        runs.append((str(tile), tile, lambda tile=tile: launch_combine(*args_, *tile)))
    best = None
    for name, choice, fn in runs:
        output.fill_(float("nan"))
        fn()
        error = (output.float() - expected).abs().max().item()
        us = timed(fn)
        if us and error < 5e-2 and (best is None or us < best[0]):
            best = (us, name, choice)
        rate = moved / us / 1e3 if us else 0.0
        print(f"   {name:<24} {us:7.1f} us {rate:7.0f} GB/s {100 * rate / (bandwidth / 1e9):5.1f} % "
              f"max|err| {error:.2g}", flush=True)
    if best:
        print(f"   fastest: {best[1]} {best[0]:.1f} us")
    return best[2] if best else None


def _mla_op_ab(torch, device, timed, bandwidth, baseline, best_tile):
    """The MLA op at ``MLA_OP_POINTS`` with main's combine, this tree's and ``best_tile``'s, alternately."""
    from mtp_ctrl.triton_ops import mla_attention, paged_mla_attention
    from mtp_ctrl.triton_ops.paged_attn import launch_combine

    own_combine = mla_attention.combine_kv_splits
    combines = {"this tree": own_combine}
    if baseline is not None:
        combines["main"] = baseline.combine_kv_splits
    if best_tile is not None:
        combines[f"tile {best_tile}"] = lambda *args_: launch_combine(*args_, *best_tile)
    print("\nthe MLA op (decode rows, bf16, C 512 + R 64, 64-token blocks; its table's tiles and splits): "
          "us of a graph replay (median of 20), % = latent bytes read once / us, of the copy; each combine "
          "twice, alternately (main = --baseline's combine_kv_splits)")
    for heads, batch, context in MLA_OP_POINTS:
        blocks = -(-context // 64)
        cache = torch.randn(batch * blocks, 64, 576, dtype=torch.bfloat16, device=device)
        block_table = torch.randperm(batch * blocks, device=device).view(batch, blocks).int()
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
        query_latent = torch.randn(batch, heads, 512, dtype=torch.bfloat16, device=device)
        query_rope = torch.randn(batch, heads, 64, dtype=torch.bfloat16, device=device)
        latent_bytes = batch * context * 576 * 2

        def call():
            return paged_mla_attention(query_latent, query_rope, cache, block_table, seq_lens, starts, 576 ** -0.5,
                                       max_query_len=1, max_seq_len=context)
        times = {name: [] for name in combines}
        outputs = {}
        for name in list(combines) * 2:
            mla_attention.combine_kv_splits = combines[name]
            try:
                outputs[name] = call().float()
                times[name].append(timed(call))
            finally:
                mla_attention.combine_kv_splits = own_combine
        share = lambda us: 100 * latent_bytes / us / 1e3 / (bandwidth / 1e9) if us else 0.0  # noqa: E731
        cells = [f"{name} {' / '.join(f'{us:.1f}' for us in values)} us "
                 f"({' / '.join(f'{share(us):.1f}' for us in values)} %)" for name, values in times.items()]
        diff = max((value - outputs["this tree"]).abs().max().item() for value in outputs.values())
        print(f"   {heads} heads, B {batch}, context {context}: {'; '.join(cells)}; max|diff| {diff:.2g}", flush=True)
        del cache


def triton_p2(value):
    return 1 << max(0, (value - 1).bit_length())


def main(args):
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)
    import torch

    from mtp_ctrl.triton_ops import paged_attention, paged_mla_attention

    if args.combine_sweep:
        combine_sweep(torch, args.baseline, args.quick)
        return
    cuda = torch.cuda.is_available() and not args.quick
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shapes = [("dense", shape) for shape in (QUICK_SHAPES if args.quick else DENSE_SHAPES)]
    shapes += [] if args.quick else [("mla", shape) for shape in MLA_SHAPES]
    trees = [("this tree", (paged_attention, paged_mla_attention))]
    if args.baseline:
        trees.insert(0, (f"baseline {args.baseline}", load_baseline(args.baseline)))
    results = [(label, measure(torch, ops, shapes, cuda, device, dtype, args.quick)) for label, ops in trees]
    device_name = torch.cuda.get_device_name() if cuda else "cpu (torch twins)"
    print(f"\nsplit-K paged attention on {device_name}, GPU us: op = the whole op replayed from a CUDA graph "
          "(median); attention / combine = the kernels, torch.profiler mean per launch (0: one split, no combine)")
    header = " | ".join(f"{what} ({label})" for what in ("op us", "combine us") for label, _ in results)
    print(f"| {'shape':<38} | {header} | attention us ({results[-1][0]}) | max |err| |")
    print("|" + "---|" * (3 + 2 * len(results)))
    worst = 0.0
    for index, (kind, shape) in enumerate(shapes):
        cells = [f"{rows[index][1]:.1f}" for _, rows in results] + [f"{rows[index][3]:.1f}" for _, rows in results]
        error = max(rows[index][4] for _, rows in results)
        worst = max(worst, error)
        print(f"| {shape[0]:<38} | {' | '.join(cells)} | {results[-1][1][index][2]:.1f} | {error:.2g} |")
    if worst > (5e-2 if cuda else 1e-4):
        sys.exit("an op differs from its torch twin")


if __name__ == "__main__":
    main(parse_args())
