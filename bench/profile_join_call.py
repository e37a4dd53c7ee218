"""What a call that admits requests costs, beside a decode call: wall, host and GPU (issue 34).

    python bench/profile_join_call.py [--batch 128] [--joins 1 4 16] [--engines 0:fixed 2:fixed 2:none]
    python bench/profile_join_call.py --quick                                   # CPU smoke run

The demo model as ``bench_adaptive.py`` serves it (fp32, CUDA graphs, 64-byte prompts) with
``--batch`` requests decoding. Each round aborts the ``k`` oldest requests (``--joins``), runs a few
decode calls, queues ``k`` new requests and runs on: the call that queues them launches their
prefill beside the others' decode rows (a "join" call, a mixed step), the next ones decode them
too. The rounds run twice: free-running (each call's wall since the previous call returned: what
the loop pays), then with the GPU drained before each call (the call's host seconds, and the
kernels of the step it launched from torch.profiler: their count and summed time). Medians per
engine, ``k`` and kind of call (decode, join, the first and second call after the join); the
join's wall includes queuing its requests (``add_request``, between the calls). The last column
sums over the free-running rounds the launches that ran eagerly (no CUDA graph covers the step)
and the graphs captured in those calls (a key not warmed up is captured on its first use).
``--engines S:POLICY``: ``fixed`` (every request drafts S), ``none`` (every request drafts 0 on
an engine of S: a draft-length policy's D = 0 steps), ``pinned0`` (the same through the goodput
policy's whole path, ``bench_adaptive.PinnedPlain``) or ``optout`` (every request's
``num_speculative_tokens=0``: never drafts, so no MTP window runs, over prompts neither).
"""

import argparse
import collections
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KINDS = ("decode", "join", "after 1", "after 2")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--joins", type=int, nargs="+", default=[1, 4, 16], help="requests that join a round")
    parser.add_argument("--engines", nargs="+", default=["0:fixed", "2:fixed", "2:none"], metavar="S:POLICY")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--top", type=int, default=10,
                        help="the join and decode steps' top kernels printed (largest k)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--quick", action="store_true", help="CPU: batch 2, one join, one round, no graphs")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


def one_round(controller, prompts, params, live, joins, timed_call):
    """Abort the ``joins`` oldest of ``live`` (request ids), decode, queue ``joins`` new requests and
    decode them: ``[(kind, timed_call())]`` for the calls of ``KINDS``."""
    for request_id in live[:joins]:
        controller.abort_request(request_id)
    del live[:joins]
    controller.step()  # retires the aborted requests
    samples = [("decode", timed_call()) for _ in range(4)]
    live += [controller.add_request(prompt, params) for prompt in prompts[:joins]]
    samples.append(("join", timed_call()))
    samples += [(kind, timed_call()) for kind in KINDS[2:]]
    return samples


