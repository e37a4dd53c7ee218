"""Train an EAGLE-3-style draft head for the frozen demo model, end to end (serial EAGLE drafting,
or with ``--mode ptd`` a parallel-drafting head that drafts all S tokens in one forward).

1. Capture: the paged target generates over windows of training text (the Python standard
   library's source, examples/byte_corpus.py) with ``HiddenStateCapture``: each window is a
   prompt, so every byte of it is verified and its aux hidden states (an early, a middle and the
   last decoder layer) land in safetensors shards, from the serving forward itself.
2. Train: the head (``mtp_ctrl.models.build_eagle_head(..., dense=True)``) on the captured
   states, the target frozen. Losses (our choice, and why):
   - token loss: cross-entropy of the head's logits at position p against the *target's*
     next-token distribution at p + 1 (computed from the captured last-layer state through the
     target's final norm and output layer, no second target forward). Distilling the target's
     distribution rather than the text's next byte is what acceptance measures: a draft is kept
     when it equals the target's token.
   - feature loss (EAGLE's regression): smooth L1 between the head's output at p and the step-1
     feature at p + 1 (``fc`` of the captured states, detached). Draft steps k > 1 feed the head
     its own output as the feature, so training that output to look like the next position's
     feature is what makes deeper drafts work. Weight ``--feature-loss-scale`` (0.5).
   - EAGLE-3's training-time test (unrolling the head on its own outputs with the matching
     attention mask) is not done here: it needs a custom attention mask over the unrolled
     depths; the feature loss is the cheaper stand-in. Depth agreement below shows its effect.
   ``--mode ptd`` (parallel drafting) trains the head as ``ParallelDraftingProposer`` runs it:
   every position p of a crop is an anchor (its last verified row, token t_{p+1}) followed by
   ``--eval-depth - 1`` mask rows (``mask_token_id``, the learned ``mask_hidden`` feature) at
   positions p + 1, ...; a mask row attends to the verified rows <= p and its anchor's earlier
   mask rows only (``mtp_ctrl.models.ptd_layout``), all anchors in one forward. Draft k of anchor
   p (row p for k = 1, its (k-1)-th mask row after) is distilled to the target's distribution of
   t_{p+k+1}; each depth's loss weighs the same. No feature loss: no output is fed back.
3. Save ``{"model_args", "aux_layer_ids", "target_checkpoint", "state_dict"}`` (bf16), and with
   ``--mode ptd`` ``"mask_token_id"`` (``mask_hidden`` is in the state_dict).
4. Evaluate on held-out text with the serving path: ``EagleProposer`` (or
   ``ParallelDraftingProposer``) at ``--eval-depth`` drafts, greedy; prints the acceptance rate
   per depth (draft agreement: how often the k-th draft is the target's token, given the earlier
   ones were) and the mean accepted length.

    python examples/train_eagle.py --out eagle_demo.pt                       # H100: a few minutes
    python examples/train_eagle.py --quick --out /tmp/eagle_quick.pt         # CPU smoke run, seconds
    python examples/train_eagle.py --mode ptd --out mtp_ctrl/checkpoints/ptd_demo.pt   # parallel drafting
    python examples/train_eagle.py --mode ptd --quick --out /tmp/ptd_quick.pt
    python examples/generate.py --checkpoint mtp_ctrl/checkpoints/mtp_demo.pt --proposer eagle \\
        --draft-checkpoint eagle_demo.pt --num-speculative-tokens 3
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

DEFAULT_TARGET = str(Path(__file__).resolve().parents[1] / "mtp_ctrl" / "checkpoints" / "mtp_demo.pt")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("eagle", "ptd"), default="eagle",
                        help="eagle: serial drafting (EagleProposer); ptd: parallel drafting, all drafts in one "
                             "forward (ParallelDraftingProposer), trained for S = --eval-depth")
    parser.add_argument("--mask-token-id", type=int, default=None,
                        help="--mode ptd: the mask rows' token (default: the vocabulary's last id, never text)")
    parser.add_argument("--checkpoint", default=DEFAULT_TARGET, help="the frozen target (examples/train_mtp.py)")
    parser.add_argument("--aux-layers", default=None, help="comma-separated decoder layers (default: first, middle, last)")
    parser.add_argument("--capture-windows", type=int, default=2048, help="training-text windows captured")
    parser.add_argument("--window-len", type=int, default=512, help="bytes per captured window")
    parser.add_argument("--capture-dir", default=None, help="where the shards go (default: a temporary directory)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256, help="positions per training crop")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (warm-up, cosine decay)")
    parser.add_argument("--feature-loss-scale", type=float, default=0.5)
    parser.add_argument("--eval-prompts", type=int, default=16)
    parser.add_argument("--eval-new-tokens", type=int, default=128)
    parser.add_argument("--eval-depth", type=int, default=4,
                        help="S of the held-out evaluation (--mode ptd: also the S trained for)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--out", default="eagle_demo.pt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: a few windows, steps and tokens")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args(argv)
    if args.eval_depth < 1:
        parser.error(f"--eval-depth must be >= 1, got {args.eval_depth}")
    if args.mask_token_id is not None and args.mode != "ptd":
        parser.error("--mask-token-id goes with --mode ptd")
    if args.quick:
        args.capture_windows, args.window_len, args.steps, args.batch_size, args.seq_len = 4, 48, 3, 2, 32
        args.eval_prompts, args.eval_new_tokens, args.eval_depth = 2, 6, 2
    return args


def load_target(path: str, device):
    """(paged target for serving and capture, dense twin for training), frozen, same weights."""
    from demo_model import build_demo_model, load_checkpoint, load_full_state_dict

    model_args, state_dict = load_checkpoint(path)
    paged = build_demo_model(model_args)
    load_full_state_dict(paged, state_dict)
    dense = build_demo_model(model_args, dense=True)
    load_full_state_dict(dense, state_dict)
    for model in (paged, dense):
        model.to(device).eval().requires_grad_(False)
    return model_args, paged, dense


def make_controller(model, num_speculative_tokens: int, proposer, max_model_len: int, device, max_requests: int = 8):
    from mtp_ctrl.controllers import InferenceConfig, TextGenerationController

    graphs = (1, 2, 4, 8) if device.type == "cuda" else ()
    config = InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=max_requests,
                             block_size_tokens=16, max_model_len=max_model_len,
                             max_tokens_per_step=max(1024, max_requests * (num_speculative_tokens + 1)),
                             cuda_graph_batch_sizes=graphs)
    return TextGenerationController(model, config, proposer=proposer)


def capture(model, windows, aux_layer_ids, output_dir: str, device):
    """Prefill every window (one sampled token each) through HiddenStateCapture; returns
    ``(aux [n, W, k * H], tokens [n, W] int64)`` on the CPU, in window order."""
    import torch

    from mtp_ctrl.controllers import HiddenStateCapture, SamplingParams
    from mtp_ctrl.controllers.hidden_state_capture import load_capture

    window_len = windows.shape[1]
    recorder = HiddenStateCapture(aux_layer_ids, output_dir, capacity_tokens=1 << 16)
    controller = make_controller(model, 1, recorder, window_len + 8, device)
    controller.generate([w.tolist() for w in windows], SamplingParams(max_new_tokens=1))
    recorder.close()
    hidden, tokens, positions, request_ids = load_capture(output_dir)
    keep = positions < window_len  # the prompt's rows (request ids are 0..n-1 in window order)
    count = windows.shape[0]
    aux = hidden[keep].view(count, window_len, -1)
    tokens = tokens[keep].view(count, window_len)
    if not torch.equal(tokens, windows.long().cpu()):
        raise RuntimeError("captured token ids differ from the windows")
    return aux, tokens


def target_log_probs(dense, aux_last):  # [s, b, H] -> [s, b, V] fp32
    from mtp_ctrl.models.eagle_head import eagle_logits

    return eagle_logits(dense, aux_last).log_softmax(-1)


def set_learning_rate(optimizer, lr: float, step: int, steps: int, warmup: int) -> None:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``steps``."""
    import math

    if step < warmup:
        factor = (step + 1) / warmup
    else:
        factor = 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    for group in optimizer.param_groups:
        group["lr"] = lr * factor


