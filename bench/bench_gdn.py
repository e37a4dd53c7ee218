"""Gated DeltaNet hybrids (Qwen3-Next shape): the decode/verify kernel's state traffic, the prefill
kernel against flash-linear-attention, and end-to-end decode at S = 0 vs S = 2.

    python bench/bench_gdn.py [--quick] [--skip-e2e] [--kernels] [--skip-old] [--e2e] [--tune]

1. The decode/verify rows and their commit (one layer: 32 value heads, 16 key heads, K = V = 128,
   fp32 state), at batch 1, 32, 128 and S = 0, 2, 4: the deferred commit (``gdn_verify_rows``
   applies the slot's pending rows, writes the committed state back, steps and stores its own
   rows; ``gdn_mark_pending_rows`` records the kept ones: one read and one write of the state at
   every S), beside ``--baseline``'s verify + replay (main's two launches, timed in this process)
   and the old path (``gdn_decode_rows`` writes 1 + S states, the commit copies one); state bytes /
   time against a same-run device copy's bandwidth, and each path's S = 2 step over its S = 0 step
   (the issue's target: <= 1.5x).
2. ``gdn_varlen_scan`` (ours, recurrent, one segment) vs fla-core's ``chunk_gated_delta_rule``
   (chunked, from the same initial state, final state out): tokens/s at chunk 64 .. 8192 (fla
   only when installed).
3. End to end: a Qwen3-Next-shaped hybrid scaled to one GPU (24 layers GDN : attention 3 : 1,
   hidden 2048, gated attention 16 heads over 2 KV groups of 256 with q/k norm and rotary on a
   quarter, 1 MTP layer as Qwen3-Next ships, rerun for depth 2 (``mtp_reuse_last_layer``), bf16,
   random weights: no draft is accepted, the worst case of speculation) with CUDA graphs: median wall ms of a decode step and tokens/s at S = 0 and 2,
   batch 1, 8, 32.

``--kernels`` runs table 1 only, ``--e2e`` table 3 only, ``--skip-old`` drops its old-path columns: with this script run
against another checkout's package (``PYTHONPATH``) table 1 is that checkout's baseline in the same
run (``--baseline PATH`` times that checkout's kernels in this process instead). ``--tune`` times
every candidate launch shape (``GDNTiles``: value dims a program, warps) of the verify kernel at
batch 1, 32, 128 and S = 0, 2, 4 against the same-run device copy and prints the fastest (for
reading: ``mtp_ctrl/triton_ops/gdn_tiles.py`` holds one shape); the candidates are compiled first
in parallel processes.

``--quick`` runs tiny shapes on the CPU (the torch twins, or the kernels through Triton's interpreter
with ``TRITON_INTERPRET=1``; no fla, no end to end): a smoke test of the script, not a measurement.
"""

import argparse
import statistics
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (a smoke test)")
    parser.add_argument("--skip-e2e", action="store_true", help="kernels only")
    parser.add_argument("--kernels", action="store_true", help="table 1 only (the decode/verify kernels)")
    parser.add_argument("--e2e", action="store_true", help="table 3 only (end to end)")
    parser.add_argument("--skip-old", action="store_true", help="table 1 without the old path (gdn_decode_rows)")
    parser.add_argument("--graph-calls", type=int, default=10, metavar="N",
                        help="table 1 on CUDA: time N calls captured in one CUDA graph (GPU time, no launch "
                             "latency); 0: eager calls, as before the fourth session")
    parser.add_argument("--tune", action="store_true",
                        help="only sweep the verify kernel's launch shapes (batch 1, 32, 128; S = 0, 2, 4)")
    parser.add_argument("--baseline", metavar="GDN_REPLAY_PY",
                        help="with --tune or table 1: also time this file's kernels in the same process "
                             "(another checkout's mtp_ctrl/triton_ops/gdn_replay.py, with its gdn_tiles.py and "
                             "gdn_recurrent.py: its deferred-commit step, or an older main's verify + "
                             "gdn_replay_accepted)")
    parser.add_argument("--tune-scope", metavar="BATCHES/DRAFTS/CANDIDATES",
                        help="with --tune: e.g. '32,128/0,2/8x1,16x1,32x4' (default: 1,32,128/0,2,4/all)")
    parser.add_argument("--schedules", metavar="SCHEDULES",
                        help="with --tune: row schedules (GDNRowSchedule, 'own/pending/ahead/q/maxreg', 'all' = "
                             "every row early) timed under each shape, comma-separated, or 'candidates' "
                             "(gdn_tiles.CANDIDATE_SCHEDULES); two steps of each (the second applying the "
                             "first's rows) are checked torch.equal against the baseline's (outputs, states)")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help answers before torch loads
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mtp_ctrl.triton_ops import (  # noqa: E402
    gdn_decode_rows,
    gdn_mark_pending_rows,
    gdn_row_input_width,
    gdn_varlen_scan,
    gdn_verify_rows,
    mamba_state_selective_copy,
)


