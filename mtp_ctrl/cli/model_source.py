"""The model options ``generate`` and ``serve`` share: the arguments (:func:`add_model_arguments`),
their checks that need no torch (:func:`check_model_arguments`, run before torch is imported so a
typo fails at once), and reading and building the model they name (a bad file ends the script
with one ``error:`` line, never a traceback)."""

import argparse
import json
import os
import sys
import time

DEFAULT_DRAFT_CHECKPOINTS = {"eagle": "eagle_demo", "ptd": "ptd_demo", "multi_layer_eagle": "multi_layer_eagle_demo"}
TRAINED_BY = {"eagle": "examples/train_eagle.py", "ptd": "examples/train_eagle.py --mode ptd",
              "multi_layer_eagle": "examples/train_multi_layer_eagle.py"}


def add_model_arguments(parser) -> None:
    """The options that say which model and drafter to run and how (generate.py and the server)."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", default=None,
                        help="a file written by examples/train_mtp.py (default: the shipped demo model)")
    source.add_argument("--load", default=None, metavar="DIR", help="a megatron dist_checkpointing directory")
    source.add_argument("--random-weights", action="store_true",
                        help="an untrained model of the demo's shape (drafts are almost never accepted)")
    source.add_argument("--hf", default=None, metavar="DIR",
                        help="a Hugging Face checkpoint directory (config.json + safetensors + tokenizer.json)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="--hf: the weights' dtype (default: the checkpoint's on CUDA, float32 on a CPU)")
    parser.add_argument("--model-args", default=None, metavar="JSON",
                        help="the model's shape for --load (default: the checkpoint's content metadata)")
    parser.add_argument("--num-speculative-tokens", type=int, default=2, help="S, drafts per step (>= 1)")
    parser.add_argument("--mtp-attention", choices=("paged", "single_position"), default="paged")
    parser.add_argument("--mtp-reuse-last-layer", action="store_true",
                        help="--proposer mtp: S may exceed the checkpoint's MTP layers; the deeper drafts rerun its "
                             "last MTP layer (e.g. Qwen3-Next ships one; acceptance past it depends on training)")
    parser.add_argument("--proposer", choices=("mtp", "eagle", "ptd", "multi_layer_eagle"), default="mtp",
                        help="drafter: the model's MTP layers, an EAGLE head drafting serially, a parallel-drafting "
                             "head drafting all S tokens in one pass, or multi-layer EAGLE draft layers "
                             "(--draft-checkpoint)")
    parser.add_argument("--draft-checkpoint", default=None, metavar="PATH",
                        help="the drafter's weights: an EAGLE head (examples/train_eagle.py), a parallel-drafting "
                             "head (train_eagle.py --mode ptd), or draft layers (examples/train_multi_layer_eagle.py); "
                             "with the shipped target, each proposer defaults to its shipped head "
                             "(mtp_ctrl/checkpoints: eagle_demo.pt, ptd_demo.pt, multi_layer_eagle_demo.pt)")
    parser.add_argument("--draft-hf", default=None, metavar="DIR",
                        help="--hf --proposer eagle: a public EAGLE-3 head directory (the EAGLE / SpecForge "
                             "layout: config.json + safetensors with its d2t draft vocabulary)")
    parser.add_argument("--decode-steps-per-launch", type=int, default=4,
                        help="decode steps one launch may run back to back (one host build and apply for all): "
                             "a small model's step is shorter than the host's work for it (1 = one step per launch)")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV (on hybrids also the recurrent state) of prompt prefixes shared with "
                             "earlier requests (docs/prefix_caching.md); on by default")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (= processes under torchrun)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")


def check_model_arguments(parser, args, min_speculative_tokens: int = 1) -> None:
    """Checks of add_model_arguments' options that need no torch (errors through ``parser``)."""
    if args.num_speculative_tokens < min_speculative_tokens:
        parser.error(f"--num-speculative-tokens must be >= {min_speculative_tokens}, got {args.num_speculative_tokens}")
    for name in ("tp", "decode_steps_per_launch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.model_args is not None:
        if args.load is None:
            parser.error("--model-args goes with --load")
        try:
            args.model_args = json.loads(args.model_args)
        except json.JSONDecodeError as error:
            parser.error(f"--model-args is not JSON: {error}")
        if not isinstance(args.model_args, dict):
            parser.error("--model-args must be a JSON object")
    if args.hf is None and args.dtype:
        parser.error("--dtype goes with --hf")
    check_sources(parser, args)


def check_sources(parser, args) -> None:
    """What can be checked without torch: the device's name, the process count, that the files
    exist, and which draft checkpoint goes with --proposer (the shipped head for the shipped target)."""
    from mtp_ctrl.checkpoints import shipped_checkpoint_path

    if args.device is not None and args.device.split(":")[0] not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != args.tp:
        parser.error(f"--tp {args.tp} needs {args.tp} processes, got {world_size} (use torchrun --nproc-per-node "
                     f"{args.tp})")
    try:
        shipped_target = shipped_checkpoint_path()
    except FileNotFoundError as error:  # an install without its package data: --checkpoint still works
        if args.checkpoint is None and args.load is None and args.hf is None and not args.random_weights:
            parser.error(str(error))
        shipped_target = None
    if args.hf is not None:
        if not os.path.isfile(os.path.join(args.hf, "config.json")):
            parser.error(f"--hf {args.hf} is not a Hugging Face checkpoint directory (no config.json)")
        if args.proposer not in ("mtp", "eagle"):
            parser.error("--hf drafts with the checkpoint's own MTP layers (--proposer mtp) or a public EAGLE-3 "
                         "head (--proposer eagle --draft-hf DIR)")
        if args.draft_checkpoint is not None:
            parser.error("--hf takes its draft head as --draft-hf DIR (a public EAGLE-3 head), not --draft-checkpoint")
        if (args.proposer == "eagle") != (args.draft_hf is not None):
            parser.error("--proposer eagle with --hf needs --draft-hf DIR, and --draft-hf goes with --proposer eagle")
        if args.draft_hf is not None and not os.path.isfile(os.path.join(args.draft_hf, "config.json")):
            parser.error(f"--draft-hf {args.draft_hf} is not an EAGLE-3 head directory (no config.json)")
        return
    if args.draft_hf is not None:
        parser.error("--draft-hf goes with --hf")
    if args.checkpoint is None and args.load is None and not args.random_weights:
        args.checkpoint = shipped_target
    for flag, path, exists in (("--checkpoint", args.checkpoint, os.path.isfile),
                               ("--draft-checkpoint", args.draft_checkpoint, os.path.isfile),
                               ("--load", args.load, os.path.isdir)):
        if path is not None and not exists(path):
            parser.error(f"{flag} {path} does not exist{' (a directory is expected)' if flag == '--load' else ''}")
    # the shipped heads were trained for the shipped target: a default only when serving that one
    serves_shipped_target = args.checkpoint is not None and shipped_target is not None and \
        os.path.samefile(args.checkpoint, shipped_target)
    if args.draft_checkpoint is None and serves_shipped_target and args.proposer in DEFAULT_DRAFT_CHECKPOINTS:
        args.draft_checkpoint = shipped_checkpoint_path(DEFAULT_DRAFT_CHECKPOINTS[args.proposer])
    if args.proposer == "mtp" and args.draft_checkpoint is not None:
        parser.error("--draft-checkpoint PATH goes with --proposer eagle, ptd or multi_layer_eagle")
    if args.proposer != "mtp" and args.draft_checkpoint is None:
        parser.error(f"--proposer {args.proposer} needs --draft-checkpoint PATH ({TRAINED_BY[args.proposer]} "
                     "writes one; the shipped heads go with the shipped target only)")


def dist_checkpoint_model_args(args):
    """The model shape of --load: --model-args, else the checkpoint's content metadata."""
    if args.model_args is not None:
        return args.model_args
    from mtp_ctrl.models import read_content_metadata

    if not os.path.isfile(os.path.join(args.load, "metadata.json")):
        sys.exit(f"error: --load {args.load} is not a megatron dist_checkpointing directory (no metadata.json)")
    try:
        metadata = read_content_metadata(args.load) or {}
    except ValueError as error:  # a damaged file, named
        sys.exit(f"error: --load: {error}")
    if not isinstance(metadata.get("model_args"), dict):
        sys.exit(f"error: {args.load} does not record its model shape (no content metadata 'model_args'): "
                 "pass --model-args '{\"num_layers\": ..., ...}' (see --help)")
    return metadata["model_args"]


def read_model_source(args):
    """``(model_args, state_dict or None)`` of --checkpoint / --load (None for --random-weights),
    after checking the drafter's checkpoint and that the model has S MTP layers; a bad file ends
    the script with one ``error:`` line."""
    from mtp_ctrl.models.demo_model import load_checkpoint

    checkpoint = None
    if args.checkpoint:
        checkpoint = checkpoint_or_exit("--checkpoint", args.checkpoint, load_checkpoint)
    if args.draft_checkpoint:
        checkpoint_or_exit("--draft-checkpoint", args.draft_checkpoint, read_draft_checkpoint)
    if args.load:
        checkpoint = (dist_checkpoint_model_args(args), None)  # (model_args, weights read after the build)
    source = args.checkpoint or args.load
    depth = 0 if checkpoint is None else checkpoint[0].get("mtp_num_layers", 0)
    if checkpoint is not None and args.proposer == "mtp" and args.num_speculative_tokens > depth and \
            not (args.mtp_reuse_last_layer and depth > 0):
        sys.exit(f"error: --num-speculative-tokens {args.num_speculative_tokens} needs at least that many MTP "
                 f"layers; {source} has {checkpoint[0].get('mtp_num_layers', 0)} (use "
                 f"--num-speculative-tokens {checkpoint[0].get('mtp_num_layers', 0)} or less, or "
                 f"--mtp-reuse-last-layer)")
    return checkpoint


def pick_device(args):
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda, but torch sees no CUDA device (use --device cpu)")
    return device


def build_model(args, checkpoint, device):
    """The target model on ``device``, this rank's shard (process groups initialised)."""
    import torch
    import torch.distributed as dist

    from mtp_ctrl.models.demo_model import DEMO_MODEL_ARGS, build_demo_model, config_overrides, load_full_state_dict

    if checkpoint is not None:
        model = build_demo_model(checkpoint[0], tensor_parallel_size=args.tp, **config_overrides(checkpoint[0]))
        if args.load:
            from mtp_ctrl.models import load_distributed_checkpoint

            model = model.to(device)  # each rank reads its shard straight into the device's memory
            started = time.perf_counter()
            checkpoint_or_exit("--load", args.load, lambda path: load_distributed_checkpoint(model, path))
            if dist.get_rank() == 0:
                print(f"loaded {args.load} at TP {args.tp} in {time.perf_counter() - started:.2f} s")
        else:
            checkpoint_or_exit("--checkpoint", args.checkpoint, lambda path: load_full_state_dict(model, checkpoint[1]))
    else:
        model_args = dict(DEMO_MODEL_ARGS, mtp_num_layers=args.num_speculative_tokens)
        torch.manual_seed(1234)  # every rank draws the same master weights and keeps its shard
        model = build_demo_model(model_args, tensor_parallel_size=args.tp)
    return model.to(device).eval()


def checkpoint_or_exit(flag: str, path: str, read):
    """``read(path)``; a file that is not what ``flag`` expects (another format, truncated, another
    shape) ends the script with one ``error:`` line instead of a traceback."""
    try:
        return read(path)
    except (ValueError, RuntimeError, KeyError, OSError, EOFError) as error:
        detail = str(error).strip()
        sys.exit(f"error: {flag} {path}: {detail.splitlines()[0] if detail else type(error).__name__}")


def read_draft_checkpoint(path: str) -> dict:
    """The draft checkpoint's dict, read once before the model is built, so that a file that is
    not a draft checkpoint fails at once (its kind is checked when the proposer is built)."""
    import torch

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises RuntimeError, pickle's errors, EOFError, ... for bad files
        raise ValueError(f"not a readable torch checkpoint ({type(error).__name__})") from error
    if not isinstance(saved, dict) or not {"aux_layer_ids", "state_dict"} <= set(saved):
        raise ValueError("not a draft-head checkpoint (a dict with aux_layer_ids and state_dict, as "
                         "examples/train_eagle.py and train_multi_layer_eagle.py write)")
    return saved
