"""Exact-match vs rejection-sampling acceptance on the trained demo model, same run.

    python bench/bench_rejection.py [--checkpoint mtp_ctrl/checkpoints/mtp_demo.pt] [--repeats 3] [--quick] [--device cpu]

The demo GPT (examples/train_mtp.py, 2 MTP layers) samples 128 new bytes from 64-byte held-out
prompts, batch 8, S = 2 with paged MTP attention, at temperature 0.7 and 1.0 (seeds 0..7). Per
temperature: plain sampling (S = 0), S = 2 with ``acceptance="exact_match"`` (output identical to
plain sampling, checked) and with ``acceptance="rejection"`` (same distribution, other tokens).
Each point is the median tokens/s of ``--repeats`` timed ``generate`` calls after a warm-up call
(decode steps replayed from CUDA graphs on a GPU); the three modes of a temperature take turns,
one call each per round, so drift hits them alike. The accepted length is tokens gained per
verify step over the timed calls. ``--quick`` (any device, e.g. a CPU smoke run): 16 new tokens,
one timed call.
"""

import argparse
import os
import statistics
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="mtp_ctrl/checkpoints/mtp_demo.pt")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per point (median)")
    parser.add_argument("--quick", action="store_true", help="16 new tokens, one timed call (a smoke run)")
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

PROMPT_LEN, BATCH, S = 64, 8, 2
TEMPERATURES = (0.7, 1.0)


class Point:
    """One mode at one temperature: its controller (warmed up: compiled, graphs captured) and timings."""

    def __init__(self, model, prompts, temperature, num_speculative_tokens, acceptance, new_tokens, device):
        config = InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=len(prompts),
                                 block_size_tokens=16, max_model_len=PROMPT_LEN + new_tokens + 8,
                                 max_tokens_per_step=len(prompts) * PROMPT_LEN, acceptance=acceptance,
                                 cuda_graph_batch_sizes=(len(prompts),) if device.type == "cuda" else ())
        self.controller = TextGenerationController(model, config)
        self.prompts, self.device, self.rates, self.outputs = prompts, device, [], None
        self.params = [SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=seed)
                       for seed in range(len(prompts))]
        self.controller.generate(prompts, self.params)  # warm-up: compile, capture
        self.controller.metrics.reset()

    def time_one_call(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        results = self.controller.generate(self.prompts, self.params)
        seconds = time.perf_counter() - started
        self.rates.append(sum(len(r.output_tokens) for r in results) / seconds)
        self.outputs = [r.output_tokens for r in results]

    def finish(self):
        """(median tokens/s, mean accepted length, outputs of the last call)."""
        self.controller.close()
        return statistics.median(self.rates), self.controller.metrics.mean_accepted_length, self.outputs


def main(args=None):
    args = args or parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    init_distributed(1, device)
    model_args, state_dict = load_checkpoint(args.checkpoint)
    model = build_demo_model(model_args)
    load_full_state_dict(model, state_dict)
    model = model.to(device).eval()
    prompts = [w.tolist() for w in evenly_spaced_windows(load_stdlib_corpus().held_out, BATCH, PROMPT_LEN)]
    new_tokens, repeats = (16, 1) if args.quick else (128, args.repeats)
    rows, paired = [], {}  # paired: per temperature, the median over rounds of rejection / exact match
    progress = tqdm(total=len(TEMPERATURES) * 3, desc="points", unit="point", disable=not sys.stdout.isatty())
    with torch.no_grad():
        for temperature in TEMPERATURES:
            modes = [(0, "exact_match")] + [(S, acceptance) for acceptance in ("exact_match", "rejection")]
            points = [Point(model, prompts, temperature, num_speculative_tokens, acceptance, new_tokens, device)
                      for num_speculative_tokens, acceptance in modes]
            for _ in range(repeats):  # the modes take turns
                for point in points:
                    point.time_one_call()
            paired[temperature] = statistics.median(
                rejection / exact for exact, rejection in zip(points[1].rates, points[2].rates))
            plain_rate, _, plain_outputs = points[0].finish()
            rows.append((temperature, 0, "-", plain_rate, 1.0, 1.0, "yes"))
            progress.update()
            for (num_speculative_tokens, acceptance), point in zip(modes[1:], points[1:]):
                rate, accepted_length, outputs = point.finish()
                same = outputs == plain_outputs
                rows.append((temperature, num_speculative_tokens, acceptance, rate, rate / plain_rate, accepted_length,
                             "yes" if same else ("NO" if acceptance == "exact_match" else "no (expected)")))
                progress.set_postfix_str(f"T {temperature} {acceptance}: {rate:.0f} tokens/s")
                progress.update()
    progress.close()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\n{name}; demo GPT ({args.checkpoint}), batch {BATCH}, {PROMPT_LEN}-byte prompts, {new_tokens} new "
          f"tokens, paged MTP attention{', CUDA graphs' if device.type == 'cuda' else ''}; "
          f"median of {repeats} run{'s' if repeats > 1 else ''}")
    print(f"{'T':>4} {'S':>2} {'acceptance':>12} {'tokens/s':>9} {'speed-up':>9} {'accepted len':>13} {'== plain':>14}")
    for temperature, num_speculative_tokens, acceptance, rate, speedup, accepted_length, same in rows:
        print(f"{temperature:4.1f} {num_speculative_tokens:2d} {acceptance:>12} {rate:9.0f} {speedup:8.2f}x "
              f"{accepted_length:13.2f} {same:>14}")
    print("rejection / exact match, median of the rounds' ratios: "
          + ", ".join(f"T {temperature}: {ratio:.3f}" for temperature, ratio in paired.items()))
    dist.destroy_process_group()
    if any(row[2] == "exact_match" and row[6] != "yes" for row in rows):
        sys.exit("exact-match output differs from plain sampling")


if __name__ == "__main__":
    main(ARGS)