def _time_ms(fn, device, repeats, graph_calls=0):
    """Median ms of ``fn()`` (CUDA events on the GPU, wall clock on the CPU), after 2 warm-ups.
    ``graph_calls`` > 0 (CUDA): ``fn`` is captured that many times in one CUDA graph and each timed
    replay is divided by it: GPU time without the host's launch latency (a launch from Python
    costs tens of us, more than the kernel itself below batch ~64)."""
    import time

    for _ in range(2):
        fn()
    if graph_calls and device.type == "cuda":
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(graph_calls):
                fn()
        graph.replay()
        return _time_ms(graph.replay, device, repeats) / graph_calls
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def _rows(num_rows, key_heads, heads, key_dim, value_dim, device):
    q = F.normalize(torch.randn(num_rows, key_heads, key_dim, device=device), dim=-1) * key_dim ** -0.5
    k = F.normalize(torch.randn(num_rows, key_heads, key_dim, device=device), dim=-1)
    return dict(q=q, k=k, v=torch.randn(num_rows, heads, value_dim, device=device),
                g=-F.softplus(torch.randn(num_rows, heads, device=device)),
                beta=torch.sigmoid(torch.randn(num_rows, heads, device=device)))


def copy_bandwidth_gbs(device, num_bytes):
    source = torch.empty(num_bytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    ms = _time_ms(lambda: target.copy_(source), device, 20)
    return 2 * num_bytes / ms / 1e6  # read + write


def _table_tiles(batch, R):
    """The verify kernel's tiles of the package's table."""
    from mtp_ctrl.triton_ops.gdn_tiles import gdn_verify_tiles

    return _tiles_name(gdn_verify_tiles(batch, R))


def _tiles_name(tiles):
    """``BLOCK_V/warps`` (and ``:`` the row schedule when it has one)."""
    schedule = getattr(tiles, "schedule", None)
    return f"{tiles.block_v}/{tiles.num_warps}" + (f":{schedule_name(schedule)}" if schedule is not None else "")


def parse_schedule(text):
    """``own/pending/ahead/q/maxreg`` (``all``: every row early; q: 1 = at its row) -> GDNRowSchedule."""
    from mtp_ctrl.triton_ops.gdn_tiles import GDNRowSchedule

    own, pending, ahead, q_at_row, max_registers = text.split("/")
    return GDNRowSchedule(own_early=None if own == "all" else int(own),
                          pending_early=None if pending == "all" else int(pending), ahead=int(ahead),
                          q_at_row=bool(int(q_at_row)), max_registers=int(max_registers))


def schedule_name(schedule):
    """The inverse of :func:`parse_schedule`."""
    return schedule.label()


def _make_tiles(candidate):
    """GDNTiles of a candidate ``(BLOCK_V, warps)`` or ``(BLOCK_V, warps, schedule text)``."""
    from mtp_ctrl.triton_ops.gdn_tiles import GDNTiles

    block_v, num_warps, *schedule = candidate
    return GDNTiles(block_v, num_warps, parse_schedule(schedule[0]) if schedule else None)


def _pending_row_inputs(width_of, device, shape, batch, S):
    """``[1, batch + 1, 2, 1 + S, F]`` stored rows of the layout whose width ``width_of`` gives (this
    package's ``[k | u | g]``, or a baseline's ``[k | v | g | beta]``): zeros, every column past
    ``k`` and ``v`` / ``u`` (g, and beta where stored) 0.5, so the pending rows do real work."""
    key_heads, heads, key_dim, value_dim = shape
    width = width_of(key_heads, key_dim, heads, value_dim)
    row_inputs = torch.zeros(1, batch + 1, 2, S + 1, width, device=device)
    row_inputs[..., key_heads * key_dim + heads * value_dim:].fill_(0.5)
    return row_inputs


def _verify_setup(device, shape, batch, S):
    """Pools and rows of one verify step at ``batch`` requests of 1 + S rows (slot ``batch``: the
    scratch slot), each slot with all 1 + S rows of its last step pending (every draft accepted:
    the most work); ``row_inputs`` as this package lays them out, ``old_row_inputs`` as main's
    verify + replay path did ([1, M, R, F])."""
    key_heads, heads, key_dim, value_dim = shape
    R = S + 1
    width = gdn_row_input_width(key_heads, key_dim, heads, value_dim) + heads  # the old [k | v | g | beta]
    pending = torch.full((batch + 1,), R if S else 0, dtype=torch.int32, device=device)
    pending[batch] = 0
    return dict(states=torch.zeros(1, batch + 1, heads, key_dim, value_dim, device=device),
                row_inputs=_pending_row_inputs(gdn_row_input_width, device, shape, batch, S),
                old_row_inputs=torch.zeros(1, batch + 1, R, width, device=device),
                pending=pending, parity=torch.zeros(batch + 1, dtype=torch.int32, device=device),
                slots=torch.arange(batch, device=device), status=torch.zeros(batch, dtype=torch.int64, device=device),
                accepted=torch.full((batch,), S, dtype=torch.int64, device=device),
                rows=_rows(batch * R, key_heads, heads, key_dim, value_dim, device))


def _baseline_pools(module, step):
    """``step`` with its own copies of the pools for a baseline module with the deferred commit, its
    stored rows in that module's layout (``module.gdn_row_input_width``)."""
    key_heads, key_dim = step["rows"]["k"].shape[1:]
    heads, value_dim = step["rows"]["v"].shape[1:]
    batch, S = step["slots"].shape[0], step["row_inputs"].shape[3] - 1
    return dict(step, **{name: step[name].clone() for name in ("states", "pending", "parity")},
                row_inputs=_pending_row_inputs(module.gdn_row_input_width, step["states"].device,
                                               (key_heads, heads, key_dim, value_dim), batch, S))


def _two_steps(step, S, tiles=None, module=None):
    """(outputs, states) after each of two steps from ``step``'s states with nothing pending: the
    second applies the first's 1 + S stored rows (every draft accepted). What ``--tune``'s bit-for-bit
    check compares with the baseline's: the stored rows' layouts may differ, what they commit may not."""
    step["pending"].zero_()
    first = _deferred_step(step, S, tiles, module).clone()
    first_states = step["states"].clone()
    return first, first_states, _deferred_step(step, S, tiles, module).clone(), step["states"].clone()


def _deferred_step(step, S, tiles=None, module=None):
    """One layer's step of this package (``module``: another checkout's gdn_replay module with the
    deferred commit): the verify rows (the pending rows applied first), then the commit's
    bookkeeping (it keeps every slot at 1 + S pending rows: the same work every call; none at
    S = 0, as ``MambaStateSlots.commit_accepted``: nothing is ever pending there)."""
    R = S + 1
    verify, mark = ((module.gdn_verify_rows, module.gdn_mark_pending_rows) if module is not None
                    else (gdn_verify_rows, gdn_mark_pending_rows))
    out = verify(step["states"], step["row_inputs"], step["pending"], step["parity"], 0, step["slots"],
                 **step["rows"], rows_per_request=R, **({} if tiles is None else {"tiles": tiles}))
    if S > 0:
        mark(step["pending"], step["parity"], step["status"], step["slots"], step["accepted"], R,
             step["slots"].shape[0])
    return out


def decode_kernel_table(device, shape, batches, drafts, old_path=True, baseline=None, graph_calls=0):
    """Per step of one layer: this package's verify rows with the deferred commit (``gdn_verify_rows``
    applies the slot's 1 + S pending rows, writes the committed state, steps its own rows;
    ``gdn_mark_pending_rows``: every draft accepted, the most work), (``baseline``: another checkout's
    gdn_replay.py, timed in this process) that checkout's verify + ``gdn_replay_accepted``, and
    (``old_path``) ``gdn_decode_rows`` + the copy commit. Returns {(path, batch, S): us}."""
    key_heads, heads, key_dim, value_dim = shape
    state_bytes = heads * key_dim * value_dim * 4
    copy_gbs = copy_bandwidth_gbs(device, max(batches) * state_bytes * (2 + max(drafts)))
    width = gdn_row_input_width(key_heads, key_dim, heads, value_dim)
    base_module = _load_baseline(baseline) if baseline else None
    import mtp_ctrl

    print(f"\n1. GDN decode/verify state traffic per step, one layer ({heads} value heads, {key_heads} key heads, "
          f"K = {key_dim}, V = {value_dim}, fp32 state {state_bytes / 2**20:.1f} MiB per request, row inputs "
          f"{width * 4 / 2**10:.1f} KiB); package {mtp_ctrl.__file__}; same-run device copy {copy_gbs:.0f} GB/s. "
          "step: gdn_verify_rows with the commit folded in (reads + writes 1 state at every S) + "
          "gdn_mark_pending_rows; 'of copy' = state bytes / time / copy GB/s; tiles = BLOCK_V/warps; "
          + (f"GPU time: {graph_calls} calls captured in one CUDA graph, a replay / {graph_calls}" if graph_calls
             else "times of eager calls (host launch latency included)")
          + ((f"; base: {baseline}'s step (the deferred commit: reads + writes 1 state), timed here"
              if _is_deferred(base_module) else
              f"; base: {baseline} verify (reads 1 state; S = 0 writes it too) + replay (reads + writes 1), "
              "timed here") if baseline else "")
          + ("; old: gdn_decode_rows + copy commit (moves 1 + (1 + S) + 2 states)" if old_path else ""))
    print(f"{'batch':>5} {'S':>2} | {'step us':>8} {'of copy':>7} {'vs S=0':>6} {'tiles':>5}"
          + ((f" | {'base step':>9} {'of copy':>7} {'vs S=0':>6} {'new/base':>8}" if _is_deferred(base_module) else
              f" | {'base verify':>11} {'of copy':>7} {'replay':>7} {'of copy':>7} {'total':>7} {'vs S=0':>6} "
              f"{'new/base':>8}") if baseline else "")
          + (f" | {'old us':>8} {'of copy':>7} {'vs S=0':>6}" if old_path else ""))
    times = {}

    def share(batch, states_moved, us):
        return f"{batch * state_bytes * states_moved / us / 1e3 / copy_gbs:7.0%}"
    for batch in batches:
        for S in drafts:
            R = S + 1
            step = _verify_setup(device, shape, batch, S)
            times[("deferred", batch, S)] = us = _time_ms(lambda: _deferred_step(step, S), device, 20,
                                                          graph_calls) * 1e3
            line = (f"{batch:5d} {S:2d} | {us:8.1f} {share(batch, 2, us)} "
                    f"{us / times[('deferred', batch, drafts[0])]:5.2f}x {_table_tiles(batch, R):>5}")
            if base_module is not None:
                verify_us, replay_us = _time_baseline(base_module, device, step, key_heads, S, graph_calls=graph_calls)
                times[("base", batch, S)] = total = verify_us + replay_us
                if _is_deferred(base_module):
                    base_s0 = times[("base", batch, drafts[0])]
                    line += f" | {total:9.1f} {share(batch, 2, total)} {total / base_s0:5.2f}x {us / total:7.2f}x"
                else:
                    replay_cells = f"{replay_us:7.1f} {share(batch, 2, replay_us)}" if S else f"{'-':>7} {'-':>7}"
                    line += (f" | {verify_us:11.1f} {share(batch, 1 if S else 2, verify_us)} {replay_cells} "
                             f"{total:7.1f} {total / times[('base', batch, drafts[0])]:5.2f}x {us / total:7.2f}x")
            if old_path:
                states, slots, rows = step["states"], step["slots"], step["rows"]
                inter = torch.zeros(1, batch + 1, R, heads, key_dim, value_dim, device=device)

                def old_step():
                    gdn_decode_rows(states, inter, 0, slots, **rows)
                    mamba_state_selective_copy(inter, states, step["status"], slots, step["accepted"], 1)
                times[("old", batch, S)] = old_us = _time_ms(old_step, device, 20, graph_calls) * 1e3
                line += (f" | {old_us:8.1f} {share(batch, 1 + R + 2, old_us)} "
                         f"{old_us / times[('old', batch, drafts[0])]:5.2f}x")
                del inter
            print(line, flush=True)
            del step
    return times


def _candidates():
    """(BLOCK_V, warps) of gdn_tiles.CANDIDATE_TILES: the launch shapes --tune times."""
    from mtp_ctrl.triton_ops.gdn_tiles import CANDIDATE_TILES

    return tuple((tiles.block_v, tiles.num_warps) for tiles in CANDIDATE_TILES)


TUNE_CANDIDATES = _candidates()


def _compile_candidates(jobs, device_type="cuda", shape=(16, 32, 128, 128)):
    """Worker of --tune's parallel compile: run each (kernel, S, BLOCK_V, warps) once at batch 1 at
    Qwen3-Next's shape, so its binary lands in Triton's cache for the timing process."""
    device = torch.device(device_type)
    for kernel, S, *tiles in jobs:
        step = _verify_setup(device, shape, 1, S)
        if kernel == "baseline":  # tiles[0]: the baseline's path
            _time_baseline(_load_baseline(tiles[0]), device, step, shape[0], S, repeats=0)
            continue
        _deferred_step(step, S, tiles=_make_tiles(tiles))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return len(jobs)


def _load_baseline(path):
    """Another checkout's gdn_replay.py as a module, with that checkout's gdn_tiles.py and
    gdn_recurrent.py standing in for this package's while it loads (its other imports: this package)."""
    import importlib.util
    import os

    folder = os.path.dirname(os.path.abspath(path))

    def load(name, file):
        spec = importlib.util.spec_from_file_location(name, os.path.join(folder, file))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    saved = {}
    try:
        for sibling in ("gdn_tiles", "gdn_recurrent"):
            name = f"mtp_ctrl.triton_ops.{sibling}"
            saved[name] = sys.modules.get(name)
            sys.modules[name] = load(f"baseline_{sibling}", f"{sibling}.py")
        return load("baseline_gdn_replay", os.path.basename(path))
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _is_deferred(module):
    """Whether a baseline gdn_replay module has the deferred commit (one launch a step) or main's
    older verify + replay launches."""
    return not hasattr(module, "gdn_replay_accepted")


def _time_baseline(module, device, step, key_heads, S, repeats=20, graph_calls=0):
    """(verify us, replay us) of the baseline module's verify + replay kernels at one step
    (repeats = 0: compile only); its own states and row inputs (main's [1, M, R, F] layout). A
    baseline with the deferred commit: (its whole step's us, 0.0), on its own copies of the pools."""
    if _is_deferred(module):
        own = _baseline_pools(module, step)
        _deferred_step(own, S, module=module)
        if not repeats:
            return 0.0, 0.0
        return _time_ms(lambda: _deferred_step(own, S, module=module), device, repeats, graph_calls) * 1e3, 0.0
    states, row_inputs = step["states"].clone(), step["old_row_inputs"]
    slots, rows = step["slots"], step["rows"]

    def replay():
        module.gdn_replay_accepted(states, row_inputs, step["status"], slots, step["accepted"], key_heads)
    module.gdn_verify_rows(states, row_inputs, 0, slots, **rows)
    if S:
        replay()
    if not repeats:
        return 0.0, 0.0
    verify_us = _time_ms(lambda: module.gdn_verify_rows(states, row_inputs, 0, slots, **rows), device, repeats,
                         graph_calls) * 1e3
    return verify_us, (_time_ms(replay, device, repeats, graph_calls) * 1e3 if S else 0.0)


def _precompile(jobs, device_type="cuda", shape=(16, 32, 128, 128)):
    import concurrent.futures
    import functools
    import multiprocessing
    import os
    import time

    started = time.perf_counter()
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 2, 14))
    chunks = [jobs[index::workers] for index in range(workers)]
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        compiled = sum(pool.map(functools.partial(_compile_candidates, device_type=device_type, shape=shape), chunks))
    print(f"   compiled {compiled} kernels in {workers} processes, {time.perf_counter() - started:.1f} s")


