"""The goodput engine's host work a step beyond the fixed engine's, in the queued mixed workload
(issue 34): cProfile of one timed ``generate`` each, on the CPU with a tiny model (the host work
of the loop does not depend on the model's size; the torch twins run every op).

    PYTHONPATH=$PWD python bench/profile_queued_host.py [--batch 64] [--S 3] [--top 20]

Prints thread CPU ms per step of each engine (fixed S, GoodputPolicy at S_max = S) and the
functions whose own time per step differs most between them (cProfile, ``tottime``).
"""

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mtp_ctrl  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--S", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--queued", type=int, default=4, help="requests: this many times the slots")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args()
    mtp_ctrl.quiet_known_warnings(args.verbose)
    from bench_adaptive import MIXES, PROMPT_LEN, AcceptanceOracle, engine, widen_logit_margins
    from bench_forward import QUICK_MODEL, build_model
    from mtp_ctrl.controllers import GoodputPolicy, SamplingParams

    device = torch.device("cpu")
    mtp_ctrl.init_single_process(device)
    max_model_len = PROMPT_LEN + args.new_tokens + 8
    model = build_model(QUICK_MODEL, device, max_model_len + 8).float()
    widen_logit_margins(model)
    total = args.queued * args.batch
    prompts = torch.randint(0, QUICK_MODEL["vocab_size"], (total, PROMPT_LEN),
                            generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens)
    plain = engine(model, 0, args.batch, max_model_len, device="cpu")
    outputs = [r.output_tokens for r in plain.generate(prompts, params)]
    plain.close()
    sequences = torch.zeros(total, PROMPT_LEN + args.new_tokens + 16, dtype=torch.int64)
    for index, (prompt, output) in enumerate(zip(prompts, outputs)):
        sequences[index, : len(prompt) + len(output)] = torch.tensor(list(prompt) + list(output))
    mix = MIXES["mixed"]
    rates = torch.tensor([mix[i % len(mix)] for i in range(total)])
    first_id = torch.zeros((), dtype=torch.int64)
    stats = {}
    for name, policy in (("fixed", None), ("goodput", GoodputPolicy())):
        controller = engine(model, args.S, args.batch, max_model_len, policy,
                            AcceptanceOracle(sequences, rates, first_id), device="cpu")
        for _ in range(3):  # untimed: the policy's exploration (every depth measured at the grid)
            first_id.fill_(controller.debug_view().next_request_id)
            controller.generate(prompts, params)
        first_id.fill_(controller.debug_view().next_request_id)
        controller.metrics.reset()
        profile = cProfile.Profile(time.thread_time)
        started = time.thread_time()
        profile.enable()
        results = controller.generate(prompts, params)
        profile.disable()
        cpu = time.thread_time() - started
        steps = controller.metrics.as_dict()["step_time"]["steps"]
        assert [list(r.output_tokens) for r in results] == [list(o) for o in outputs], name
        stat = pstats.Stats(profile)
        launch = sum(v[3] for k, v in stat.stats.items() if k[2] == "_launch_run")
        print(f"{name}: {steps} steps, thread CPU {cpu / steps * 1e3:.2f} ms a step, of it outside the launches "
              f"(the host's bookkeeping) {(cpu - launch) / steps * 1e3:.3f} ms; lengths "
              f"{controller.metrics.as_dict()['draft_length_counts']}")
        stats[name] = (stat, steps)
        controller.close()
    own = {}
    for name, (stat, steps) in stats.items():
        for (path, line, function), (_, calls, tottime, cumtime, _) in stat.stats.items():
            if not any(part in path for part in ("controllers", "state", "numpy")) and "numpy" not in function:
                continue  # host code only: the launches' ops run eagerly here (under graphs: one replay)
            key = f"{os.path.basename(path)}:{line}({function})"
            own.setdefault(key, {})[name] = (tottime / steps * 1e6, cumtime / steps * 1e6, calls / steps)
    rows = sorted(own.items(), key=lambda item: -abs(item[1].get("goodput", (0, 0, 0))[0]
                                                     - item[1].get("fixed", (0, 0, 0))[0]))
    print(f"\nown time us a step, goodput - fixed (top {args.top}); cumulative us; calls a step")
    for key, values in rows[: args.top]:
        g, f = values.get("goodput", (0, 0, 0)), values.get("fixed", (0, 0, 0))
        print(f"  {g[0] - f[0]:+8.1f}  own {f[0]:7.1f} -> {g[0]:7.1f}  cum {f[1]:8.1f} -> {g[1]:8.1f}  "
              f"calls {f[2]:5.2f} -> {g[2]:5.2f}  {key}")


if __name__ == "__main__":
    main()
