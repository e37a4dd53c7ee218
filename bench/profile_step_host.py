"""Where a decode step's host time goes: cProfile over the decode steps of the demo model.

    python bench/profile_step_host.py [--batch 8] [--num-speculative-tokens 0] [--no-overlap] [--steps 200]
        [--draft-policy fixed|none|goodput|pinned0] [--timed] [--compare S:POLICY ...] [--rounds 4]

``--compare 0:fixed 2:none 2:fixed 2:goodput``: those engines built in one process and their host
parts timed round-robin (``--rounds``), medians (processes on a shared host differ by up to 1.5x);
then each engine's ``step()`` calls (median, mean, p90, p99, max; what its slowest 5 % spend more
than a median call) and the CUDA graphs it captured in the timed rounds.
``--timed``: no cProfile (its per-call cost inflates small numpy calls several times): the wall
time of the host's parts (the draft-length hooks, the MTP plan, metrics, step building, the
read-back's application), each wrapped in ``time.perf_counter``, per steady step.

``--draft-policy none``: every request drafts 0 on an engine of S > 0 (a draft-length policy's
D = 0 steps: what such a step costs the host beside a plain engine's, S = 0); ``pinned0``: the
same depth through ``GoodputPolicy``'s whole path (holds, decisions, timing samples), with step costs
that make every draft a loss (``bench_adaptive.PinnedPlain``).
"""

import argparse
import cProfile
import math
import os
import pstats
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


POLICIES = ("fixed", "none", "goodput", "pinned0")


def parse_args(description: str, default_batch: int, default_speculative: int, default_steps: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--checkpoint", default="mtp_ctrl/checkpoints/mtp_demo.pt")
    parser.add_argument("--batch", type=int, default=default_batch)
    parser.add_argument("--num-speculative-tokens", type=int, default=default_speculative)
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--steps", type=int, default=default_steps)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--draft-policy", choices=POLICIES, default="fixed",
                        help="fixed: S drafts a step (default); none: 0 drafts a step; goodput: GoodputPolicy; "
                             "pinned0: GoodputPolicy held at 0 drafts")
    parser.add_argument("--graphs", action="store_true", help="profile_step_kernels: replay the step's CUDA graphs")
    parser.add_argument("--timed", action="store_true", help="perf_counter per host part instead of cProfile")
    parser.add_argument("--compare", nargs="+", metavar="S:POLICY", default=None,
                        help="time the host parts of these engines in one process, round-robin (e.g. 0:fixed 2:none)")
    parser.add_argument("--rounds", type=int, default=4, help="--compare: rounds over the engines")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (no graphs, eager twins)")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args()


def decoding_demo_controller(args, graphs: bool):
    """The demo model (bf16, CUDA) with ``args.batch`` held-out prompts decoding, past warm-up
    (kernels compiled, graphs captured when ``graphs``): the state both profiles time. Each request
    may emit enough tokens that none finishes within the 155 set-up steps and ``args.steps`` profiled
    ones at full acceptance (600 at least): every engine is timed mid-decode, none in its tail."""
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)
    import torch
    from byte_corpus import evenly_spaced_windows, load_stdlib_corpus
    from demo_model import init_distributed, load_demo_model
    from mtp_ctrl.controllers import GoodputPolicy, InferenceConfig, SamplingParams, TextGenerationController
    device = torch.device(getattr(args, "device", "cuda"))
    if not torch.distributed.is_initialized():  # --compare builds several engines in one process
        init_distributed(1, device)
    model = load_demo_model(args.checkpoint, device).to(torch.bfloat16)
    prompts = [w.tolist() for w in evenly_spaced_windows(load_stdlib_corpus().held_out, args.batch, 64)]
    # within the demo model's 1024 positions (a long --steps at S > 0 ends once requests finish)
    new_tokens = min(max(600, (155 + args.steps) * (1 + args.num_speculative_tokens)),
                     getattr(model, "max_sequence_length", 1024) - 64 - 16 - args.num_speculative_tokens)
    config = InferenceConfig(num_speculative_tokens=args.num_speculative_tokens, max_requests=args.batch,
                             block_size_tokens=16, max_model_len=64 + new_tokens + 16,
                             max_tokens_per_step=max(64, args.batch * 64),
                             cuda_graph_batch_sizes=(args.batch,) if graphs and device.type == "cuda" else (),
                             overlap_scheduling=not args.no_overlap)
    from bench_adaptive import NoDrafts, PinnedPlain

    policy = {"fixed": None, "none": NoDrafts, "goodput": GoodputPolicy,
              "pinned0": PinnedPlain}[getattr(args, "draft_policy", "fixed")]
    controller = TextGenerationController(model, config, draft_policy=policy() if policy else None)
    controller.generate(prompts, SamplingParams(max_new_tokens=8))  # compile, capture
    for prompt in prompts:
        controller.add_request(prompt, SamplingParams(max_new_tokens=new_tokens))
    for _ in range(5):
        controller.step()
    return controller


