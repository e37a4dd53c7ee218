"""Drafting-input ops (contracts in docs/kernels.md): eager and CUDA-graph-replayed kernels vs their torch references.

Every request is a decode with S = 3 drafts: 1 + S = 4 rows, a random number of them accepted
(parallel drafting adds K - 1 = 3 draft rows; multi-layer EAGLE keeps MAX_SHIFT = 3 cached rows).
Per op and batch size: the median time of the eager op (``triton.testing.do_bench``), of the op
replayed from a CUDA graph (20 calls captured in one graph; per-call median over replays) and of
its torch reference (eager). The two hidden-row copies (``ptd_prepare_inputs`` hidden rows,
``shift_and_gather_cache_hidden``) also report GB/s (rows read + rows written, from the graph
time) and the share of a same-run device copy of the same bytes (``dst.copy_(src)``, graph-timed).

    python bench/bench_drafting_ops.py            # 1, 8, 64, 256, 1024 requests; H = 4096, 7168 (bf16)
    python bench/bench_drafting_ops.py --quick    # 1, 64, 1024 requests; H = 7168
"""

import argparse
import statistics
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer batch sizes and one hidden size")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help answers before torch loads
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)  # before megatron-core is imported

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from tqdm import tqdm  # noqa: E402

from mtp_ctrl.state.attention_metadata import AttentionMetadata  # noqa: E402
from mtp_ctrl.triton_ops import (  # noqa: E402
    copy_and_expand_eagle_inputs,
    eagle_prepare_inputs_padded,
    eagle_prepare_next_token_padded,
    eagle_step_update_slot_mapping_and_metadata,
    extend_all_queries_by_n,
    ptd_prepare_inputs,
    reference,
    shift_and_gather_cache,
    shift_and_gather_cache_hidden,
)

ROWS = 4  # 1 + S rows per request
NUM_DRAFTS = 4  # K drafts of parallel drafting: K - 1 = 3 draft rows per request
MAX_SHIFT = 3
BLOCK_SIZE, MAX_MODEL_LEN, VOCAB = 16, 8192, 32_000
DEVICE = "cuda"


def _randint(high, size, dtype=torch.int64):
    return torch.randint(0, high, size, device=DEVICE, dtype=dtype)


def _decode_layout(num_requests):
    """``query_start_loc [R + 1]`` of R requests of ROWS rows, and each request's accepted rows [R]."""
    query_start_loc = torch.arange(0, (num_requests + 1) * ROWS, ROWS, device=DEVICE, dtype=torch.int32)
    accepted = torch.randint(1, ROWS + 1, (num_requests,), device=DEVICE, dtype=torch.int32)
    return query_start_loc, accepted


def _positions(num_requests):
    """[R * ROWS] int64: consecutive positions per request, starting below MAX_MODEL_LEN - 64."""
    first = _randint(MAX_MODEL_LEN - 64, (num_requests, 1))
    return (first + torch.arange(ROWS, device=DEVICE)).reshape(-1)


