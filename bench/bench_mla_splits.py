"""Split-K counts of the warp-specialized Gluon MLA kernel: a CPU model, then a GPU sweep.

    python bench/bench_mla_splits.py --model                      # the model only (CPU)
    python bench/bench_mla_splits.py --points 128,32,8192 64,32,8192 --counts 1,2,3,4,6,8
    python bench/bench_mla_splits.py --quick                      # a CPU smoke run of the sweep

The decode-row entry above 32 heads (``WGMMA_WS_TILES``: one program an SM, whole waves) splits
each request's context so that ``B x head tiles x splits`` programs fill the SMs' waves best
(``mla_tiles.kv_split_count``). At 128 heads a program is compute-bound (one 64-token tile in
about 2.3 us on an H100: RESULTS, mla6), so a launch costs about ``waves x tiles a program`` tile
times, plus a cost each wave (the query tile's load, the pipeline's fill and drain, the partials'
stores), plus the split partials' traffic (``splits x T x H x C`` fp32 written by the kernel and
read by the combine), plus a fixed cost (launches). The model (:func:`predicted_us`) takes its
constants from mla6's four 128-head points; the sweep times, per point, the table's split count
(main's rule), each of ``--counts`` (``num_kv_splits``), and the split-K combine alone at each
count, all in one process: GPU us of a graph replay (median of 20), % of a same-run device copy.
``--ws-baseline`` (an earlier ``mla_wgmma_ws.py``, e.g. main's, copied aside) adds that kernel at
the table's split count, timed first and last beside this one.
"""

import argparse
import math
import os
import sys

LATENT, ROPE, BLOCK_N, BLOCK_SIZE = 512, 64, 64, 64
# the model's constants, fitted to mla6's H100 figures at 128 heads (batch 32 / 128 x 8k / 32k)
TILE_US = 2.30  # one 64-token tile of one program (compute-bound at 128 heads)
WAVE_US = 15.0  # each wave: the query tile's load, the pipeline's fill and drain, the output stores
FIXED_US = 9.4  # each launch pair
COPY_BYTES_PER_US = 2431e3  # the same-run copy (2431 GB/s)
SMS = 132  # an H100 SXM


def split_shape(batch, heads, kv_tokens, splits, num_sms=SMS):
    """(splits that get tokens, programs, waves, tiles a program) of a launch at ``splits``, as the
    launcher cuts it: tokens a split rounded up to whole 64-token tiles."""
    head_tiles = math.ceil(heads / 64)
    tokens_per_split = math.ceil(math.ceil(kv_tokens / splits) / BLOCK_N) * BLOCK_N
    used = math.ceil(kv_tokens / tokens_per_split)
    programs = batch * head_tiles * used
    return used, programs, math.ceil(programs / num_sms), tokens_per_split // BLOCK_N


def predicted_us(batch, heads, kv_tokens, splits, num_sms=SMS):
    """The model's GPU us of a launch (kernel + combine) at ``splits`` (module docstring)."""
    used, _, waves, tiles = split_shape(batch, heads, kv_tokens, splits, num_sms)
    partial_bytes = used * batch * heads * LATENT * 4 if used > 1 else 0
    return TILE_US * waves * tiles + WAVE_US * waves + FIXED_US + 2 * partial_bytes / COPY_BYTES_PER_US


def table_splits(batch, heads, kv_tokens, num_sms=SMS):
    """The table's split count (main's rule) for a decode-row launch of this shape."""
    from mtp_ctrl.triton_ops.mla_attention import MAX_KV_SPLITS
    from mtp_ctrl.triton_ops.mla_tiles import kv_split_count, mla_tiles

    tiles = mla_tiles(heads, batch, kv_tokens, 1)
    head_tiles = math.ceil(heads / min(64, 1 << (heads - 1).bit_length()))
    return kv_split_count(tiles, num_sms, batch * head_tiles, kv_tokens, MAX_KV_SPLITS)


def model_table(points, counts):
    print(f"model ({SMS} SMs; {TILE_US} us a tile, {WAVE_US} us a wave, {FIXED_US} us a launch, partials at "
          f"{COPY_BYTES_PER_US / 1e3:.0f} GB/s): predicted us per split count; * = the table's count")
    for heads, batch, context in points:
        chosen = table_splits(batch, heads, context)
        cells = []
        for splits in counts:
            used, programs, waves, tiles = split_shape(batch, heads, context, splits)
            mark = "*" if splits == chosen else " "
            cells.append(f"{splits}{mark}: {predicted_us(batch, heads, context, splits):6.1f} "
                         f"({programs} programs, {waves} wave(s) x {tiles} tiles)")
        print(f"   {heads} heads, B {batch}, {context}: " + "; ".join(cells))


