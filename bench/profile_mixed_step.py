"""Kernel tables of a decode step and of a mixed step (decodes plus one 64-token prompt chunk),
each replayed from its CUDA graph, for the random hybrid GPT of bench_controller (M*M*M*M*).

    python bench/profile_mixed_step.py [--batch 8]

Prints, per ``controller.step()`` call (synchronised, under torch.profiler): the kernel count,
the GPU busy time (sum of kernel times) and the top kernels by time. The call after the prompt
arrives admits it and launches the mixed step; the call after that applies it and launches a
decode step. Needs CUDA.
"""

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PROMPT_LEN = 64


def kernel_table(controller, label, top=25):
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        controller.step()
        torch.cuda.synchronize()
    events = [event for event in prof.events() if event.device_type.name == "CUDA"]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for event in events:
        by_name[event.name][0] += 1
        by_name[event.name][1] += event.device_time
    busy = sum(total for _, total in by_name.values())
    print(f"== {label}: {len(events)} kernels, GPU busy {busy:.0f} us")
    for name, (count, total) in sorted(by_name.items(), key=lambda item: -item[1][1])[:top]:
        print(f"  {total:8.1f} us {count:4d}x  {name[:110]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)
    import torch

    if not torch.cuda.is_available():
        sys.exit("profile_mixed_step.py replays CUDA graphs: it needs a CUDA device")
    from bench_controller import build_model
    from demo_model import init_distributed
    from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController

    init_distributed(1, torch.device("cuda"))
    model = build_model("M*M*M*M*").to(torch.bfloat16)
    batch = args.batch
    prompts = [list(range(1 + index, 1 + index + PROMPT_LEN)) for index in range(batch)]
    config = InferenceConfig(num_speculative_tokens=0, max_requests=batch + 1, block_size_tokens=16,
                             max_model_len=PROMPT_LEN + 200, max_tokens_per_step=max((batch + 1) * PROMPT_LEN, 256),
                             cuda_graph_batch_sizes=(batch, batch + 1))
    controller = TextGenerationController(model, config)
    controller.warmup()  # every graph shape, the mixed steps' included
    controller.generate(prompts, SamplingParams(max_new_tokens=8))
    for prompt in prompts:
        controller.add_request(prompt, SamplingParams(max_new_tokens=100))
    for _ in range(6):
        controller.step()
    kernel_table(controller, "decode step")
    controller.add_request(prompts[0], SamplingParams(max_new_tokens=2))
    kernel_table(controller, "admits the prompt, launches the mixed step")
    kernel_table(controller, "applies the mixed step, launches a decode step")
    controller.close()


if __name__ == "__main__":
    main()
