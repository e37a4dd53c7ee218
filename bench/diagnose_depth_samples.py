"""Issue 34: what the goodput policy's step timings are made of, against the loop's own steps.

    python bench/diagnose_depth_samples.py --batch 32 --temperature 1      # GPU: the demo model
    python bench/diagnose_depth_samples.py --quick                          # CPU smoke run

The demo point of ``bench_adaptive.py`` (64-byte prompts, ``2 x batch`` requests of 192 tokens on
``batch`` slots): plain decoding (S = 0), the S = 2 engine with ``GoodputPolicy``, and the S = 2
engine held at D = 0 through the policy's path ("pinned 0"). Each engine is warmed as the bench
warms it, then timed ``--repeats`` times round-robin. Every ``step()`` call of the timed runs is
logged: the loop's wall since the previous call returned (what the cost model samples), the launch
it applied (its draft depths D, verify width V, prefill chunks, the MTP plan: a forced catch-up or
not), how many requests it emitted for and how many finished. The goodput engine's cost-model
records (steady samples and realised sums) are logged beside, each tied to the call it measured.
The log uses the ``on_apply`` / ``on_launch`` / ``on_step_end`` hooks; overriding ``on_step_end``
makes every engine collect its outputs each call (the same small host cost for all three).

Printed: per engine and kind of call, the calls and their median wall; per depth, the policy's
steady samples: how many, their median, and how many fell on calls that finished a request or ran
below a full batch (the drain). So one sees whether a depth's estimate comes from the steps the
loop mostly runs, or from a few unusual ones. Then the policy's decisions in the timed runs, by
objective (tokens a second while requests wait, the drain when none does), the depth run and the
top-scoring one, with each depth's priced seconds a step, score and expected tokens (means).
Also per engine: the calls of the timed runs that launched a step eagerly or captured a CUDA graph
(a key ``warmup()`` did not capture: the controller holds one more graph after its launch), and
the keys captured then.
"""

import argparse
import collections
import os
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU, tiny run")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=1, help="decode runs: steps a launch (InferenceConfig)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 192 (quick 8)")
    parser.add_argument("--json", default=None, help="also write every logged call here")
    parser.add_argument("--cprofile", nargs="*", default=(), metavar="ENGINE",
                        help="cProfile these engines' timed generates (plain, goodput, 'pinned 0'); prints the "
                             "package's functions by cumulative time, per timed call")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)

import cProfile  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # noqa: E402
import bench_adaptive as bench  # noqa: E402

import mtp_ctrl  # noqa: E402
from mtp_ctrl.cli.byte_corpus import evenly_spaced_windows, load_stdlib_corpus  # noqa: E402
from mtp_ctrl.controllers import SamplingParams, TextGenerationController  # noqa: E402


class LoggedController(TextGenerationController):
    """Logs each ``step()`` call (see the module docstring) through the documented hooks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.logging, self.returned_at, self._logged_applies, self._launch_plans = [], False, None, [], {}
        self._keys_seen, self._call_launches = set(), []  # graph keys launched so far; this call's launch kinds
        self._num_graphs = None  # graphs held after the last new key's launch (None: before the first launch)
        self.captured_keys = []  # graph keys captured by a launch while logging (not by warmup())

    def on_launch(self, step, graph_key):
        plan = None if graph_key is None else graph_key[-1]
        self._launch_plans[id(step)] = plan
        if graph_key is None:
            self._call_launches.append("eager")  # no graph covers the step's shape
        elif graph_key in self._keys_seen:
            self._call_launches.append("replay")
        else:  # the key's first launch: a replay of a graph warmup() captured, or a capture now (more graphs)
            self._keys_seen.add(graph_key)
            num_graphs = self.debug_view().num_cuda_graphs  # a new key is rare: its cost stays out of the log
            captured = self._num_graphs is not None and num_graphs > self._num_graphs  # the first: warm-up's run
            self._num_graphs = num_graphs
            self._call_launches.append("capture" if captured else "replay")
            if captured and self.logging:
                self.captured_keys.append(graph_key)

    def on_apply(self, step, readbacks, overlapped):
        self._logged_applies.append((step.num_drafts, step.verify_width, step.num_prefill > 0,
                              _plan_kind(self._launch_plans.pop(id(step), None))))

    def on_step_end(self, outputs):
        """Each call's log entry (the wall since the last call's hook: generate's loop between them
        included, as the cost model's sample includes it)."""
        now = time.perf_counter()
        if self.logging and self.returned_at is not None:
            self.calls.append(dict(wall=now - self.returned_at, applied=list(self._logged_applies),
                                   emitted=len(outputs), finished=sum(1 for _, _, done in outputs if done),
                                   launches=list(self._call_launches)))
        self.returned_at, self._logged_applies, self._call_launches = now, [], []


