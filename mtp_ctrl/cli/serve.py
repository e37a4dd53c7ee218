"""Serve a model with speculative decoding over an OpenAI-compatible HTTP API.

    python -m mtp_ctrl.serve                                  # the shipped demo model, http://127.0.0.1:8000
    python -m mtp_ctrl.serve --port 8001 --num-speculative-tokens 2 --proposer eagle
    torchrun --nproc-per-node 2 -m mtp_ctrl.serve --tp 2     # rank 0 serves HTTP, every rank steps
    mtp-ctrl-serve ...                                        # the same, once pip-installed

Then point any OpenAI client at it:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.completions.create(model="mtp_ctrl-demo", prompt="def main(", max_tokens=32, temperature=0)

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (streaming with ``"stream": true``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus). The model options are
``examples/generate.py``'s (``--checkpoint``, ``--load DIR``, ``--random-weights``, ``--proposer``,
``--num-speculative-tokens``, ``--tp``...). The demo model reads and writes UTF-8 bytes; a Hugging
Face checkpoint (``--hf DIR``) its own tokenizer and chat template. Needs the ``serve`` extra
(FastAPI, uvicorn).
"""

import argparse
import os
import sys


def parse_args(argv=None):
    from mtp_ctrl.cli.model_source import add_model_arguments, check_model_arguments

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default="mtp_ctrl-demo", help="the model name clients send")
    parser.add_argument("--max-requests", type=int, default=None,
                        help="requests decoding at once; more wait in the queue (default: 32 on CUDA, 4 on CPU)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="prompt + output tokens per request (default: the model's max_sequence_length - S)")
    args = parser.parse_args(argv)
    for name in ("max_requests", "max_model_len"):
        if getattr(args, name) is not None and getattr(args, name) < 2:
            parser.error(f"--{name.replace('_', '-')} must be >= 2, got {getattr(args, name)}")
    if not 0 <= args.port < 65536:
        parser.error(f"--port must be in [0, 65536), got {args.port}")
    check_model_arguments(parser, args, min_speculative_tokens=0)  # S = 0: plain decoding
    return args


def make_server_controller(model, args, device, max_sequence_length: int):
    """A controller sized for serving: ``--max-requests`` rows, graphs for every batch bucket on CUDA."""
    from mtp_ctrl.controllers import InferenceConfig, TextGenerationController

    max_requests = args.max_requests or (32 if device.type == "cuda" else 4)
    stride = args.num_speculative_tokens + 1
    max_model_len = args.max_model_len or max_sequence_length - args.num_speculative_tokens  # verify rows fit
    buckets = tuple(sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_requests} | {max_requests}))
    config = InferenceConfig(
        num_speculative_tokens=args.num_speculative_tokens, max_requests=max_requests, block_size_tokens=16,
        max_model_len=max_model_len, max_tokens_per_step=max(256, max_requests * stride),
        mtp_attention=args.mtp_attention, cuda_graph_batch_sizes=buckets if device.type == "cuda" else (),
        decode_steps_per_launch=args.decode_steps_per_launch, prefix_caching=args.prefix_caching,
        mtp_reuse_last_layer=args.mtp_reuse_last_layer)
    proposer = None
    if args.proposer != "mtp" and args.num_speculative_tokens > 0:
        from mtp_ctrl.cli.draft_heads import load_cli_proposer

        proposer = load_cli_proposer(args, model, args.num_speculative_tokens)
    controller = TextGenerationController(model, config, proposer=proposer)
    controller.warmup()  # every graph shape now, not while serving
    return controller


def main(argv=None):
    """Rank 0: the engine loop in this process, the HTTP frontend in a spawned one
    (:mod:`mtp_ctrl.serve.frontend`); other TP ranks follow rank 0's steps."""
    args = parse_args(argv)  # argument errors come here, before torch is imported
    try:
        import fastapi  # noqa: F401  (the frontend process uses them; say so before loading a model)
        import uvicorn  # noqa: F401
    except ImportError as error:
        sys.exit(f"error: the server needs FastAPI and uvicorn ({error}): pip install \"mtp_ctrl[serve]\"")
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)  # before megatron-core is imported
    if args.hf is not None:  # a clear error for a bad directory, before anything starts
        from mtp_ctrl.cli.model_source import checkpoint_or_exit
        from mtp_ctrl.models.hf_text import HFText

        checkpoint_or_exit("--hf", args.hf, HFText)
    frontend = None
    if int(os.environ.get("RANK", "0")) == 0:  # spawned first: its imports overlap the model's loading
        from mtp_ctrl.serve.frontend import start_frontend

        frontend = start_frontend(None if args.hf is None else str(args.hf), args.served_model_name, args.host,
                                  args.port, args.verbose)
    controller = None
    try:
        controller, command_group = _build_controller(args)
        import torch.distributed as dist

        from mtp_ctrl.serve.engine import EngineLoop, follow

        if dist.get_rank() != 0:
            follow(controller, command_group)
            return
        process, connection = frontend
        try:
            ended_by = EngineLoop(controller, connection, command_group).run(
                f"S = {args.num_speculative_tokens}, TP {args.tp}, {controller.shape.device}")
        except Exception as error:
            sys.exit(f"error: the engine stopped: {type(error).__name__}: {error}")
        if ended_by == "frontend":
            process.join(10)
            if process.exitcode not in (None, 0):
                sys.exit(f"error: the HTTP frontend exited with code {process.exitcode} (its output above says why)")
    finally:
        if frontend is not None:
            _close_frontend(*frontend)
        if controller is not None:
            controller.close()
        if os.environ.get("RANK") is not None and _distributed_ready():
            import torch.distributed as dist

            dist.destroy_process_group()


def _build_controller(args):
    """This rank's model and serving controller; (the controller, the gloo group of rank 0's
    commands under TP, else None)."""
    import torch.distributed as dist

    from mtp_ctrl.cli.distributed import init_distributed
    from mtp_ctrl.cli.model_source import build_model, pick_device, read_model_source
    from mtp_ctrl.models.demo_model import DEMO_MODEL_ARGS

    device = pick_device(args)
    if args.hf is not None:
        from mtp_ctrl.cli.hf_generate import load_hf_model

        init_distributed(args.tp, device)
        model = load_hf_model(args, device, rank_zero=dist.get_rank() == 0)
        max_sequence_length = model.max_sequence_length
    else:
        checkpoint = read_model_source(args)
        init_distributed(args.tp, device)
        model = build_model(args, checkpoint, device)
        max_sequence_length = (checkpoint[0] if checkpoint else DEMO_MODEL_ARGS)["max_sequence_length"]
    controller = make_server_controller(model, args, device, max_sequence_length)
    return controller, dist.new_group(backend="gloo") if args.tp > 1 else None


def _close_frontend(process, connection) -> None:
    connection.close()  # the frontend sees EOF and shuts down
    process.join(15)
    if process.is_alive():
        process.terminate()
        process.join(5)


def _distributed_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


if __name__ == "__main__":
    main()
