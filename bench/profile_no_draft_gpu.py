"""Issue 34: where a no-draft step's extra cost goes, on one GPU (one timed generate per engine).

    python bench/profile_no_draft_gpu.py [--quick] [--skip-demo] [--skip-large] [--skip-run-windows]
                                         [--catch-up-positions 8 32]

1. Demo model, batch 128, greedy, ``--new-tokens`` (64) new tokens: plain decoding (S = 0) against the S = 2 engine
   drafting nothing (a policy returning 0 for everyone), with the MTP windows run on each
   no-draft step (``mtp_idle_windows="run"``) and skipped ("skip", the default; with
   ``--catch-up-positions``, one engine per M: a forced catch-up every M + 1 steps). Per step: the
   loop's wall, the GPU time (CUDA events around each launch), and the host's split: the graph
   replay call, the wait for the read-back, and everything else (bookkeeping).
2. The 1B model (``bench_adaptive``'s, oracle drafter at 0.2 acceptance), batch 64, 48 new tokens,
   closed batch: plain decoding against the goodput policy at S_max = 3 (after the untimed
   generates its exploration takes), its oracle with and without prefix-cache reuse (the plain
   engine reuses the prompts' cached blocks from the generate before): GPU time per phase (the prefill launch, decode launches by
   verify width V and depths D) from the launches' CUDA events, the generate's wall, and
   torch.profiler's top kernels of each engine's generate (kernel time summed).
"""

import argparse
import collections
import os
import sys
import time

import numpy as np


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU, tiny shapes")
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--catch-up-positions", type=int, nargs="+", default=None,
                        help="the skipped-windows engine at each of these mtp_catch_up_positions M (default: "
                             "the config's)")
    parser.add_argument("--skip-run-windows", action="store_true", help="no engine with the windows run")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="the demo part's tokens a request (a forced catch-up comes once M positions fell behind)")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mtp_ctrl  # noqa: E402
from bench_adaptive import (FULL_MODEL, PROMPT_LEN, QUICK_MODEL, AcceptanceOracle, NoDrafts, build_model,  # noqa: E402
                            engine, run_point, widen_logit_margins)
from mtp_ctrl.cli.byte_corpus import evenly_spaced_windows, load_stdlib_corpus  # noqa: E402
from mtp_ctrl.controllers import GoodputPolicy, SamplingParams  # noqa: E402
from mtp_ctrl.controllers import cuda_graphs as cuda_graphs_module  # noqa: E402
from mtp_ctrl.controllers import readback as readback_module  # noqa: E402

HOST = collections.Counter()  # seconds of host time by part, for the engine being timed
LAUNCHES = []  # (step, GPU seconds or None) of every launch applied


def instrument():
    """Time the graph replay call and the read-back wait on the host; record each launch's GPU time."""
    run, wait = cuda_graphs_module.StepGraphs.run, readback_module.Readbacks.wait

    def timed_run(self, key, launch):
        started = time.perf_counter()
        try:
            return run(self, key, launch)
        finally:
            HOST["graph replay"] += time.perf_counter() - started

    def timed_wait(launched):
        started = time.perf_counter()
        readback, gpu_seconds = wait(launched)
        HOST["read-back wait"] += time.perf_counter() - started
        LAUNCHES.append((launched.step, gpu_seconds))
        return readback, gpu_seconds

    cuda_graphs_module.StepGraphs.run = timed_run
    readback_module.Readbacks.wait = staticmethod(timed_wait)


def timed_generate(controller, prompts, params, before=lambda: None):
    """One timed generate after ``run_point``'s warm generates: (wall seconds, steps, metrics' step time)."""
    before()
    if controller.shape.device.type == "cuda":
        torch.cuda.synchronize()
    HOST.clear()
    LAUNCHES.clear()
    controller.metrics.reset()
    started = time.perf_counter()
    results = controller.generate(prompts, params)
    seconds = time.perf_counter() - started
    return seconds, results, controller.metrics.as_dict()["step_time"]


def demo_part(args, device):
    batch, new_tokens = (4, 8) if args.quick else (128, args.new_tokens)
    model = mtp_ctrl.load_demo_model(device=device)
    prompts = [w.tolist() for w in evenly_spaced_windows(load_stdlib_corpus().held_out, batch, PROMPT_LEN)]
    params = SamplingParams(max_new_tokens=new_tokens)
    print(f"demo batch {batch}, {new_tokens} new tokens, greedy: ms per step (mean over the timed generate)")
    reference = None
    engines = [("plain S = 0", 0, None, "run", None)]
    if not args.skip_run_windows:
        engines.append(("S = 2, D = 0, windows run", 2, NoDrafts(), "run", None))
    engines += [(f"S = 2, D = 0, windows skipped{'' if m is None else f', M = {m}'}", 2, NoDrafts(), "skip", m)
                for m in (args.catch_up_positions or [None])]
    for label, S, policy, windows, positions in engines:
        controller = engine(model, S, batch, PROMPT_LEN + new_tokens + 8, policy, device=device.type,
                            idle_windows=windows, catch_up_positions=positions)
        run_point(controller, prompts, params)
        best = None
        for _ in range(3):
            seconds, results, times = timed_generate(controller, prompts, params)
            if best is None or seconds < best[0]:
                best = (seconds, dict(HOST), times, [r.output_tokens for r in results])
        seconds, host, times, outputs = best
        reference = outputs if reference is None else reference
        steps = times["steps"]
        wall = seconds / steps * 1e3
        replay, wait = host.get("graph replay", 0.0) / steps * 1e3, host.get("read-back wait", 0.0) / steps * 1e3
        gpu = "-" if times["mean_gpu_ms"] is None else f"{times['mean_gpu_ms']:.3f}"
        print(f"  {label}: {steps} steps, {batch * new_tokens / seconds:.0f} tok/s; wall {wall:.3f}, GPU {gpu}; "
              f"host: graph replay {replay:.3f}, read-back wait {wait:.3f}, bookkeeping {wall - replay - wait:.3f}; "
              f"== plain {outputs == reference}", flush=True)
        controller.close()


