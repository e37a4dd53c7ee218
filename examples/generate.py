"""Generate with and without MTP speculation on a small megatron-core GPT, and compare.

    python examples/generate.py                                   # CPU, or the GPU when there is one
    torchrun --nproc-per-node 2 examples/generate.py --tp 2       # tensor parallel on 2 GPUs
    python examples/generate.py --checkpoint model.pt             # weights saved with torch.save(model.state_dict())

The model has MTP layers; with random weights (no checkpoint) the drafts are rarely accepted,
so the point of that run is the equality of the two outputs, not the speed-up.
"""

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from mtp_ctrl.models import build_gpt_model


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (= processes under torchrun)")
    parser.add_argument("--num-speculative-tokens", type=int, default=2)
    parser.add_argument("--mtp-attention", choices=("paged", "single_position"), default="paged")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--checkpoint", default=None, help="state_dict of a model with this script's shape")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    return parser.parse_args()


def init_distributed(tp: int, device: torch.device) -> None:
    if "RANK" not in os.environ:  # a plain `python` run: one process of its own
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != tp:
        raise ValueError(f"--tp {tp} needs {tp} processes, got {dist.get_world_size()} (use torchrun)")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def build_model(args, device: torch.device):
    config = TransformerConfig(
        num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8, num_query_groups=4,
        mtp_num_layers=max(args.num_speculative_tokens, 1), hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, tensor_model_parallel_size=args.tp,
    )
    torch.manual_seed(1234)  # every rank draws the same master weights and keeps its shard
    model = build_gpt_model(config, vocab_size=512, max_sequence_length=1024)
    if args.checkpoint:
        model.load_state_dict(torch.load(args.checkpoint, map_location="cpu"))
    return model.to(device).eval()


def run(model, args, num_speculative_tokens: int, prompts, device):
    config = InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=8, block_size_tokens=16,
                             max_model_len=256, max_tokens_per_step=256, mtp_attention=args.mtp_attention)
    controller = TextGenerationController(model, config, seed=0)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=None)
    controller.generate(prompts[:1], params)  # warm-up: kernels compile once
    if device.type == "cuda":
        torch.cuda.synchronize()
    controller = TextGenerationController(model, config, seed=0)
    started = time.perf_counter()
    results = controller.generate(prompts, params)
    seconds = time.perf_counter() - started
    return results, seconds, controller.metrics


def main():
    args = parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    init_distributed(args.tp, device)
    model = build_model(args, device)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (args.prompt_len + 3 * i,), generator=generator).tolist()
               for i in range(args.num_prompts)]
    plain, plain_seconds, _ = run(model, args, 0, prompts, device)
    spec, spec_seconds, metrics = run(model, args, args.num_speculative_tokens, prompts, device)
    if dist.get_rank() == 0:
        for result in spec:
            print(f"request {result.request_id}: {list(result.output_tokens)} ({result.finish_reason.value})")
        tokens = sum(len(r.output_tokens) for r in spec)
        same = [r.output_tokens for r in plain] == [r.output_tokens for r in spec]
        print(f"device {device}, tp {args.tp}, S = {args.num_speculative_tokens} ({args.mtp_attention} MTP attention)")
        print(f"outputs identical to plain decoding: {same}")
        print(f"plain:       {tokens / plain_seconds:8.1f} tokens/s")
        print(f"speculative: {tokens / spec_seconds:8.1f} tokens/s, mean accepted length "
              f"{metrics.mean_accepted_length:.2f}, acceptance per depth "
              f"{[round(rate, 2) for rate in metrics.acceptance_per_depth]}")
        print(f"step time split: {metrics.summary().split('; ')[-1]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