def _plan_kind(plan):
    """"catch-up" when a step of the plan widens its windows (M extra rows), "skip" when it runs
    no window, "windows" otherwise, "-" without a plan (S = 0, fixed S)."""
    if not plan:
        return "-"
    if any(extra for _, extra in plan):
        return "catch-up"
    return "skip" if all(depths == 0 for depths, _ in plan) else "windows"


class SampleLog:
    """Mixin for a goodput policy: logs every cost-model record with the controller's call count
    (a record at call k measures call k - 1)."""

    controller = None

    def bind(self, shape):
        super().bind(shape)
        model, log, policy = self.cost_model, [], self
        record, record_realised = model.record, model.record_realised

        def logged_record(batch_size, num_drafts, wall_seconds, gpu_seconds, mixed=False):
            log.append(dict(kind="steady", call=len(policy.controller.calls) - 1, D=num_drafts, mixed=mixed,
                            wall=wall_seconds, logging=policy.controller.logging))
            return record(batch_size, num_drafts, wall_seconds, gpu_seconds, mixed)

        def logged_realised(batch_size, verify_width, wall_seconds, steps, tokens, request_steps, mixed=False,
                            expected_tokens=None):
            log.append(dict(kind="realised", call=len(policy.controller.calls) - 1, D=verify_width, mixed=mixed,
                            wall=wall_seconds / max(steps, 1), steps=steps, logging=policy.controller.logging))
            return record_realised(batch_size, verify_width, wall_seconds, steps, tokens, request_steps, mixed,
                                   expected_tokens)

        model.record, model.record_realised, self.samples = logged_record, logged_realised, log
        self.decisions = []

    def choose(self, query):
        started = time.thread_time()
        lengths = super().choose(query)
        host_ms = (time.thread_time() - started) * 1e3
        drain = bool(self.drain_objective and query.num_waiting == 0 and query.tokens_left is not None)
        self.decisions.append(dict(call=len(self.controller.calls), logging=self.controller.logging,
                                   mode="drain" if drain else ("queue" if query.num_waiting else "closed"),
                                   requests=int(query.caps.shape[0]), waiting=int(query.num_waiting),
                                   depth=int(self.last_depth), best=int(np.argmax(self.last_scores)),
                                   seconds_ms=[round(float(s) * 1e3, 4) for s in self.last_seconds],
                                   scores=[float(s) for s in self.last_scores],
                                   tokens=[round(float(t), 3) for t in self.expected_tokens], host_ms=host_ms))
        return lengths


class LoggedGoodput(SampleLog, bench.TimedGoodput):
    pass


class LoggedPinnedPlain(SampleLog, bench.PinnedPlain):
    pass


def build(model, S, batch, max_model_len, policy, device, decode_steps=1):
    """``bench_adaptive.engine``'s controller (its config, warmed up; ``decode_steps``: decode runs),
    logged; the policy learns it."""
    controller = bench.engine(model, S, batch, max_model_len, policy, device=device, controller_class=LoggedController,
                              decode_steps_per_launch=decode_steps)
    if policy is not None:
        policy.controller = controller
    return controller


