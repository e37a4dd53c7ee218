"""Generate with and without MTP speculation on a small megatron-core GPT, and compare.

    python examples/generate.py                                   # CPU, or the GPU when there is one
    torchrun --nproc-per-node 2 examples/generate.py --tp 2       # tensor parallel on 2 GPUs
    python examples/generate.py --checkpoint mtp_demo.pt          # a model trained by examples/train_mtp.py

With random weights (no checkpoint) the drafts are rarely accepted, so the point of that run is
the equality of the two outputs, not the speed-up. A checkpoint written by train_mtp.py brings
its own model shape; the prompts are then held-out standard-library source text (bytes) and
the outputs are printed as text too.
"""

import argparse
import time

import torch
import torch.distributed as dist

from byte_corpus import decode_bytes, evenly_spaced_windows, load_stdlib_corpus
from demo_model import DEMO_MODEL_ARGS, build_demo_model, init_distributed, load_checkpoint, load_full_state_dict
from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (= processes under torchrun)")
    parser.add_argument("--num-speculative-tokens", type=int, default=2)
    parser.add_argument("--mtp-attention", choices=("paged", "single_position"), default="paged")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--checkpoint", default=None, help="a file written by examples/train_mtp.py")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    return parser.parse_args()


def build_model(args, device: torch.device):
    """The checkpoint's model (each TP rank loads its shard), or the demo shape with random weights."""
    if args.checkpoint:
        model_args, state_dict = load_checkpoint(args.checkpoint)
        model = build_demo_model(model_args, tensor_parallel_size=args.tp)
        load_full_state_dict(model, state_dict)
    else:
        model_args = dict(DEMO_MODEL_ARGS, mtp_num_layers=max(args.num_speculative_tokens, 1))
        torch.manual_seed(1234)  # every rank draws the same master weights and keeps its shard
        model = build_demo_model(model_args, tensor_parallel_size=args.tp)
    return model.to(device).eval()


def make_prompts(args):
    """Prompt i has prompt_len + 3 i tokens: held-out corpus text with a checkpoint, random ids without."""
    lengths = [args.prompt_len + 3 * i for i in range(args.num_prompts)]
    if args.checkpoint:
        windows = evenly_spaced_windows(load_stdlib_corpus().held_out, args.num_prompts, max(lengths))
        return [window[:length].tolist() for window, length in zip(windows, lengths)]
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, DEMO_MODEL_ARGS["vocab_size"], (length,), generator=generator).tolist()
            for length in lengths]


def run(model, args, num_speculative_tokens: int, prompts, device):
    graph_batches = (1, 2, 4, 8) if device.type == "cuda" else ()  # decode steps replay CUDA graphs
    config = InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=8, block_size_tokens=16,
                             max_model_len=256, max_tokens_per_step=256, mtp_attention=args.mtp_attention,
                             cuda_graph_batch_sizes=graph_batches)
    controller = TextGenerationController(model, config, seed=0)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=None)
    controller.generate(prompts, params)  # warm-up: kernels compile, CUDA graphs are captured
    if device.type == "cuda":
        torch.cuda.synchronize()
    controller.metrics.reset()
    started = time.perf_counter()
    results = controller.generate(prompts, params)
    seconds = time.perf_counter() - started
    controller.close()  # frees the graphs (needed before destroy_process_group under TP)
    return results, seconds, controller.metrics


def main():
    args = parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    init_distributed(args.tp, device)
    model = build_model(args, device)
    prompts = make_prompts(args)
    plain, plain_seconds, _ = run(model, args, 0, prompts, device)
    spec, spec_seconds, metrics = run(model, args, args.num_speculative_tokens, prompts, device)
    if dist.get_rank() == 0:
        for index, (prompt, result) in enumerate(zip(prompts, spec)):
            print(f"prompt {index}: {list(result.output_tokens)} ({result.finish_reason.value})")
            if args.checkpoint:
                print(f"  {decode_bytes(prompt)!r} -> {decode_bytes(result.output_tokens)!r}")
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
