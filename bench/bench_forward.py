"""One decode forward of a paged megatron GPT: fused layer glue and fused rope + KV write against megatron's own.

Model (default): 16 layers, hidden 2048, ffn 8192, 16 query heads over 4 KV groups (D = 128),
2 MTP layers, vocab 32000, bf16, megatron-core's local layers (944M parameters); ``--quick``: a
2-layer toy. Batch: B requests x (1 + S) rows (a verify of S drafts) at ``--context`` tokens each
(the step's rows included), KV caches filled with noise. Paths, all on the same weights:

- ``glue``: ``PagedGPTRunner(fused_rope=True, fused_glue=True)`` (the default): rope inside the KV
  write, and each layer's bias / residual / norm / activation / QKV-split glue as Triton kernels;
- ``rope``: ``fused_rope=True, fused_glue=False``: rope fused, megatron's element-wise glue;
- ``unfused``: ``fused_rope=False, fused_glue=False``: megatron's rotary and glue.

Per point, path and call:

- kernels: GPU kernel events of one eager call under torch.profiler (memcpy/memset apart);
- k/layer: kernels of one decoder layer alone (layer 0 replayed with its captured inputs);
- graph us: median GPU time of the call replayed from a CUDA graph (``--replays`` replays);
- floor us: bytes the call must read from HBM (weights of the layers it runs + the output
  layer, and the K/V of every context token in those layers; embedding rows ignored) over a
  same-run device-to-device copy's bandwidth (1 GiB, counted read + write).

Two calls per point: ``forward`` (decoder over B(1 + S) rows, logits of every row) and ``mtp``
(one MTP depth over the same rows). "same tokens" compares each path's greedy tokens with the
``unfused`` path. In bf16 a few rows can differ; for each differing row the bench prints the
unfused path's top-2 logit margin and the largest logit difference between the two paths on that
row: a margin within that difference (often 0, an exact bf16 tie) is a near-tie that rounding
decides, not a bug.

    python bench/bench_forward.py                      # H100: B = 1, 8, 32 and S = 0, 2
    python bench/bench_forward.py --quick              # toy model, few points
    python bench/bench_forward.py --quick --device cpu # smoke test: eager wall time, no profiler
    python bench/bench_forward.py --megatron-fusions   # also megatron's bias/residual fusions in the megatron paths
"""

import argparse
import os
import socket
import statistics
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer toy model and fewer points")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--context", type=int, default=None, help="tokens per request (default 1024; quick 64)")
    parser.add_argument("--block-size", type=int, default=64, help="KV block size in tokens")
    parser.add_argument("--replays", type=int, default=50, help="CUDA-graph replays per timing")
    parser.add_argument("--megatron-fusions", action="store_true",
                        help="config.bias_activation_fusion and bias_dropout_fusion (torch.compile'd element-wise glue)")
    parser.add_argument("--kernel-table", action="store_true",
                        help="only B = 1, S = 0, the default path: GPU time per kernel name inside a graph replay")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help answers before torch loads
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)  # before megatron-core is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from mtp_ctrl.models import PagedGPTRunner, build_gpt_model  # noqa: E402
from mtp_ctrl.state import KVCacheSpec  # noqa: E402
from mtp_ctrl.state.attention_metadata import AttentionMetadata  # noqa: E402

FULL_MODEL = dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16,
                  num_query_groups=4, mtp_num_layers=2, vocab_size=32000)
QUICK_MODEL = dict(num_layers=2, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8,
                   num_query_groups=2, mtp_num_layers=2, vocab_size=512)


def init_single_process(device: torch.device) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def build_model(shape: dict, device: torch.device, max_sequence_length: int, megatron_fusions: bool = False):
    fields = {name: value for name, value in shape.items() if name != "vocab_size"}
    if megatron_fusions:  # megatron's torch.compile'd bias+GeLU and bias+dropout+residual (its jit_fuser)
        fields.update(bias_activation_fusion=True, bias_dropout_fusion=True)
    dtype = torch.bfloat16
    config = TransformerConfig(**fields, hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=dtype,
                               use_cpu_initialization=device.type != "cuda")
    if device.type == "cuda":  # megatron draws GPU weights from its own RNG tracker
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    model = build_gpt_model(config, shape["vocab_size"], max_sequence_length, use_transformer_engine=False)
    return model.to(device).eval()


