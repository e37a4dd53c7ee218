"""MTP step bookkeeping (verify, prepare-next-forward, KV rewind, fused) and the Mamba state commit.

Bookkeeping: a decode batch of N requests with S = 3 drafts each, block size 16, about 70% of
drafts accepted. Every figure is a median over 7 timings after warm-up:
  eager  - what a caller pays per call: host wall clock over 200 back-to-back calls from Python,
           synchronised at the end, divided by 200 (argument checks, allocation, the launch, and
           the GPU time where that is longer). Repeated calls have one argument signature, so
           verify_and_commit's checks are a cache hit, as in a serving loop;
  graph  - 100 calls captured in one CUDA graph, CUDA events around one replay, divided by 100
           (the cost of the op inside the step's graph).
The torch reference is the three reference ops in a row, eager. Repeated calls keep rewinding
the same KV state; the kernels' cost does not depend on those values.

Mamba commit: all N requests decode; L = 8 layers; an SSM state of 64 heads x 64 x 128 in fp32
and a conv state of 4 x (2 * 4096 + 2 * 128) in bf16, each committed by its own call. GB/s
counts bytes read + written; the comparison is ``dst.copy_(src)`` of the same byte count in the
same run. Both are timed from CUDA graphs (10 calls per graph).

    python bench/bench_step_ops.py            # N in 1, 8, 64, 256, 1024
    python bench/bench_step_ops.py --quick    # fewer points
"""

import argparse
import statistics
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer points")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help answers before torch loads
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)  # before megatron-core is imported

import torch  # noqa: E402
import triton  # noqa: E402
from tqdm import tqdm  # noqa: E402

from mtp_ctrl.triton_ops import (  # noqa: E402
    mamba_state_selective_copy,
    prepare_next_forward_pass,
    reference,
    rewind_kv_cache,
    verify_and_commit,
    verify_speculative_tokens,
)
from mtp_ctrl.triton_ops.fused_step import StepCommit  # noqa: E402

NUM_SPEC, BLOCK_SIZE, ACCEPT_PROB = 3, 16, 0.7
MAMBA_LAYERS = 8
MAMBA_STATES = {  # name -> (state shape, dtype)
    "ssm fp32 64x64x128": ((64, 64, 128), torch.float32),
    "conv bf16 4x8448": ((4, 2 * 4096 + 2 * 128), torch.bfloat16),
}
MAMBA_MEMORY_BUDGET = 40 << 30  # bytes of intermediate + current + copy buffers per point


