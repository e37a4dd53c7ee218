"""Which GPU kernels a decode step launches and how long they take: torch.profiler over eager
decode steps of the demo model, by kernel.

    python bench/profile_step_kernels.py [--batch 1] [--num-speculative-tokens 2] [--steps 20]

Eager steps (no graph) so every launch is visible; kernel times are the same work a replayed
graph runs. Prints kernels per step and the top kernels by total time.
"""

import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step_host import decoding_demo_controller, parse_args  # noqa: E402  the same set-up


def main():
    args = parse_args(__doc__.splitlines()[0], default_batch=1, default_speculative=2, default_steps=20)
    controller = decoding_demo_controller(args, graphs=False)  # eager: every launch is visible
    import torch

    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(args.steps):
            controller.step()
        torch.cuda.synchronize()
    kernels = collections.Counter()
    times = collections.Counter()
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:90]
            kernels[name] += 1
            times[name] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    total_count, total_us = sum(kernels.values()), sum(times.values())
    print(f"{torch.cuda.get_device_name()}; demo, batch {args.batch}, S = {args.num_speculative_tokens}, eager, "
          f"{args.steps} steps: {total_count / args.steps:.0f} GPU ops per step, {total_us / args.steps:.0f} us "
          f"of GPU time per step")
    print(f"{'us/step':>8} {'n/step':>7}  kernel")
    for name, total in times.most_common(args.top):
        print(f"{total / args.steps:8.1f} {kernels[name] / args.steps:7.1f}  {name}")


if __name__ == "__main__":
    main()