def _load_ws_module(path):
    """An earlier ``mla_wgmma_ws.py`` as a module (its launcher in place of the package's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mla_wgmma_ws_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sweep(points, counts, quick, ws_baseline=None):
    import torch

    from mtp_ctrl.triton_ops import mla_attention, paged_mla_attention
    from mtp_ctrl.triton_ops.mla_attention import wgmma_kernel_applies
    from mtp_ctrl.triton_ops.paged_attn import combine_kv_splits

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_forward import copy_bandwidth, graph_time_us

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    bandwidth = copy_bandwidth(device) if cuda else 1e11
    timed = (lambda fn: graph_time_us(fn, replays=20)) if cuda else (lambda fn: (fn(), 0.0)[1])
    print(f"{torch.cuda.get_device_name() if cuda else 'CPU'}; device copy {bandwidth / 1e9:.0f} GB/s; "
          f"torch {torch.__version__}")
    own_modules = mla_attention._gluon_module
    baseline = _load_ws_module(ws_baseline) if ws_baseline and os.path.exists(ws_baseline) else None
    if ws_baseline and baseline is None:
        print(f"(no --ws-baseline file {ws_baseline}: its rows are left out)")

    def with_baseline(fn):
        mla_attention._gluon_module = lambda name: baseline if name == "mla_wgmma_ws" else own_modules(name)
        try:
            return fn()
        finally:
            mla_attention._gluon_module = own_modules
    for heads, batch, context in points:
        blocks = math.ceil(context / BLOCK_SIZE)
        cache = torch.randn(batch * blocks, BLOCK_SIZE, LATENT + ROPE, dtype=dtype, device=device)
        block_table = torch.randperm(batch * blocks, device=device).view(batch, blocks).int()
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
        query_latent = torch.randn(batch, heads, LATENT, dtype=dtype, device=device)
        query_rope = torch.randn(batch, heads, ROPE, dtype=dtype, device=device)
        latent_bytes = batch * context * (LATENT + ROPE) * cache.element_size()
        share = lambda us: 100 * latent_bytes / us / 1e3 / (bandwidth / 1e9) if us else 0.0  # noqa: E731
        chosen = table_splits(batch, heads, context)
        print(f"\n{heads} heads, B {batch}, context {context} (Gluon runs: "
              f"{wgmma_kernel_applies(query_latent, cache, ROPE)}); the table's split count {chosen}")
        print(f"   {'splits':>8} {'us':>8} {'%':>5} {'model us':>8} {'combine us':>10} {'max|diff|':>9}")

        def call(splits):
            return paged_mla_attention(query_latent, query_rope, cache, block_table, seq_lens, starts,
                                       (128 + ROPE) ** -0.5, max_query_len=1, max_seq_len=context,
                                       num_kv_splits=splits)
        reference = call(None).float()
        if baseline is not None:
            diff = (with_baseline(lambda: call(None)).float() - reference).abs().max().item()
            main_us = with_baseline(lambda: timed(lambda: call(None)))
            print(f"   {'main ws':>8} {main_us:8.1f} {share(main_us):5.1f} {'':8} {'':10} {diff:9.4f}", flush=True)
        times = {"table": timed(lambda: call(None))}
        print(f"   {'table':>8} {times['table']:8.1f} {share(times['table']):5.1f} "
              f"{predicted_us(batch, heads, context, chosen):8.1f}", flush=True)
        for splits in counts:
            diff = (call(splits).float() - reference).abs().max().item()
            times[splits] = timed(lambda: call(splits))
            combine_us = 0.0
            if splits > 1 and cuda:
                partial_acc = torch.randn(splits, batch, heads, LATENT, device=device)
                partial_max = torch.randn(splits, batch, heads, device=device)
                partial_sum = torch.rand(splits, batch, heads, device=device) + 1
                output = torch.empty(batch, heads, LATENT, dtype=dtype, device=device)
                combine_us = timed(lambda: combine_kv_splits(partial_acc, partial_max, partial_sum, starts, output))
                del partial_acc
            print(f"   {splits:>8} {times[splits]:8.1f} {share(times[splits]):5.1f} "
                  f"{predicted_us(batch, heads, context, splits):8.1f} {combine_us:10.1f} {diff:9.4f}", flush=True)
        again = timed(lambda: call(None))
        main_again = f"; main ws again {with_baseline(lambda: timed(lambda: call(None))):.1f} us" if baseline else ""
        best = min(times, key=times.get)
        print(f"   the table again {again:.1f} us{main_again}; fastest: {best} splits {times[best]:.1f} us "
              f"({share(times[best]):.1f} %)")
        del cache


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="*", default=["128,32,8192", "128,32,32768", "128,128,8192",
                                                        "128,128,32768", "64,32,8192"],
                        help="HEADS,BATCH,CONTEXT decode-row launches")
    parser.add_argument("--counts", default="1,2,3,4,6,8", help="split counts timed at each point")
    parser.add_argument("--model", action="store_true", help="the CPU model only")
    parser.add_argument("--ws-baseline", help="an earlier mla_wgmma_ws.py timed at the table's split count too")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke run)")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args(argv)
    import mtp_ctrl
    mtp_ctrl.quiet_known_warnings(args.verbose)
    points = [tuple(int(value) for value in point.split(",")) for point in args.points]
    counts = [int(value) for value in args.counts.split(",")]
    model_table(points, counts)
    if args.model:
        return
    if args.quick:
        points, counts = [(128, 2, 256)], [1, 2]
    sweep(points, counts, args.quick, args.ws_baseline)


if __name__ == "__main__":
    main()
