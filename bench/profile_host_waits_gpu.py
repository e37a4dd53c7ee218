"""Issue 34: does the loop wait for the GPU where it should not? The wall-GPU gap of some engines
(H100, demo batch 32: fixed S = 1 0.43 ms a step, the S = 2 engine at D = 0 or 1 0.24-0.26, plain
0.05, D = S = 2 0.12) is not host work on the CPU (equal host profiles): look for waits.

    python bench/profile_host_waits_gpu.py [--batch 32] [--quick]

Per engine (plain; fixed S = 1; fixed S = 2; the S = 2 engine pinned at D = 0, then at D = 1), one
generate after a warm one, under ``torch.profiler`` (CPU and CUDA activities): per step, the CUDA
runtime calls that wait or allocate (``cudaStreamSynchronize``, ``cudaEventSynchronize``,
``cudaDeviceSynchronize``, ``cudaMemcpy`` not async, ``cudaMalloc``, ``cudaFree``,
``cudaHostAlloc``) and their microseconds, and the syncs ``torch.cuda.set_sync_debug_mode("warn")``
reports, with where the first one came from. The loop's one intended wait is the read-back's
``cudaEventSynchronize`` (one a launch).
"""

import argparse
import collections
import os
import sys
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mtp_ctrl  # noqa: E402

WAITS = ("Synchronize", "cudaMemcpy", "cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaMallocHost")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="CPU, batch 4, 8 tokens (a smoke run)")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args()
    mtp_ctrl.quiet_known_warnings(args.verbose)
    from bench_adaptive import PROMPT_LEN, engine
    from mtp_ctrl.cli.byte_corpus import evenly_spaced_windows, load_stdlib_corpus
    from mtp_ctrl.controllers import SamplingParams
    from mtp_ctrl.controllers.draft_policy import DraftLengthPolicy

    class Pinned(DraftLengthPolicy):  # every request drafts `depth` (the S = 2 engine at D < S)
        decide_every, longest_hold = 8, 64

        def __init__(self, depth):
            super().__init__()
            self.depth = depth

        def choose(self, query):
            return np.minimum(query.caps, self.depth)

    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    mtp_ctrl.init_single_process(device)
    batch, new_tokens = (4, 8) if args.quick else (args.batch, args.new_tokens)
    model = mtp_ctrl.load_demo_model(device=device)
    prompts = [w.tolist() for w in evenly_spaced_windows(load_stdlib_corpus().held_out, batch, PROMPT_LEN)]
    params = SamplingParams(max_new_tokens=new_tokens)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    print(f"{torch.cuda.get_device_name() if cuda else 'CPU'}; demo batch {batch}, {new_tokens} tokens, greedy")
    for label, S, policy in (("plain", 0, None), ("fixed S = 1", 1, None), ("fixed S = 2", 2, None),
                             ("S = 2 engine, D = 0", 2, Pinned(0)), ("S = 2 engine, D = 1", 2, Pinned(1))):
        controller = engine(model, S, batch, PROMPT_LEN + new_tokens + 8, policy, device=device.type)
        controller.generate(prompts, params)
        controller.metrics.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with torch.profiler.profile(activities=activities) as profile:
                    controller.generate(prompts, params)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        times = controller.metrics.as_dict()["step_time"]
        steps = max(times["steps"], 1)
        waits = collections.defaultdict(lambda: [0, 0.0])
        for event in profile.events():
            if any(name in event.name for name in WAITS) and "Async" not in event.name:
                waits[event.name][0] += 1
                waits[event.name][1] += event.cpu_time_total
        syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
        gpu = "-" if times["mean_gpu_ms"] is None else f"{times['mean_gpu_ms']:.3f}"
        print(f"  {label}: {steps} steps, wall {times['mean_step_ms']:.3f} / GPU {gpu} ms a step (under the "
              f"profiler); per step: " + (", ".join(f"{name} {count / steps:.2f}x {us / steps:.0f} us"
                                                    for name, (count, us) in sorted(waits.items())) or "no waits")
              + f"; sync warnings {len(syncs)}", flush=True)
        for warning in syncs[:2]:
            print(f"    first sync warning: {warning.filename}:{warning.lineno}: {str(warning.message)[:160]}")
        controller.close()


if __name__ == "__main__":
    main()
