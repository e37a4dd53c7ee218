"""Every drafter on the same target, in one run: which one should a user pick?

    python bench/bench_drafters.py [--quick] [--eagle PATH] [--ptd PATH] [--multi-layer-eagle PATH]

Target: the shipped demo GPT (mtp_ctrl/checkpoints/mtp_demo.pt), 64-byte held-out prompts, 128
new tokens, CUDA graphs. Drafters: MTP paged and MTP single-position (the model's own heads),
EAGLE, parallel drafting (PTD) and multi-layer EAGLE (heads from examples/train_eagle.py and
examples/train_multi_layer_eagle.py; a drafter whose head file is missing is skipped). Each
drafter runs at each S it supports; the table keeps its best S per (batch, T). Columns:

- accepted length: tokens emitted per decode step (1 + accepted drafts);
- speed-up: tokens/s over plain decoding (S = 0) in the same run (median of 3 ``generate`` calls);
- draft GPU: GPU time per step spent drafting = the step's GPU time (graph replay, CUDA events)
  minus that of the same step with a drafter that launches nothing (same S, same batch);
- outputs == plain decoding (greedy, and seeded sampling at T = 0.7).
Training cost is each head's own record (the checkpoint's ``train_seconds`` when present).
"""

import argparse
import os
import statistics
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mtp_ctrl", "checkpoints")
    parser.add_argument("--checkpoint", default=os.path.join(here, "mtp_demo.pt"))
    parser.add_argument("--eagle", default=os.path.join(here, "eagle_demo.pt"))
    parser.add_argument("--ptd", default=os.path.join(here, "ptd_demo.pt"))
    parser.add_argument("--multi-layer-eagle", default=os.path.join(here, "multi_layer_eagle_demo.pt"))
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8, greedy only")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help answers before torch loads
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)  # before megatron-core is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))  # noqa: E402
from byte_corpus import evenly_spaced_windows, load_stdlib_corpus  # noqa: E402
from demo_model import init_distributed, load_demo_model  # noqa: E402

from mtp_ctrl.controllers import InferenceConfig, Proposer, SamplingParams, TextGenerationController  # noqa: E402

PROMPT_LEN, NEW_TOKENS, REPEATS = 64, 128, 3


class NoDraftProposer(Proposer):
    """Drafts token 0 everywhere from a preallocated tensor: a step that launches no drafting work,
    the baseline of the draft phase's GPU time."""

    def bind(self, controller) -> None:
        super().bind(controller)
        S = controller.config.num_speculative_tokens
        self._drafts = torch.zeros(controller.config.max_requests, S, dtype=torch.int64, device=controller.device)

    def propose(self, batch):
        return self._drafts[: batch.num_requests]


def run(model, prompts, S, temperature, mtp_attention="paged", proposer=None):
    """(median tokens/s, accepted length, mean GPU ms per step, outputs) of one configuration."""
    config = InferenceConfig(num_speculative_tokens=S, max_requests=len(prompts), block_size_tokens=16,
                             max_model_len=PROMPT_LEN + NEW_TOKENS + 8, max_tokens_per_step=len(prompts) * PROMPT_LEN,
                             mtp_attention=mtp_attention, cuda_graph_batch_sizes=(len(prompts),))
    controller = TextGenerationController(model, config, proposer=proposer)
    controller.warmup()
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=temperature, seed=1 if temperature > 0 else None)
    controller.generate(prompts, params)  # warm-up
    controller.metrics.reset()
    rates, outputs = [], None
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        started = time.perf_counter()
        results = controller.generate(prompts, params)
        rates.append(sum(len(r.output_tokens) for r in results) / (time.perf_counter() - started))
        outputs = [r.output_tokens for r in results]
    metrics = controller.metrics.as_dict()["step_time"]
    accepted = controller.metrics.mean_accepted_length
    controller.close()
    return statistics.median(rates), accepted, metrics["mean_gpu_ms"], outputs


def drafters(model, args):
    """name -> (S values, mtp_attention, proposer factory or None, training cost)."""
    from mtp_ctrl.cli.draft_heads import load_draft_proposer  # noqa: E402

    table = {"MTP paged": ((1, 2), "paged", None, "the model's own heads (train_mtp.py)"),
             "MTP single-position": ((1, 2), "single_position", None, "the model's own heads")}
    for name, kind, path, depths in (("EAGLE", "eagle", args.eagle, (2, 3, 4)), ("PTD", "ptd", args.ptd, (2, 3, 4)),
                                     ("multi-layer EAGLE", "multi_layer_eagle", args.multi_layer_eagle, None)):
        if not os.path.exists(path):
            print(f"skipping {name}: {path} not found")
            continue
        saved = torch.load(path, map_location="cpu", weights_only=True)
        cost = f"{saved['train_seconds']:.0f} GPU-s" if "train_seconds" in saved else "see its training log"
        depths = depths or (int(saved.get("num_layers", 3)),)  # one draft layer per depth

        def factory(S, kind=kind, path=path):
            return load_draft_proposer(kind, model, path, S)

        table[name] = (depths, "paged", factory, cost)
    return table


def main(args):
    device = torch.device("cuda")
    init_distributed(1, device)
    model = load_demo_model(args.checkpoint, device)
    held_out = load_stdlib_corpus().held_out
    batches = (1, 8) if args.quick else (1, 8, 32)
    temperatures = (0.0,) if args.quick else (0.0, 0.7)
    candidates = drafters(model, args)
    rows = []
    for temperature in temperatures:
        for batch in batches:
            prompts = [w.tolist() for w in evenly_spaced_windows(held_out, batch, PROMPT_LEN)]
            plain_rate, _, _, plain_outputs = run(model, prompts, 0, temperature)
            baselines = {}  # (S, mtp_attention) -> GPU ms of a step that drafts nothing
            for name, (depths, attention, factory, cost) in candidates.items():
                best = None
                for S in depths:
                    if (S, attention) not in baselines:
                        baselines[S, attention] = run(model, prompts, S, temperature, attention, NoDraftProposer())[2]
                    proposer = None if factory is None else factory(S)
                    rate, accepted, gpu_ms, outputs = run(model, prompts, S, temperature, attention, proposer)
                    point = (rate / plain_rate, S, accepted, gpu_ms - baselines[S, attention], outputs == plain_outputs)
                    if best is None or point[0] > best[0]:
                        best = point
                    print(f"T {temperature} batch {batch} {name} S {S}: {rate:.0f} tokens/s ({rate / plain_rate:.2f}x), "
                          f"accepted {accepted:.2f}, draft GPU {point[3]:.3f} ms", flush=True)
                rows.append((temperature, batch, name, *best, cost))
    print(f"\n{torch.cuda.get_device_name()}; demo GPT, {PROMPT_LEN}-byte prompts, {NEW_TOKENS} new tokens, CUDA graphs; "
          f"each drafter at its best S; median of {REPEATS} runs")
    print("| T | batch | drafter | best S | accepted len | speed-up | draft GPU ms/step | == plain | training cost |")
    print("|---|---|---|---|---|---|---|---|---|")
    for temperature, batch, name, speedup, S, accepted, draft_ms, same, cost in rows:
        print(f"| {temperature:.1f} | {batch} | {name} | {S} | {accepted:.2f} | {speedup:.2f}x | {draft_ms:.3f} | "
              f"{same} | {cost} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
