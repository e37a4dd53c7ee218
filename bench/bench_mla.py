"""Multi-latent attention: the paged MLA decode kernel, absorbed vs decompressed attention, KV bytes
per token, and decode steps of a DeepSeek-V3-shaped MLA GPT scaled to one GPU.

    python bench/bench_mla.py                # kernel tables + KV bytes (+ --e2e for the model steps)
    python bench/bench_mla.py --e2e-only     # only the end-to-end steps
    python bench/bench_mla.py --quick        # small shapes (a smoke run; CPU works too)
    python bench/bench_mla.py --kernels-only --tune --heads 128 --batches 32 --contexts 8192
    python bench/bench_mla.py --pick 16,32,8192 --winner-file W.json --final   # the tune, then the final table
    python bench/bench_mla.py --wgmma --heads 64,128 --batches 1,32,128 --contexts 2048,8192,32768
    python bench/bench_mla.py --wgmma --baseline .scratch/baseline/mla_wgmma_main.py   # + an earlier kernel

Printed, in one run:
1. The kernel (``paged_mla_attention``, ``--rows`` query rows a request (1: decode, 1 + S:
   verify), C = 512 latent + R = 64 rope dims, bf16, block 64) at ``--batches`` (1, 32, 128) x
   ``--contexts`` (2k, 8k, 32k, 128k) x ``--heads`` (16, 32, 64, 128: DeepSeek-V3's 128 heads at
   TP 8, 4, 2, 1): GPU us of a graph replay, the latent bytes it must read (B x context x 576 x 2)
   over that time, and that bandwidth as a share of a same-run device copy; the default tiles, the
   shape table's (``mla_tiles.py``) and, with --tune, the fastest of ``CANDIDATES`` with its
   TFLOP/s of dot work.
2. The same attention end to end from the no-rope query: absorbed (W_UK, the kernel, W_UV) vs
   decompressed (the latents up-projected to per-head K/V, then the standard paged kernel), where
   the decompressed K/V fits in memory; and per prefill chunk length, which of the two is faster.
3. KV bytes per token and layer: the latent cache vs standard attention's K and V per head.
1b. (--wgmma) The Gluon kernel (``WGMMA_TILES``, sm_90; its two schedules, and ``--baseline``'s
   copy of an earlier kernel) beside the Triton kernel's tiles for the shape (the table's Triton
   entry: ``mla_tiles(..., gluon=False)``), same process: us, % of the copy and TFLOP/s of each,
   the fastest Gluon column and its speed-up over the first, max |difference|.
4. (--e2e) Decode steps of the DeepSeek-V3-shaped MLA GPT (module constant E2E_SHAPE; random bf16
   weights, dense FFN, 2 MLA MTP layers): median wall ms of controller.step(), GPU ms per step
   (torch.profiler kernel time), tokens/s at S = 0 and S = 2 (random weights: no draft accepted).
"""

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    parser.add_argument("--e2e", action="store_true", help="also time the MLA GPT's decode steps")
    parser.add_argument("--e2e-only", action="store_true", help="only the MLA GPT's decode steps")
    parser.add_argument("--tune", action="store_true", help="try every tile candidate at every shape")
    parser.add_argument("--kernels-only", action="store_true", help="only section 1 (the kernel table)")
    parser.add_argument("--heads", default="16,32,64,128", help="section 1's local head counts (comma-separated)")
    parser.add_argument("--batches", default="1,32,128", help="section 1's request counts")
    parser.add_argument("--contexts", default="2048,8192,32768,131072", help="section 1's context lengths")
    parser.add_argument("--rows", type=int, default=1, help="section 1's query rows a request (1 + S for verify)")
    parser.add_argument("--pick", help="HEADS,BATCH,CONTEXT: time PICK_CANDIDATES there, write the fastest to "
                        "--winner-file (and nothing else)")
    parser.add_argument("--winner-file", help="the --pick result (JSON); without --pick: the table's entry for "
                        "its shape's bucket becomes the winner for this run")
    parser.add_argument("--final", action="store_true", help="the final table in one process (FINAL_PARTS, then "
                        "sections 2 and 3), after --pick's winner is installed where --pick is given")
    parser.add_argument("--wgmma", action="store_true", help="section 1b only: the Gluon kernel vs the Triton "
                        "kernel's tiles at --heads x --batches x --contexts, --rows")
    parser.add_argument("--baseline", help="with --wgmma: an earlier mla_wgmma.py (e.g. main's, copied aside) timed "
                        "beside the package's schedules in the same process")
    parser.add_argument("--gluon-columns", default="main,serial,async,ws", help="with --wgmma: the Gluon columns "
                        "(main: --baseline's kernel; serial / async / ws: the package's kernel in that schedule)")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mtp_ctrl.state import KVCacheSpec, LatentKVCacheSpec  # noqa: E402