def decode_batch(batch, rows_per_request, context, block_size_tokens, device):
    """Metadata of B requests x (1 + S) rows at positions ``context - 1 - S .. context - 1``, disjoint blocks."""
    blocks_per_request = -(-context // block_size_tokens)
    block_table = torch.arange(batch * blocks_per_request, dtype=torch.int32).view(batch, blocks_per_request)  # [B, n]
    positions = torch.arange(context - rows_per_request, context).repeat(batch)  # [T] int64
    request_of_row = torch.arange(batch).repeat_interleave(rows_per_request)  # [T]
    slots = block_table[request_of_row, positions // block_size_tokens].long() * block_size_tokens \
        + positions % block_size_tokens  # [T] int64
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(0, (batch + 1) * rows_per_request, rows_per_request, dtype=torch.int32).to(device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        slot_mapping=slots.to(device), block_table=block_table.to(device), positions=positions.to(device),
        num_actual_tokens=batch * rows_per_request, max_query_len=rows_per_request, max_seq_len=context,
    )
    return metadata, batch * blocks_per_request


def count_gpu_events(fn):
    """(kernels, memcpy + memset) GPU events of one eager call of ``fn``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [event.name for event in prof.events() if event.device_type == DeviceType.CUDA]
    memory_ops = sum(1 for name in names if name.startswith(("Memcpy", "Memset")))
    return len(names) - memory_ops, memory_ops


def graph_time_us(fn, replays):
    """Median GPU time of ``fn`` replayed from a CUDA graph (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for _ in range(3):
        graph.replay()
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = [1e3 * start.elapsed_time(end) for start, end in zip(starts, ends)]
    del graph
    return statistics.median(times)


def graph_replay_kernels(fn, replays):
    """The GPU events of ``replays`` replays of ``fn`` captured in a CUDA graph (warmed up on a side
    stream first), under torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    del graph
    return [event for event in prof.events() if event.device_type == DeviceType.CUDA]


def kernel_table(fn, replays=20, top=25):
    """Kernel names, launches and GPU us per call, summed over ``replays`` graph replays under
    torch.profiler; also the replay's span, so the idle time between kernels shows (their sum vs
    the span)."""
    events = graph_replay_kernels(fn, replays)
    if not events:
        print("  the profiler saw no kernels inside graph replays")
        return
    by_name = {}
    for event in events:
        count, total = by_name.get(event.name, (0, 0.0))
        by_name[event.name] = (count + 1, total + event.device_time)
    busy = sum(total for _, total in by_name.values()) / replays
    span = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / replays
    print(f"  kernels per replay {len(events) / replays:.0f}, kernel time {busy:.1f} us, replay span ~{span:.1f} us "
          f"(idle between kernels ~{span - busy:.1f} us)")
    for name, (count, total) in sorted(by_name.items(), key=lambda item: -item[1][1])[:top]:
        print(f"  {total / replays:8.1f} us {count / replays:5.0f}x  {name[:110]}")


def eager_time_us(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - begin))
    return statistics.median(times)


def copy_bandwidth(device):
    """Bytes per second of a 1 GiB device-to-device copy (read + write), from a CUDA graph."""
    num_bytes = 1 << 30
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = graph_time_us(lambda: dst.copy_(src), replays=20) * 1e-6
    del src, dst
    return 2 * num_bytes / seconds


def param_bytes(module) -> int:
    return sum(parameter.numel() * parameter.element_size() for parameter in module.parameters())


def floor_bytes(model, runner, batch, context, kv_bytes_per_token_layer):
    """HBM bytes a forward and one MTP depth must read: weights they use + the K/V they attend over."""
    output_weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights \
        else model.output_layer.weight
    output_bytes = output_weight.numel() * output_weight.element_size()
    decoder = param_bytes(model.decoder) + output_bytes \
        + runner.num_decoder_layers * batch * context * kv_bytes_per_token_layer
    mtp = None
    if runner.mtp_num_layers:
        mtp = param_bytes(model.mtp.layers[0]) + output_bytes + batch * context * kv_bytes_per_token_layer
    return decoder, mtp


def decoder_layer_kernels(runner, token_ids, metadata, caches):
    """Kernels (GPU events, memcpy/memset apart) of decoder layer 0 alone: its inputs are captured
    during one forward, then the layer runs again on them under the profiler, inside the same paged
    forward context (it rewrites the same K/V slots with the same values)."""
    from mtp_ctrl.models.forward_context import paged_forward_context

    layer = runner.model.decoder.layers[0]
    captured = {}

    def capture(module, args, kwargs):
        captured.update(args=args, kwargs=kwargs)

    handle = layer.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        runner.forward(token_ids, metadata.positions, metadata, caches)
    finally:
        handle.remove()
    _, rotary = runner.rotary_tables(metadata.positions)

    def call():
        with torch.no_grad(), paged_forward_context(metadata, caches, None, rotary, fused_glue=runner.fused_glue):
            layer(*captured["args"], **captured["kwargs"])

    call()
    return count_gpu_events(call)[0]


def diagnose_token_mismatch(label, reference_logits, logits, max_rows=8):
    """Rows whose greedy token differs from the reference path's, one line each (up to max_rows).

    Per row: the reference's top-2 margin, the reference's gap between the two paths' tokens, and
    that row's largest |logit difference| between the paths. The verdict compares the gap with the
    paths' typical disagreement (the median over all rows of that largest difference): a gap
    within twice of it is a near-tie that rounding decides; a larger one deserves a look."""
    reference_logits, logits = reference_logits.float(), logits.float()  # [T, V] fp32
    differs = (reference_logits.argmax(-1) != logits.argmax(-1)).nonzero().flatten().tolist()
    if not differs:
        return
    top2 = reference_logits.topk(2, dim=-1).values  # [T, 2]
    margins = top2[:, 0] - top2[:, 1]  # [T]
    row_differences = (reference_logits - logits).abs().amax(-1)  # [T]
    noise = row_differences.median().item()
    print(f"  {label}: {len(differs)} of {logits.shape[0]} rows differ; over all rows: median top-2 margin "
          f"{margins.median().item():.4f}, median max |logit diff| {noise:.4f}")
    for row in differs[:max_rows]:
        reference_token, token = int(reference_logits[row].argmax()), int(logits[row].argmax())
        gap = (reference_logits[row, reference_token] - reference_logits[row, token]).item()
        verdict = "near-tie (rounding)" if gap <= 2 * noise else "LARGE GAP: check"
        print(f"    row {row}: tokens {reference_token} vs {token}, reference top-2 margin {margins[row].item():.4f}, "
              f"reference gap between the two tokens {gap:.4f}, max |logit diff| {row_differences[row].item():.4f}: "
              f"{verdict}")


PATHS = {"glue": dict(fused_rope=True, fused_glue=True), "rope": dict(fused_rope=True, fused_glue=False),
         "unfused": dict(fused_rope=False, fused_glue=False)}


def main():
    args = ARGS
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --quick --device cpu for the CPU smoke test")
    gpu = device.type == "cuda"
    shape = QUICK_MODEL if args.quick else FULL_MODEL
    context = args.context or (64 if args.quick else 1024)
    batches, drafts = ((1, 8) if args.quick else (1, 8, 32)), (0, 2)

    init_single_process(device)
    model = build_model(shape, device, max_sequence_length=max(4096, context),
                        megatron_fusions=args.megatron_fusions)
    runners = {path: PagedGPTRunner(model, **flags) for path, flags in PATHS.items()}
    reference_path = "unfused"
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    spec = KVCacheSpec(num_layers=runners["glue"].num_kv_layers, num_kv_heads=shape["num_query_groups"],
                       head_dim=head_dim, dtype=torch.bfloat16)
    kv_bytes_per_token_layer = 2 * shape["num_query_groups"] * head_dim * 2
    bandwidth = copy_bandwidth(device) if gpu else None
    print(f"{torch.cuda.get_device_name() if gpu else 'CPU'}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
          f"parameters, bf16, context {context}, block size {args.block_size}"
          + (", megatron bias fusions on" if args.megatron_fusions else "")
          + (f", device copy {bandwidth / 1e9:.0f} GB/s" if gpu else ""), flush=True)

    if args.kernel_table:
        metadata, num_blocks = decode_batch(1, 1, context, args.block_size, device)
        caches = spec.allocate(num_blocks, args.block_size, device)
        token_ids = torch.randint(0, shape["vocab_size"], (metadata.num_tokens,), device=device)
        for path in ("glue",):
            runner = runners[path]
            print(f"B 1 S 0 forward, path {path}: graph {graph_time_us(lambda: runner.forward(token_ids, metadata.positions, metadata, caches), args.replays):.1f} us")
            kernel_table(lambda: runner.forward(token_ids, metadata.positions, metadata, caches))
        return

    rows = []
    for batch in batches:
        for num_drafts in drafts:
            rows_per_request = 1 + num_drafts
            metadata, num_blocks = decode_batch(batch, rows_per_request, context, args.block_size, device)
            caches = spec.allocate(num_blocks, args.block_size, device)
            for key_cache, value_cache in caches:
                key_cache.normal_(0, 0.5), value_cache.normal_(0, 0.5)
            num_tokens = metadata.num_tokens
            generator = torch.Generator().manual_seed(batch * 10 + num_drafts)
            token_ids = torch.randint(0, shape["vocab_size"], (num_tokens,), generator=generator).to(device)
            next_ids = torch.randint(0, shape["vocab_size"], (num_tokens,), generator=generator).to(device)
            floors = floor_bytes(model, runners["glue"], batch, context, kv_bytes_per_token_layer)
            results = {}
            for path, runner in runners.items():
                hidden = runner.forward(token_ids, metadata.positions, metadata, caches)[1]
                calls = {"forward": lambda r=runner: r.forward(token_ids, metadata.positions, metadata, caches)}
                if runner.mtp_num_layers:
                    calls["mtp"] = lambda r=runner, h=hidden: r.mtp_forward(0, h, next_ids, metadata.positions, metadata=metadata,
                                                                            kv_caches=caches)
                layer_kernels = decoder_layer_kernels(runner, token_ids, metadata, caches) if gpu else None
                for call, fn in calls.items():
                    logits = fn()[0]
                    if gpu:
                        kernels, memory_ops = count_gpu_events(fn)
                        time_us = graph_time_us(fn, args.replays)
                    else:
                        kernels = memory_ops = None
                        time_us = eager_time_us(fn, repeats=5)
                    results[path, call] = (kernels, layer_kernels if call == "forward" else None, memory_ops, time_us,
                                           logits)
            for call, floor in zip(("forward", "mtp"), floors):
                if (reference_path, call) not in results:
                    continue
                floor_us = floor / bandwidth * 1e6 if gpu else None
                reference_logits = results[reference_path, call][4]
                for path in runners:
                    kernels, layer_kernels, memory_ops, time_us, logits = results[path, call]
                    agree = torch.equal(logits.argmax(-1), reference_logits.argmax(-1))
                    rows.append((batch, num_drafts, num_tokens, call, path, kernels, layer_kernels, memory_ops,
                                 time_us, floor_us, agree))
                    print(f"B {batch:3d} S {num_drafts} {call:7s} {path:7s}: {time_us:9.1f} us", flush=True)
                    if path != reference_path:
                        diagnose_token_mismatch(f"{path} vs {reference_path}", reference_logits, logits)
            del caches, results
            if gpu:
                torch.cuda.empty_cache()

    timing = "graph us" if gpu else "eager us"
    print(f"\n{'B':>3} {'S':>2} {'T':>4} {'call':>7} {'path':>7} {'kernels':>7} {'k/layer':>7} {'memops':>6} "
          f"{timing:>9} {'floor us':>8} {'x floor':>7} {'same tokens':>11}")
    for batch, num_drafts, num_tokens, call, path, kernels, layer_kernels, memory_ops, time_us, floor_us, agree in rows:
        fmt = lambda value, spec: "n/a" if value is None else format(value, spec)  # noqa: E731
        ratio = None if floor_us is None else time_us / floor_us
        print(f"{batch:3d} {num_drafts:2d} {num_tokens:4d} {call:>7} {path:>7} {fmt(kernels, '7d'):>7} "
              f"{fmt(layer_kernels, '7d'):>7} {fmt(memory_ops, '6d'):>6} {time_us:9.1f} {fmt(floor_us, '8.1f'):>8} "
              f"{fmt(ratio, '7.2f'):>7} {str(agree):>11}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
