"""Issue 34: what a decode-only step that drafts D = 1 costs in the S_max = 2 engine, against fixed S = 1 / 2.

    python bench/bench_depth_skip.py [--quick] [--batches 32 128] [--catch-up-positions 8 16]

The trained demo model, greedy, 64 new tokens, one process: fixed S = 1, fixed S = 2, and the
S_max = 2 engine with a policy pinned at D = 1 (``PinnedDepth``), its depth 1 windows run on every
step (``mtp_idle_windows="run"``: before depth skipping) and skipped (``"skip"``: depth 1 runs only
on forced catch-ups and steps with prefill chunks) at each M (``mtp_catch_up_positions``). Per
engine: tokens/s (the best of three timed generates), the loop's wall ms a step, the warm-up's
replay ms of the steady decode-only graph (what the policy's cost model is seeded with), and the
GPU ms (CUDA events around each launch) of the decode-only launches by plan (depths run, extra
rows): the skipped step, the forced catch-up, and their mean over the generate.
"""

import argparse
import collections
import os
import sys


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU, tiny shapes")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default 32 128 (quick: 4)")
    parser.add_argument("--catch-up-positions", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--verbose", action="store_true")
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mtp_ctrl  # noqa: E402
from bench_adaptive import PROMPT_LEN, engine, run_point  # noqa: E402
from profile_no_draft_gpu import LAUNCHES, instrument  # noqa: E402
from mtp_ctrl.cli.byte_corpus import evenly_spaced_windows, load_stdlib_corpus  # noqa: E402
from mtp_ctrl.controllers import SamplingParams  # noqa: E402
from mtp_ctrl.controllers.draft_policy import DraftLengthPolicy, FixedDraftLength  # noqa: E402


class PinnedDepth(DraftLengthPolicy):
    """Every request drafts ``depth`` (capped) on every step."""

    decide_every, longest_hold = 8, 64

    def __init__(self, depth: int):
        super().__init__()
        self.depth = depth

    def warmup_depths(self, num_speculative_tokens):
        return (self.depth, num_speculative_tokens)

    def choose(self, query):
        return np.minimum(query.caps, self.depth)


def plan_costs(controller, prompts, params):
    """One generate: GPU ms (CUDA events) of its decode-only launches by plan, and their mean."""
    plans = []
    controller.on_launch = lambda step, key: plans.append(
        None if step.num_prefill else "eager" if key is None else "every window" if key[6] is None else key[6])
    LAUNCHES.clear()
    controller.generate(prompts, params)
    controller.on_launch = lambda step, key: None
    by_plan = collections.defaultdict(list)
    for plan, (_, gpu_seconds) in zip(plans, LAUNCHES):
        if plan is not None:
            by_plan[plan].append(float("nan") if gpu_seconds is None else gpu_seconds * 1e3)  # nan: off CUDA
    every = [ms for values in by_plan.values() for ms in values]
    return {str(plan): (len(values), float(np.mean(values))) for plan, values in by_plan.items()}, \
        (float(np.mean(every)) if every else None)


def main(args):
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    mtp_ctrl.init_single_process(device)
    instrument()
    print(torch.cuda.get_device_name() if device.type == "cuda" else "CPU", flush=True)
    model = mtp_ctrl.load_demo_model(device=device)
    held_out = load_stdlib_corpus().held_out
    new_tokens = args.new_tokens or (8 if args.quick else 64)
    params = SamplingParams(max_new_tokens=new_tokens)
    for batch in args.batches or ((4,) if args.quick else (32, 128)):
        prompts = [w.tolist() for w in evenly_spaced_windows(held_out, batch, PROMPT_LEN)]
        engines = [("fixed S = 1", 1, FixedDraftLength(), None, None),
                   ("fixed S = 2", 2, FixedDraftLength(), None, None),
                   ("S_max = 2, D = 1, windows run", 2, PinnedDepth(1), "run", None)]
        engines += [(f"S_max = 2, D = 1, skip M = {m}", 2, PinnedDepth(1), "skip", m) for m in args.catch_up_positions]
        print(f"\ndemo batch {batch}, greedy, {new_tokens} new tokens", flush=True)
        reference = None
        for label, S, policy, windows, positions in engines:
            controller = engine(model, S, batch, PROMPT_LEN + new_tokens + 8, policy, device=device.type,
                                idle_windows=windows, catch_up_positions=positions)
            replay = {d: round(seconds * 1e3, 3) for (g, d), seconds in policy.cost_model.gpu.items() if g == batch}
            rate, outputs, _, times = run_point(controller, prompts, params, repeats=3)
            reference = outputs if reference is None else reference
            by_plan, mean_gpu = plan_costs(controller, prompts, params)
            plans = "; ".join(f"{plan}: {count} x {ms:.3f}" for plan, (count, ms) in sorted(by_plan.items()))
            mean = "-" if mean_gpu is None else f"{mean_gpu:.3f}"
            print(f"  {label}: {rate:.0f} tok/s; wall {times['step_ms']:.3f} ms/step; warm-up replay ms by D {replay}; "
                  f"decode GPU ms by plan [{plans}], mean {mean}; == fixed S = 1 {outputs == reference}", flush=True)
            controller.close()


if __name__ == "__main__":
    main(ARGS)