from mtp_ctrl.state.attention_metadata import AttentionMetadata  # noqa: E402
from mtp_ctrl.triton_ops import paged_mla_attention  # noqa: E402
from mtp_ctrl.triton_ops.mla_attention import wgmma_kernel_applies  # noqa: E402
from mtp_ctrl.triton_ops.mla_tiles import (DEFAULT_TILES, WGMMA_ASYNC_TILES, WGMMA_TILES, WGMMA_WS_TILES,  # noqa: E402
                                          MLATiles, mla_tiles)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # noqa: E402
from bench_forward import copy_bandwidth, graph_time_us  # noqa: E402

LATENT, ROPE, QK, V = 512, 64, 128, 128  # DeepSeek-V3's kv_lora_rank, qk_pos_emb_head_dim, qk_head_dim, v_head_dim
BLOCK = 64
# --tune candidates per head count: MLATiles(block_m, block_n, num_warps, num_stages, programs_per_sm,
# min_split_tokens[, whole_waves, max_registers]); the defaults and the table's entries are always timed too
W = True
CANDIDATES = {
    16: ((16, 32, 4, 3, 4, 64), (32, 64, 8, 2, 8, 32), (32, 32, 4, 3, 8, 32), (32, 64, 4, 2, 4, 64),
         (16, 32, 4, 3, 8, 32)),
    32: ((32, 64, 8, 2, 8, 32), (32, 64, 4, 2, 4, 64)),
    64: ((64, 64, 8, 2, 2, 128), (64, 32, 8, 3, 2, 128), (64, 64, 8, 2, 1, 128, W)),
    128: ((64, 64, 8, 2, 2, 128), (64, 32, 8, 3, 2, 128), (64, 64, 8, 2, 1, 128, W)),
}
# --pick candidates by (heads, rows a request), timed at batch 32 / 8k: MLATiles(block_m, block_n, warps,
# stages, programs/SM, min split tokens, whole_waves, max_registers). Programs an SM holds (ptxas for
# sm_90a, triton 3.6): 8 warps one (162-204 registers) unless capped at 128 registers; 4 warps two
# (220-255). Stages add no buffer to 16-row decode tiles (the pipeliner keeps one latent tile there; the
# 64-row verify tile (64, 64) gets two).
PICK_CANDIDATES = {
    (16, 1): ((32, 64, 8, 2, 1, 64, W), (32, 64, 8, 2, 2, 64, W), (16, 32, 4, 3, 2, 64, W), (16, 32, 4, 3, 4, 64),
              (32, 32, 8, 2, 2, 64, W, 128), (32, 32, 8, 3, 2, 64, W, 128), (32, 64, 8, 2, 2, 64, W, 128)),
    # verify rows (1 + S = 3 a request, 48 matrix rows): 64-row tiles hold all three, so the cache
    # is read once (a 32-row tile holds two rows: two reads). (64, 64): 255 registers, 64 B
    # spilled, 216 KiB shared; (64, 32): 250, none, 144 KiB. The H100 pick (mla4): (64, 64, one
    # program an SM, whole waves) 203 us, 2.0x the default; the table's verify entry since
    (16, 3): ((64, 64, 8, 2, 1, 128, W), (64, 32, 8, 2, 1, 64, W), (64, 64, 8, 2, 2, 128)),
}
# --final: (heads, batches, contexts, query rows a request): TP 8 everywhere, TP 4 / 2 / 1 at batch >= 32
# and context >= 8k, verify rows (1 + S = 3) at 16 and 128 heads
FINAL_PARTS = (("16", "1,32,128", "2048,8192,32768,131072", 1),
               ("32,64,128", "32,128", "8192,32768,131072", 1),
               ("16,128", "32,128", "8192,32768", 3))