def start_training(module, dense, lr: float, steps: int, seed: int):
    """What every training loop starts with: ``module`` in train mode, its AdamW optimizer, the
    warm-up length, a seeded generator for the crops, and the slot of the target's last decoder
    layer among ``module.aux_layer_ids`` (None when it is not captured). Returns ``(optimizer,
    warmup, generator, last_slot)``."""
    import torch

    module.train()
    optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    last_layer = dense.config.num_layers - 1
    last_slot = module.aux_layer_ids.index(last_layer) if last_layer in module.aux_layer_ids else None
    return optimizer, max(1, steps // 20), torch.Generator().manual_seed(seed), last_slot


def random_crops(aux, tokens, batch_size: int, seq_len: int, generator, device):
    """``batch_size`` random crops of ``seq_len`` captured positions: aux states ``[s, b, k * H]``
    (sequence first, as megatron's layers take them) and tokens ``[b, s]``, on ``device``."""
    import torch

    crops = torch.randint(0, tokens.shape[0], (batch_size,), generator=generator)
    starts = torch.randint(0, tokens.shape[1] - seq_len + 1, (batch_size,), generator=generator)
    index = starts[:, None] + torch.arange(seq_len)[None, :]  # [b, s]
    return aux[crops[:, None], index].to(device).transpose(0, 1), tokens[crops[:, None], index].to(device)


def train_head(dense, head, aux, tokens, *, steps: int, batch_size: int, seq_len: int, lr: float,
               feature_loss_scale: float, seed: int, log_every: Optional[int] = None):
    """AdamW on the head only; returns the last step's ``(token_loss, feature_loss)``."""

    import torch
    import torch.nn.functional as F

    from mtp_ctrl.models.eagle_head import dense_eagle_forward, eagle_logits

    device = next(head.parameters()).device
    hidden_size = dense.config.hidden_size
    optimizer, warmup, generator, last_slot = start_training(head, dense, lr, steps, seed)
    last_is_aux = last_slot is not None
    seq_len = min(seq_len, tokens.shape[1])
    losses = (float("nan"), float("nan"))
    for step in range(steps):
        set_learning_rate(optimizer, lr, step, steps, warmup)
        batch_aux, batch_tokens = random_crops(aux, tokens, batch_size, seq_len, generator, device)  # [s, b, kH], [b, s]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            features = head.project_aux(batch_aux)  # [s, b, H]
            out = dense_eagle_forward(dense, head, features[:-1], batch_tokens[:, 1:])  # [s - 1, b, H]: predicts t_{p+2}
            logits = eagle_logits(dense, out[:-1])  # [s - 2, b, V]
            if last_is_aux:
                last = batch_aux[1:-1, :, last_slot * hidden_size:(last_slot + 1) * hidden_size]  # target at p + 1
                with torch.no_grad():
                    target = target_log_probs(dense, last).exp()  # [s - 2, b, V]
                token_loss = -(target * logits.log_softmax(-1)).sum(-1).mean()
            else:
                token_loss = F.cross_entropy(logits.flatten(0, 1), batch_tokens[:, 2:].transpose(0, 1).flatten())
            feature_loss = F.smooth_l1_loss(out[:-1].float(), features[1:-1].detach().float())
            loss = token_loss + feature_loss_scale * feature_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        losses = (float(token_loss.detach()), float(feature_loss.detach()))
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:5d}  token loss {losses[0]:.3f}  feature loss {losses[1]:.4f}", flush=True)
    head.eval()
    return losses


