"""GPU ops a decode step launches per acceptance mode: torch.profiler over eager decode steps.

    python bench/count_rejection_kernels.py [--checkpoint mtp_ctrl/checkpoints/mtp_demo.pt] [--steps 20]

The demo GPT of ``bench/bench_rejection.py`` (batch 8, 64-byte prompts, temperature 0.7, paged
MTP), decoding past warm-up, eager (no graph, so every kernel, copy and fill shows): plain
decoding (S = 0), S = 2 with exact match and with rejection acceptance. A replayed graph runs the
same kernels. Uses only the public controller API, so it also counts an older checkout.
"""

import argparse
import collections
import os
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="mtp_ctrl/checkpoints/mtp_demo.pt")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top", type=int, default=0, help="also list the top kernels by count per mode")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


MODES = ((0, "exact_match"), (2, "exact_match"), (2, "rejection"))  # (S, acceptance)
BATCH, PROMPT_LEN = 8, 64


def count_mode(model, prompts, S, acceptance, args, torch):
    """(GPU ops per step, GPU us per step, Counter of op names, Counter of their us, over the profiled steps)."""
    from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController

    config = InferenceConfig(num_speculative_tokens=S, max_requests=BATCH, block_size_tokens=16, max_model_len=400,
                             max_tokens_per_step=BATCH * PROMPT_LEN, acceptance=acceptance,
                             cuda_graph_batch_sizes=())
    controller = TextGenerationController(model, config)
    params = [SamplingParams(max_new_tokens=300, temperature=args.temperature, seed=seed) for seed in range(BATCH)]
    controller.generate(prompts, [SamplingParams(max_new_tokens=8, temperature=args.temperature, seed=seed)
                                  for seed in range(BATCH)])  # compile
    for prompt, param in zip(prompts, params):
        controller.add_request(prompt, param)
    for _ in range(5):  # past the prefill
        controller.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(args.steps):
            controller.step()
        torch.cuda.synchronize()
    names, times = collections.Counter(), collections.Counter()
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            names[event.name[:80]] += 1
            times[event.name[:80]] += getattr(event, "device_time_total", None) or event.cuda_time_total
    controller.close()
    return sum(names.values()) / args.steps, sum(times.values()) / args.steps, names, times


def main(args=None):
    args = args or parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from byte_corpus import evenly_spaced_windows, load_stdlib_corpus
    from demo_model import build_demo_model, init_distributed, load_checkpoint, load_full_state_dict

    device = torch.device("cuda")
    init_distributed(1, device)
    model_args, state_dict = load_checkpoint(args.checkpoint)
    model = build_demo_model(model_args)
    load_full_state_dict(model, state_dict)
    model = model.to(device).eval()
    prompts = [w.tolist() for w in evenly_spaced_windows(load_stdlib_corpus().held_out, BATCH, PROMPT_LEN)]
    rows = []
    with torch.no_grad():
        for S, acceptance in MODES:
            rows.append((S, acceptance, *count_mode(model, prompts, S, acceptance, args, torch)))
    print(f"\n{torch.cuda.get_device_name()}; demo GPT, batch {BATCH}, T = {args.temperature}, eager decode steps, "
          f"{args.steps} profiled; package at {os.path.dirname(os.path.abspath(mtp_ctrl.__file__))}")
    print(f"{'S':>2} {'acceptance':>12} {'GPU ops / step':>15} {'GPU us / step':>14}")
    for S, acceptance, per_step, us_per_step, _names, _times in rows:
        print(f"{S:2d} {acceptance:>12} {per_step:15.1f} {us_per_step:14.1f}")
    if len(rows) == 3:
        exact, rejection = rows[1][4], rows[2][4]
        extra = rejection - exact
        print(f"rejection - exact match: {(sum(rejection.values()) - sum(exact.values())) / args.steps:+.1f} ops "
              f"per step; by name (per step): " + ", ".join(f"{name} {count / args.steps:+.1f}"
                                                           for name, count in extra.most_common(12)))
        extra_us = rows[2][5].copy()
        extra_us.subtract(rows[1][5])
        print("their GPU us per step: " + ", ".join(f"{name} {extra_us[name] / args.steps:+.1f}"
                                                    for name, _count in extra.most_common(12)))
    for S, acceptance, _per_step, _us, names, times in rows if args.top else ():
        print(f"-- S = {S}, {acceptance}: top {args.top} ops by count per step (count, us)")
        for name, count in names.most_common(args.top):
            print(f"{count / args.steps:7.1f} {times[name] / args.steps:7.1f}  {name}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