# DeepSeek-V3's attention (MLA dims, YaRN) at 16 heads, hidden 2048, 16 layers, dense GLU FFN
E2E_SHAPE = dict(num_layers=16, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16, q_lora_rank=768,
                 kv_lora_rank=LATENT, qk_head_dim=QK, qk_pos_emb_head_dim=ROPE, v_head_dim=V, mtp_num_layers=2)


def metadata_for(batch, rows, context, device, shuffled=True):
    """Every request: ``rows`` query rows ending at position ``context - 1``, its blocks scattered."""
    blocks = math.ceil(context / BLOCK)
    ids = torch.randperm(batch * blocks, device=device) if shuffled else torch.arange(batch * blocks, device=device)
    block_table = ids.view(batch, blocks).int()
    q_start = torch.arange(batch + 1, device=device, dtype=torch.int32) * rows
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    positions = (context - rows + torch.arange(rows, device=device)).repeat(batch)
    return AttentionMetadata(query_start_loc=q_start, seq_lens=seq_lens,
                             slot_mapping=torch.full((batch * rows,), -1, dtype=torch.int64, device=device),
                             block_table=block_table, positions=positions, num_actual_tokens=batch * rows,
                             max_query_len=rows, max_seq_len=context)


def tiles_label(tiles):
    """``(block_m,block_n,warps,stages,programs/SM,min split tokens[,W][,Rn][,G][,A])``; W: whole waves,
    Rn: at most n registers a thread, G: the Gluon kernel, A / WS: its async / warp-specialized schedule."""
    values = dataclasses.astuple(tiles)
    return "(" + ",".join(str(value) for value in values[:6]) + (",W" if tiles.whole_waves else "") \
        + (f",R{tiles.max_registers}" if tiles.max_registers else "") + (",G" if tiles.wgmma else "") \
        + {"serial": "", "async": ",A", "warp_specialized": ",WS"}[tiles.schedule] + ")"