def train_head_ptd(dense, head, aux, tokens, *, steps: int, batch_size: int, seq_len: int, lr: float, depth: int,
                   seed: int, log_every: Optional[int] = None):
    """AdamW on a parallel-drafting head (``mask_hidden`` included) over the multi-anchor layout
    of ``mtp_ctrl.models.ptd_layout``; returns the last step's loss per depth ``[depth]``."""

    import torch

    from mtp_ctrl.models.eagle_head import eagle_logits
    from mtp_ctrl.models.ptd_layout import dense_ptd_forward, ptd_draft_rows

    device = next(head.parameters()).device
    hidden_size = dense.config.hidden_size
    optimizer, warmup, generator, last_slot = start_training(head, dense, lr, steps, seed)
    last_is_aux = last_slot is not None
    seq_len = min(seq_len, tokens.shape[1])
    num_anchors, num_mask_rows = seq_len - 1, depth - 1  # anchors p = 0 .. s - 2 (row p's token t_{p+1})
    draft_rows = ptd_draft_rows(num_anchors, num_mask_rows, device)  # [n, depth]
    # anchor p's draft k (column k - 1) predicts t_{p+k+1}: the target's distribution at position p + k
    target_positions = torch.arange(num_anchors, device=device)[:, None] + torch.arange(1, depth + 1, device=device)
    valid = target_positions <= seq_len - 1  # [n, depth] (the target's state at p + k is in the crop)
    if not last_is_aux:
        valid &= target_positions + 1 <= seq_len - 1  # the next byte t_{p+k+1} is in the crop
    target_positions = target_positions.clamp(max=seq_len - 1)
    losses = [float("nan")] * depth
    for step in range(steps):
        set_learning_rate(optimizer, lr, step, steps, warmup)
        batch_aux, batch_tokens = random_crops(aux, tokens, batch_size, seq_len, generator, device)  # [s, b, kH], [b, s]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            features = head.project_aux(batch_aux[:-1])  # [n, b, H]
            out = dense_ptd_forward(dense, head, features, batch_tokens[:, 1:], num_mask_rows)  # [n * depth, b, H]
            logits = eagle_logits(dense, out[draft_rows.flatten()])  # [n * depth, b, V] fp32
            log_probs = logits.log_softmax(-1).view(num_anchors, depth, batch_size, -1)  # [n, depth, b, V]
            if last_is_aux:
                last = batch_aux[target_positions.flatten(), :, last_slot * hidden_size:(last_slot + 1) * hidden_size]
                with torch.no_grad():
                    target = target_log_probs(dense, last).exp().view_as(log_probs)  # [n, depth, b, V]
                per_row = -(target * log_probs).sum(-1)  # [n, depth, b]
            else:
                labels = batch_tokens.transpose(0, 1)[(target_positions + 1).clamp(max=seq_len - 1)]  # [n, depth, b]
                per_row = -log_probs.gather(-1, labels[..., None])[..., 0]
            weights = valid[..., None].float()  # [n, depth, 1]
            depth_losses = (per_row * weights).sum((0, 2)) / (weights.sum((0, 2)) * batch_size)  # [depth]
            loss = depth_losses.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        losses = [float(value) for value in depth_losses.detach()]
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:5d}  token loss per depth {[round(value, 3) for value in losses]}", flush=True)
    head.eval()
    return losses