def main():
    args = parse_args(__doc__.splitlines()[0], default_batch=8, default_speculative=0, default_steps=200)
    if args.compare:
        compare_timed_parts(args)
        return
    controller = decoding_demo_controller(args, graphs=True)
    for _ in range(50):  # first uses: graphs not warmed up are captured here (a policy's other tiers)
        controller.step()
    controller.metrics.reset()
    for _ in range(100):  # unprofiled steady steps: the host share this profile explains
        controller.step()
    print(controller.metrics.summary())
    if args.timed:
        totals = time_host_parts(lambda: "")
        done = run_steps(controller, args.steps)
        print(f"{done} steps; host parts, us a step: " + ", ".join(
            f"{name} {seconds / max(done, 1) * 1e6:.1f}" for (_, name), seconds in sorted(totals.items())))
        return
    profiler = cProfile.Profile()
    profiler.enable()
    steps = run_steps(controller, args.steps)
    profiler.disable()
    print(f"{steps} steps")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.top)


def run_steps(controller, steps: int) -> int:
    done = 0
    while controller.has_unfinished_requests() and done < steps:
        controller.step()
        done += 1
    return done


HOST_PARTS = (("draft_lengths", "DraftLengths", ("choose", "needs_mask", "launched", "applied", "step_timing",
                                                 "record_timing")),
              ("metrics", "GenerationMetrics", ("record_acceptance", "record_no_drafts", "record_step", "record_gpu")),
              ("mtp_catch_up", "WindowCatchUp", ("plan_launch",)),
              ("output_rows", "OutputRows", ("apply", "emitted_since")),
              ("readback", "Readbacks", ("begin", "end")),
              ("cuda_graphs", "StepGraphs", ("run",)),
              ("slot_lifecycle", "SlotLifecycle", ("retire_finished", "admit_waiting", "queue_view")),
              ("tp_lockstep", "TPLockstep", ("check",)),
              ("mtp_ctrl.state.context", "DynamicInferenceContext", ("build_step", "commit_readback", "needs_sync",
                                                                     "_verify_width", "_graph_shape",
                                                                     "_decode_run_steps",
                                                                     "_schedule_prefill_chunks")),
              ("mtp_ctrl.state.block_reservations", "BlockReservations", ("reserve", "take_writes")),
              ("mtp_ctrl.state.request_table", "RequestTable", ("write_inserted_rows",)),
              ("mtp_ctrl.state.kv_block_allocator", "KVBlockAllocator", ("allocate",)),
              ("mtp_ctrl.state.step_metadata", "StepBuffers", ("build", "prepare_inputs")),
              ("mtp_ctrl.state.staging", "StagingBuffers", ("wait_until_host_writable", "copy_to_device")),
              ("step_launch", "StepLauncher", ("launch",)),
              ("mtp_proposer", "MTPProposer", ("on_step_scheduled", "propose", "on_no_drafts")),
              ("controller", "TextGenerationController", ("_build_step", "_launch_step", "_apply", "_apply_in_flight",
                                                           "_step_once", "has_unfinished_requests", "step")))


def time_host_parts(label, step_log=None):
    """Wrap the host's parts (``HOST_PARTS``) in ``perf_counter``; returns the totals in seconds by
    ``(label(), part)`` (``label``: which engine runs now). ``step_log`` (a dict): each ``step()``
    call's seconds and its parts' seconds, appended to ``step_log[label()]``."""
    import collections
    import importlib
    import time

    totals = collections.Counter()
    in_step = collections.Counter()  # the parts' seconds within the step() call running now
    for module_name, owner_name, names in HOST_PARTS:
        module = module_name if "." in module_name else f"mtp_ctrl.controllers.{module_name}"
        owner = getattr(importlib.import_module(module), owner_name)
        for name in names:
            def timed(*args, _original=getattr(owner, name), _name=name, **kwargs):
                started = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    seconds = time.perf_counter() - started
                    totals[(label(), _name)] += seconds
                    if step_log is not None:
                        if _name == "step":
                            step_log.setdefault(label(), []).append((seconds, dict(in_step)))
                            in_step.clear()
                        else:
                            in_step[_name] += seconds

            setattr(owner, name, timed)
    return totals


