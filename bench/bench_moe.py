"""MoE decode steps at graph speed: the sync-free MoE path vs megatron's eager MoELayer, one GPU.

    python bench/bench_moe.py            # the DeepSeek-V3-shaped model below, batch 1/8/32/128, S = 0 and 2
    python bench/bench_moe.py --quick    # a small model and two batches (a smoke run; CPU works too)
    python bench/bench_moe.py --batches 1 --no-megatron   # batch 1 only, the sync-free path only
    torchrun --nproc-per-node 2 bench/bench_moe.py --ep 2   # experts split over 2 GPUs (each GPU its own batch)
    torchrun --nproc-per-node 2 bench/bench_moe.py --tp 2   # attention and every expert split over 2 GPUs

The model (bf16, random weights, built on the GPU): 16 layers, hidden 2048, 16 query heads over 4
KV groups; layer 0 a dense MLP of 5632, layers 1-15 MoE with 64 routed experts of FFN 1408 (GLU),
top-6, 2 shared experts (one MLP of 2816), sigmoid scores with 8 groups (top-4 groups), expert bias
and scaling factor 2.5 (DeepSeek-V3's routing); 2 MoE MTP layers; vocab 32768. Random weights, so
no draft is accepted: S = 2 measures the whole cost of verifying and drafting.

Printed, in one run:
1. Per MoE layer and row count T: GPU time of one layer replayed from a CUDA graph for each
   grouped-GEMM backend (the Triton fused-MoE kernel, torch's grouped GEMM), megatron's eager
   MoELayer wall time, kernels per layer (torch.profiler), the distinct routed experts T rows select
   and the layer's HBM floor (attention excluded: shared + distinct experts over the copy bandwidth).
2. Per batch B and S: median wall ms of ``controller.step()`` and its GPU ms (torch.profiler kernel
   time per step) on the sync-free path (graphs) and on megatron's path (eager); the step's HBM
   floor; tokens/s. With --tp or --ep, the expert exchange (the all-gather before and the
   reduce-scatter after the experts, NCCL kernels captured in the graphs) is its own column: its
   kernel time per layer and per step, which includes any wait for the slower rank. The floor counts the weights the step reads once (attention, dense and shared
   MLPs, the distinct experts its rows select, the output layer) for the decoder over B (1 + S)
   rows and each of the S MTP depths over B rows, and the K/V it attends over.

Under torchrun, rank 0 prints; figures are per GPU. ``--ep 2`` (world 2, TP 1): each GPU runs
its own B requests (megatron's data-parallel ranks) and holds half of the experts, so a layer
routes 2 x T rows and each GPU reads the distinct experts of its half; the floor counts those.
``--tp 2``: both GPUs run the same B requests on half of every weight.
"""

import argparse
import inspect
import os
import socket
import statistics
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and two batches (smoke run)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per point (graph path)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (under torchrun)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (under torchrun)")
    parser.add_argument("--batches", default=None,
                        help="comma-separated batch sizes (default 1,8,32,128; --quick: 1,8)")
    parser.add_argument("--no-megatron", action="store_true",
                        help="skip megatron's eager MoELayer (its columns print nan): a shorter run")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args(argv)
    for name in ("tp", "ep"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != args.tp * args.ep:
        parser.error(f"--tp {args.tp} --ep {args.ep} needs tp x ep = {args.tp * args.ep} processes, got {world_size} "
                     f"(use torchrun --nproc-per-node {args.tp * args.ep})")
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # --help answers before torch loads
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)  # before megatron-core is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from mtp_ctrl.controllers import InferenceConfig, TextGenerationController  # noqa: E402
from mtp_ctrl.models import build_gpt_model, moe_layers  # noqa: E402
from mtp_ctrl.models.moe_inference import graph_moe_forward, route_rows  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # noqa: E402
from bench_forward import copy_bandwidth, count_gpu_events, graph_replay_kernels, graph_time_us, kernel_table  # noqa: E402,E501
from steady_decode import timed_decode_steps  # noqa: E402

PROMPT_LEN = 128
# the layer as a step runs it (fused shared-expert activation), where graph_moe_forward takes the
# switch (the same script also times older trees, whose graph_moe_forward has no such argument)
STEP_GLUE = {"fused_glue": True} if "fused_glue" in inspect.signature(graph_moe_forward).parameters else {}