def main(args):
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)
    import torch
    from torch.profiler import ProfilerActivity, profile

    import bench_adaptive as bench
    from mtp_ctrl.cli.byte_corpus import evenly_spaced_windows, load_stdlib_corpus
    from mtp_ctrl.controllers import SamplingParams

    device = torch.device("cpu" if args.quick else "cuda")
    batch, joins, rounds = (2, [1], 1) if args.quick else (args.batch, args.joins, args.rounds)
    mtp_ctrl.init_single_process(device)
    model = mtp_ctrl.load_demo_model(device=device)
    prompts = [w.tolist() for w in evenly_spaced_windows(load_stdlib_corpus().held_out, 2 * batch, bench.PROMPT_LEN)]
    new_tokens = 64 if args.quick else 700
    params = SamplingParams(max_new_tokens=new_tokens, temperature=args.temperature, seed=5)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    table, top_kernels, launches = {}, {}, {}
    from mtp_ctrl.controllers import TextGenerationController

    class CountingController(TextGenerationController):
        """Counts the launches that ran eagerly (no CUDA graph covers the step) and the graphs
        captured (a key not warmed up is captured on its first use), per call kind."""

        eager_launches = 0

        def on_launch(self, step, graph_key):
            if graph_key is None:
                CountingController.eager_launches += 1

    for spec in args.engines:
        S, policy_name = spec.split(":")
        policy = {"fixed": None, "none": bench.NoDrafts(), "pinned0": bench.PinnedPlain(), "optout": None}[policy_name]
        # optout: every request's num_speculative_tokens = 0 (never drafts: no MTP window at all)
        engine_params = dataclasses.replace(params, num_speculative_tokens=0) if policy_name == "optout" else params
        controller = bench.engine(model, int(S), batch, bench.PROMPT_LEN + new_tokens + 16, policy,
                                  device=device.type, controller_class=CountingController)
        for k in joins:
            live = [controller.add_request(prompt, engine_params) for prompt in prompts[batch:2 * batch]]
            for _ in range(8):
                controller.step()
            last = [time.perf_counter()]

            def free_running():
                eager, graphs = CountingController.eager_launches, controller.debug_view().num_cuda_graphs
                controller.step()
                now = time.perf_counter()
                captured = controller.debug_view().num_cuda_graphs - graphs
                seconds, last[0] = now - last[0], now
                return seconds, CountingController.eager_launches - eager, captured

            def drained():
                sync()
                started = time.perf_counter()
                activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
                with profile(activities=[activity]) as prof:
                    controller.step()
                    host = time.perf_counter() - started
                    sync()
                kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                return host, len(kernels), sum(e.device_time for e in kernels) / 1e6, kernels

            samples = {"wall": [], "drained": []}
            for _ in range(rounds):
                last[0] = time.perf_counter()
                samples["wall"] += one_round(controller, prompts, engine_params, live, k, free_running)
            for _ in range(rounds):
                samples["drained"] += one_round(controller, prompts, engine_params, live, k, drained)
            for request_id in live:
                controller.abort_request(request_id)
            while controller.has_unfinished_requests():
                controller.step()
            for top_kind, calls in (("join", rounds), ("decode", 4 * rounds)):
                top = collections.Counter()
                for name, row in samples["drained"]:
                    if name == top_kind:
                        for event in row[3]:
                            top[event.name[:60]] += event.device_time / 1e3 / calls
                top_kernels[(spec, k, top_kind)] = top.most_common(args.top)
            for kind in KINDS:
                walls = [s[0] for name, s in samples["wall"] if name == kind]
                # launches that ran eagerly, graphs captured: over the free-running rounds' calls of this kind
                launches[(spec, k, kind)] = (sum(s[1] for name, s in samples["wall"] if name == kind),
                                             sum(s[2] for name, s in samples["wall"] if name == kind))
                drained_rows = [s for name, s in samples["drained"] if name == kind]
                table[(spec, k, kind)] = (statistics.median(walls), statistics.median(r[0] for r in drained_rows),
                                          statistics.median(r[1] for r in drained_rows),
                                          statistics.median(r[2] for r in drained_rows))
        controller.close()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}; demo batch {batch}, T = {args.temperature:g}; medians of {rounds} rounds; ms")
    print("| engine | joins | call | wall | host (drained) | kernels | kernel ms | eager launches, graphs captured |")
    print("|---|---|---|---|---|---|---|---|")
    for (spec, k, kind), (wall, host, count, kernel) in table.items():
        eager, captured = launches[(spec, k, kind)]
        print(f"| {spec} | {k} | {kind} | {wall * 1e3:.3f} | {host * 1e3:.3f} | {count:g} | {kernel * 1e3:.3f} "
              f"| {eager}, {captured} |")
    for (spec, k, kind), top in top_kernels.items():
        if k == max(joins) and top:
            print(f"{spec}, {k} joining, {kind} step's top kernels, ms a step: "
                  + "; ".join(f"{name} {ms:.3f}" for name, ms in top))


if __name__ == "__main__":
    main(parse_args())
