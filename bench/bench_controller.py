"""Decode-step time of the controller: eager vs CUDA graphs, S = 0 vs S = 2 (paged MTP drafting).

    python bench/bench_controller.py [--quick] [--layer-pattern M*M*M*M*]
    torchrun --nproc-per-node 2 bench/bench_controller.py --quick      # tensor parallel (TP = 2)

A GPT of 8 layers (hidden 1024, 16 heads over 4 KV groups, 2 MTP layers, bf16, vocab 32768) with
random weights, so no draft is accepted: the S = 2 rows measure the full cost of verifying and
drafting, the worst case of speculation. Each point: ``batch`` requests with 128-token prompts,
prefilled, then 10 warm-up decode steps (graph capture happens there) and the median wall time of
50 ``controller.step()`` calls (each ends with the step's read-back, so it is the whole step).
``--layer-pattern`` makes the decoder hybrid ("M" Mamba-2 with 32 heads of 64, 8 groups, state
128; "*" attention): its S = 2 rows also pay the per-row Mamba states and the Mamba commit.
"""

import argparse
import os
import socket
import statistics
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layer-pattern", default=None, help='hybrid decoder, e.g. "M*M*M*M*" (default: all attention)')
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

from mtp_ctrl.controllers import InferenceConfig, TextGenerationController  # noqa: E402
from mtp_ctrl.models import build_gpt_model  # noqa: E402
from steady_decode import timed_decode_steps  # noqa: E402

VOCAB_SIZE, PROMPT_LEN = 32768, 128


def init_process_groups() -> int:
    """One process (plain ``python``) or every torchrun rank as one tensor-parallel group; returns TP."""
    if "RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    return dist.get_world_size()


def build_model(layer_pattern=None, tensor_parallel_size=1):
    config = TransformerConfig(num_layers=8, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=16,
                               num_query_groups=4, mtp_num_layers=2, hidden_dropout=0.0, attention_dropout=0.0,
                               use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True,
                               mamba_state_dim=128, mamba_head_dim=64, mamba_num_groups=8,
                               tensor_model_parallel_size=tensor_parallel_size)
    torch.manual_seed(0)
    return build_gpt_model(config, vocab_size=VOCAB_SIZE, max_sequence_length=2048,
                           layer_pattern=layer_pattern).cuda().eval()


def median_step_ms(model, batch, num_speculative_tokens, graphs, steps, vocab_size=VOCAB_SIZE,
                   batch_buckets=(1, 8, 32)):
    """Median wall ms of ``controller.step()`` once ``batch`` random 128-token prompts all decode."""
    config = InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=32, block_size_tokens=16,
                             max_model_len=1024, max_tokens_per_step=2048,
                             cuda_graph_batch_sizes=batch_buckets if graphs else (), mtp_attention="paged")
    controller = TextGenerationController(model, config)
    times = timed_decode_steps(controller, batch, vocab_size, PROMPT_LEN, max_new_tokens=500, warmup_steps=10,
                               steps=steps)
    controller.close()  # frees its graphs (a process group with captured collectives cannot be destroyed)
    return statistics.median(times)


def main(args=None):
    args = args or parse_args()
    tp = init_process_groups()
    model = build_model(args.layer_pattern, tp)
    batches = (1, 8) if args.quick else (1, 8, 32)
    rows = []
    points = [(batch, num_speculative_tokens) for batch in batches for num_speculative_tokens in (0, 2)]
    progress = tqdm(points, desc="points", unit="point", disable=not (sys.stdout.isatty() and dist.get_rank() == 0))
    for batch, num_speculative_tokens in progress:
        eager = median_step_ms(model, batch, num_speculative_tokens, graphs=False, steps=50)
        graphed = median_step_ms(model, batch, num_speculative_tokens, graphs=True, steps=50)
        rows.append((batch, num_speculative_tokens, eager, graphed))
        progress.set_postfix_str(f"batch {batch} S {num_speculative_tokens}: eager {eager:.2f} ms, graph {graphed:.2f} ms")
    if dist.get_rank() != 0:
        dist.destroy_process_group()
        return
    layers = f"layers {args.layer_pattern}" if args.layer_pattern else "all attention"
    print(f"\n{torch.cuda.get_device_name()} x {tp} (TP = {tp}); 8-layer GPT ({layers}), hidden 1024, bf16, random weights "
          "(0 drafts accepted); "
          f"median ms per decode step (whole step incl. scheduling and read-back)")
    print(f"{'batch':>5} {'S':>2} {'eager ms':>9} {'graph ms':>9} {'graph speed-up':>15}")
    for batch, num_speculative_tokens, eager, graphed in rows:
        print(f"{batch:5d} {num_speculative_tokens:2d} {eager:9.2f} {graphed:9.2f} {eager / graphed:14.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