def kernel_tables(device, bandwidth, args):
    """Section 1: per (heads, batch, context), the default tiles, the table's tiles and (--tune)
    the fastest candidate, each as GPU us and % of the device copy, and the best's TFLOP/s of
    dot work; every candidate's output is compared with the default's (max |difference|, bf16)."""
    def ints(text):
        return tuple(int(value) for value in text.split(","))

    batches, contexts, heads_list = ints(args.batches), ints(args.contexts), ints(args.heads)
    if args.quick:
        batches, contexts, heads_list = (1, 8), (256, 1024), (16,)
    rows, tune = args.rows, args.tune
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cache = torch.empty(max(batches) * max(contexts) // BLOCK, BLOCK, LATENT + ROPE, dtype=dtype,
                        device=device).normal_()
    print(f"\n1. paged MLA kernel, {rows} query row(s) a request (latent {LATENT} + rope {ROPE}, {dtype}, block "
          f"{BLOCK}); % = latent bytes read once / GPU time, of the device copy ({bandwidth / 1e9:.0f} GB/s); "
          "TFLOP/s = dot work (rows x heads x context x 2 x (576 + 512)) / time; tiles = (block_m, block_n, warps, "
          "stages, programs/SM, min split tokens[, W: whole waves][, Rn: n registers at most])")
    print(f"   default tiles {tiles_label(DEFAULT_TILES)}")
    best_counts, largest_diff = {}, 0.0
    for heads in heads_list:
        candidates = [MLATiles(*values) for values in CANDIDATES.get(heads, ())] if tune else []
        print(f"   {heads} heads" + (f"; candidates {[tiles_label(t) for t in candidates]}" if tune else ""))
        print(f"   {'B':>4} {'context':>7} {'default us':>10} {'%':>5} {'table us':>9} {'%':>5} {'table tiles':>27}"
              + (f" {'best us':>9} {'%':>5} {'TFLOP/s':>7} {'best tiles':>27} {'max|diff|':>9}" if tune else ""))
        for batch in batches:
            query_latent = torch.randn(batch * rows, heads, LATENT, dtype=dtype, device=device)
            query_rope = torch.randn(batch * rows, heads, ROPE, dtype=dtype, device=device)
            for context in contexts:
                metadata = metadata_for(batch, rows, context, device)
                call_args = (query_latent, query_rope, cache, metadata.block_table, metadata.seq_lens,
                             metadata.query_start_loc, (QK + ROPE) ** -0.5)
                table = mla_tiles(heads, batch, context, rows)
                latent_bytes = batch * context * (LATENT + ROPE) * cache.element_size()
                share = lambda us: 100 * latent_bytes / us / 1e3 / (bandwidth / 1e9)  # noqa: E731
                flops = batch * rows * heads * context * 2 * (LATENT + ROPE + LATENT)
                times, baseline, shape_diff = {}, None, 0.0
                for tiles in dict.fromkeys([DEFAULT_TILES, table, *candidates]):
                    def call(tiles=tiles):
                        return paged_mla_attention(*call_args, max_query_len=rows, max_seq_len=context, tiles=tiles)
                    try:
                        out = call()
                        baseline = out if baseline is None else baseline
                        shape_diff = max(shape_diff, (out.float() - baseline.float()).abs().max().item())
                        times[tiles] = time_us(call, device)
                    except Exception as error:  # a candidate that does not fit (shared memory, registers)
                        times[tiles] = float("inf")
                        print(f"   {tiles_label(tiles)} failed: {type(error).__name__}: {str(error)[:120]}")
                line = f"   {batch:4d} {context:7d} {times[DEFAULT_TILES]:10.1f} {share(times[DEFAULT_TILES]):5.1f} " \
                       f"{times[table]:9.1f} {share(times[table]):5.1f} {tiles_label(table):>27}"
                if tune:
                    best, best_us = min(times.items(), key=lambda item: item[1])
                    best_counts[best] = best_counts.get(best, 0) + 1
                    line += f" {best_us:9.1f} {share(best_us):5.1f} {flops / best_us / 1e6:7.1f} " \
                            f"{tiles_label(best):>27} {shape_diff:9.4f}"
                print(line, flush=True)
                largest_diff = max(largest_diff, shape_diff)
    if tune:
        print(f"   fastest-tile counts: { {tiles_label(t): n for t, n in best_counts.items()} }")
    print(f"   largest |output - default's output| over every tile configuration: {largest_diff:.4f}")
    del cache


class _BaselineGluon:
    """A copy of an earlier ``mla_wgmma.py`` (``--baseline``, e.g. main's) in place of the
    package's Gluon module, for a same-process comparison (its launcher has no schedules)."""

    def __init__(self, path):
        import importlib.util
        spec = importlib.util.spec_from_file_location("mla_wgmma_baseline", path)
        self.module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.module)

    def launch_paged_mla_wgmma(self, *args, async_dots=False):
        return self.module.launch_paged_mla_wgmma(*args)


def _with_gluon_module(module, fn):
    """``fn()`` with ``module`` as the launcher's Gluon module (None: the package's own)."""
    from mtp_ctrl.triton_ops import mla_attention
    if module is None:
        return fn()
    own = mla_attention._gluon_module
    mla_attention._gluon_module = lambda name: module if name == "mla_wgmma" else own(name)
    try:
        return fn()
    finally:
        mla_attention._gluon_module = own


