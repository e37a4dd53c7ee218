"""Mamba-2 prefill of one step: the per-request loop (``causal_conv_chunk`` + ``ssm_chunk_scan``
per request, host row ranges, eager) against the varlen path that a CUDA graph captures
(``causal_conv_varlen`` + ``ssm_varlen_scan`` + ``segment_of_rows`` over the packed rows, device
segments, as the mixer calls them), in two forms: the torch twins
(``mtp_ctrl.triton_ops.reference``, dozens of small ops) and the Triton kernels (three launches).

One Mamba layer's math (no projections), fp32, the sizes of bench_controller's hybrid layers:
32 heads of 64, 8 groups of state 128 (each head's B, C expanded), conv width 4 (4096 conv
channels), scan chunks of 64 rows. Per layout (T packed rows of n requests): milliseconds per
call (CUDA events, median of 5 runs of 10 calls) for the loop, the torch varlen path eagerly and
replayed from a CUDA graph, the Triton path eagerly and replayed, and the torch varlen path's
peak extra memory. Both varlen paths' outputs are compared with the loop's first (max abs
difference, the larger of the two).

A second table times the decode rows of one layer (``mamba_decode_rows``: nd requests of 1 + S
rows, conv + SSM row by row, the state after every row written out): the torch twin (a loop of
torch ops per row) against the Triton kernel, eager and graph-replayed.

    python bench/bench_mamba_prefill.py            # H100: five layouts, three decode batches
    python bench/bench_mamba_prefill.py --quick    # small sizes; runs on CPU too (no graph; the
                                                   # triton column is the twin unless TRITON_INTERPRET=1)
"""

import argparse
import statistics
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU allowed, no CUDA graph there)")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help answers before torch loads
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)  # before megatron-core is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mtp_ctrl import triton_ops  # noqa: E402
from tests.unit.mamba_oracle import causal_conv_chunk, ssm_chunk_scan  # noqa: E402 (the per-request oracle)
from mtp_ctrl.triton_ops import reference  # noqa: E402

# (name, T, [(first row, rows)] of the prefill requests; other rows are decode rows or padding)
LAYOUTS = [
    ("1 prompt x 2048", 2048, [(0, 2048)]),
    ("8 prompts x 256", 2048, [(256 * i, 256) for i in range(8)]),
    ("64 chunks x 32", 2048, [(32 * i, 32) for i in range(64)]),
    ("mixed: 8 decodes x 3 + 40", 64, [(24, 40)]),
    ("mixed: 8 decodes x 3 + 64", 88, [(24, 64)]),
]
QUICK_LAYOUTS = [("1 x 40", 64, [(0, 40)]), ("3 x 13 + decodes", 64, [(9, 13), (22, 13), (35, 13)])]


def make_inputs(num_rows, heads, head_dim, state_size, channels, width, device, generator):
    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator, device=device) * scale
    return dict(x=rand(num_rows, heads, head_dim), dt=F.softplus(rand(num_rows, heads) - 2),
                A=-torch.rand(heads, generator=generator, device=device) * 4 - 0.1,
                B=rand(num_rows, heads, state_size, scale=0.1), C=rand(num_rows, heads, state_size, scale=0.1),
                D=rand(heads), conv_in=rand(num_rows, channels), weight=rand(channels, width, scale=0.5),
                bias=rand(channels))


def per_request(inputs, windows, states, segments, chunk_size):
    """The reference: one conv and one scan per prefill request, host row ranges."""
    y, conv_out = torch.zeros_like(inputs["x"]), torch.zeros_like(inputs["conv_in"])
    for g, (start, count) in enumerate(segments):
        rows = slice(start, start + count)
        conv_out[rows], _ = causal_conv_chunk(windows[g], inputs["conv_in"][rows], inputs["weight"], inputs["bias"])
        y[rows], _ = ssm_chunk_scan(states[g], inputs["x"][rows], inputs["dt"][rows], inputs["A"], inputs["B"][rows],
                                    inputs["C"][rows], inputs["D"], chunk_size)
    return y, conv_out


def varlen(ops, inputs, windows, states, row_start, row_count, chunk_size):
    """One layer's varlen prefill through ``ops`` (the Triton ops or their torch twins)."""
    conv_out, _ = ops.causal_conv_varlen(windows, inputs["conv_in"], row_start, row_count, inputs["weight"],
                                         inputs["bias"])
    y, _ = ops.ssm_varlen_scan(states, inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], inputs["D"],
                               row_start, row_count, chunk_size)
    ops.segment_of_rows(row_start, row_count, conv_out.shape[0])  # the mixer's `inside` mask
    return y, conv_out


def graph_ms(fn, device):
    """Milliseconds per replay of ``fn`` captured in a CUDA graph (nan off CUDA)."""
    if device.type != "cuda":
        return float("nan")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up (and Triton compiles) off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, device)


def time_ms(fn, device):
    if device.type != "cuda":
        import time
        fn()  # warm-up
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - start) * 1e3)
        return statistics.median(runs)
    fn()
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) / 10)
    return statistics.median(runs)


