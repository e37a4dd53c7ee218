"""Train the demo GPT and its MTP layers on the Python standard library's source (byte tokens).

    python examples/train_mtp.py --steps 50 --batch-size 4 --seq-len 128 --out /tmp/mtp_demo.pt    # CPU check
    python examples/train_mtp.py --steps 3000 --batch-size 64 --seq-len 256 --out mtp_demo.pt       # a GPU (H100: 2 min)
    python examples/generate.py --checkpoint mtp_demo.pt                                           # serve it
    python examples/train_mtp.py --steps 50 --batch-size 4 --seq-len 128 --save-format dist --out /tmp/mtp_dist
    torchrun --nproc-per-node 2 examples/generate.py --tp 2 --load /tmp/mtp_dist                   # megatron's format

Training is megatron-core's own path: the dense twin of the paged model (same parameter names,
causal SDPA attention) runs ``GPTModel.forward`` with labels; megatron computes the
language-model loss it returns and adds ``mtp_loss_scaling_factor / mtp_num_layers`` times each
MTP depth's loss to the backward pass (depth k predicts the token k + 2 ahead). The saved
state_dict loads strictly into :func:`mtp_ctrl.models.build_gpt_model`'s paged model.

``--save-format dist`` writes megatron's distributed checkpoint instead (a directory,
``dist_checkpointing`` torch_dist, the training dtype fp32, the model shape as its content metadata
``{"model_args": ...}``): what Megatron training writes, loadable at any TP size by
``examples/generate.py --load DIR`` (:func:`mtp_ctrl.models.load_distributed_checkpoint`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

if TYPE_CHECKING:  # torch and megatron-core load inside the functions, so that --help is instant
    import torch
    from megatron.core.models.gpt import GPTModel


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256, help="tokens (bytes) per training window")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate (warm-up, cosine decay)")
    parser.add_argument("--mtp-num-layers", type=int, default=2, help="MTP depths trained (the demo model's 2)")
    parser.add_argument("--mtp-loss-scale", type=float, default=0.3, help="megatron's mtp_loss_scaling_factor")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--out", default="mtp_demo.pt", help="checkpoint path (a new directory with --save-format dist)")
    parser.add_argument("--save-format", choices=("torch", "dist"), default="torch",
                        help="torch: one torch.save file (bf16); dist: a megatron dist_checkpointing directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=None,
                        help="steps between loss reports (default: steps / 10, at most 100)")
    parser.add_argument("--eval-windows", type=int, default=16, help="held-out windows of --seq-len evaluated")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.save_format == "dist" and os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        parser.error(f"--out {args.out} must be a new or empty directory with --save-format dist")
    if args.log_every is None:
        args.log_every = max(1, min(100, args.steps // 10))
    return args


@dataclass(frozen=True)
class LossReport:
    loss: float  # next-token cross entropy, nats per byte
    mtp_losses: List[float]  # per MTP depth k: cross entropy of the token k + 2 ahead


@dataclass(frozen=True)
class HeldOutReport(LossReport):
    draft_agreement: List[float]  # per depth: how often its argmax is the decoder's argmax at that position


def learning_rate_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first min(100, steps / 10) steps, then cosine decay to 10 %."""
    warmup = max(1, min(100, steps // 10))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def install_mtp_loss_tracker(num_layers: int, device: torch.device) -> torch.Tensor:
    """The [num_layers] fp32 tensor megatron adds each depth's mean MTP loss to on every training forward.

    megatron creates it on the current CUDA device on first use; creating it here puts it on
    ``device`` (a CPU run has no CUDA device).
    """
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    values = torch.zeros(num_layers, device=device)
    MTPLossLoggingHelper.tracker["values"] = values
    return values


def train(model: GPTModel, tokens: torch.Tensor, *, steps: int, batch_size: int, seq_len: int, lr: float,
          seed: int, log_every: int = 100) -> LossReport:
    """AdamW on random windows of ``tokens`` [n] uint8; returns the mean losses of the last logging interval.

    On a terminal a progress bar shows steps/s and the latest losses; otherwise (a log file, a
    pipe) one line is printed every ``log_every`` steps.
    """
    import torch
    from tqdm import tqdm

    from byte_corpus import sample_windows

    device = next(model.parameters()).device
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: learning_rate_factor(step, steps))
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(seq_len, device=device).expand(batch_size, seq_len)  # [B, L] int64
    mtp_loss_sums = install_mtp_loss_tracker(model.config.mtp_num_layers or 0, device)  # [depths] fp32
    loss_sum = torch.zeros((), device=device)
    report, interval_steps = LossReport(float("nan"), []), 0
    interactive = sys.stdout.isatty()
    progress = tqdm(total=steps, desc="train", unit="step", disable=not interactive)
    started = time.perf_counter()
    for step in range(steps):
        batch = sample_windows(tokens, batch_size, seq_len + 1, generator)  # [B, L + 1] int64
        per_token_loss = model(batch[:, :-1], positions, None, labels=batch[:, 1:])  # [B, L] fp32
        loss = per_token_loss.mean()  # megatron added the MTP losses to this graph's backward
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss_sum += loss.detach()
        interval_steps += 1
        if (step + 1) % log_every == 0 or step + 1 == steps:
            report = LossReport(loss_sum.item() / interval_steps, (mtp_loss_sums / interval_steps).tolist())
            loss_sum.zero_()
            mtp_loss_sums.zero_()
            interval_steps = 0
            message = f"loss {report.loss:.3f}, mtp {[round(value, 3) for value in report.mtp_losses]}"
            progress.set_postfix_str(message, refresh=False)
            if not interactive:
                elapsed = time.perf_counter() - started
                print(f"step {step + 1}/{steps}: {message} ({elapsed:.0f} s, {(step + 1) / elapsed:.2f} steps/s)",
                      flush=True)
        progress.update()
    progress.close()
    return report


def evaluate(model: GPTModel, tokens: torch.Tensor, seq_len: int, num_windows: int) -> HeldOutReport:
    """Losses and draft agreement over ``num_windows`` evenly spaced windows of ``tokens`` [n] uint8.

    Draft agreement at depth k: over rows i, how often MTP depth k's argmax at row i (its guess
    for token i + k + 2) equals the decoder's argmax at row i + k + 1, with the true text as
    prefix; it estimates the acceptance rate of greedy speculation at that depth.
    """
    import torch
    import torch.nn.functional as F

    from byte_corpus import evenly_spaced_windows
    from mtp_ctrl.models import dense_full_sequence

    was_training = model.training
    model.eval()
    depths = model.config.mtp_num_layers or 0
    loss_sum, mtp_loss_sums, agreement_sums = 0.0, [0.0] * depths, [0.0] * depths
    windows = evenly_spaced_windows(tokens, num_windows, seq_len)  # [num_windows, seq_len] int64
    for window in windows:
        with torch.no_grad():
            logits, mtp_logits = dense_full_sequence(model, window)  # [n, V], depths x [n, V]
        loss_sum += F.cross_entropy(logits[:-1].float(), window[1:]).item()
        greedy = logits.argmax(-1)  # [n] int64
        for depth, depth_logits in enumerate(mtp_logits):
            ahead = depth + 2
            mtp_loss_sums[depth] += F.cross_entropy(depth_logits[:-ahead].float(), window[ahead:]).item()
            agreement_sums[depth] += (depth_logits[:-ahead].argmax(-1) == greedy[ahead - 1:-1]).float().mean().item()
    model.train(was_training)
    return HeldOutReport(loss_sum / num_windows, [value / num_windows for value in mtp_loss_sums],
                         [value / num_windows for value in agreement_sums])


def main(args: Optional[argparse.Namespace] = None):
    args = args or parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)  # before megatron-core is imported
    import torch
    import torch.distributed as dist

    from byte_corpus import load_stdlib_corpus
    from demo_model import DEMO_MODEL_ARGS, build_demo_model, init_distributed, save_checkpoint

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    init_distributed(1, device)
    model_args = dict(DEMO_MODEL_ARGS, mtp_num_layers=args.mtp_num_layers)
    torch.manual_seed(args.seed)
    model = build_demo_model(model_args, dense=True, mtp_loss_scaling_factor=args.mtp_loss_scale).to(device)
    print("reading the standard library's source ...", flush=True)
    corpus = load_stdlib_corpus()
    print(f"corpus: {corpus.train.numel() / 1e6:.1f} MB train, {corpus.held_out.numel() / 1e3:.0f} kB held out "
          f"({corpus.held_out_files[0]} .. {corpus.held_out_files[-1]}); "
          f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters on {device}", flush=True)
    started = time.perf_counter()
    final = train(model, corpus.train.to(device), steps=args.steps, batch_size=args.batch_size,
                  seq_len=args.seq_len, lr=args.lr, seed=args.seed, log_every=args.log_every)
    seconds = time.perf_counter() - started
    print(f"evaluating on {args.eval_windows} held-out windows ...", flush=True)
    held_out = evaluate(model, corpus.held_out.to(device), args.seq_len, args.eval_windows)
    if args.save_format == "dist":
        from mtp_ctrl.models import save_distributed_checkpoint

        save_distributed_checkpoint(model, args.out, content_metadata={"model_args": dict(model_args)})
    else:
        save_checkpoint(args.out, model_args, model)
    print(f"trained {args.steps} steps in {seconds:.0f} s")
    print(f"final train loss {final.loss:.3f} nats/byte; MTP loss per depth "
          f"{[round(value, 3) for value in final.mtp_losses]}")
    print(f"held-out loss {held_out.loss:.3f}; MTP loss per depth {[round(value, 3) for value in held_out.mtp_losses]}; "
          f"draft agreement per depth {[round(value, 3) for value in held_out.draft_agreement]}")
    print(f"saved {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