def time_garbage_collection(totals, label) -> None:
    """Add the time Python's garbage collector runs, by generation, to ``totals`` at ``(label(),
    "gc<generation>")`` (its collections land inside whichever part allocated last)."""
    import gc
    import time

    started = [0.0]

    def on_collect(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            totals[(label(), f"gc{info['generation']}")] += time.perf_counter() - started[0]

    gc.callbacks.append(on_collect)


def compare_timed_parts(args) -> None:
    """``--compare S:policy ...``: every engine built in this process, then ``--rounds`` rounds of
    ``--steps / rounds`` steady steps each, round-robin (host drift hits every engine alike);
    prints each engine's median µs a step of each host part over the rounds."""
    import copy
    import statistics

    engines = {}
    for spec in args.compare:
        S, _, policy = spec.partition(":")
        if not S.isdigit() or policy not in ("",) + POLICIES:
            raise ValueError(f"--compare takes S:POLICY (POLICY one of {', '.join(POLICIES)}), got {spec!r}")
        engine_args = copy.copy(args)
        engine_args.num_speculative_tokens, engine_args.draft_policy = int(S), policy or "fixed"
        controller = decoding_demo_controller(engine_args, graphs=True)
        run_steps(controller, 50)  # first uses: graphs not warmed up are captured here
        engines[spec] = controller
    current = [""]
    step_log = {}  # engine -> [(seconds, {part: seconds})] of each step() call
    totals = time_host_parts(lambda: current[0], step_log)
    captures = log_graph_captures(lambda: current[0])
    time_garbage_collection(totals, lambda: current[0])
    per_round = max(args.steps // args.rounds, 1)
    samples = {}  # (engine, part) -> [us a step of each round]
    for _ in range(args.rounds):
        for spec, controller in engines.items():
            current[0] = spec
            before = dict(totals)
            done = run_steps(controller, per_round)
            for key, seconds in totals.items():
                if key[0] == spec:
                    samples.setdefault(key, []).append((seconds - before.get(key, 0.0)) / max(done, 1) * 1e6)
    parts = sorted({part for _, part in samples})
    print(f"batch {args.batch}, {args.rounds} rounds of {per_round} steps; median us a step (host parts; each "
          f"wrapped part also pays ~0.3 us of its timer):")
    print(f"{'part':>18} " + " ".join(f"{spec:>11}" for spec in engines))
    for part in parts:
        print(f"{part:>18} " + " ".join(
            f"{statistics.median(samples[(spec, part)]) if (spec, part) in samples else 0.0:11.1f}" for spec in engines))
    print_step_tails(step_log)
    for spec, keys in captures.items():
        print(f"{spec}: {len(keys)} graphs captured in the timed rounds (first uses), by key:")
        for key in keys:
            print(f"    {key}")


def log_graph_captures(label):
    """Log the key of each CUDA graph a step captures from now on (its first use), by ``label()``."""
    from mtp_ctrl.controllers.cuda_graphs import StepGraphs

    captures = {}
    run = StepGraphs.run

    def logged(graphs, key, launch):
        if key not in graphs:
            captures.setdefault(label(), []).append(key)
        return run(graphs, key, launch)

    StepGraphs.run = logged
    return captures


def print_step_tails(step_log) -> None:
    """Each engine's step() calls: median, mean and tail (us), and what its slowest 5 % spend more
    than its median call does (the parts whose excess is largest)."""
    import statistics

    print("\nstep() calls, us: median / mean / p90 / p99 / max; the slowest 5 %: parts over their median call's")
    for spec, calls in step_log.items():
        walls = sorted(seconds for seconds, _ in calls)
        n = len(walls)
        median = statistics.median(walls)
        figures = (median, statistics.fmean(walls), nearest_rank(walls, 0.9), nearest_rank(walls, 0.99), walls[-1])
        print(f"{spec:>11}: " + " / ".join(f"{seconds * 1e6:7.1f}" for seconds in figures) + f" over {n} calls; "
              f"the tail's share of the mean's excess: {tail_share(walls, median):.0%}")
        cut = nearest_rank(walls, 0.95)
        slow = [parts for seconds, parts in calls if seconds >= cut]
        typical = [parts for seconds, parts in calls if abs(seconds - median) <= 0.1 * median] or [p for _, p in calls]
        names = {name for parts in slow for name in parts}
        excess = {name: statistics.fmean(parts.get(name, 0.0) for parts in slow)
                  - statistics.fmean(parts.get(name, 0.0) for parts in typical) for name in names}
        top = sorted(excess.items(), key=lambda item: -item[1])[:8]
        print(" " * 13 + ", ".join(f"{name} +{seconds * 1e6:.0f}" for name, seconds in top))


def nearest_rank(ordered, share: float) -> float:
    """The ``share`` percentile of the sorted ``ordered`` (nearest rank)."""
    return ordered[min(len(ordered) - 1, max(math.ceil(share * len(ordered)) - 1, 0))]


def tail_share(walls, median: float) -> float:
    """The share of (mean - median) x calls that the calls above the 95th percentile make."""
    cut = nearest_rank(walls, 0.95)
    excess = sum(seconds - median for seconds in walls)
    return sum(seconds - median for seconds in walls if seconds >= cut) / excess if excess > 0 else 0.0


if __name__ == "__main__":
    main()
