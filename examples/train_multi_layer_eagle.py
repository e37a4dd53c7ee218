"""Train multi-layer EAGLE draft layers (layer k drafts token k) for the frozen demo model, end to end.

1. Capture: as examples/train_eagle.py (its ``capture``): the paged target prefills windows of
   training text through ``HiddenStateCapture``; every position's aux hidden states land in shards.
2. Train: ``--num-layers`` dense draft layers (``build_multi_layer_eagle_heads(..., dense=True)``),
   the target frozen, teacher-forced as they are served: layer 1 reads ``fc`` of the captured
   states and ``t_{p+1}``, layer k reads layer k - 1's output at p and ``t_{p+k}``. Loss: the
   mean over layers of the cross-entropy of layer k's logits at p against the *target's*
   next-token distribution at p + k (train_eagle.py's distillation, from the captured last-layer
   state), which is what acceptance measures. No feature regression: each layer is trained for
   its own depth, and it sees the same inputs serving as in training whenever the earlier
   drafts were accepted.
3. Save ``{"model_args", "aux_layer_ids", "num_layers", "target_checkpoint", "state_dict"}`` (bf16):
   eagle_demo.pt's format plus ``num_layers``.
4. Evaluate on held-out text with the serving path: ``MultiLayerEagleProposer`` at S = num_layers,
   greedy: the draft agreement per depth and the mean accepted length.

    python examples/train_multi_layer_eagle.py --out multi_layer_eagle_demo.pt     # H100: about 2 minutes
    python examples/train_multi_layer_eagle.py --quick --out /tmp/mle_quick.pt      # CPU smoke run, seconds
    python examples/generate.py --checkpoint mtp_ctrl/checkpoints/mtp_demo.pt --proposer multi_layer_eagle \\
        --draft-checkpoint multi_layer_eagle_demo.pt --num-speculative-tokens 3
"""

import argparse
import os
import sys
import time
from pathlib import Path

DEFAULT_TARGET = str(Path(__file__).resolve().parents[1] / "mtp_ctrl" / "checkpoints" / "mtp_demo.pt")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=DEFAULT_TARGET, help="the frozen target (examples/train_mtp.py)")
    parser.add_argument("--num-layers", type=int, default=3, help="draft layers = S served (>= 1)")
    parser.add_argument("--aux-layers", default=None,
                        help="comma-separated decoder layers (default: first, middle, last)")
    parser.add_argument("--capture-windows", type=int, default=2048, help="training-text windows captured")
    parser.add_argument("--window-len", type=int, default=512, help="bytes per captured window")
    parser.add_argument("--capture-dir", default=None, help="where the shards go (default: a temporary directory)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256, help="positions per training crop")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (warm-up, cosine decay)")
    parser.add_argument("--eval-prompts", type=int, default=16)
    parser.add_argument("--eval-new-tokens", type=int, default=128)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--out", default="multi_layer_eagle_demo.pt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: a few windows, steps and tokens")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args(argv)
    if args.quick:
        args.capture_windows, args.window_len, args.steps, args.batch_size, args.seq_len = 4, 48, 3, 2, 32
        args.eval_prompts, args.eval_new_tokens = 2, 6
        args.num_layers = min(args.num_layers, 2)
    if args.num_layers < 1:
        parser.error(f"--num-layers must be >= 1, got {args.num_layers}")
    if args.seq_len < args.num_layers + 2:
        parser.error(f"--seq-len must be >= num_layers + 2 = {args.num_layers + 2}, got {args.seq_len}")
    return args