def _block_table(num_requests):
    return _randint(1 << 16, (num_requests, MAX_MODEL_LEN // BLOCK_SIZE), dtype=torch.int32)


def eagle_inputs_args(num_requests):
    query_start_loc, accepted = _decode_layout(num_requests)
    query_end_loc = query_start_loc[:-1] + accepted - 1
    return (_randint(VOCAB, (num_requests * ROWS,)), _positions(num_requests), _randint(VOCAB, (num_requests,)),
            query_start_loc, query_end_loc, 0, VOCAB, 1, True)


def prepare_inputs_args(num_requests):
    query_start_loc, accepted = _decode_layout(num_requests)
    cu_num_draft_tokens = torch.full((num_requests,), ROWS - 1, device=DEVICE, dtype=torch.int32).cumsum(0)
    return cu_num_draft_tokens.to(torch.int32), accepted, query_start_loc


def next_token_args(num_requests):
    sampled = _randint(VOCAB, (num_requests, ROWS))
    _, accepted = _decode_layout(num_requests)
    sampled = torch.where(torch.arange(ROWS, device=DEVICE) < accepted[:, None], sampled, -1)
    discard = torch.zeros(num_requests, dtype=torch.bool, device=DEVICE)
    return sampled, discard, _randint(VOCAB, (num_requests,)), VOCAB


def step_slot_mapping_args(num_requests):
    positions = _randint(MAX_MODEL_LEN - 1, (num_requests,))
    seq_lens = (positions + 1).to(torch.int32)
    return (positions, _block_table(num_requests), seq_lens, BLOCK_SIZE, MAX_MODEL_LEN,
            torch.empty_like(positions), torch.empty_like(positions), num_requests)


def extend_args(num_requests):
    query_start_loc, _ = _decode_layout(num_requests)
    num_rows = num_requests * ROWS
    positions = _positions(num_requests)
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=(positions.view(num_requests, ROWS)[:, -1] + 1).to(torch.int32),
        slot_mapping=_randint(1 << 20, (num_rows,)),
        block_table=_block_table(num_requests),
        positions=positions,
        num_actual_tokens=num_rows,
        max_query_len=ROWS,
        max_seq_len=MAX_MODEL_LEN,
    )
    return metadata, NUM_DRAFTS - 1, _randint(1 << 20, (num_rows + num_requests * (NUM_DRAFTS - 1),))


def ptd_args(num_requests, hidden_size):
    query_start_loc, accepted = _decode_layout(num_requests)
    num_rows = num_requests * ROWS
    out_query_start_loc = torch.zeros(num_requests + 1, device=DEVICE, dtype=torch.int32)
    out_query_start_loc[1:] = (accepted + NUM_DRAFTS - 1).cumsum(0)
    num_output_rows = num_rows + num_requests * (NUM_DRAFTS - 1)
    return (_randint(VOCAB, (num_rows,)), _positions(num_requests),
            torch.randn(num_rows, hidden_size, device=DEVICE, dtype=torch.bfloat16), _randint(1 << 20, (num_rows,)),
            _randint(VOCAB, (num_requests,)), query_start_loc[:-1] + accepted - 1, query_start_loc,
            out_query_start_loc, _block_table(num_requests), BLOCK_SIZE, MAX_MODEL_LEN, VOCAB,
            torch.randn(hidden_size, device=DEVICE, dtype=torch.bfloat16), num_output_rows)


def shift_gather_args(num_requests, hidden_size=None):
    query_start_loc, accepted = _decode_layout(num_requests)
    num_rows = num_requests * ROWS
    cached_lens = torch.full((num_requests,), MAX_SHIFT, device=DEVICE, dtype=torch.int32)
    shifts = (ROWS - accepted).clamp(max=MAX_SHIFT)  # rejected rows shift the window right
    sampled = query_start_loc[:-1] + accepted - 1
    store_starts = torch.maximum(query_start_loc[:-1], sampled + 1 - MAX_SHIFT)
    store_lens = sampled - store_starts + 1
    if hidden_size is None:
        src, cached = _randint(VOCAB, (num_rows,)), _randint(VOCAB, (num_requests, MAX_SHIFT))
    else:
        src = torch.randn(num_rows, hidden_size, device=DEVICE, dtype=torch.bfloat16)
        cached = torch.randn(num_requests, MAX_SHIFT, hidden_size, device=DEVICE, dtype=torch.bfloat16)
    return src, cached, query_start_loc, shifts, cached_lens, store_starts, store_lens


def _graph_us(fn, calls_per_graph=20, replays=15):
    """Median µs per call of ``fn`` captured ``calls_per_graph`` times in one CUDA graph.

    A fixed number of captured calls keeps the graph's memory bounded for ops that allocate
    their outputs (do_bench_cudagraph captures as many calls as fit in its time budget).
    """
    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):
        fn()  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(side_stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / calls_per_graph)
    return statistics.median(times)


