"""Host cost of requests joining and leaving: where the wall time of a whole batch goes.

    python bench/bench_join_finish.py [--batch 32] [--new-tokens 96] [--repeats 5] [--verbose]

The shipped demo model generates for ``--batch`` 64-token prompts at S = 0 and S = 2 (decode
runs of 4, CUDA graphs; the requests end at new_tokens, - 8, - 16, - 24 tokens). Per run, the
wall time of every ``controller.step()`` call: the whole run, the call that admits the batch
(its prefill launch included), and the calls in which requests finish (their launches
included). Medians over ``--repeats`` runs; then the torch ops one admission of the whole batch
issues (torch.profiler, the rows' device writes included), each one a launch on the GPU.

To compare two versions of the package in one lease, run it twice with PYTHONPATH pointing at
each (bench/RESULTS.md, "joins and leaves").
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="mtp_ctrl/checkpoints/mtp_demo.pt")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args()


def _admission_ops(controller, prompts, params) -> int:
    """Top-level torch ops of admitting ``prompts`` and writing their rows (then runs them out)."""
    from torch.profiler import ProfilerActivity, profile

    ids = [controller.add_request(prompt, params) for prompt in prompts]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        # internals, on purpose: only admission is profiled (SlotLifecycle since 2026-11-26)
        lifecycle = getattr(controller, "_lifecycle", None)
        lifecycle.admit_waiting() if lifecycle is not None else controller._admit_waiting()
        # what the next build_step does first (versions before 2026-11-25 wrote each row at admission)
        getattr(controller.context.table, "write_inserted_rows", lambda: None)()
    while controller.has_unfinished_requests():
        controller.step()
    for request_id in ids:
        controller.pop_result(request_id)
    return sum(1 for event in prof.events() if event.name.startswith("aten::") and event.cpu_parent is None)


def main():
    args = parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)  # before megatron-core is imported
    import torch
    from byte_corpus import evenly_spaced_windows, load_stdlib_corpus
    from demo_model import build_demo_model, init_distributed, load_checkpoint, load_full_state_dict
    from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU only checks the script
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    init_distributed(1, device)
    model_args, state_dict = load_checkpoint(args.checkpoint)
    model = build_demo_model(model_args)
    load_full_state_dict(model, state_dict)
    model = model.to(device).to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    batch, new_tokens = args.batch, args.new_tokens
    prompts = [window.tolist() for window in evenly_spaced_windows(load_stdlib_corpus().held_out, batch, 64)]
    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}; demo model, batch {batch}, 64-token prompts, {new_tokens} new tokens, "
          f"decode runs of 4; wall ms per run (median of {args.repeats}); package {mtp_ctrl.__file__}")
    print(f"{'S':>2} {'run':>7} {'admit call':>10} {'finish calls':>12} {'tokens/s':>9} {'admission ops':>13}")
    for S in (0, 2):
        config = InferenceConfig(num_speculative_tokens=S, max_requests=batch + 1, block_size_tokens=16,
                                 max_model_len=64 + new_tokens + 16, max_tokens_per_step=(batch + 1) * 64,
                                 cuda_graph_batch_sizes=(batch, batch + 1), decode_steps_per_launch=4)
        controller = TextGenerationController(model, config)
        controller.warmup()
        controller.generate(prompts, SamplingParams(max_new_tokens=new_tokens))  # compile, first replays
        runs, admits, finishes, tokens = [], [], [], []
        for _ in range(args.repeats):
            ids = [controller.add_request(prompt, SamplingParams(max_new_tokens=new_tokens - 8 * (index % 4)))
                   for index, prompt in enumerate(prompts)]
            synchronize()
            calls = []  # (wall seconds, live rows before, live rows after)
            while controller.has_unfinished_requests():
                live = controller.context.table.num_live
                started = time.perf_counter()
                controller.step()
                calls.append((time.perf_counter() - started, live, controller.context.table.num_live))
            runs.append(sum(wall for wall, _, _ in calls))
            admits.append(calls[0][0])
            finishes.append(sum(wall for wall, before, after in calls if after < before))
            tokens.append(sum(len(controller.pop_result(request_id).output_tokens) for request_id in ids))
        ops = _admission_ops(controller, prompts, SamplingParams(max_new_tokens=4))
        controller.close()
        run = statistics.median(runs)
        print(f"{S:>2} {run * 1e3:7.2f} {statistics.median(admits) * 1e3:10.2f} "
              f"{statistics.median(finishes) * 1e3:12.2f} {statistics.median(tokens) / run:9.0f} {ops:>13}")


if __name__ == "__main__":
    main()