def summarize(name, controller, batch, samples=None):
    """Printed rows (and returned): per kind of call, per depth's samples."""
    print(f"\n== {name}: {len(controller.calls)} timed calls")
    groups = collections.defaultdict(list)
    for call in controller.calls:
        if len(call["applied"]) != 1:
            groups[("applied %d" % len(call["applied"]),)].append(call["wall"])
            continue
        D, V, mixed, plan = call["applied"][0]
        phase = "finishes" if call["finished"] else ("drain" if call["emitted"] < batch else "full")
        groups[(f"D={D} V={V}", "mixed" if mixed else "decode", plan, phase)].append(call["wall"])
    rows = []
    for launch_kind in ("capture", "eager"):
        walls = [call["wall"] for call in controller.calls if launch_kind in call["launches"]]
        if walls:
            print(f"calls that launched a step by {launch_kind}: {len(walls)}, {sum(walls) * 1e3:.1f} ms in all")
            rows.append(dict(engine=name, launches=launch_kind, calls=len(walls), total_ms=round(sum(walls) * 1e3, 3)))
    for key in controller.captured_keys:
        print(f"    captured: {key}")
    print(f"{'applied launch':14} {'kind':7} {'plan':9} {'phase':9} {'calls':>6} {'median ms':>10} {'mean ms':>8}")
    for key, walls in sorted(groups.items()):
        walls_ms = np.array(walls) * 1e3
        row = dict(engine=name, key=list(key), calls=len(walls), median_ms=round(float(np.median(walls_ms)), 3),
                   mean_ms=round(float(walls_ms.mean()), 3))
        rows.append(row)
        print(f"{key[0]:14} {(key[1] if len(key) > 1 else ''):7} {(key[2] if len(key) > 2 else ''):9} "
              f"{(key[3] if len(key) > 3 else ''):9} {len(walls):6d} {row['median_ms']:10.3f} {row['mean_ms']:8.3f}")
    if samples is not None:
        print(f"-- {name}'s cost-model records in the timed runs, by depth (phase of the call measured)")
        by_depth = collections.defaultdict(list)
        for sample in samples:
            if not sample["logging"] or sample["call"] < 0 or sample["call"] >= len(controller.calls):
                continue
            call = controller.calls[sample["call"]]
            phase = "finishes" if call["finished"] else ("drain" if call["emitted"] < batch else "full")
            by_depth[(sample["kind"], sample["D"], sample["mixed"], phase)].append(sample["wall"])
        for key, walls in sorted(by_depth.items()):
            walls_ms = np.array(walls) * 1e3
            row = dict(engine=name, record=list(key), count=len(walls), median_ms=round(float(np.median(walls_ms)), 3))
            rows.append(row)
            print(f"{key[0]:8} D={key[1]} {'mixed' if key[2] else 'decode':6} {key[3]:9} {len(walls):5d} "
                  f"{row['median_ms']:8.3f} ms")
    return rows


def summarize_decisions(name, decisions):
    """Printed rows (and returned): the policy's decisions in the timed runs by (objective, depth
    run, top-scoring depth), with each depth's mean priced ms a step and score over the best's."""
    groups = collections.defaultdict(list)
    for decision in decisions:
        if decision["logging"]:
            groups[(decision["mode"], decision["depth"], decision["best"])].append(decision)
    rows = []
    print(f"-- {name}'s decisions in the timed runs: objective, D run, top score's D; their host time (thread "
          f"CPU); per depth: priced ms, score / top, expected tokens")
    for (mode, depth, best), group in sorted(groups.items()):
        seconds = np.mean([d["seconds_ms"] for d in group], axis=0)
        relative = np.mean([np.array(d["scores"]) / max(d["scores"]) for d in group], axis=0)
        tokens = np.mean([d["tokens"] for d in group], axis=0)
        host_ms = [d["host_ms"] for d in group]
        row = dict(engine=name, decisions=[mode, depth, best], count=len(group),
                   host_ms=[round(float(np.mean(host_ms)), 3), round(float(np.max(host_ms)), 3)],
                   seconds_ms=[round(float(x), 3) for x in seconds],
                   score_over_top=[round(float(x), 3) for x in relative],
                   tokens=[round(float(x), 3) for x in tokens])
        rows.append(row)
        print(f"{mode:7} D={depth} top={best} {len(group):4d}  host ms mean / max {row['host_ms']}  "
              f"priced ms {row['seconds_ms']}  score/top "
              f"{row['score_over_top']}  tokens {row['tokens']}")
    warm = [d["host_ms"] for d in decisions if not d["logging"]]
    if warm:
        print(f"   (warm-up: {len(warm)} decisions, host ms mean {np.mean(warm):.3f}, max {np.max(warm):.3f})")
    return rows