def tune_table(device, shape, batches, drafts, candidates=TUNE_CANDIDATES, baseline=None, graph_calls=0):
    """Every candidate launch shape of this package's step (verify with the deferred commit, 1 + S
    pending rows) at each (batch, S): us and state bytes (2 states) / time against a same-run device
    copy, beside the baseline's step (``baseline``: another checkout's gdn_replay.py), then per
    candidate its share of the copy at every (batch, S) and its S = 2 / S = 0 time (the one shape
    for every launch is chosen from that table). Returns {(kernel, batch, S): (us, tiles)}."""
    key_heads, heads, key_dim, value_dim = shape
    state_bytes = heads * key_dim * value_dim * 4
    copy_gbs = copy_bandwidth_gbs(device, max(batches) * state_bytes * 2)
    print(f"\n--tune: {heads} value heads, {key_heads} key heads, K = {key_dim}, V = {value_dim}; copy {copy_gbs:.0f} "
          "GB/s; a step moves 2 states; max|diff| = output against the first candidate; ==base: two steps from "
          "the same states (the second applies the first's 1 + S rows) give the baseline's outputs and states, "
          "torch.equal; "
          + (f"GPU time: {graph_calls} calls in one CUDA graph" if graph_calls else "eager calls"))
    if device.type == "cuda":
        try:
            _precompile([("step", S, *tile) for S in drafts for tile in candidates]
                        + [("baseline", S, baseline) for S in drafts if baseline])
        except Exception as error:  # the timing loop compiles what is missing, one after another
            print(f"   parallel compile failed ({type(error).__name__}: {error}); compiling while timing")
    print(f"{'batch':>5} {'S':>2} {'tiles':>6} {'us':>8} {'of copy':>7} {'max|diff|':>9}"
          + (f" {'==base':>6}" if baseline else ""))
    best, times = {}, {}
    base_module = _load_baseline(baseline) if baseline else None
    for batch in batches:
        for S in drafts:
            step = _verify_setup(device, shape, batch, S)
            step["states"].normal_().mul_(0.1)
            first, start = None, {name: step[name].clone() for name in ("states", "row_inputs", "parity", "pending")}
            want = None
            if base_module is not None:
                if _is_deferred(base_module):  # two steps from the same start (the second applies the
                    # first's rows): what bit for bit means when the stored rows' layouts differ
                    want = _two_steps(_baseline_pools(base_module, step), S, module=base_module)
                base = _time_baseline(base_module, device, step, key_heads, S, graph_calls=graph_calls)
                best[("baseline", batch, S)] = (sum(base), base)
                print(f"{batch:5d} {S:2d} {'base':>6} {sum(base):8.1f} "
                      f"{batch * state_bytes * 2 / sum(base) / 1e3 / copy_gbs:7.0%}")
            for candidate in candidates:
                tiles = _make_tiles(candidate)
                for name, value in start.items():  # each candidate's check from the same start
                    step[name].copy_(value)
                got = _two_steps(step, S, tiles)
                result = got[2]
                same = want is not None and all(torch.equal(a, b) for a, b in zip(got, want))
                for name, value in start.items():  # timed from the setup's pools (1 + S rows pending)
                    step[name].copy_(value)
                first = result if first is None else first
                diff = (result - first).abs().max().item()
                us = _time_ms(lambda: _deferred_step(step, S, tiles), device, 20, graph_calls) * 1e3
                times[(candidate, batch, S)] = us
                print(f"{batch:5d} {S:2d} {_tiles_name(tiles):>6} {us:8.1f} "
                      f"{batch * state_bytes * 2 / us / 1e3 / copy_gbs:7.0%} {diff:9.2e}"
                      + (f" {'yes' if same else 'NO':>6}" if want is not None else ""), flush=True)
                if ("step", batch, S) not in best or us < best[("step", batch, S)][0]:
                    best[("step", batch, S)] = (us, tiles)
            del step
    print("\n--tune: per candidate, share of the copy at each (batch, S) and S = 2 / S = 0 time"
          + ("; base = the baseline's step" if baseline else ""))
    columns = [(batch, S) for batch in batches for S in drafts]
    print(f"{'tiles':>6} | " + " ".join(f"{f'b{batch}/S{S}':>8}" for batch, S in columns)
          + " | " + " ".join(f"{f'b{batch} S2/S0':>10}" for batch in batches if 0 in drafts and 2 in drafts))
    rows = [(_tiles_name(_make_tiles(c)), {key: times[(c,) + key] for key in columns}) for c in candidates]
    if baseline:
        rows.insert(0, ("base", {key: best[("baseline",) + key][0] for key in columns}))
    for name, row in rows:
        shares = " ".join(f"{batch * state_bytes * 2 / row[(batch, S)] / 1e3 / copy_gbs:8.0%}" for batch, S in columns)
        ratios = " ".join(f"{row[(batch, 2)] / row[(batch, 0)]:9.2f}x" for batch in batches
                          if 0 in drafts and 2 in drafts)
        print(f"{name:>6} | {shares} | {ratios}", flush=True)
    # For reading only: gdn_tiles.py holds ONE shape for every launch (a verify row and a plain row
    # agree bit for bit only under one launch shape; see its DEFAULT_TILES), never a shape per launch.
    print("\n--tune: the fastest shape per launch (gdn_tiles.DEFAULT_TILES must be ONE shape for all)")
    for (kernel, batch, S), (us, tiles) in sorted(best.items(), key=lambda item: str(item[0])):
        if kernel != "baseline":
            print(f"  batch {batch:4d} S {S}: {_tiles_name(tiles)}  {us:.1f} us")
    return best


