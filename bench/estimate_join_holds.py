"""Held joins on the demo's queue, estimated: the real schedule, priced by measured call costs (issue 34).

    python bench/estimate_join_holds.py [--batch 32] [--holds 0 4 8 16] [--temperatures 0 1]
    python bench/estimate_join_holds.py --quick                     # CPU smoke run (batch 8, 24 tokens)

The demo workload of ``bench_adaptive.py`` (``2 x batch`` requests of 64 prompt bytes, 192 new tokens
each, seed 5, decode runs of 4) runs through plain decoding and fixed S = 2 with
``InferenceConfig(join_hold_steps=h)`` for each ``--holds`` value. The schedule a run launches (which
launches admit requests, how many decode steps each runs) does not depend on the device or on time,
so it is recorded here (``on_launch``; on the CPU too) and priced launch by launch with the H200's
measured wall of each kind of call at batch 32, T = 1 (``COSTS``: bench/RESULTS.md, "What a join call
costs" and "Where the T = 1 loss is"): a decode run's steps at their per-step wall, a single decode step,
a join call (plus a little per request it admits), and the surcharge of the two calls after a join.
Prints each engine's launches, join launches, steps, priced ms and its ratio to plain decoding's
priced ms. An estimate, not a measurement: it prices nothing the table does not list (the join's
prompt length, a smaller batch's cheaper steps) and takes batch 32's costs at every batch.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# ms, H200, demo, batch 32, T = 1 (bench/history/join_call_32_T1_h200_2026-11-27_s17.txt; the decode
# runs' per-step wall from diagnose_depth_samples --decode-steps 4, twentieth session)
COSTS = {
    0: dict(run_step=0.279, single=0.342, join=0.959, join_per_request=0.027, after=(0.263, 0.171)),
    2: dict(run_step=0.598, single=0.679, join=1.505, join_per_request=0.017, after=(0.251, 0.145)),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--holds", type=int, nargs="+", default=[0, 4, 8, 16], help="join_hold_steps values (S = 2)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--quick", action="store_true", help="batch 8, 24 new tokens, holds 0 and 4")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


def schedule_class():
    from mtp_ctrl.controllers import TextGenerationController

    class ScheduleRecorded(TextGenerationController):
        """Records each launch: (requests it admits, decode steps it runs)."""

        launches = None

        def on_launch(self, step, graph_key):
            self.launches.append((step.num_prefill, step.num_steps))

    return ScheduleRecorded


def priced_ms(launches, S):
    """The schedule's wall at ``COSTS[S]`` (module docstring)."""
    cost, total, surcharges = COSTS[S], 0.0, []
    for joining, steps in launches:
        if joining:
            total += cost["join"] + cost["join_per_request"] * (joining - 1)
            surcharges = list(cost["after"])
            continue
        total += steps * cost["run_step"] if steps > 1 else cost["single"]
        if surcharges:
            total += surcharges.pop(0)
    return total


def run(model, prompts, params, S, hold, batch, device):
    from mtp_ctrl.controllers import InferenceConfig

    config = InferenceConfig(num_speculative_tokens=S, max_requests=batch, block_size_tokens=16,
                             max_model_len=len(prompts[0]) + params.max_new_tokens + 8,
                             max_tokens_per_step=max(batch * len(prompts[0]), 256), decode_steps_per_launch=4,
                             join_hold_steps=hold, cuda_graph_batch_sizes=(batch,) if device == "cuda" else ())
    controller = schedule_class()(model, config)
    controller.launches = []
    results = controller.generate(prompts, [params] * len(prompts))
    controller.close()
    return controller.launches, [result.output_tokens for result in results]


def main(args):
    import mtp_ctrl
    from mtp_ctrl.cli.byte_corpus import evenly_spaced_windows, load_stdlib_corpus
    from mtp_ctrl.controllers import SamplingParams

    mtp_ctrl.quiet_known_warnings(args.verbose)
    batch, new_tokens, holds = (8, 24, [0, 4]) if args.quick else (args.batch, args.new_tokens, args.holds)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mtp_ctrl.init_single_process(device)
    model = mtp_ctrl.load_demo_model(device=device)
    prompts = [w.tolist() for w in evenly_spaced_windows(load_stdlib_corpus().held_out, 2 * batch, 64)]
    print(f"demo, batch {batch}, 2 x {batch} requests of {new_tokens} tokens, decode runs of 4; schedules on {device}, "
          f"priced at the H200's batch-32 call costs (ms)")
    print("| T | engine | launches | join launches | decode steps | priced ms | /plain |")
    print("|---|---|---|---|---|---|---|")
    for temperature in args.temperatures:
        params = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=5)
        plain_launches, plain_outputs = run(model, prompts, params, 0, 0, batch, device)
        plain_ms = priced_ms(plain_launches, 0)
        engines = [(0, 0, plain_launches, plain_outputs)] + [
            (2, hold, *run(model, prompts, params, 2, hold, batch, device)) for hold in holds]
        for S, hold, launches, outputs in engines:
            if outputs != plain_outputs:
                raise SystemExit(f"S = {S}, hold {hold}: output differs from plain decoding's")
            ms = priced_ms(launches, S)
            print(f"| {temperature:g} | S = {S}, hold {hold} | {len(launches)} | {sum(j > 0 for j, _ in launches)} | "
                  f"{sum(steps for j, steps in launches if not j)} | {ms:.1f} | {plain_ms / ms:.3f} |", flush=True)


if __name__ == "__main__":
    main(parse_args())
