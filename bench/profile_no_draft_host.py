"""Issue 34: the host side of a no-draft (D = 0) step in a speculative engine vs a plain engine's
step, on CPU: thread CPU time per step of the controller's parts (the policy's choose / observe,
its drain objective, step building, the read-back's application, drafting bookkeeping), and
``step()`` less the launch (what CUDA graphs do not remove). The launch itself runs eagerly
here, so its time (``launch``) is the eager device work, MTP windows included, not a graph's.

    PYTHONPATH=$PWD python bench/profile_no_draft_host.py [--batch 128] [--new-tokens 24]

Engines: fixed S = 0 (plain); S = 2 with a policy drafting nothing (``NoDrafts``); S = 2 with
``GoodputPolicy`` whose costs make D = 0 the best (the drain objective on: a closed batch).
"""

import argparse
import collections
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mtp_ctrl  # noqa: E402
from bench_adaptive import PROMPT_LEN, NoDrafts, engine  # noqa: E402
from profile_policy_path import timed  # noqa: E402  (thread time of a wrapped call, summed by label)
from mtp_ctrl.cli.byte_corpus import evenly_spaced_windows, load_stdlib_corpus  # noqa: E402
from mtp_ctrl.controllers import GoodputPolicy, SamplingParams  # noqa: E402
from mtp_ctrl.controllers import controller as controller_module  # noqa: E402
from mtp_ctrl.controllers import draft_lengths as draft_lengths_module  # noqa: E402
from mtp_ctrl.controllers import draft_policy as draft_policy_module  # noqa: E402
from mtp_ctrl.controllers import output_rows as output_rows_module  # noqa: E402
from mtp_ctrl.controllers import proposers as proposers_module  # noqa: E402
from mtp_ctrl.controllers.step_costs import StepCostModel  # noqa: E402

Controller = controller_module.TextGenerationController
TIMED = [(draft_lengths_module.DraftLengths, name) for name in ("choose", "launched", "applied", "step_timing")] + \
        [(draft_policy_module.GoodputPolicy, "choose"), (draft_policy_module.GoodputPolicy, "observe"),
         (output_rows_module.OutputRows, "apply"), (Controller, "_launch_run"), (Controller, "_build_step"),
         (Controller, "_apply"), (Controller, "_step")]
FUNCTIONS = [(draft_policy_module, "expected_drain_steps"), (proposers_module, "notify_committed")]


class DepthZeroCheapest(StepCostModel):
    def seconds(self, batch_size, num_drafts):
        return 1.0 + num_drafts

    def policy_seconds(self, batch_size, num_drafts):
        return 1.0 + num_drafts

    def is_measured(self, batch_size, num_drafts):
        return True


class GoodputAtZero(GoodputPolicy):
    def bind(self, shape):
        super().bind(shape)
        self.cost_model = DepthZeroCheapest()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=24)
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
    for module, name in FUNCTIONS:
        setattr(module, name, timed(totals, name, getattr(module, name)))
    for label, S, policy in (("plain S=0", 0, None), ("S=2 no drafts", 2, NoDrafts()),
                             ("S=2 goodput at D=0", 2, GoodputAtZero())):
        controller = engine(model, S, args.batch, PROMPT_LEN + args.new_tokens + 8, policy, device="cpu")
        controller.generate(prompts, params)
        totals.clear()
        controller.metrics.reset()
        controller.generate(prompts, params)
        steps = controller.metrics.steps
        per_step = {key.split(".")[-1] if "." in key and not key.startswith(("Goodput", "DraftLengths")) else key:
                    value / steps * 1e6 for key, value in totals.items()}
        host = per_step.get("_step", 0.0) - per_step.get("_launch_run", 0.0)
        print(f"{label}: {steps} steps; thread CPU us per step: step - launch (host) {host:.0f}; " + ", ".join(
            f"{key} {value:.0f}" for key, value in sorted(per_step.items())), flush=True)
        controller.close()


if __name__ == "__main__":
    main()