def _median_event_us(run, calls, repeats=7):
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def eager_us(fn, calls=200, repeats=7):
    """Host wall-clock us per call of ``calls`` eager calls, with one synchronisation at the end."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6 / calls)
    return statistics.median(times)


def graph_us(fn, calls=100):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return _median_event_us(graph.replay, calls)


def _step_inputs(num_requests, max_blocks=64):
    """Packed decode rows, caller buffers and KV bookkeeping of ``num_requests`` decode requests."""
    stride = NUM_SPEC + 1
    num_rows = num_requests * stride
    output_tokens = torch.randint(0, 32000, (num_rows,), device="cuda")  # [T] int64
    input_tokens = torch.randint(0, 32000, (num_rows,), device="cuda")  # [T] int64
    copied = torch.rand(num_rows, device="cuda") < ACCEPT_PROB
    copied[::stride] = False  # row 0 of a request is its base token
    input_tokens[1:] = torch.where(copied[1:], output_tokens[:-1], input_tokens[1:])
    required_logit_indices = torch.arange(num_rows, device="cuda")  # [T] int64
    buffers = [
        torch.zeros(num_requests, dtype=torch.int64, device="cuda"),  # sampled_tokens_buf [N]
        torch.zeros(num_requests, dtype=torch.int64, device="cuda"),  # last_accepted_seq_buf [N]
        torch.zeros(num_requests, NUM_SPEC, dtype=torch.int64, device="cuda"),  # accepted tokens [N, S]
        torch.zeros(num_requests, dtype=torch.int64, device="cuda"),  # accepted_token_counts [N]
    ]
    kv_len = torch.randint(NUM_SPEC + 1, max_blocks * BLOCK_SIZE, (num_requests,), device="cuda")  # [N]
    counts = (kv_len - 1) // BLOCK_SIZE + 1  # [N]
    block_ids = torch.arange(num_requests * max_blocks, device="cuda").view(num_requests, max_blocks)
    block_ids = torch.where(torch.arange(max_blocks, device="cuda") < counts[:, None], block_ids, -1)
    last_id = block_ids.gather(1, (counts - 1)[:, None]).squeeze(1)
    kv_state = [(kv_len - 1) % BLOCK_SIZE, kv_len, counts, last_id, block_ids]
    return (input_tokens, output_tokens, required_logit_indices), buffers, kv_state


def bench_bookkeeping(num_requests):
    (input_tokens, output_tokens, required), buffers, kv_state = _step_inputs(num_requests)
    prefill_status = torch.zeros(num_requests, dtype=torch.int32, device="cuda")  # [N]: all decode
    num_active = torch.tensor([num_requests], device="cuda")  # read by the kernels, as from a graph
    last_one, mask, tokens = verify_speculative_tokens(input_tokens, output_tokens, num_requests, 0, NUM_SPEC)
    out = StepCommit(torch.empty_like(last_one), torch.empty_like(mask),
                     torch.empty_like(kv_state[3]), torch.empty(num_requests, dtype=torch.bool, device="cuda"))

    def verify():
        return verify_speculative_tokens(input_tokens, output_tokens, num_requests, 0, NUM_SPEC)

    def prepare():
        prepare_next_forward_pass(num_requests, output_tokens, required, last_one, mask, tokens, *buffers, NUM_SPEC)

    def rewind():
        return rewind_kv_cache(buffers[3], prefill_status, *kv_state, NUM_SPEC, BLOCK_SIZE, num_active)

    def three_ops(ops=(verify_speculative_tokens, prepare_next_forward_pass, rewind_kv_cache), active=num_active):
        verify_op, prepare_op, rewind_op = ops
        step_last, step_mask, step_tokens = verify_op(input_tokens, output_tokens, num_requests, 0, NUM_SPEC)
        prepare_op(num_requests, output_tokens, required, step_last, step_mask, step_tokens, *buffers, NUM_SPEC)
        return rewind_op(buffers[3], prefill_status, *kv_state, NUM_SPEC, BLOCK_SIZE, active)

    def reference_ops():
        ops = (reference.verify_speculative_tokens, reference.prepare_next_forward_pass, reference.rewind_kv_cache)
        return three_ops(ops, num_requests)

    def fused():
        return verify_and_commit(input_tokens, output_tokens, required, *buffers, *kv_state, num_requests, 0,
                                 NUM_SPEC, BLOCK_SIZE, num_active, out)

    return dict(verify=eager_us(verify), prepare=eager_us(prepare), rewind=eager_us(rewind),
                three_graph=graph_us(three_ops), fused_eager=eager_us(fused), fused_graph=graph_us(fused),
                reference=eager_us(reference_ops))


def bench_mamba(num_requests, state_shape, dtype):
    """(commit GB/s, copy GB/s) or None when the point does not fit the memory budget."""
    state_bytes = torch.Size(state_shape).numel() * dtype.itemsize
    slot_bytes = MAMBA_LAYERS * state_bytes  # one request's state over all layers
    needed = num_requests * slot_bytes * (NUM_SPEC + 1 + 1 + 2)  # intermediate, current, copy src + dst
    if needed > MAMBA_MEMORY_BUDGET:
        return None
    intermediate = torch.randn((MAMBA_LAYERS, num_requests, NUM_SPEC + 1) + state_shape, device="cuda").to(dtype)
    current = torch.empty((MAMBA_LAYERS, num_requests) + state_shape, dtype=dtype, device="cuda")
    prefill_status = torch.zeros(num_requests, dtype=torch.int32, device="cuda")  # [N]: all decode
    state_idx = torch.randperm(num_requests, device="cuda")  # [N] int64
    accepted = torch.randint(0, NUM_SPEC + 1, (num_requests,), device="cuda")  # [N] int64
    moved = 2 * num_requests * slot_bytes  # read + write
    commit_us = graph_us(lambda: mamba_state_selective_copy(intermediate, current, prefill_status, state_idx,
                                                            accepted, MAMBA_LAYERS), calls=10)
    del intermediate, current
    src = torch.empty(num_requests * slot_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_us = graph_us(lambda: dst.copy_(src), calls=10)
    del src, dst
    torch.cuda.empty_cache()
    return moved / commit_us / 1e3, moved / copy_us / 1e3


def main(args=None):
    args = args or parse_args()
    sizes = [1, 64, 1024] if args.quick else [1, 8, 64, 256, 1024]
    mamba_sizes = [8, 64] if args.quick else sizes

    progress = tqdm(total=len(sizes) + len(MAMBA_STATES) * len(mamba_sizes), desc="points", unit="point",
                    disable=not sys.stdout.isatty())
    bookkeeping = {}
    for num_requests in sizes:
        bookkeeping[num_requests] = bench_bookkeeping(num_requests)
        progress.set_postfix_str(f"bookkeeping N={num_requests}")
        progress.update()
    mamba = {}
    for name, (state_shape, dtype) in MAMBA_STATES.items():
        for num_requests in mamba_sizes:
            mamba[name, num_requests] = bench_mamba(num_requests, state_shape, dtype)
            progress.set_postfix_str(f"mamba {name} N={num_requests}")
            progress.update()
    progress.close()

    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"S = {NUM_SPEC}, block size {BLOCK_SIZE}, decode-only batches")
    print("times in us per call; eager = host wall clock from Python (sync at the end); "
          "graph = 100 calls captured in one graph, one replay")
    print("targets (H100): fused graph <= 4 us, fused eager <= 30 us, Mamba commit >= 90% of copy")
    header = ["N", "verify", "prepare", "rewind", "3 ops graph", "fused eager", "fused graph", "torch ref"]
    print("".join(f"{h:>13}" for h in header))
    for num_requests, t in bookkeeping.items():
        values = [t["verify"], t["prepare"], t["rewind"], t["three_graph"], t["fused_eager"], t["fused_graph"],
                  t["reference"]]
        print(f"{num_requests:>13}" + "".join(f"{v:13.1f}" for v in values))
    print(f"\nMamba commit, L = {MAMBA_LAYERS}, S = {NUM_SPEC}; GB/s of bytes read + written, from CUDA graphs")
    print(f"{'state':>20}{'N':>6}{'commit GB/s':>13}{'copy GB/s':>11}{'% copy':>8}")
    for (name, num_requests), result in mamba.items():
        if result is None:
            print(f"{name:>20}{num_requests:>6}  skipped: over the {MAMBA_MEMORY_BUDGET >> 30} GiB memory budget")
            continue
        commit_gbps, copy_gbps = result
        print(f"{name:>20}{num_requests:>6}{commit_gbps:13.0f}{copy_gbps:11.0f}{100 * commit_gbps / copy_gbps:7.0f}%")


if __name__ == "__main__":
    main(ARGS)
