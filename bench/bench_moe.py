"""Decode-step time of an MoE model (megatron's MoELayer) at S = 0 and S = 2, against a dense twin.

    python bench/bench_moe.py                                  # one GPU
    torchrun --nproc-per-node 2 bench/bench_moe.py             # TP = 2 (experts sharded over TP)
    torchrun --nproc-per-node 2 bench/bench_moe.py --ep 2      # EP = 2 (attention replicated, experts split)
    python bench/bench_moe.py --quick                          # small model, CPU without CUDA (smoke run)

The MoE GPT: 8 layers, hidden 1024, 16 heads over 4 KV groups, 2 MTP layers, bf16, vocab 32768;
every decoder and MTP layer is MoE with 8 experts of 1024, top-2, and one shared expert of 1024.
Its dense twin has the same attention and one MLP of 3072 per layer: the same active parameters
per token (2 routed + 1 shared expert). Random weights, so no draft is accepted: S = 2 measures the
full cost of verifying and drafting. Each point: ``batch`` requests with 128-token prompts,
prefilled, 10 warm-up decode steps, then the median wall time of 30 ``controller.step()`` calls.

MoE steps run eagerly (megatron's expert dispatch reads per-expert token counts on the host, so a
step cannot be captured in a CUDA graph; mtp_ctrl/models/moe.py); the dense twin is timed eagerly
and with CUDA graphs, so the table shows both the MoE layer's own cost and what graphs would save.
``S2/S0`` is the verify step's cost ratio: speculation gains when the mean accepted length exceeds it.
"""

import argparse
import os
import socket
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and few points (runs on CPU without CUDA)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size under torchrun (TP = world size / EP)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
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
from tqdm import tqdm  # noqa: E402

from mtp_ctrl.models import build_gpt_model, moe_layers  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # noqa: E402
from bench_controller import median_step_ms  # noqa: E402  the same timing loop


def init_process_groups(expert_parallel_size: int):
    """One process (plain ``python``) or every torchrun rank; returns (device, TP, EP)."""
    if "RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
        dist.init_process_group("gloo", rank=0, world_size=1)
    world_size = dist.get_world_size()
    if expert_parallel_size < 1 or world_size % expert_parallel_size != 0:
        raise SystemExit(f"--ep {expert_parallel_size} must divide the world size {world_size}")
    tp = world_size // expert_parallel_size
    # experts shard over TP (expert TP = TP) without EP, over EP only with it
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=expert_parallel_size,
                                             expert_tensor_parallel_size=tp if expert_parallel_size == 1 else 1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return device, tp, expert_parallel_size


def build_models(args, device, tp, ep):
    """(MoE model, dense twin with the same active parameters per token), random weights."""
    quick_cpu = args.quick and device.type == "cpu"
    hidden, layers, expert_ffn = (128, 2, 128) if quick_cpu else (1024, 8, 1024)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    common = dict(num_layers=layers, hidden_size=hidden, num_attention_heads=16 if not quick_cpu else 4,
                  num_query_groups=4 if not quick_cpu else 2, mtp_num_layers=2, hidden_dropout=0.0,
                  attention_dropout=0.0, add_bias_linear=False, use_cpu_initialization=True, params_dtype=dtype,
                  bf16=dtype == torch.bfloat16, tensor_model_parallel_size=tp)
    active_ffn = expert_ffn * (args.topk + 1)  # routed experts + the shared one
    moe = TransformerConfig(ffn_hidden_size=active_ffn, num_moe_experts=args.experts, moe_router_topk=args.topk,
                            moe_ffn_hidden_size=expert_ffn, moe_shared_expert_intermediate_size=expert_ffn,
                            expert_model_parallel_size=ep, expert_tensor_parallel_size=tp if ep == 1 else 1,
                            **common)
    dense = TransformerConfig(ffn_hidden_size=active_ffn, **common)
    vocab = 1024 if quick_cpu else 32768
    models = []
    for config in (moe, dense):
        torch.manual_seed(0)
        models.append(build_gpt_model(config, vocab_size=vocab, max_sequence_length=2048).to(device).eval())
    return models, vocab


def main(args=None):
    args = args or parse_args()
    device, tp, ep = init_process_groups(args.ep)
    (moe_model, dense_model), vocab = build_models(args, device, tp, ep)
    on_gpu = device.type == "cuda"
    batches = (1, 4) if args.quick else (1, 8, 32)
    steps = 5 if args.quick and not on_gpu else 30
    kinds = [("moe", moe_model, False), ("dense", dense_model, False)] + ([("dense", dense_model, True)] if on_gpu else [])
    points = [(batch, kind) for batch in batches for kind in kinds]
    times = {}
    progress = tqdm(points, desc="points", unit="point", disable=not (sys.stdout.isatty() and dist.get_rank() == 0))
    for batch, (name, model, graphs) in progress:
        for num_speculative_tokens in (0, 2):
            times[batch, name, graphs, num_speculative_tokens] = median_step_ms(
                model, batch, num_speculative_tokens, graphs, steps, vocab_size=vocab, batch_buckets=(1, 4, 8, 32))
    if dist.get_rank() != 0:
        dist.destroy_process_group()
        return
    where = f"{torch.cuda.get_device_name()} x {dist.get_world_size()}" if on_gpu else "CPU"
    layer = moe_layers(moe_model)[0]
    print(f"\n{where} (TP = {tp}, EP = {ep}); {len(moe_model.decoder.layers)}-layer GPT + 2 MTP layers, "
          f"hidden {moe_model.config.hidden_size}, {moe_model.config.params_dtype}, random weights (0 drafts accepted); "
          f"MoE: {moe_model.config.num_moe_experts} experts ({layer.num_local_experts} per rank), top-{args.topk}, "
          f"1 shared expert, {type(layer.token_dispatcher).__name__}; dense twin: same active parameters per token")
    print("median ms per decode step (whole step incl. scheduling and read-back)")
    print(f"{'batch':>5} {'model':>12} {'S=0 ms':>8} {'S=2 ms':>8} {'S2/S0':>6}")
    for batch in batches:
        for name, _, graphs in kinds:
            plain, spec = times[batch, name, graphs, 0], times[batch, name, graphs, 2]
            label = f"{name} {'graph' if graphs else 'eager'}"
            print(f"{batch:5d} {label:>12} {plain:8.2f} {spec:8.2f} {spec / plain:6.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
