"""Where a decode step's host time goes: cProfile over the decode steps of the demo model.

    python bench/profile_step_host.py [--batch 8] [--num-speculative-tokens 0] [--no-overlap]
"""

import argparse
import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="examples/checkpoints/mtp_demo.pt")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--num-speculative-tokens", type=int, default=0)
    parser.add_argument("--no-overlap", action="store_true")
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
                             block_size_tokens=16, max_model_len=400, max_tokens_per_step=args.batch * 64,
                             cuda_graph_batch_sizes=(args.batch,), overlap_scheduling=not args.no_overlap)
    controller = TextGenerationController(model, config)
    params = SamplingParams(max_new_tokens=300)
    controller.generate(prompts, SamplingParams(max_new_tokens=8))
    for prompt in prompts:
        controller.add_request(prompt, params)
    for _ in range(5):
        controller.step()
    profiler = cProfile.Profile()
    profiler.enable()
    steps = 0
    while controller.has_unfinished_requests() and steps < 200:
        controller.step()
        steps += 1
    profiler.disable()
    print(f"{steps} steps")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