def wgmma_table(device, bandwidth, args):
    """Section 1b: the Gluon kernel (its schedules, and ``--baseline``'s copy of an earlier one)
    vs the Triton kernel's tiles, same shapes, same process."""
    def ints(text):
        return tuple(int(value) for value in text.split(","))

    batches, contexts, heads_list = ints(args.batches), ints(args.contexts), ints(args.heads)
    if args.quick:
        batches, contexts, heads_list = (1, 8), (256, 1024), (64,)
    rows = args.rows
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cache = torch.empty(max(batches) * max(contexts) // BLOCK, BLOCK, LATENT + ROPE, dtype=dtype,
                        device=device).normal_()
    probe = torch.empty(1, 64, LATENT, dtype=dtype, device=device)
    # (column, tiles, Gluon module (None: the package's)); "main": --baseline's kernel
    columns = {"serial": WGMMA_TILES, "async": WGMMA_ASYNC_TILES, "ws": WGMMA_WS_TILES}
    variants = []
    for name in args.gluon_columns.split(","):
        if name == "main" and args.baseline and os.path.exists(args.baseline):
            variants.append(("main", WGMMA_TILES, _BaselineGluon(args.baseline)))
        elif name == "main":
            print(f"   (no --baseline file {args.baseline}: the main column is left out)")
        else:
            variants.append((name, columns[name], None))
    print(f"\n1b. Gluon kernel {tiles_label(WGMMA_TILES)} vs the Triton kernel's tiles, {rows} query row(s) a "
          f"request (latent {LATENT} + rope {ROPE}, {dtype}, block {BLOCK}); the Gluon kernel runs here: "
          f"{wgmma_kernel_applies(probe, cache, ROPE)}; % = latent bytes read once / GPU time, of the device copy "
          f"({bandwidth / 1e9:.0f} GB/s); TFLOP/s = useful dot work (rows x heads x context x 2 x (576 + 512)) / time; "
          f"Gluon columns: {', '.join(name for name, _, _ in variants)} (main: --baseline {args.baseline}; serial / "
          "async / ws: MLATiles.schedule serial / async / warp_specialized); x = the fastest Gluon column's speed-up "
          "over the first Gluon column; max|diff| = the largest |Gluon - Triton| over the Gluon columns")
    largest_diff = 0.0
    for heads in heads_list:
        print(f"   {heads} heads")
        header = f"   {'B':>4} {'context':>7} {'triton us':>9} {'%':>5} {'TFLOP/s':>7}"
        for name, _, _ in variants:
            header += f" {name + ' us':>9} {'%':>5} {'TFLOP/s':>7}"
        print(header + f" {'best':>6} {'x':>6} {'max|diff|':>9} {'triton tiles':>27}")
        for batch in batches:
            query_latent = torch.randn(batch * rows, heads, LATENT, dtype=dtype, device=device)
            query_rope = torch.randn(batch * rows, heads, ROPE, dtype=dtype, device=device)
            for context in contexts:
                metadata = metadata_for(batch, rows, context, device)
                call_args = (query_latent, query_rope, cache, metadata.block_table, metadata.seq_lens,
                             metadata.query_start_loc, (QK + ROPE) ** -0.5)
                triton_tiles = mla_tiles(heads, batch, context, rows, gluon=False)
                latent_bytes = batch * context * (LATENT + ROPE) * cache.element_size()
                flops = batch * rows * heads * context * 2 * (LATENT + ROPE + LATENT)
                times, outs = {}, {}
                for name, tiles, module in [("triton", triton_tiles, None)] + variants:
                    def call(tiles=tiles, module=module):
                        return _with_gluon_module(module, lambda: paged_mla_attention(
                            *call_args, max_query_len=rows, max_seq_len=context, tiles=tiles))
                    try:
                        outs[name] = call().float()
                        times[name] = time_us(call, device)
                    except Exception as error:
                        times[name] = float("nan")
                        print(f"   {name} {tiles_label(tiles)} failed: {type(error).__name__}: {str(error)[:160]}")
                diffs = [(outs[name] - outs["triton"]).abs().max().item() for name, _, _ in variants
                         if name in outs and "triton" in outs]
                diff = max(diffs) if diffs else float("nan")
                largest_diff = max(largest_diff, diff)
                cells = ""
                for name in ["triton"] + [name for name, _, _ in variants]:
                    us = times[name]
                    share = 100 * latent_bytes / us / 1e3 / (bandwidth / 1e9)
                    cells += f" {us:9.1f} {share:5.1f} {flops / us / 1e6:7.1f}"
                gluon = {name: times[name] for name, _, _ in variants if times[name] == times[name]}
                best = min(gluon, key=gluon.get) if gluon else "-"
                speedup = times[variants[0][0]] / gluon[best] if gluon else float("nan")
                print(f"   {batch:4d} {context:7d}{cells} {best:>6} {speedup:5.2f}x {diff:9.4f} "
                      f"{tiles_label(triton_tiles):>27}", flush=True)
    print(f"   largest |Gluon output - Triton output|: {largest_diff:.4f}")
    del cache