def evaluate(model, head_state, aux_layer_ids, prompts, depth: int, new_tokens: int, device,
             mask_token_id: Optional[int] = None):
    """Greedy generation with EagleProposer at ``depth`` (ParallelDraftingProposer when
    ``mask_token_id`` is given): (acceptance per depth, mean accepted length)."""
    from mtp_ctrl.controllers import EagleProposer, ParallelDraftingProposer, SamplingParams
    from mtp_ctrl.models import build_eagle_head

    head = build_eagle_head(model, aux_layer_ids, use_transformer_engine=False,
                            parallel_drafting=mask_token_id is not None, mask_token_id=mask_token_id)
    head.load_state_dict(head_state)
    head.to(device)
    proposer = EagleProposer(head) if mask_token_id is None else ParallelDraftingProposer(head)
    controller = make_controller(model, depth, proposer, max(len(p) for p in prompts) + new_tokens + 8, device)
    controller.generate(prompts, SamplingParams(max_new_tokens=new_tokens))
    metrics = controller.metrics.as_dict()
    controller.close()
    return metrics["acceptance_per_depth"], metrics["mean_accepted_length"]


def capture_training_states(args):
    """The set-up both training scripts share: the device, the frozen target (paged and dense),
    the aux layers, and the capture of their states over ``args.capture_windows`` windows of the
    training text. Returns ``(device, model_args, paged, dense, aux_layer_ids, corpus, aux [n, W,
    k*H], tokens [n, W], capture_seconds)``."""
    import torch

    from byte_corpus import evenly_spaced_windows, load_stdlib_corpus
    from demo_model import init_distributed
    from mtp_ctrl.models import default_aux_layer_ids

    device = torch.device(args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    init_distributed(1, device)
    model_args, paged, dense = load_target(args.checkpoint, device)
    aux_layer_ids = tuple(int(x) for x in args.aux_layers.split(",")) if args.aux_layers else \
        default_aux_layer_ids(model_args["num_layers"])
    corpus = load_stdlib_corpus()
    windows = evenly_spaced_windows(corpus.train, args.capture_windows, args.window_len)  # [n, W]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        aux, tokens = capture(paged, windows, aux_layer_ids, args.capture_dir or scratch, device)
    capture_seconds = time.perf_counter() - started
    print(f"captured {tokens.numel()} positions x {aux.shape[-1]} states (layers {list(aux_layer_ids)}) "
          f"in {capture_seconds:.0f} s", flush=True)
    return device, model_args, paged, dense, aux_layer_ids, corpus, aux, tokens, capture_seconds


def main(argv=None):
    args = parse_args(argv)
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)  # before megatron-core is imported
    import torch
    import torch.distributed as dist

    from byte_corpus import evenly_spaced_windows
    from demo_model import CHECKPOINT_DTYPE
    from mtp_ctrl.models import build_eagle_head

    device, model_args, paged, dense, aux_layer_ids, corpus, aux, tokens, capture_seconds = capture_training_states(args)
    torch.manual_seed(args.seed)
    ptd = args.mode == "ptd"
    head = build_eagle_head(dense, aux_layer_ids, dense=True, use_transformer_engine=False, parallel_drafting=ptd,
                            mask_token_id=args.mask_token_id).float().to(device)
    started = time.perf_counter()
    log_every = None if args.quick else max(1, args.steps // 20)
    if ptd:
        depth_losses = train_head_ptd(dense, head, aux, tokens, steps=args.steps, batch_size=args.batch_size,
                                      seq_len=args.seq_len, lr=args.lr, depth=args.eval_depth, seed=args.seed,
                                      log_every=log_every)
        final_losses = f"final token loss per depth {[round(value, 3) for value in depth_losses]}"
    else:
        token_loss, feature_loss = train_head(dense, head, aux, tokens, steps=args.steps, batch_size=args.batch_size,
                                              seq_len=args.seq_len, lr=args.lr,
                                              feature_loss_scale=args.feature_loss_scale, seed=args.seed,
                                              log_every=log_every)
        final_losses = f"final token loss {token_loss:.3f}, feature loss {feature_loss:.4f}"
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.perf_counter() - started
    state_dict = {name: value.detach().to("cpu", CHECKPOINT_DTYPE) if torch.is_tensor(value) and value.is_floating_point()
                  else value for name, value in head.state_dict().items()}
    saved = {"model_args": dict(model_args), "aux_layer_ids": list(aux_layer_ids),
             "target_checkpoint": os.path.basename(args.checkpoint), "state_dict": state_dict,
             "train_seconds": capture_seconds + train_seconds}  # the training cost, capture included
    if ptd:
        saved.update(mode="ptd", mask_token_id=head.mask_token_id, trained_depth=args.eval_depth)
    torch.save(saved, args.out)
    held_out = evenly_spaced_windows(corpus.held_out, args.eval_prompts, 64)
    acceptance, accepted_length = evaluate(paged, state_dict, aux_layer_ids, [w.tolist() for w in held_out],
                                           args.eval_depth, args.eval_new_tokens, device,
                                           mask_token_id=head.mask_token_id if ptd else None)
    print(f"trained {args.steps} steps in {train_seconds:.0f} s ({device.type}-seconds: capture {capture_seconds:.0f}, "
          f"training {train_seconds:.0f}); {final_losses}")
    print(f"held-out greedy, S = {args.eval_depth}: draft agreement per depth {[round(a, 3) for a in acceptance]}, "
          f"mean accepted length {accepted_length:.2f}")
    print(f"saved {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules (demo_model, byte_corpus)
    main()
