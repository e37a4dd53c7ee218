"""End-to-end speed-up of MTP speculation on the trained demo model (examples/train_mtp.py).

    python bench/bench_speedup.py [--checkpoint mtp_ctrl/checkpoints/mtp_demo.pt] [--quick]

The demo GPT (4 layers, hidden 256, 2 MTP layers, byte tokens) trained on the Python standard
library's source serves prompts from the held-out text (64 bytes each) greedily. For each batch
size it runs plain decoding (S = 0) and S = 1, 2 with both MTP attention modes, decode steps
replayed from CUDA graphs; each point is the median of 3 timed ``generate`` calls after a
warm-up call (which compiles and captures). Outputs are checked equal to plain decoding.

With ``--draft-checkpoint PATH`` (an EAGLE head from examples/train_eagle.py) it compares EAGLE
at S = 1..4 with paged MTP at S = 1, 2 instead, greedy and at ``--temperature`` (seeded, so
outputs still equal plain decoding's):

    python bench/bench_speedup.py --draft-checkpoint mtp_ctrl/checkpoints/eagle_demo.pt --temperature 0.7

With ``--ptd-checkpoint PATH`` (a parallel-drafting head, ``examples/train_eagle.py --mode ptd``)
it adds parallel drafting at S = 1..4 (with ``--draft-checkpoint`` too: EAGLE and PTD side by side):

    python bench/bench_speedup.py --draft-checkpoint mtp_ctrl/checkpoints/eagle_demo.pt \
        --ptd-checkpoint mtp_ctrl/checkpoints/ptd_demo.pt --temperature 0.7
"""

import argparse
import os
import statistics
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="mtp_ctrl/checkpoints/mtp_demo.pt")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--draft-checkpoint", default=None, help="EAGLE head: compare EAGLE S=1..4 with MTP S=1,2")
    parser.add_argument("--ptd-checkpoint", default=None, help="parallel-drafting head: add PTD S=1..4")
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: also time seeded sampling at this T")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help answers before torch loads
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)  # before megatron-core is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))  # noqa: E402
from byte_corpus import evenly_spaced_windows, load_stdlib_corpus  # noqa: E402
from demo_model import build_demo_model, init_distributed, load_checkpoint, load_full_state_dict  # noqa: E402

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 64, 128


def tokens_per_second(model, prompts, num_speculative_tokens, mode, repeats, proposer=None, temperature=0.0):
    config = InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=len(prompts),
                             block_size_tokens=16, max_model_len=PROMPT_LEN + NEW_TOKENS + 8,
                             max_tokens_per_step=len(prompts) * PROMPT_LEN, mtp_attention=mode,
                             cuda_graph_batch_sizes=(len(prompts),))
    controller = TextGenerationController(model, config, proposer=proposer)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=temperature, seed=1 if temperature > 0 else None)
    controller.generate(prompts, params)  # warm-up: compile, capture
    rates, outputs = [], None
    controller.metrics.reset()
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        results = controller.generate(prompts, params)
        seconds = time.perf_counter() - started
        rates.append(sum(len(r.output_tokens) for r in results) / seconds)
        outputs = [r.output_tokens for r in results]
    controller.close()
    return statistics.median(rates), controller.metrics.mean_accepted_length, outputs


def main(args=None):
    args = args or parse_args()
    device = torch.device("cuda")
    init_distributed(1, device)
    model_args, state_dict = load_checkpoint(args.checkpoint)
    model = build_demo_model(model_args)
    load_full_state_dict(model, state_dict)
    model = model.to(device).eval()
    held_out = load_stdlib_corpus().held_out
    rows = []
    batches = (1, 8) if args.quick else (1, 8, 32)
    progress = tqdm(total=len(batches) * 5, desc="points", unit="point", disable=not sys.stdout.isatty())
    from mtp_ctrl.cli.draft_heads import load_eagle_proposer, load_ptd_proposer

    if args.draft_checkpoint or args.ptd_checkpoint:
        points = [(S, "paged", None, None) for S in (1, 2)]
        if args.draft_checkpoint:
            points += [(S, "eagle", load_eagle_proposer, args.draft_checkpoint) for S in (1, 2, 3, 4)]
        if args.ptd_checkpoint:
            points += [(S, "ptd", load_ptd_proposer, args.ptd_checkpoint) for S in (1, 2, 3, 4)]
    else:
        points = [(S, mode, None, None) for S in (1, 2) for mode in ("paged", "single_position")]
    temperatures = (0.0,) if args.temperature <= 0 else (0.0, args.temperature)
    progress.total = len(batches) * len(temperatures) * (1 + len(points))
    for temperature in temperatures:
        for batch in batches:
            prompts = [w.tolist() for w in evenly_spaced_windows(held_out, batch, PROMPT_LEN)]
            plain_rate, _, plain_outputs = tokens_per_second(model, prompts, 0, "paged", 3, temperature=temperature)
            rows.append((batch, 0, "-", plain_rate, 1.0, 1.0, True, temperature))
            progress.update()
            for num_speculative_tokens, mode, make_proposer, path in points:
                proposer = None if make_proposer is None else make_proposer(model, path)
                rate, accepted_length, outputs = tokens_per_second(
                    model, prompts, num_speculative_tokens, "paged" if mode in ("eagle", "ptd") else mode, 3,
                    proposer=proposer, temperature=temperature)
                rows.append((batch, num_speculative_tokens, mode, rate, rate / plain_rate, accepted_length,
                             outputs == plain_outputs, temperature))
                progress.set_postfix_str(f"batch {batch} S {num_speculative_tokens} {mode}: {rate:.0f} tokens/s")
                progress.update()
    progress.close()
    print(f"\n{torch.cuda.get_device_name()}; demo GPT trained by examples/train_mtp.py, T as listed, "
          f"{PROMPT_LEN}-byte prompts, {NEW_TOKENS} new tokens, CUDA graphs; median of 3 runs")
    print(f"{'T':>4} {'batch':>5} {'S':>2} {'drafter':>15} {'tokens/s':>9} {'speed-up':>9} {'accepted len':>13} {'== plain':>9}")
    for batch, S, mode, rate, speedup, accepted_length, same, temperature in rows:
        print(f"{temperature:4.1f} {batch:5d} {S:2d} {mode:>15} {rate:9.0f} {speedup:8.2f}x {accepted_length:13.2f} "
              f"{str(same):>9}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
