"""Which GPU kernels a decode step launches and how long they take: torch.profiler over eager
decode steps of the demo model, per phase (the controller's record_function ranges).

    python bench/profile_step_kernels.py [--batch 1] [--num-speculative-tokens 2] [--steps 20]

Eager steps (no graph) so every launch is visible; kernel times are the same work a replayed
graph runs. Prints kernels per step and the top kernels by total time.
"""

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="examples/checkpoints/mtp_demo.pt")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--num-speculative-tokens", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)
    import torch
    from byte_corpus import evenly_spaced_windows, load_stdlib_corpus
    from demo_model import build_demo_model, init_distributed, load_checkpoint, load_full_state_dict
    from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController

    device = torch.device("cuda")
    init_distributed(1, device)
    model_args, state_dict = load_checkpoint(args.checkpoint)
    model = build_demo_model(model_args)
    load_full_state_dict(model, state_dict)
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    prompts = [w.tolist() for w in evenly_spaced_windows(load_stdlib_corpus().held_out, args.batch, 64)]
    config = InferenceConfig(num_speculative_tokens=args.num_speculative_tokens, max_requests=args.batch,
                             block_size_tokens=16, max_model_len=400, max_tokens_per_step=max(64, args.batch * 64))
    controller = TextGenerationController(model, config)
    controller.generate(prompts, SamplingParams(max_new_tokens=8))  # compile every kernel
    for prompt in prompts:
        controller.add_request(prompt, SamplingParams(max_new_tokens=300))
    for _ in range(4):
        controller.step()
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