def time_round_robin(engines, prompts, params, repeats, device, profiles, tokens_per_s):
    """``repeats`` timed generates of each engine, round-robin (``profiles``: cProfile these engines')."""
    for _ in range(repeats):
        for entry in engines:
            if device.type == "cuda":
                torch.cuda.synchronize()
            entry.controller.returned_at = None  # no wall across runs
            profile = profiles.get(entry.name)
            started = time.perf_counter()
            if profile is not None:
                profile.enable()
            results = entry.generate(prompts, params)
            if profile is not None:
                profile.disable()
            seconds = time.perf_counter() - started
            tokens_per_s[entry.name].append(sum(len(r.output_tokens) for r in results) / seconds)


def main(args):
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    mtp_ctrl.init_single_process(device)
    model = mtp_ctrl.load_demo_model(device=device)
    batch = 2 if args.quick else args.batch
    new_tokens = args.new_tokens or (8 if args.quick else bench.DEMO_NEW_TOKENS)
    prompts = [w.tolist() for w in evenly_spaced_windows(load_stdlib_corpus().held_out, 2 * batch, bench.PROMPT_LEN)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=args.temperature, seed=5)
    max_len = bench.PROMPT_LEN + new_tokens + 8
    kinds = [("plain", 0, None), ("goodput", 2, LoggedGoodput()), ("pinned 0", 2, LoggedPinnedPlain())]
    engines = [bench.PointEngine(S, name, policy, build(model, S, batch, max_len, policy, device.type, args.decode_steps))
               for name, S, policy in kinds]
    for entry in engines:
        bench.warm(entry, prompts, params)
        entry.controller.logging = True
    tokens_per_s = collections.defaultdict(list)
    profiles = {name: cProfile.Profile() for name in args.cprofile}
    with bench.frozen_heap():
        time_round_robin(engines, prompts, params, args.repeats, device, profiles, tokens_per_s)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}; demo batch {batch}, T = {args.temperature:g}, {len(prompts)} requests x {new_tokens} tokens, "
          f"{args.repeats} timed runs each")
    for engine_name, runs in tokens_per_s.items():
        print(f"{engine_name:10} tokens/s median {np.median(runs):10.0f}  runs {[round(r) for r in runs]}")
    for name, profile in profiles.items():
        calls = len(next(entry for entry in engines if entry.name == name).controller.calls)
        print(f"\n== cProfile of {name}'s timed generates ({calls} calls): the package's functions by cumulative time")
        pstats.Stats(profile).sort_stats("cumulative").print_stats("mtp_ctrl", 45)
    rows = []
    for entry in engines:
        rows += summarize(entry.name, entry.controller, batch, getattr(entry.policy, "samples", None))
        if getattr(entry.policy, "decisions", None):
            rows += summarize_decisions(entry.name, entry.policy.decisions)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(dict(tokens_per_s=tokens_per_s, rows=rows), file, indent=1)
    for entry in engines:
        entry.controller.close()


if __name__ == "__main__":
    main(ARGS)