def prefill_table(device, shape, chunks):
    key_heads, heads, key_dim, value_dim = shape
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        chunk_gated_delta_rule = None
    print(f"\n2. prefill of one request, one layer: tokens/s, ours (gdn_varlen_scan) vs fla-core chunk_gated_delta_rule"
          + ("" if chunk_gated_delta_rule else " (fla not installed)"))
    print(f"{'chunk':>6} {'ours ms':>9} {'ours tok/s':>11} {'fla ms':>8} {'fla tok/s':>10} {'max |diff|':>10}")
    for chunk in chunks:
        rows = _rows(chunk, key_heads, heads, key_dim, value_dim, device)
        initial = torch.randn(1, heads, key_dim, value_dim, device=device) * 0.1
        start, count = torch.zeros(1, dtype=torch.int64, device=device), torch.full((1,), chunk, device=device)
        ours_ms = _time_ms(lambda: gdn_varlen_scan(initial, **rows, row_start=start, row_count=count), device, 5)
        line = f"{chunk:6d} {ours_ms:9.3f} {chunk / ours_ms * 1e3:11.0f}"
        if chunk_gated_delta_rule is not None:
            ratio = heads // key_heads
            q, k = (rows[name].repeat_interleave(ratio, dim=1)[None] for name in ("q", "k"))

            def fla():
                return chunk_gated_delta_rule(q, k, rows["v"][None], rows["g"][None], rows["beta"][None], scale=1.0,
                                              initial_state=initial, output_final_state=True)
            fla_ms = _time_ms(fla, device, 5)
            ours_o, _ = gdn_varlen_scan(initial, **rows, row_start=start, row_count=count)
            diff = (fla()[0][0].float() - ours_o).abs().max().item()
            line += f" {fla_ms:8.3f} {chunk / fla_ms * 1e3:10.0f} {diff:10.2e}"
        print(line)


