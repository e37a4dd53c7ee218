"""``generate.py --hf DIR``: plain vs speculative generation on a Hugging Face checkpoint, text in and out
(drafting with its own MTP layers, or with a public EAGLE-3 head: ``--proposer eagle --draft-hf DIR2``).

The checkpoint is loaded by :func:`mtp_ctrl.models.load_hf_checkpoint` (each TP rank reads its
shard), its tokenizer by :class:`mtp_ctrl.models.hf_text.HFText`; requests stop at the
checkpoint's EOS ids and at ``--stop`` strings (:class:`StopStringController`). The timing and the
report are :mod:`mtp_ctrl.cli.generate`'s.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from mtp_ctrl.cli.distributed import init_distributed
from mtp_ctrl.cli.generate import choose_cpu_threads, compare, header, print_report, write_metrics
from mtp_ctrl.cli.model_source import checkpoint_or_exit
from mtp_ctrl.controllers import SamplingParams, TextGenerationController
from mtp_ctrl.controllers.stop_rules import FinishReason

DEFAULT_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Speculative decoding works by")


class StopStringController(TextGenerationController):
    """A controller that also finishes a request once its text contains one of ``stop_strings``
    (a :class:`~mtp_ctrl.models.hf_text.StopStrings`; None: only the token stop rules). The
    output keeps the token that completes the stop string, as a stop sequence is kept."""

    stop_strings = None

    def accept_tokens(self, record, new_tokens):
        kept, reason = super().accept_tokens(record, new_tokens)
        if self.stop_strings is not None and kept:
            count = self.stop_strings.keep_count(record.output_tokens, kept)
            if count is not None:
                return kept[:count], FinishReason.STOP_SEQUENCE
        return kept, reason


def stop_string_controller_class(stop_strings):
    """A :class:`StopStringController` subclass bound to ``stop_strings``."""
    return type("BoundStopStringController", (StopStringController,), {"stop_strings": stop_strings})


def text_prompts(args, text):
    """Prompt ids: --prompt texts (or DEFAULT_PROMPTS), through the chat template with --chat,
    cycled to --num-prompts."""
    texts = args.prompt or list(DEFAULT_PROMPTS)
    if args.chat:
        encoded = [text.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    else:
        encoded = [text.encode(t) for t in texts]
    if any(not ids for ids in encoded):
        sys.exit("error: a --prompt encodes to no tokens")
    return [encoded[i % len(encoded)] for i in range(args.num_prompts)]


def load_hf_model(args, device, rank_zero: bool):
    """--hf's model (each TP rank reads its shard; bf16 or the checkpoint's dtype on CUDA, fp32 on a
    CPU unless --dtype), checked to have S MTP layers when they draft; a bad checkpoint ends the
    script in one line."""
    from mtp_ctrl.models import load_hf_checkpoint

    dtype = getattr(torch, args.dtype) if args.dtype else (None if device.type == "cuda" else torch.float32)
    started = time.perf_counter()
    model = checkpoint_or_exit("--hf", args.hf, lambda path: load_hf_checkpoint(path, tp=args.tp, device=device,
                                                                                dtype=dtype))
    if rank_zero:
        print(f"loaded {args.hf} at TP {args.tp} in {time.perf_counter() - started:.2f} s", flush=True)
    depth = model.config.mtp_num_layers or 0
    if args.proposer == "mtp" and args.num_speculative_tokens > depth and not (args.mtp_reuse_last_layer and depth):
        sys.exit(f"error: --num-speculative-tokens {args.num_speculative_tokens} needs at least that many MTP "
                 f"layers; {args.hf} ships {depth} (or pass --mtp-reuse-last-layer)")
    return model


def run_hf(args) -> None:
    from mtp_ctrl.models.hf_text import HFText

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda, but torch sees no CUDA device (use --device cpu)")
    repeats = args.repeats or (5 if device.type == "cuda" else 3)
    if args.num_prompts is None:
        args.num_prompts = 128 if device.type == "cuda" else len(args.prompt or DEFAULT_PROMPTS)
    rank_zero = int(os.environ.get("RANK", "0")) == 0
    if rank_zero:
        print(header(args, device, repeats), flush=True)
        if device.type == "cpu":
            print(choose_cpu_threads(torch), flush=True)
    text = checkpoint_or_exit("--hf", args.hf, HFText)
    init_distributed(args.tp, device)
    model = load_hf_model(args, device, rank_zero)
    prompts = text_prompts(args, text)
    eos = tuple(token for token in text.eos_token_ids if token < model.vocab_size)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=None,
                            eos_token_ids=eos)
    controller_class = stop_string_controller_class(text.stop_strings(args.stop) if args.stop else None)
    report = compare(model, args, prompts, device, repeats, show_progress=rank_zero, params=params,
                     controller_class=controller_class)
    if rank_zero:
        print_report(args, device, prompts, report, decode=text.decode)  # an output ends with its stop string
        write_metrics(args, report)
    dist.destroy_process_group()