def _bench_us(fn, graph):
    if graph:
        return _graph_us(fn)
    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def _copy_us(num_bytes):
    """Graph-timed ``dst.copy_(src)`` moving ``num_bytes`` (half read, half written)."""
    src = torch.empty(num_bytes // 4, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    return _bench_us(lambda: dst.copy_(src), graph=True)


def measure(name, op, args, hidden_bytes=None):
    """One table row: times in µs; for hidden-row copies GB/s and the share of a device copy."""
    reference_op = getattr(reference, op.__name__)
    op(*args)  # compile
    row = dict(
        op=name,
        eager=_bench_us(lambda: op(*args), graph=False),
        graph=_bench_us(lambda: op(*args), graph=True),
        torch=_bench_us(lambda: reference_op(*args), graph=False),
    )
    if hidden_bytes is not None:
        row["gbps"] = hidden_bytes / (row["graph"] * 1e-6) / 1e9
        row["copy_share"] = _copy_us(hidden_bytes) / row["graph"]
    return row


def run(batch_sizes, hidden_sizes):
    rows = []
    progress = tqdm(batch_sizes, desc="batch sizes", unit="size", disable=not sys.stdout.isatty())
    for num_requests in progress:
        point = dict(requests=num_requests, hidden="")
        simple_ops = [
            ("copy_and_expand_eagle_inputs", copy_and_expand_eagle_inputs, eagle_inputs_args(num_requests)),
            ("eagle_prepare_inputs_padded", eagle_prepare_inputs_padded, prepare_inputs_args(num_requests)),
            ("eagle_prepare_next_token_padded", eagle_prepare_next_token_padded, next_token_args(num_requests)),
            ("eagle_step_update_slot_mapping", eagle_step_update_slot_mapping_and_metadata,
             step_slot_mapping_args(num_requests)),
            ("extend_all_queries_by_n", extend_all_queries_by_n, extend_args(num_requests)),
            ("shift_and_gather_cache", shift_and_gather_cache, shift_gather_args(num_requests)),
        ]
        for name, op, args in simple_ops:
            rows.append({**point, **measure(name, op, args)})
        for hidden_size in hidden_sizes:
            point = dict(requests=num_requests, hidden=hidden_size)
            row_bytes = hidden_size * 2  # bf16
            out_rows = num_requests * (ROWS + NUM_DRAFTS - 1)
            rows.append({**point, **measure("ptd_prepare_inputs", ptd_prepare_inputs,
                                            ptd_args(num_requests, hidden_size), 2 * out_rows * row_bytes)})
            moved_rows = num_requests * (ROWS + MAX_SHIFT)  # window rows and refreshed cache rows
            rows.append({**point, **measure("shift_and_gather_cache_hidden", shift_and_gather_cache_hidden,
                                            shift_gather_args(num_requests, hidden_size),
                                            2 * moved_rows * row_bytes)})
        progress.set_postfix_str(f"done: {num_requests} requests")
    return rows


def print_table(rows):
    header = (f"{'op':34s} {'R':>5s} {'H':>5s} {'eager us':>9s} {'graph us':>9s} {'torch us':>9s} "
              f"{'torch/graph':>11s} {'GB/s':>7s} {'of copy':>8s}")
    print(header)
    print("-" * len(header))
    for row in rows:
        bandwidth = f"{row['gbps']:7.0f} {100 * row['copy_share']:7.0f}%" if "gbps" in row else f"{'':7s} {'':8s}"
        print(f"{row['op']:34s} {row['requests']:5d} {str(row['hidden']):>5s} {row['eager']:9.1f} "
              f"{row['graph']:9.1f} {row['torch']:9.1f} {row['torch'] / row['graph']:10.1f}x {bandwidth}")


def main(options=None):
    options = options or parse_args()
    torch.manual_seed(0)
    batch_sizes = [1, 64, 1024] if options.quick else [1, 8, 64, 256, 1024]
    hidden_sizes = [7168] if options.quick else [4096, 7168]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rows = run(batch_sizes, hidden_sizes)
    print()
    print_table(rows)


if __name__ == "__main__":
    main(ARGS)