def pick(device, bandwidth, args):
    """--pick: every PICK_CANDIDATES entry (and the default and the table's tiles) at one shape,
    the default timed first and last (the run's spread); the fastest goes to --winner-file."""
    import json

    heads, batch, context = (int(value) for value in args.pick.split(","))
    rows = args.rows
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cache = torch.empty(batch * math.ceil(context / BLOCK), BLOCK, LATENT + ROPE, dtype=dtype, device=device).normal_()
    query_latent = torch.randn(batch * rows, heads, LATENT, dtype=dtype, device=device)
    query_rope = torch.randn(batch * rows, heads, ROPE, dtype=dtype, device=device)
    metadata = metadata_for(batch, rows, context, device)
    call_args = (query_latent, query_rope, cache, metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
                 (QK + ROPE) ** -0.5)
    latent_bytes = batch * context * (LATENT + ROPE) * cache.element_size()
    table = mla_tiles(heads, batch, context, rows)
    candidates = [DEFAULT_TILES, table, *(MLATiles(*values) for values in PICK_CANDIDATES.get((heads, rows), ()))]
    print(f"\npick: {heads} heads, B {batch}, context {context}, {rows} row(s); us of a graph replay (median of 20), "
          f"% of the copy ({bandwidth / 1e9:.0f} GB/s); tiles = (block_m, block_n, warps, stages, programs/SM, "
          "min split tokens[, W: whole waves][, Rn: n registers at most])")
    times, baseline, largest_diff = {}, None, 0.0
    for tiles in dict.fromkeys(candidates):
        def call(tiles=tiles):
            return paged_mla_attention(*call_args, max_query_len=rows, max_seq_len=context, tiles=tiles)
        try:
            out = call()
            baseline = out if baseline is None else baseline
            largest_diff = max(largest_diff, (out.float() - baseline.float()).abs().max().item())
            times[tiles] = time_us(call, device, replays=20)
        except Exception as error:  # a candidate that does not fit (shared memory, registers)
            times[tiles] = float("inf")
            print(f"   {tiles_label(tiles)} failed: {type(error).__name__}: {str(error)[:120]}")
        share = 100 * latent_bytes / times[tiles] / 1e3 / (bandwidth / 1e9)
        print(f"   {tiles_label(tiles):>32} {times[tiles]:8.1f} us {share:5.1f} %", flush=True)
    again = time_us(lambda: paged_mla_attention(*call_args, max_query_len=rows, max_seq_len=context,
                                                tiles=DEFAULT_TILES), device, replays=20)
    print(f"   the default again: {again:.1f} us")
    best, best_us = min(times.items(), key=lambda item: item[1])
    print(f"   fastest: {tiles_label(best)} {best_us:.1f} us "
          f"({100 * latent_bytes / best_us / 1e3 / (bandwidth / 1e9):.1f} %); the table's entry "
          f"{tiles_label(table)} {times[table]:.1f} us; max |output - default's| {largest_diff:.4f}")
    if args.winner_file:
        with open(args.winner_file, "w") as handle:
            json.dump(dict(shape=[heads, batch, context], rows=rows, tiles=list(dataclasses.astuple(best)), us=best_us),
                      handle)
    del cache


