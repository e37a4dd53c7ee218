"""The draft-length policy path's host cost per step on CPU (issue 34): fixed S vs a GoodputPolicy
pinned to S (every cost equal, so it drafts S each step: the same lengths, so the difference is
the policy path's own work). Thread CPU time of the controller's draft-length calls, per step.

    PYTHONPATH=$PWD python bench/profile_policy_path.py [--batch 64] [--new-tokens 32]
"""

import argparse
import collections
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mtp_ctrl  # noqa: E402
from bench_adaptive import PROMPT_LEN, PinnedGoodput, engine  # noqa: E402
from mtp_ctrl.cli.byte_corpus import evenly_spaced_windows, load_stdlib_corpus  # noqa: E402
from mtp_ctrl.controllers import SamplingParams  # noqa: E402
from mtp_ctrl.controllers import controller as controller_module  # noqa: E402
from mtp_ctrl.controllers import draft_lengths as draft_lengths_module  # noqa: E402
from mtp_ctrl.controllers import step_launch as step_launch_module  # noqa: E402

TIMED = [(draft_lengths_module.DraftLengths, name) for name in
         ("choose", "launched", "applied", "step_timing", "record_timing")] + \
        [(step_launch_module.StepLauncher, "_mask_undrafted"), (controller_module.TextGenerationController, "step")]


def timed(totals, label, function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        started = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            totals[label] += time.thread_time() - started
    return wrapper


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--S", type=int, default=2)
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args()
    mtp_ctrl.quiet_known_warnings(args.verbose)
    device = torch.device("cpu")
    mtp_ctrl.init_single_process(device)
    model = mtp_ctrl.load_demo_model(device=device)
    prompts = [w.tolist() for w in evenly_spaced_windows(load_stdlib_corpus().held_out, args.batch, PROMPT_LEN)]
    params = SamplingParams(max_new_tokens=args.new_tokens)
    totals = collections.Counter()
    for owner, name in TIMED:
        setattr(owner, name, timed(totals, f"{owner.__name__}.{name}", getattr(owner, name)))
    for label, policy in (("fixed", None), ("pinned", PinnedGoodput())):
        controller = engine(model, args.S, args.batch, PROMPT_LEN + args.new_tokens + 8, policy, device="cpu")
        controller.generate(prompts, params)
        totals.clear()
        controller.metrics.reset()
        controller.generate(prompts, params)
        steps = controller.metrics.steps
        print(f"{label}: {steps} steps; per step (thread CPU us): " + ", ".join(
            f"{key.split('.')[-1]} {value / steps * 1e6:.0f}" for key, value in sorted(totals.items())), flush=True)
        controller.close()


if __name__ == "__main__":
    main()