def end_to_end_table(batches, steps):
    import os
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mtp_ctrl.controllers import InferenceConfig, TextGenerationController
    from mtp_ctrl.models import build_gpt_model
    from steady_decode import timed_decode_steps

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    vocab = 32768
    config = TransformerConfig(
        num_layers=24, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16, num_query_groups=2,
        kv_channels=256, mtp_num_layers=1, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.bfloat16, bf16=True, normalization="RMSNorm", activation_func=F.silu,
        gated_linear_unit=True, qk_layernorm=True, attention_output_gate=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, linear_conv_kernel_dim=4)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)  # weights initialised on the GPU (a CPU init of 1B parameters is slow)
    model = build_gpt_model(config, vocab_size=vocab, max_sequence_length=4096, rotary_percent=0.25).cuda().eval()
    print("\n3. end to end: 24-layer Qwen3-Next-shaped hybrid (18 GDN + 6 gated attention), hidden 2048, 1 MTP layer "
          "(S = 2 reruns it: mtp_reuse_last_layer), bf16, random weights (0 drafts accepted), CUDA graphs; median ms "
          "per decode step (whole step)")
    print(f"{'batch':>5} {'S':>2} {'step ms':>8} {'tok/s':>8}")
    for batch in batches:
        for S in (0, 2):
            inference = InferenceConfig(num_speculative_tokens=S, max_requests=max(batches), block_size_tokens=16,
                                        max_model_len=1024, max_tokens_per_step=2048,
                                        cuda_graph_batch_sizes=tuple(sorted({1, 8, max(batches)})),
                                        mtp_attention="paged", mtp_reuse_last_layer=True)
            controller = TextGenerationController(model, inference)
            times = timed_decode_steps(controller, batch, vocab, 128, max_new_tokens=400, warmup_steps=5, steps=steps)
            controller.close()
            ms = statistics.median(times)
            print(f"{batch:5d} {S:2d} {ms:8.2f} {batch / ms * 1e3:8.0f}")  # 1 token per request per step (none accepted)
    dist.destroy_process_group()