def init_parallel(tensor_parallel_size: int, expert_parallel_size: int, device: torch.device) -> int:
    """Process groups and parallel_state (a plain ``python`` run is one process of its own); returns
    the rank. Ranks other than 0 print nothing."""
    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(sock.getsockname()[1]))
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device.type == "cuda" and int(os.environ["WORLD_SIZE"]) > 1 else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size,
                                             expert_model_parallel_size=expert_parallel_size)
    rank = dist.get_rank()
    if rank != 0:
        sys.stdout = open(os.devnull, "w")
    return rank


def build_model(quick: bool, device: torch.device, tensor_parallel_size: int = 1, expert_parallel_size: int = 1):
    """The DeepSeek-V3-shaped MoE GPT (module docstring), random bf16 weights drawn on ``device``
    (every rank draws its shards from the same seed, so replicated weights agree across ranks)."""
    on_gpu = device.type == "cuda"
    layers, hidden, experts, expert_ffn = (4, 256, 16, 128) if quick else (16, 2048, 64, 1408)
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * expert_ffn, num_attention_heads=16,
        num_query_groups=4, mtp_num_layers=2, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        num_moe_experts=experts, moe_ffn_hidden_size=expert_ffn, moe_router_topk=6,
        moe_shared_expert_intermediate_size=2 * expert_ffn, moe_layer_freq=[0] + [1] * (layers - 1),
        moe_router_score_function="sigmoid", moe_router_num_groups=8, moe_router_group_topk=4,
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32",
        tensor_model_parallel_size=tensor_parallel_size, expert_model_parallel_size=expert_parallel_size,
        use_cpu_initialization=not on_gpu, perform_initialization=not on_gpu,
        params_dtype=torch.bfloat16 if on_gpu else torch.float32, bf16=on_gpu)
    torch.manual_seed(0)
    model = build_gpt_model(config, vocab_size=2048 if quick else 32768, max_sequence_length=4096)
    model = model.to(device).eval()
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, 0.02, generator=generator)
        for layer in moe_layers(model):
            layer.router.expert_bias.normal_(0.0, 0.05, generator=generator)
    return model


def expert_bytes(layer) -> int:
    expert = layer.experts.local_experts[0]
    return sum(p.numel() * p.element_size() for p in expert.parameters())


def param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def distinct_experts(layer, num_rows: int, trials: int = 8) -> float:
    """Mean number of distinct routed experts of this GPU that ``layer`` reads when each EP rank
    routes ``num_rows`` random rows (with EP = 1: the distinct experts ``num_rows`` rows select)."""
    expert_parallel_size = parallel_state.get_expert_model_parallel_world_size()
    local = torch.tensor(layer.local_expert_indices, device=layer.router.weight.device)
    counts = []
    with torch.no_grad():
        for trial in range(trials):
            generator = torch.Generator(device=layer.router.weight.device).manual_seed(trial)
            rows = torch.randn(num_rows * expert_parallel_size, layer.config.hidden_size,
                               device=layer.router.weight.device, dtype=layer.router.weight.dtype, generator=generator)
            ids, _ = route_rows(layer, rows)
            counts.append(torch.isin(ids.unique(), local).sum().item())
    return sum(counts) / len(counts)


def exchange_us(fn, replays: int = 10) -> float:
    """NCCL kernel time per call of ``fn`` replayed from a CUDA graph (0 on one GPU). It includes
    any wait for the slower rank, so it bounds the exchange's own cost from above."""
    if dist.get_world_size() == 1:
        return 0.0
    events = graph_replay_kernels(fn, replays)
    return sum(event.device_time for event in events if "nccl" in event.name.lower()) / replays