def install_winner(path):
    """The table entry whose bucket holds --pick's shape becomes --pick's winner (this process only)."""
    import json

    from mtp_ctrl.triton_ops import mla_tiles as tiles_module

    with open(path) as handle:
        data = json.load(handle)
    dims = (*data["shape"], data.get("rows", 1))  # heads, batch, context, rows
    winner = MLATiles(*data["tiles"])
    table = list(tiles_module.TILE_TABLE)
    for index, (bounds, _) in enumerate(table):
        if all(bound is None or dim <= bound for dim, bound in zip(dims, bounds)):
            table[index] = (bounds, winner)
            break
    tiles_module.TILE_TABLE = tuple(table)
    print(f"the table's entry {table[index][0]} (heads, batch, context, rows bounds) is --pick's winner "
          f"{tiles_label(winner)} for this run")


def time_us(fn, device, replays=10):
    if device.type == "cuda":
        return graph_time_us(fn, replays=replays)
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e6


def absorbed_vs_decompressed(device, quick):
    from mtp_ctrl.models.mla_attention import absorbed_mla_attention, decompressed_mla_attention

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads = 16
    up = torch.nn.Linear(LATENT, heads * (QK + V), bias=False, device=device, dtype=dtype)
    weight = up.weight.detach().view(heads, QK + V, LATENT)

    def kv_up_proj(rows):
        return up(rows), None

    print(f"\n2. attention from the no-rope query, {heads} heads: absorbed (W_UK + kernel + W_UV) vs decompressed "
          "(up-projection to K/V + the standard paged kernel); GPU us")
    print(f"   {'B':>4} {'rows':>4} {'context':>7} {'absorbed':>9} {'decompr.':>9} {'faster':>10}")
    shapes = [(1, 1, 1024), (8, 3, 1024)] if quick else \
        [(1, 1, 2048), (1, 1, 8192), (32, 1, 2048), (32, 1, 8192), (32, 3, 8192), (128, 1, 8192),
         (1, 16, 4096), (1, 64, 4096), (1, 256, 4096), (1, 1024, 4096), (4, 512, 2048)]
    for batch, rows, context in shapes:
        metadata = metadata_for(batch, rows, context, device)
        cache = torch.empty(batch * math.ceil(context / BLOCK), BLOCK, LATENT + ROPE, dtype=dtype, device=device).normal_()
        query_nope = torch.randn(batch * rows, heads, QK, dtype=dtype, device=device)
        roped = torch.randn(batch * rows, heads, ROPE, dtype=dtype, device=device)
        scale = (QK + ROPE) ** -0.5
        with torch.no_grad():
            absorbed = time_us(lambda: absorbed_mla_attention(query_nope, roped, cache, metadata, weight, scale), device)
            decompressed_bytes = batch * context * heads * 2 * (QK + ROPE) * cache.element_size() * 2
            if decompressed_bytes > 24e9:
                decompressed = float("nan")
            else:
                decompressed = time_us(lambda: decompressed_mla_attention(query_nope, roped, cache, metadata,
                                                                          kv_up_proj, V, scale), device)
        faster = "absorbed" if not decompressed < absorbed else "decompr."
        print(f"   {batch:4d} {rows:4d} {context:7d} {absorbed:9.1f} {decompressed:9.1f} {faster:>10}")
        del cache