def phases():
    """GPU ms and launches by phase of the launches recorded."""
    by_phase = collections.defaultdict(lambda: [0, 0.0, 0])
    for step, gpu_seconds in LAUNCHES:
        phase = "prefill" if step.num_prefill else f"decode V={step.verify_width} D={step.num_drafts}"
        by_phase[phase][0] += 1
        by_phase[phase][1] += (gpu_seconds or 0.0) * 1e3
        by_phase[phase][2] += step.dimensions.token_count
    return ", ".join(f"{phase}: {count} x, {ms:.2f} ms, {rows} rows"
                     for phase, (count, ms, rows) in sorted(by_phase.items()))


def kernel_summary(controller, prompts, params, before, top=8):
    """torch.profiler over one generate: (kernel ms in all, [(kernel, ms, calls)] of the top ones)."""
    if controller.shape.device.type != "cuda":
        return None
    before()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        controller.generate(prompts, params)
        torch.cuda.synchronize()
    kernels = collections.Counter()
    calls = collections.Counter()
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.device_time / 1e3
            calls[event.name] += 1
    return sum(kernels.values()), [(name[:70], ms, calls[name]) for name, ms in kernels.most_common(top)]


class NoReuseOracle(AcceptanceOracle):
    """The oracle as it was: no prefix-cache reuse (``Proposer``'s default), so every generate's
    prompts are computed in full, where the plain engine reuses their cached blocks."""

    def prefix_cache_lookahead(self):
        return None


def large_part(args, device):
    shape = QUICK_MODEL if args.quick else FULL_MODEL
    batch, new_tokens = (4, 8) if args.quick else (64, 48)
    max_model_len = PROMPT_LEN + new_tokens + 8
    model = build_model(shape, device, max_model_len + 8)
    if device.type == "cpu":
        model = model.float()
    widen_logit_margins(model)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, shape["vocab_size"], (batch, PROMPT_LEN), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=new_tokens)
    controller = engine(model, 0, batch, max_model_len, device=device.type)
    _, plain_outputs, _, _ = run_point(controller, prompts, params)
    sequences = torch.zeros(batch, PROMPT_LEN + new_tokens + 16, dtype=torch.int64)
    for index, (prompt, output) in enumerate(zip(prompts, plain_outputs)):
        sequences[index, : len(prompt) + len(output)] = torch.tensor(list(prompt) + list(output))
    sequences, rates = sequences.to(device), torch.full((batch,), 0.2, device=device)
    first_id = torch.zeros((), dtype=torch.int64, device=device)
    print(f"\n1B batch {batch} at 0.2, closed, {new_tokens} new tokens: GPU per phase (CUDA events per launch)")
    engines = [("plain S = 0", controller, None)]
    for label, oracle in (("goodput S_max = 3, oracle without prefix reuse (before)", NoReuseOracle),
                          ("goodput S_max = 3, oracle reusing cached prompt blocks", AcceptanceOracle)):
        policy = GoodputPolicy()
        engines.append((label, engine(model, 3, batch, max_model_len, policy, oracle(sequences, rates, first_id),
                                      device.type), policy))
    for label, controller, policy in engines:
        before = (lambda c=controller: first_id.fill_(c.debug_view().next_request_id))
        if policy is not None:
            run_point(controller, prompts, params, policy=policy, before=before)
        seconds, results, times = timed_generate(controller, prompts, params, before)
        same = [r.output_tokens for r in results] == plain_outputs
        gpu_total = sum((gpu or 0.0) for _, gpu in LAUNCHES) * 1e3
        print(f"  {label}: {times['steps']} steps, wall {seconds * 1e3:.2f} ms, GPU {gpu_total:.2f} ms in "
              f"{len(LAUNCHES)} launches ({phases()}); == plain {same}", flush=True)
        summary = kernel_summary(controller, prompts, params, before)
        if summary is not None:
            total, top = summary
            print(f"    kernels {total:.2f} ms in all; top: " + "; ".join(f"{name} {ms:.2f} ms / {n}" for name, ms, n in top))
    for _, controller, _ in engines:
        controller.close()


def main(args):
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    mtp_ctrl.init_single_process(device)
    instrument()
    print(torch.cuda.get_device_name() if device.type == "cuda" else "CPU", flush=True)
    if not args.skip_demo:
        demo_part(args, device)
    if not args.skip_large:
        large_part(args, device)


if __name__ == "__main__":
    main(ARGS)