def bench_layout(name, num_rows, segments, sizes, chunk_size, device):
    heads, head_dim, state_size, channels, width = sizes
    generator = torch.Generator(device=device).manual_seed(0)
    inputs = make_inputs(num_rows, heads, head_dim, state_size, channels, width, device, generator)
    # one segment per grid request as the controller lays them out: 0-row segments for the rest
    starts, counts, row = [], [], 0
    for start, count in segments:
        if start > row:
            starts.append(row)
            counts.append(0)
        starts.append(start)
        counts.append(count)
        row = start + count
    starts.append(row)
    counts.append(0)  # the padding request
    row_start = torch.tensor(starts, device=device)
    row_count = torch.tensor(counts, device=device)
    n = row_start.shape[0]
    windows = torch.randn(n, channels, width - 1, generator=generator, device=device)
    states = torch.randn(n, heads, head_dim, state_size, generator=generator, device=device) * 0.1
    prefill = [g for g in range(n) if counts[g] > 0]
    loop_windows, loop_states = windows[prefill], states[prefill]

    with torch.no_grad():
        want_y, want_conv = per_request(inputs, loop_windows, loop_states, segments, chunk_size)
        inside = torch.zeros(num_rows, dtype=torch.bool, device=device)  # rows outside: unspecified conv output
        for start, count in segments:
            inside[start:start + count] = True
        error = 0.0
        for ops in (reference, triton_ops):
            got_y, got_conv = varlen(ops, inputs, windows, states, row_start, row_count, chunk_size)
            error = max(error, (want_y - got_y).abs().max().item(),
                        (want_conv - got_conv)[inside].abs().max().item())
        loop_ms = time_ms(lambda: per_request(inputs, loop_windows, loop_states, segments, chunk_size), device)
        def torch_path():
            return varlen(reference, inputs, windows, states, row_start, row_count, chunk_size)

        def triton_path():
            return varlen(triton_ops, inputs, windows, states, row_start, row_count, chunk_size)

        torch_ms, triton_ms = time_ms(torch_path, device), time_ms(triton_path, device)
        peak_mib = float("nan")
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            torch_path()
            torch.cuda.synchronize()
            peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
        torch_graph_ms, triton_graph_ms = graph_ms(torch_path, device), graph_ms(triton_path, device)
    print(f"{name:>28} {num_rows:>6} {len(segments):>4} {loop_ms:>10.3f} {torch_ms:>10.3f} {torch_graph_ms:>10.3f} "
          f"{triton_ms:>10.3f} {triton_graph_ms:>10.3f} {peak_mib:>9.1f} {error:>10.2e}")


DECODE_BATCHES = [(1, 3), (8, 3), (32, 3)]  # (decode requests, 1 + S rows each)
QUICK_DECODE_BATCHES = [(2, 3)]


def bench_decode(num_requests, rows_per_request, sizes, device):
    heads, head_dim, state_size, channels, width = sizes
    generator = torch.Generator(device=device).manual_seed(1)
    num_slots = num_requests + 1
    num_rows = num_requests * rows_per_request
    inputs = make_inputs(num_rows, heads, head_dim, state_size, channels, width, device, generator)
    states = dict(conv=torch.randn(1, num_slots, channels, width - 1, generator=generator, device=device),
                  ssm=torch.randn(1, num_slots, heads, head_dim, state_size, generator=generator,
                                  device=device) * 0.1,
                  inter_conv=torch.zeros(1, num_slots, rows_per_request, channels, width - 1, device=device),
                  inter_ssm=torch.zeros(1, num_slots, rows_per_request, heads, head_dim, state_size, device=device))
    slot_ids = torch.randperm(num_slots, generator=generator, device=device)[:num_requests]

    def run(ops):
        return ops.mamba_decode_rows(states["conv"], states["ssm"], states["inter_conv"], states["inter_ssm"], 0,
                                     slot_ids, inputs["conv_in"], inputs["dt"], inputs["weight"], inputs["bias"],
                                     inputs["A"], inputs["D"])

    with torch.no_grad():
        error = (run(reference) - run(triton_ops)).abs().max().item()
        torch_ms, triton_ms = time_ms(lambda: run(reference), device), time_ms(lambda: run(triton_ops), device)
        torch_graph_ms = graph_ms(lambda: run(reference), device)
        triton_graph_ms = graph_ms(lambda: run(triton_ops), device)
    print(f"{num_requests:>10} {rows_per_request:>6} {torch_ms:>10.3f} {torch_graph_ms:>10.3f} {triton_ms:>10.3f} "
          f"{triton_graph_ms:>10.3f} {error:>10.2e}")


def main():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not ARGS.quick:
        print("bench_mamba_prefill: needs a CUDA GPU (or --quick for a CPU smoke run)")
        return 0
    if ARGS.quick:
        sizes, chunk_size, layouts = (4, 16, 16, 4 * 16 + 2 * 2 * 16, 4), 16, QUICK_LAYOUTS
    else:
        sizes, chunk_size, layouts = (32, 64, 128, 32 * 64 + 2 * 8 * 128, 4), 64, LAYOUTS
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; heads x head_dim x state "
          f"= {sizes[0]} x {sizes[1]} x {sizes[2]}, conv channels {sizes[3]}, chunk {chunk_size}; ms per call")
    header = ("layout", "T", "n", "loop", "varlen", "graph", "triton", "tri graph", "peak MiB", "max diff")
    print(" ".join(f"{name:>{width}}" for name, width in zip(header, (28, 6, 4, 10, 10, 10, 10, 10, 9, 10))))
    for name, num_rows, segments in layouts:
        bench_layout(name, num_rows, segments, sizes, chunk_size, device)
    print("\ndecode rows of one layer (mamba_decode_rows); ms per call")
    header = ("requests", "rows", "torch", "graph", "triton", "tri graph", "max diff")
    print(" ".join(f"{name:>{width}}" for name, width in zip(header, (10, 6, 10, 10, 10, 10, 10))))
    heads, head_dim, state_size = sizes[:3]
    groups = (sizes[3] - heads * head_dim) // (2 * state_size)
    if groups < 1 or heads % groups:
        raise SystemExit(f"bench_mamba_prefill: conv channels {sizes[3]} do not hold x, B and C")
    for num_requests, rows_per_request in (QUICK_DECODE_BATCHES if ARGS.quick else DECODE_BATCHES):
        bench_decode(num_requests, rows_per_request, sizes, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