def kv_bytes_table():
    print("\n3. KV cache bytes per token and layer (bf16)")
    latent = LatentKVCacheSpec(num_layers=1, latent_dim=LATENT + ROPE, dtype=torch.bfloat16).bytes_per_block(1)
    for label, heads, head_dim in (("DeepSeek-V3 MHA, K and V 128 dims a head, 128 heads", 128, 128),
                                   ("the same, 16 heads (a TP-8 shard)", 16, 128)):
        standard = KVCacheSpec(num_layers=1, num_kv_heads=heads, head_dim=head_dim, dtype=torch.bfloat16).bytes_per_block(1)
        print(f"   {label}: {standard} B vs MLA latent {latent} B ({standard / latent:.1f}x less)")
    print(f"   61 layers (DeepSeek-V3) at 128k context: latent {61 * latent * 131072 / 2**30:.1f} GiB a request, "
          f"standard {61 * 128 * 2 * 128 * 2 * 131072 / 2**30:.0f} GiB")


def e2e(device, quick):
    import torch.distributed as dist
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from bench_forward import init_single_process
    from bench_moe import step_times
    from mtp_ctrl.models import build_gpt_model

    init_single_process(device)
    on_gpu = device.type == "cuda"
    shape = dict(E2E_SHAPE)
    if quick:
        shape.update(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, q_lora_rank=64,
                     kv_lora_rank=64, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32)
    config = MLATransformerConfig(
        **shape, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", qk_layernorm=True, rope_type="yarn",
        rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096,
        use_cpu_initialization=not on_gpu, perform_initialization=not on_gpu,
        params_dtype=torch.bfloat16 if on_gpu else torch.float32, bf16=on_gpu)
    torch.manual_seed(0)
    vocab = 2048 if quick else 32768
    model = build_gpt_model(config, vocab_size=vocab, max_sequence_length=8192, use_transformer_engine=False)
    model = model.to(device).eval()
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            tensor.fill_(1.0) if "norm" in name and name.endswith("weight") else tensor.normal_(0.0, 0.02, generator=generator)
    total = sum(p.numel() for p in model.parameters())
    print(f"\n4. decode steps, MLA GPT {total / 1e9:.2f} B parameters ({shape}); controller.step() wall, GPU kernel "
          "time per step (profiler), tokens/s (random weights: one token a request and step)")
    print(f"   {'B':>4} {'S':>2} {'wall ms':>8} {'GPU ms':>7} {'wall/GPU':>8} {'tok/s':>8} {'graphs':>6}")
    for batch in ((1, 4) if quick else (1, 32)):
        for S in (0, 2):
            wall, gpu, _, used = step_times(model, batch, S, "triton", on_gpu, 3 if quick else 15, vocab)
            print(f"   {batch:4d} {S:2d} {wall:8.2f} {gpu:7.2f} {wall / gpu:8.2f} {batch / wall * 1e3:8.0f} {str(used):>6}")
    dist.destroy_process_group()


def main(args):
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else 1e11
    print(f"{where}; device copy bandwidth {bandwidth / 1e9:.0f} GB/s; torch {torch.__version__}")
    if args.wgmma:
        wgmma_table(device, bandwidth, args)
        return
    if args.pick:
        pick(device, bandwidth, args)
        if not args.final:
            return
    if args.winner_file and os.path.exists(args.winner_file):
        install_winner(args.winner_file)
    if args.final:
        for heads, batches, contexts, rows in FINAL_PARTS:
            part = argparse.Namespace(**dict(vars(args), heads=heads, batches=batches, contexts=contexts, rows=rows,
                                             tune=False))
            kernel_tables(device, bandwidth, part)
        absorbed_vs_decompressed(device, args.quick)
        kv_bytes_table()
        return
    if not args.e2e_only:
        kernel_tables(device, bandwidth, args)
        if not args.kernels_only:
            absorbed_vs_decompressed(device, args.quick)
            kv_bytes_table()
    if args.e2e or args.e2e_only:
        e2e(device, args.quick)


if __name__ == "__main__":
    main(ARGS)
