"""Which GPU kernels a decode step launches and how long they take: torch.profiler over eager
decode steps of the demo model, by kernel.

    python bench/profile_step_kernels.py [--batch 1] [--num-speculative-tokens 2] [--steps 20]
        [--draft-policy fixed|none|goodput] [--graphs]

Eager steps (no graph) so every launch is visible; kernel times are the same work a replayed
graph runs. ``--graphs``: the steps replay their CUDA graphs (after 50 first-use steps), so the
GPU time a step is the kernels a user's step runs, counted by the profiler (no host wait in it);
the parts of the step are not labelled then (one graph launch holds them all). Prints kernels per step, the kernels by part of the step (set-up, decoder forward,
sampling, verify, drafting and its MTP forwards), and the top kernels by total time.
"""

import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step_host import decoding_demo_controller, parse_args  # noqa: E402  the same set-up


# Parts of a step, labelled by wrapping the methods that run them (a profile-only wrapper).
REGIONS = (("context", "prepare_inputs", "set-up (prepare_inputs)"), ("runner", "forward", "decoder forward"),
           ("runner", "mtp_forward", "MTP forward (all depths)"), ("proposer", "propose", "drafting glue"),
           ("controller", "sample_rows", "sampling"))


def label_regions(controller, torch):
    owners = {"context": controller.context, "runner": controller.runner, "proposer": controller.proposer,
              "controller": controller}
    for owner_name, method_name, label in REGIONS:
        owner = owners[owner_name]
        method = getattr(owner, method_name)

        def labelled(*args, _method=method, _label=label, **kwargs):
            with torch.profiler.record_function("region:" + _label):
                return _method(*args, **kwargs)

        setattr(owner, method_name, labelled)


LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaMemcpyAsync",
                "cudaMemsetAsync", "cudaGraphLaunch")


REST = "rest of the step (verify, staging, read-back)"


def launches_by_region(profiler):
    """{label: launches}: each CUDA launch call counts for the innermost labelled part that encloses
    it on the host (the profiler does not link device kernels to record_function ranges).

    The enclosing part is found through the profiler's CPU event tree (``cpu_parent``, built per
    thread), so it needs ``ProfilerActivity.CPU``: with CUDA alone no ``region:`` range is recorded
    and every launch fell to the rest of the step."""
    totals = collections.Counter()
    for event in profiler.events():
        if not event.name.startswith(LAUNCH_CALLS):
            continue
        label, parent = REST, event.cpu_parent
        while parent is not None:
            if parent.name.startswith("region:"):
                label = parent.name[len("region:"):]
                break
            parent = parent.cpu_parent
        totals[label] += 1
    return totals


def main():
    args = parse_args(__doc__.splitlines()[0], default_batch=1, default_speculative=2, default_steps=20)
    controller = decoding_demo_controller(args, graphs=args.graphs)  # eager: every launch is visible
    import torch

    if args.graphs:
        for _ in range(50):  # first uses: tiers not warmed up are captured here
            controller.step()
    else:
        label_regions(controller, torch)

    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]  # CPU: the regions
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(args.steps):
            controller.step()
        torch.cuda.synchronize()
    kernels = collections.Counter()
    times = collections.Counter()
    for event in profiler.events():
        # with the CPU activity on, each labelled part also shows as a GPU annotation span: not a kernel
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith("region:"):
            name = event.name[:90]
            kernels[name] += 1
            times[name] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    total_count, total_us = sum(kernels.values()), sum(times.values())
    print(f"{torch.cuda.get_device_name()}; demo, batch {args.batch}, S = {args.num_speculative_tokens}, "
          f"{'graphs' if args.graphs else 'eager'}, policy {args.draft_policy}, {args.steps} steps: {total_count / args.steps:.0f} GPU ops per step, {total_us / args.steps:.0f} us "
          f"of GPU time per step")
    print(f"{'launches/step':>14}  part of the step")
    by_region = launches_by_region(profiler)
    for label, count in by_region.most_common():
        print(f"{count / args.steps:14.1f}  {label}")
    if set(by_region) <= {REST} and not args.graphs:
        print("warning: no launch fell in a labelled part: a method of REGIONS is no longer on the step's path")
    print(f"{'us/step':>8} {'n/step':>7}  kernel")
    for name, total in times.most_common(args.top):
        print(f"{total / args.steps:8.1f} {kernels[name] / args.steps:7.1f}  {name}")


if __name__ == "__main__":
    main()
