"""Host cost of one decode step's bookkeeping in DynamicInferenceContext, and its one copy.

Every request decodes with S = 3 drafts (4 rows), block_size_tokens = 16. Per batch size B:
``build_step`` (schedule, take blocks, stage, the one host-to-device copy) plus ``prepare_inputs``
(the device half) and ``commit_readback`` (the host learns each request's accepted count) in host
microseconds (median of wall time; every draft is accepted, so the device needs no rewind and its
lengths must equal the host's at the end), the staged bytes per step, and the copy's device time
(CUDA events) against a pageable-memory copy of the same bytes. On a machine without CUDA the
host columns run on the CPU and the copy columns are left out.

    python bench/bench_state.py            # B in 1, 8, 64, 256
    python bench/bench_state.py --quick    # B in 1, 64
"""

import argparse
import statistics
import sys
import time

import numpy as np


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two batch sizes, fewer steps")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help answers before torch loads
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)  # before megatron-core is imported

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from mtp_ctrl.state import DynamicInferenceContext, EngineShape, KVCacheSpec  # noqa: E402

NUM_SPECULATIVE_TOKENS, BLOCK_SIZE_TOKENS, MAX_MODEL_LEN, PROMPT_LEN = 3, 16, 4096, 100


def _device_us(fn, repeats=50):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def bench_batch(batch, steps, device):
    blocks_per_request = -(-(MAX_MODEL_LEN + NUM_SPECULATIVE_TOKENS) // BLOCK_SIZE_TOKENS)
    stride = NUM_SPECULATIVE_TOKENS + 1
    shape = EngineShape(max_requests=batch, max_model_len=MAX_MODEL_LEN, block_size_tokens=BLOCK_SIZE_TOKENS,
                        num_speculative_tokens=NUM_SPECULATIVE_TOKENS, max_tokens_per_step=max(batch * stride, 2048),
                        device=device)
    ctx = DynamicInferenceContext(shape, kv_cache=KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8,
                                                              dtype=torch.bfloat16),
                                  num_blocks=batch * max(blocks_per_request, shape.max_blocks_per_request))
    for request_id in range(batch):
        ctx.add_request(request_id, torch.randint(0, 1000, (PROMPT_LEN,)))
    build_us, commit_us = [], []
    for index in range(steps + 5):
        t0 = time.perf_counter()
        step = ctx.build_step()
        ctx.prepare_inputs(step)
        t1 = time.perf_counter()
        if device == "cuda":
            torch.cuda.synchronize()  # the controller reads the step's results back here
        t2 = time.perf_counter()
        ctx.commit_readback(step, np.full(step.num_decode, NUM_SPECULATIVE_TOKENS, dtype=np.int64))
        t3 = time.perf_counter()
        if index >= 5 and step.num_prefill == 0:  # warm decode steps only
            build_us.append((t1 - t0) * 1e6)
            commit_us.append((t3 - t2) * 1e6)
    assert ctx.table.mismatched_rows() == [], ctx.table.mismatched_rows()
    row = {"batch": batch, "build_us": statistics.median(build_us), "commit_us": statistics.median(commit_us)}
    if device == "cuda":
        staging = ctx._step_buffers.staging  # the step's pinned staging buffers (no public handle: a bench)
        pageable = torch.zeros(staging.nbytes, dtype=torch.uint8)  # same bytes, not pinned
        device_bytes = torch.empty_like(pageable, device="cuda")
        row.update(staged_kib=staging.nbytes / 1024, copy_us=_device_us(staging.copy_to_device),
                   pageable_us=_device_us(lambda: device_bytes.copy_(pageable, non_blocking=True)))
    return row


def main(args=None):
    args = args or parse_args()
    batches, steps = ((1, 64), 30) if args.quick else ((1, 8, 64, 256), 200)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (host columns only)"
    print(f"device: {name}  S = {NUM_SPECULATIVE_TOKENS}, block_size_tokens = {BLOCK_SIZE_TOKENS}, "
          f"max_model_len = {MAX_MODEL_LEN}")
    rows = [bench_batch(batch, steps, device)
            for batch in tqdm(batches, desc="batch sizes", disable=not sys.stdout.isatty())]
    print(f"{'B':>5} {'build+prepare us':>17} {'commit_readback us':>19}"
          + (f" {'staged KiB':>11} {'H2D copy us':>12} {'pageable us':>12}" if device == "cuda" else ""))
    for row in rows:
        line = f"{row['batch']:>5} {row['build_us']:>17.1f} {row['commit_us']:>19.1f}"
        if device == "cuda":
            line += f" {row['staged_kib']:>11.1f} {row['copy_us']:>12.1f} {row['pageable_us']:>12.1f}"
        print(line)


if __name__ == "__main__":
    main(ARGS)