@torch.no_grad()
def layer_table(model, rows_list, bandwidth, with_megatron=True):
    layer = moe_layers(model)[1]
    device = layer.router.weight.device
    one_expert = expert_bytes(layer)
    shared = param_bytes(layer.shared_experts)
    print(f"\n1. one MoE layer ({layer.num_local_experts} experts, top-{layer.config.moe_router_topk}, "
          f"{one_expert / 2**20:.1f} MiB per expert, shared {shared / 2**20:.1f} MiB); GPU us from a replayed graph")
    print(f"{'T':>4} {'distinct':>8} {'floor us':>8} {'triton us':>9} {'exchange us':>11} {'grouped_mm us':>13} "
          f"{'megatron wall us':>16} {'kernels triton/grouped_mm/megatron':>34}")
    data_parallel_rank = parallel_state.get_expert_model_parallel_rank()  # EP ranks route rows of their own
    results = {}
    for num_rows in rows_list:
        generator = torch.Generator(device=device).manual_seed(num_rows + 1000 * data_parallel_rank)
        hidden = torch.randn(num_rows, 1, layer.config.hidden_size, device=device, dtype=layer.router.weight.dtype,
                             generator=generator)
        distinct = distinct_experts(layer, num_rows)
        floor_us = (shared + distinct * one_expert) / bandwidth * 1e6
        times, kernels = {}, {}
        for backend in ("triton", "grouped_mm"):
            call = lambda: graph_moe_forward(layer, hidden, backend, **STEP_GLUE)  # noqa: E731
            times[backend] = graph_time_us(call, replays=20) if device.type == "cuda" else float("nan")
            kernels[backend] = count_gpu_events(call)[0] if device.type == "cuda" else 0
        megatron_call = lambda: layer(hidden)  # noqa: E731  outside a paged forward: megatron's MoELayer
        if with_megatron:
            megatron_call()
        samples = [float("nan")]
        for _ in range(5 if with_megatron else 0):
            if device.type == "cuda":
                torch.cuda.synchronize()
            begin = time.perf_counter()
            megatron_call()
            if device.type == "cuda":
                torch.cuda.synchronize()
            samples.append(1e6 * (time.perf_counter() - begin))
        kernels["megatron"] = count_gpu_events(megatron_call)[0] if device.type == "cuda" and with_megatron else 0
        exchange = exchange_us(lambda: graph_moe_forward(layer, hidden, "triton", **STEP_GLUE)) \
            if device.type == "cuda" else 0.0
        results[num_rows] = dict(distinct=distinct, floor=floor_us, exchange=exchange, **times)
        print(f"{num_rows:4d} {distinct:8.1f} {floor_us:8.1f} {times['triton']:9.1f} {exchange:11.1f} "
              f"{times['grouped_mm']:13.1f} "
              f"{statistics.median(samples):16.1f} {kernels['triton']:>14}/{kernels['grouped_mm']}/{kernels['megatron']}")
    if device.type == "cuda":
        for num_rows in (rows_list[0], rows_list[-1]):
            hidden = torch.randn(num_rows, 1, layer.config.hidden_size, device=device, dtype=layer.router.weight.dtype)
            print(f"\nkernels of one MoE layer (triton backend, T = {num_rows}), replayed from a graph:")
            kernel_table(lambda: graph_moe_forward(layer, hidden, "triton", **STEP_GLUE), replays=10, top=12)
    return results