def _schedule_texts(args):
    """--schedules as texts (``candidates``: gdn_tiles.CANDIDATE_SCHEDULES)."""
    from mtp_ctrl.triton_ops.gdn_tiles import CANDIDATE_SCHEDULES

    if args.schedules == "candidates":
        return tuple(schedule_name(schedule) for schedule in CANDIDATE_SCHEDULES)
    return tuple(args.schedules.split(","))


def main(args):
    if args.quick:
        device, shape = torch.device("cpu"), (2, 4, 16, 16)
        if args.tune:
            candidates = ((8, 1), (16, 2))
            if args.schedules:
                candidates = tuple((16, 2, text) for text in _schedule_texts(args))
            return tune_table(device, shape, (2,), (0, 2, 4) if args.schedules else (0, 2), candidates=candidates,
                              baseline=args.baseline)
        decode_kernel_table(device, shape, (1, 4), (0, 2), old_path=not args.skip_old, baseline=args.baseline)
        if not args.kernels:
            prefill_table(device, shape, (64, 256))
        return
    device, shape = torch.device("cuda"), (16, 32, 128, 128)
    print(torch.cuda.get_device_name())
    if args.tune:
        batches, drafts, candidates = (1, 32, 128), (0, 2, 4), TUNE_CANDIDATES
        if args.tune_scope:
            parts = args.tune_scope.split("/")
            batches, drafts = (tuple(int(x) for x in part.split(",")) for part in parts[:2])
            if len(parts) > 2:
                candidates = tuple(tuple(int(x) for x in pair.split("x")) for pair in parts[2].split(","))
        if args.schedules:
            candidates = tuple(candidate + (text,) for candidate in candidates for text in _schedule_texts(args))
        return tune_table(device, shape, batches, drafts, candidates=candidates, baseline=args.baseline,
                          graph_calls=args.graph_calls)
    if args.e2e:
        return end_to_end_table((1, 8, 32), steps=20)
    decode_kernel_table(device, shape, (1, 32, 128), (0, 2, 4), old_path=not args.skip_old, baseline=args.baseline,
                        graph_calls=args.graph_calls)
    if args.kernels:
        return
    prefill_table(device, shape, (64, 256, 512, 1024, 4096, 8192))
    if not args.skip_e2e:
        end_to_end_table((1, 8, 32), steps=20)


if __name__ == "__main__":
    main(ARGS)
