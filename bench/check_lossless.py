"""Does speculative output equal plain output token for token on this device, whatever the batch?

    python bench/check_lossless.py [--batch 128] [--temperature 1] [--schedules 4] [--S 2]   # GPU
        [--held-joins 4] [--no-prefix-caching]
    python bench/check_lossless.py --quick                                                    # CPU smoke run

The demo model (as ``bench_adaptive.py`` serves it: fp32, CUDA graphs) generates ``2 x batch``
held-out 64-byte prompts of 192 tokens each through the step API, once per arrival schedule:
schedule 0 queues every request at once (the benchmark's workload: a second wave joins as the first
finishes); schedule k > 0 (seeded) holds each request back until a random step, so requests join
in groups of every size and the steps' shapes differ from schedule to schedule. Each engine (plain
decoding, then fixed S for each ``--S``) runs every schedule; every output is compared with plain
decoding's under schedule 0. Exact-match acceptance makes the output independent of drafts and of
the batch only as far as the model's kernels give a row the same bits whatever else the step holds:
a request that differs (printed: schedule, request, first differing position) means that some op's
result depended on the step's shape (at T > 0 a near-tie of two tokens' noisy logits then flips).

``--held-joins K`` adds a schedule (numbered ``--schedules``) that queues requests in groups: while
requests decode, waiting ones are queued only once ``batch / 8`` slots are free or after K calls
with a slot free (the admission pattern of the one differing output on record, bench/RESULTS.md,
"Adaptive draft length", sixteenth session). ``--no-prefix-caching``: every request opts out of the
prefix cache (a prompt then always prefills whole, in whatever step it joins).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bench_adaptive as bench  # noqa: E402
import mtp_ctrl  # noqa: E402
from mtp_ctrl.cli.byte_corpus import evenly_spaced_windows, load_stdlib_corpus  # noqa: E402
from mtp_ctrl.controllers import SamplingParams  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--schedules", type=int, default=4, help="arrival schedules (0: all at once; others seeded)")
    parser.add_argument("--S", type=int, nargs="+", default=[2], help="the speculative engines' S (fixed)")
    parser.add_argument("--held-joins", type=int, default=0, metavar="K",
                        help="add a schedule that queues requests in groups of batch / 8 (or after K calls)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="every request opts out of the prefix cache")
    parser.add_argument("--new-tokens", type=int, default=bench.DEMO_NEW_TOKENS)
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: batch 2, 8 tokens, 2 schedules")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args()


def arrival_steps(num_requests: int, schedule: int, spread: int) -> np.ndarray:
    """``[n]`` int64: the step() call before which each request is queued (0 for every request in
    schedule 0; otherwise uniform in ``[0, spread)``, seeded by the schedule)."""
    if schedule == 0:
        return np.zeros(num_requests, dtype=np.int64)
    return np.random.default_rng(schedule).integers(0, spread, num_requests)


def run_schedule(controller, prompts, params, arrivals, prefix_caching: bool = True) -> list:
    """Each prompt's output tokens, the requests queued at their arrival steps (step API)."""
    order = np.argsort(arrivals, kind="stable")
    request_ids, queued, calls = {}, 0, 0
    while queued < len(order) or controller.has_unfinished_requests():
        while queued < len(order) and arrivals[order[queued]] <= calls:
            index = int(order[queued])
            request_ids[index] = controller.add_request(prompts[index], params, prefix_caching=prefix_caching)
            queued += 1
        controller.step()
        calls += 1
    return results_in_order(controller, request_ids)


def run_held_joins(controller, prompts, params, batch: int, most_held_calls: int, prefix_caching: bool = True) -> list:
    """Each prompt's output tokens, the requests queued in groups: the first ``batch`` at once, then,
    while requests decode, the waiting ones only once ``batch / 8`` slots are free (requests queued
    less requests finished) or after ``most_held_calls`` calls with a slot free."""
    group = max(1, batch // 8)
    request_ids, finished, queued, held_calls = {}, set(), 0, 0
    while queued < len(prompts) or controller.has_unfinished_requests():
        finished.update(controller.finished_request_ids())
        running = queued - len(finished)
        free = batch - running
        if queued < len(prompts) and free > 0 and (running == 0 or min(free, len(prompts) - queued) >= group
                                                   or held_calls >= most_held_calls):
            for index in range(queued, min(queued + free, len(prompts))):
                request_ids[index] = controller.add_request(prompts[index], params, prefix_caching=prefix_caching)
            queued, held_calls = min(queued + free, len(prompts)), 0
        elif queued < len(prompts) and free > 0:
            held_calls += 1
        controller.step()
    return results_in_order(controller, request_ids)


def results_in_order(controller, request_ids: dict) -> list:
    """Each prompt's output tokens (``request_ids``: prompt index -> request id), popped."""
    return [list(controller.pop_result(request_ids[index]).output_tokens) for index in range(len(request_ids))]


def first_difference(output, reference) -> int:
    return next((j for j, (a, b) in enumerate(zip(output, reference)) if a != b), min(len(output), len(reference)))


def main(args):
    mtp_ctrl.quiet_known_warnings(args.verbose)
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    mtp_ctrl.init_single_process(device)
    model = mtp_ctrl.load_demo_model(device=device)
    batch = 2 if args.quick else args.batch
    new_tokens = 8 if args.quick else args.new_tokens
    schedules = 2 if args.quick else args.schedules
    prompts = [w.tolist() for w in evenly_spaced_windows(load_stdlib_corpus().held_out, 2 * batch, bench.PROMPT_LEN)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=args.temperature, seed=5)
    # a request's own decoding takes ~new_tokens / 2.5 steps at S = 2: arrivals within that spread
    spread = max(new_tokens // 2, 2)
    reference, differing = None, 0
    for S in [0] + [S for S in args.S if S > 0]:
        controller = bench.engine(model, S, batch, bench.PROMPT_LEN + new_tokens + 8, None, device=device.type)
        for schedule in range(schedules + (1 if args.held_joins else 0)):
            caching = not args.no_prefix_caching
            if schedule == schedules:  # the held joins' schedule
                outputs = run_held_joins(controller, prompts, params, batch, args.held_joins, caching)
            else:
                outputs = run_schedule(controller, prompts, params, arrival_steps(len(prompts), schedule, spread),
                                       caching)
            if reference is None:
                reference = outputs
                continue
            bad = [(index, first_difference(output, reference[index]))
                   for index, output in enumerate(outputs) if output != reference[index]]
            differing += len(bad)
            print(f"S = {S}, schedule {schedule}: {len(bad)} of {len(outputs)} requests differ from plain decoding's "
                  f"schedule 0" + (f"; (request, first position): {bad[:8]}" if bad else ""), flush=True)
        controller.close()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}; demo batch {batch}, T = {args.temperature:g}, {len(prompts)} requests x {new_tokens} tokens: "
          f"{differing} differing outputs in all")
    return differing


if __name__ == "__main__":
    sys.exit(1 if main(parse_args()) else 0)