def step_times(model, batch, num_speculative_tokens, moe_backend, graphs, steps, vocab_size):
    """(median wall ms of controller.step(), GPU ms per step from torch.profiler kernel time, of which
    NCCL kernels (the expert exchange), whether the steps replayed graphs)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    buckets = tuple(b for b in (1, 8, 32, 128) if b >= batch)[:1] if graphs else ()
    config = InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=max(batch, 1),
                             block_size_tokens=16, max_model_len=PROMPT_LEN + 512,
                             max_tokens_per_step=max(2048, batch * (1 + num_speculative_tokens)),
                             cuda_graph_batch_sizes=buckets, moe_backend=moe_backend)
    controller = TextGenerationController(model, config)
    seed = batch + 1000 * parallel_state.get_expert_model_parallel_rank()  # EP ranks serve requests of their own
    times = timed_decode_steps(controller, batch, vocab_size, PROMPT_LEN, max_new_tokens=400, warmup_steps=3,
                               steps=steps, seed=seed)
    gpu_ms = exchange_ms = float("nan")
    if torch.cuda.is_available():
        profiled = 5
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(profiled):
                controller.step()
            torch.cuda.synchronize()
        kernels = [event for event in prof.events() if event.device_type == DeviceType.CUDA]
        gpu_ms = sum(event.device_time for event in kernels) / profiled / 1e3
        exchange_ms = sum(event.device_time for event in kernels if "nccl" in event.name.lower()) / profiled / 1e3
    used_graphs = controller.debug_view().num_cuda_graphs > 0
    controller.close()
    return statistics.median(times), gpu_ms, exchange_ms, used_graphs


def step_floor_bytes(model, batch, num_speculative_tokens, distinct_of, kv_bytes_per_token_layer):
    """HBM bytes a decode step must read (module docstring); ``distinct_of(rows)`` -> distinct experts."""
    layers = list(moe_layers(model))
    decoder_moe = [layer for layer in layers if any(layer is m for m in model.decoder.modules())]
    one_expert = expert_bytes(layers[0])
    output = param_bytes(model.output_layer)
    rows = batch * (1 + num_speculative_tokens)
    decoder = param_bytes(model.decoder) - sum(param_bytes(layer.experts) for layer in decoder_moe) \
        + len(decoder_moe) * distinct_of(rows) * one_expert + output \
        + len(model.decoder.layers) * batch * (PROMPT_LEN + 32) * kv_bytes_per_token_layer
    mtp = 0
    for depth in range(num_speculative_tokens):
        mtp_layer = model.mtp.layers[depth]
        mtp += param_bytes(mtp_layer) - param_bytes(mtp_layer.transformer_layer.mlp.experts) \
            + distinct_of(batch) * one_expert + output + batch * (PROMPT_LEN + 32) * kv_bytes_per_token_layer
    return decoder + mtp


def main(args=None):
    args = args or parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    init_parallel(args.tp, args.ep, device)
    begin = time.perf_counter()
    model = build_model(args.quick, device, args.tp, args.ep)
    if device.type == "cuda":
        torch.cuda.synchronize()
    total = sum(p.numel() for p in model.parameters())
    layer = moe_layers(model)[0]
    active_per_layer = (layer.config.moe_router_topk * expert_bytes(layer) + param_bytes(layer.shared_experts)) // 2
    print(f"built in {time.perf_counter() - begin:.1f} s: {total / 1e9:.2f} B parameters "
          f"({len(model.decoder.layers)} layers + {len(model.mtp.layers)} MTP, {len(moe_layers(model))} MoE layers; "
          f"{active_per_layer / 1e6:.0f} M active expert parameters per MoE layer per token)")
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else 1e11
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{where}; device copy bandwidth {bandwidth / 1e9:.0f} GB/s; torch {torch.__version__}; "
          f"TP {args.tp}, EP {args.ep} ({dist.get_world_size()} GPU(s); figures per GPU)")
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else (1, 8) if args.quick \
        else (1, 8, 32, 128)
    rows_list = sorted({b * (1 + s) for b in batches for s in (0, 2)})
    layer_results = layer_table(model, rows_list, bandwidth, not args.no_megatron)
    distinct_of = lambda rows: layer_results[rows]["distinct"] if rows in layer_results \
        else distinct_experts(moe_layers(model)[1], rows)  # noqa: E731
    config = model.config
    kv_bytes = 2 * (config.num_query_groups // args.tp * config.kv_channels) * 2  # K and V, bf16, per token, layer, GPU
    vocab = model.vocab_size
    print("\n2. decode steps (whole controller.step(); GPU = profiler kernel time per step)")
    print(f"{'B':>4} {'S':>2} {'path':>16} {'wall ms':>8} {'GPU ms':>7} {'exch ms':>7} {'floor ms':>8} "
          f"{'GPU/floor':>9} {'wall/GPU':>8} {'tok/s':>8} {'graphs':>6}")
    summary = {}
    for batch in batches:
        for S in (0, 2):
            floor_ms = step_floor_bytes(model, batch, S, distinct_of, kv_bytes) / bandwidth * 1e3
            paths = (("sync-free graph", "triton", True, args.steps),
                     ("megatron eager", "megatron", False, max(3, args.steps // 4)))
            for label, backend, graphs, steps in paths[:1] if args.no_megatron else paths:
                wall, gpu, exchange, used = step_times(model, batch, S, backend, graphs and device.type == "cuda",
                                                       steps, vocab)
                summary[batch, S, backend] = wall
                tokens_per_s = batch / wall * 1e3  # random weights: one token per request and step (per GPU)
                print(f"{batch:4d} {S:2d} {label:>16} {wall:8.2f} {gpu:7.2f} {exchange:7.2f} {floor_ms:8.2f} "
                      f"{gpu / floor_ms:9.2f} "
                      f"{wall / gpu:8.2f} {tokens_per_s:8.0f} {str(used):>6}")
    print("\nspeed-up of the sync-free graph path over megatron's eager MoELayer (step wall):")
    for batch in () if args.no_megatron else batches:
        print(f"  B={batch:3d}: " + ", ".join(f"S={S} {summary[batch, S, 'megatron'] / summary[batch, S, 'triton']:.1f}x"
                                             for S in (0, 2)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