def train_heads(dense, heads, aux, tokens, *, steps: int, batch_size: int, seq_len: int, lr: float, seed: int,
                log_every=None):
    """AdamW on the draft layers only; returns the last step's loss per layer."""

    import torch
    import torch.nn.functional as F

    from mtp_ctrl.models import dense_multi_layer_eagle_forward
    from mtp_ctrl.models.eagle_head import eagle_logits
    from train_eagle import random_crops, set_learning_rate, start_training, target_log_probs

    device = next(heads.parameters()).device
    hidden_size, num_layers = dense.config.hidden_size, heads.num_layers
    optimizer, warmup, generator, last_slot = start_training(heads, dense, lr, steps, seed)
    seq_len = min(seq_len, tokens.shape[1])
    rows_per_crop = seq_len - num_layers - 1  # s: row p's deepest label t_{p+S+1} is still in the crop
    losses = [float("nan")] * num_layers
    for step in range(steps):
        set_learning_rate(optimizer, lr, step, steps, warmup)
        batch_aux, batch_tokens = random_crops(aux, tokens, batch_size, seq_len, generator, device)  # [N, b, mH], [b, N]
        s = rows_per_crop
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            features = heads.project_aux(batch_aux[:s])  # [s, b, H]
            outputs = dense_multi_layer_eagle_forward(dense, heads, features, batch_tokens[:, 1: s + num_layers])
            layer_losses = []
            for depth, out in enumerate(outputs, start=1):  # layer k at p predicts t_{p+k+1}
                logits = eagle_logits(dense, out)  # [s, b, V] fp32
                if last_slot is not None:
                    last = batch_aux[depth: depth + s, :, last_slot * hidden_size:(last_slot + 1) * hidden_size]
                    with torch.no_grad():
                        target = target_log_probs(dense, last).exp()  # [s, b, V]: the target at p + k
                    layer_losses.append(-(target * logits.log_softmax(-1)).sum(-1).mean())
                else:
                    labels = batch_tokens[:, depth + 1: depth + 1 + s].transpose(0, 1)  # [s, b]
                    layer_losses.append(F.cross_entropy(logits.flatten(0, 1), labels.flatten()))
            loss = torch.stack(layer_losses).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        optimizer.step()
        losses = [float(value.detach()) for value in layer_losses]
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:5d}  loss per layer {[round(value, 3) for value in losses]}", flush=True)
    heads.eval()
    return losses


def evaluate(model, path: str, prompts, new_tokens: int, device):
    """Greedy generation with the saved layers at S = num_layers: (acceptance per depth, mean accepted length)."""
    from mtp_ctrl.cli.draft_heads import load_multi_layer_eagle_heads
    from mtp_ctrl.controllers import MultiLayerEagleProposer, SamplingParams
    from train_eagle import make_controller

    heads = load_multi_layer_eagle_heads(model, path)
    controller = make_controller(model, heads.num_layers, MultiLayerEagleProposer(heads),
                                 max(len(p) for p in prompts) + new_tokens + 8, device)
    controller.generate(prompts, SamplingParams(max_new_tokens=new_tokens))
    metrics = controller.metrics.as_dict()
    controller.close()
    return metrics["acceptance_per_depth"], metrics["mean_accepted_length"]


def main(argv=None):
    args = parse_args(argv)
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)  # before megatron-core is imported
    import torch
    import torch.distributed as dist

    from byte_corpus import evenly_spaced_windows
    from demo_model import CHECKPOINT_DTYPE
    from mtp_ctrl.models import build_multi_layer_eagle_heads
    from train_eagle import capture_training_states

    device, model_args, paged, dense, aux_layer_ids, corpus, aux, tokens, capture_seconds = capture_training_states(args)
    torch.manual_seed(args.seed)
    heads = build_multi_layer_eagle_heads(dense, args.num_layers, aux_layer_ids, dense=True,
                                          use_transformer_engine=False).float().to(device)
    started = time.perf_counter()
    losses = train_heads(dense, heads, aux, tokens, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                         lr=args.lr, seed=args.seed, log_every=None if args.quick else max(1, args.steps // 20))
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.perf_counter() - started
    state_dict = {name: value.detach().to("cpu", CHECKPOINT_DTYPE)
                  if torch.is_tensor(value) and value.is_floating_point() else value
                  for name, value in heads.state_dict().items()}
    torch.save({"model_args": dict(model_args), "aux_layer_ids": list(aux_layer_ids), "num_layers": args.num_layers,
                "target_checkpoint": os.path.basename(args.checkpoint), "state_dict": state_dict,
                "train_seconds": capture_seconds + train_seconds}, args.out)  # the training cost, capture included
    held_out = evenly_spaced_windows(corpus.held_out, args.eval_prompts, 64)
    prompts = [window.tolist() for window in held_out]
    acceptance, accepted_length = evaluate(paged, args.out, prompts, args.eval_new_tokens, device)
    print(f"trained {args.num_layers} layers, {args.steps} steps in {train_seconds:.0f} s ({device.type}-seconds: "
          f"capture {capture_seconds:.0f}, training {train_seconds:.0f}); final loss per layer "
          f"{[round(value, 3) for value in losses]}")
    print(f"held-out greedy, S = {args.num_layers}: draft agreement per depth {[round(a, 3) for a in acceptance]}, "
          f"mean accepted length {accepted_length:.2f}")
    print(f"saved {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules (demo_model, train_eagle, ...)
    main()
