"""Multi-layer EAGLE against the single EAGLE head and MTP on the trained demo model.

    python bench/bench_multi_layer_eagle.py [--quick] [--temperature 0.7]
        [--draft-checkpoint examples/checkpoints/multi_layer_eagle_demo.pt]
        [--eagle-checkpoint examples/checkpoints/eagle_demo.pt]

bench_speedup.py's setting and timing (its ``tokens_per_second``: held-out 64-byte prompts, 128
new tokens, CUDA graphs, median of 3 timed ``generate`` calls after a warm-up), batches 1, 8 and
32 (1 and 8 with --quick): plain decoding, MTP at S = 2, the EAGLE head at S = L and the L
multi-layer EAGLE draft layers at S = L (L from the checkpoint). Outputs are checked equal to plain
decoding (greedy, and seeded sampling with --temperature).
"""

import argparse
import os
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="examples/checkpoints/mtp_demo.pt", help="the target")
    parser.add_argument("--draft-checkpoint", default="examples/checkpoints/multi_layer_eagle_demo.pt",
                        help="draft layers from examples/train_multi_layer_eagle.py")
    parser.add_argument("--eagle-checkpoint", default="examples/checkpoints/eagle_demo.pt",
                        help="an EAGLE head to compare with at the same S (skipped when the file is absent)")
    parser.add_argument("--quick", action="store_true", help="batches 1 and 8 only")
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: also time seeded sampling at this T")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


def main(args):
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)  # before megatron-core is imported
    import torch

    if not torch.cuda.is_available():
        print("bench_multi_layer_eagle: needs a CUDA GPU; nothing to measure here.")
        return
    if not os.path.exists(args.draft_checkpoint):
        sys.exit(f"error: {args.draft_checkpoint} does not exist (examples/train_multi_layer_eagle.py writes it)")
    import torch.distributed as dist

    sys.path.insert(0, EXAMPLES)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_speedup import PROMPT_LEN, tokens_per_second
    from byte_corpus import evenly_spaced_windows, load_stdlib_corpus
    from demo_model import build_demo_model, init_distributed, load_checkpoint, load_full_state_dict
    from generate import load_eagle_proposer
    from train_multi_layer_eagle import load_multi_layer_eagle_heads

    from mtp_ctrl.controllers import MultiLayerEagleProposer

    init_distributed(1, torch.device("cuda"))
    model_args, state_dict = load_checkpoint(args.checkpoint)
    model = build_demo_model(model_args)
    load_full_state_dict(model, state_dict)
    model = model.cuda().eval()
    num_layers = load_multi_layer_eagle_heads(model, args.draft_checkpoint).num_layers
    points = [(2, "mtp", lambda: None)]
    if os.path.exists(args.eagle_checkpoint):
        points.append((num_layers, "eagle", lambda: load_eagle_proposer(model, args.eagle_checkpoint)))
    points.append((num_layers, "multi_layer_eagle",
                   lambda: MultiLayerEagleProposer(load_multi_layer_eagle_heads(model, args.draft_checkpoint))))
    held_out = load_stdlib_corpus().held_out
    rows = []
    for temperature in (0.0,) if args.temperature <= 0 else (0.0, args.temperature):
        for batch in (1, 8) if args.quick else (1, 8, 32):
            prompts = [w.tolist() for w in evenly_spaced_windows(held_out, batch, PROMPT_LEN)]
            plain_rate, _, plain_outputs = tokens_per_second(model, prompts, 0, "paged", 3, temperature=temperature)
            rows.append((temperature, batch, 0, "plain", plain_rate, 1.0, 1.0, True))
            for S, name, make_proposer in points:
                rate, accepted_length, outputs = tokens_per_second(model, prompts, S, "paged", 3,
                                                                   proposer=make_proposer(), temperature=temperature)
                rows.append((temperature, batch, S, name, rate, rate / plain_rate, accepted_length,
                             outputs == plain_outputs))
                print(f"T {temperature} batch {batch} S {S} {name}: {rate:.0f} tokens/s", flush=True)
    print(f"\n{torch.cuda.get_device_name()}; demo GPT (examples/train_mtp.py), {PROMPT_LEN}-byte held-out prompts, "
          "CUDA graphs; median of 3 runs")
    print(f"{'T':>4} {'batch':>5} {'S':>2} {'drafter':>17} {'tokens/s':>9} {'speed-up':>9} {'accepted len':>13} "
          f"{'== plain':>9}")
    for temperature, batch, S, name, rate, speedup, accepted_length, same in rows:
        print(f"{temperature:4.1f} {batch:5d} {S:2d} {name:>17} {rate:9.0f} {speedup:8.2f}x {accepted_length:13.2f} "
              f"{str(same):>9}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())  # --help answers before torch loads
