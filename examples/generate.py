"""Generate with and without MTP speculation on a small megatron-core GPT, time both, compare.

    python examples/generate.py --checkpoint examples/checkpoints/mtp_demo.pt   # what `make demo` runs
    python examples/generate.py                                               # random weights
    torchrun --nproc-per-node 2 examples/generate.py --tp 2 --checkpoint ...  # tensor parallel on 2 GPUs
    torchrun --nproc-per-node 2 examples/generate.py --tp 2 --load DIR        # a megatron dist checkpoint
    python examples/generate.py --metrics-json metrics.json                   # keep the figures
    python examples/generate.py --checkpoint examples/checkpoints/mtp_demo.pt --proposer multi_layer_eagle \\
        --num-speculative-tokens 3    # draft layers of examples/train_multi_layer_eagle.py (--draft-checkpoint PATH)

Plain decoding (S = 0) and speculative decoding (S = --num-speculative-tokens) are each warmed up
once, then timed --repeats times, alternating, so that a slow phase of the machine hits both
alike; the table shows the median tokens/s and the spread (min..max). The outputs of the two
are compared token for token. With random weights (no checkpoint) drafts are almost never
accepted: that run shows the outputs are equal, not a speed-up. A checkpoint written by
examples/train_mtp.py brings its own model shape and prompts from held-out text.

--load DIR serves a megatron ``dist_checkpointing`` directory (torch_dist, saved at any TP size,
e.g. by ``examples/train_mtp.py --save-format dist``). Its shape comes from the checkpoint's
content metadata ``{"model_args": {...}}`` when it has one, else from --model-args: a JSON object
with num_layers, hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups,
mtp_num_layers, vocab_size (padded, as trained), max_sequence_length, and optionally any other
TransformerConfig field (e.g. "normalization": "RMSNorm"). Prompts are text when the vocabulary
holds the 256 byte tokens, random ids otherwise.

--metrics-json writes {"plain": ..., "speculative": ..., "comparison": ...}: the first two are
``controller.metrics.as_dict()`` of each mode's last timed run (docs/design.md lists the keys);
"comparison" holds every timed tokens/s figure, the medians, the speed-up and the equality check.
"""

import argparse
import json
import os
import statistics
import sys
import time

CHECKPOINTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")
DEFAULT_DRAFT_CHECKPOINTS = {"ptd": os.path.join(CHECKPOINTS, "ptd_demo.pt"),
                             "multi_layer_eagle": os.path.join(CHECKPOINTS, "multi_layer_eagle_demo.pt")}
TRAINED_BY = {"eagle": "examples/train_eagle.py", "ptd": "examples/train_eagle.py --mode ptd",
              "multi_layer_eagle": "examples/train_multi_layer_eagle.py"}
NOISY_SPREAD = 0.15  # (max - min) / median of a mode's timed runs above this: too noisy to judge
SHORT_RUN_SECONDS = 0.5  # a timed run shorter than this: too short to judge


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", default=None, help="a file written by examples/train_mtp.py")
    source.add_argument("--load", default=None, metavar="DIR", help="a megatron dist_checkpointing directory")
    parser.add_argument("--model-args", default=None, metavar="JSON",
                        help="the model's shape for --load (default: the checkpoint's content metadata)")
    parser.add_argument("--num-speculative-tokens", type=int, default=2, help="S, drafts per step (>= 1)")
    parser.add_argument("--mtp-attention", choices=("paged", "single_position"), default="paged")
    parser.add_argument("--proposer", choices=("mtp", "eagle", "ptd", "multi_layer_eagle"), default="mtp",
                        help="drafter: the model's MTP layers, an EAGLE head drafting serially, a parallel-drafting "
                             "head drafting all S tokens in one pass, or multi-layer EAGLE draft layers "
                             "(--draft-checkpoint)")
    parser.add_argument("--draft-checkpoint", default=None, metavar="PATH",
                        help="the drafter's weights: an EAGLE head (examples/train_eagle.py), a parallel-drafting "
                             "head (train_eagle.py --mode ptd), or draft layers (examples/train_multi_layer_eagle.py); "
                             "with the shipped target, ptd and multi_layer_eagle default to the shipped "
                             "examples/checkpoints/ptd_demo.pt and multi_layer_eagle_demo.pt")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts per timed run (default: 8 on CPU; 128 on CUDA, where a run of 8 is too short "
                             "to time)")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens of the first prompt (+3 per prompt, over 8 lengths)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per mode, alternating plain and speculative (default: 5 on CUDA, 3 on CPU)")
    parser.add_argument("--decode-steps-per-launch", type=int, default=4,
                        help="decode steps one launch may run back to back (one host build and apply for all): "
                             "a small model's step is shorter than the host's work for it (1 = one step per launch)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (= processes under torchrun)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--show", type=int, default=3, help="outputs printed as text")
    parser.add_argument("--metrics-json", default=None, metavar="PATH", help="write the metrics to PATH as JSON")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args(argv)
    for name in ("num_speculative_tokens", "num_prompts", "prompt_len", "max_new_tokens", "tp",
                 "decode_steps_per_launch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.model_args is not None:
        if args.load is None:
            parser.error("--model-args goes with --load")
        try:
            args.model_args = json.loads(args.model_args)
        except json.JSONDecodeError as error:
            parser.error(f"--model-args is not JSON: {error}")
        if not isinstance(args.model_args, dict):
            parser.error("--model-args must be a JSON object")
    return args


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


def main(argv=None):
    args = parse_args(argv)
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)  # before megatron-core is imported
    import torch
    import torch.distributed as dist

    from demo_model import DEMO_MODEL_ARGS, load_checkpoint

    checkpoint = load_checkpoint(args.checkpoint) if args.checkpoint else None
    # the shipped heads were trained for the shipped target: a default only when serving that one
    shipped_target = os.path.join(CHECKPOINTS, "mtp_demo.pt")
    serves_shipped_target = args.checkpoint is not None and os.path.exists(args.checkpoint) and \
        os.path.samefile(args.checkpoint, shipped_target)
    default_draft = DEFAULT_DRAFT_CHECKPOINTS.get(args.proposer)
    if args.draft_checkpoint is None and serves_shipped_target and default_draft and os.path.exists(default_draft):
        args.draft_checkpoint = default_draft
    if (args.proposer != "mtp") != (args.draft_checkpoint is not None):
        if args.proposer == "mtp":
            sys.exit("error: --draft-checkpoint PATH goes with --proposer eagle, ptd or multi_layer_eagle")
        sys.exit(f"error: --proposer {args.proposer} needs --draft-checkpoint PATH ({TRAINED_BY[args.proposer]} "
                 "writes one)")
    if args.load:
        checkpoint = (dist_checkpoint_model_args(args), None)  # (model_args, weights read after the build)
    source = args.checkpoint or args.load
    if checkpoint is not None and args.proposer == "mtp" and \
            args.num_speculative_tokens > checkpoint[0].get("mtp_num_layers", 0):
        sys.exit(f"error: --num-speculative-tokens {args.num_speculative_tokens} needs at least that many MTP "
                 f"layers; {source} has {checkpoint[0].get('mtp_num_layers', 0)} (use "
                 f"--num-speculative-tokens {checkpoint[0].get('mtp_num_layers', 0)} or less)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    repeats = args.repeats or (5 if device.type == "cuda" else 3)  # the CPU path is slow: fewer
    if args.num_prompts is None:
        args.num_prompts = 128 if device.type == "cuda" else 8

    from demo_model import build_demo_model, config_overrides, init_distributed, load_full_state_dict

    init_distributed(args.tp, device)
    if checkpoint is not None:
        model = build_demo_model(checkpoint[0], tensor_parallel_size=args.tp, **config_overrides(checkpoint[0]))
        if args.load:
            from mtp_ctrl.models import load_distributed_checkpoint

            model = model.to(device)  # each rank reads its shard straight into the device's memory
            started = time.perf_counter()
            load_distributed_checkpoint(model, args.load)
            if dist.get_rank() == 0:
                print(f"loaded {args.load} at TP {args.tp} in {time.perf_counter() - started:.2f} s")
        else:
            load_full_state_dict(model, checkpoint[1])
    else:
        model_args = dict(DEMO_MODEL_ARGS, mtp_num_layers=args.num_speculative_tokens)
        torch.manual_seed(1234)  # every rank draws the same master weights and keeps its shard
        model = build_demo_model(model_args, tensor_parallel_size=args.tp)
    model = model.to(device).eval()
    prompts = make_prompts(args, vocab_size=(checkpoint[0] if checkpoint else DEMO_MODEL_ARGS)["vocab_size"])
    report = compare(model, args, prompts, device, repeats, show_progress=dist.get_rank() == 0)
    if dist.get_rank() == 0:
        print_report(args, device, prompts, report)
        if args.metrics_json:
            with open(args.metrics_json, "w") as handle:
                json.dump(report["json"], handle, indent=2)
            print(f"metrics written to {args.metrics_json}")
    dist.destroy_process_group()


def make_prompts(args, vocab_size: int):
    """Prompt i has prompt_len + 3 i tokens: held-out text with a checkpoint, random ids without."""
    import torch

    from byte_corpus import evenly_spaced_windows, load_stdlib_corpus

    lengths = [args.prompt_len + 3 * (i % 8) for i in range(args.num_prompts)]
    if args.checkpoint or (args.load and vocab_size >= 256):
        windows = evenly_spaced_windows(load_stdlib_corpus().held_out, args.num_prompts, max(lengths))
        return [window[:length].tolist() for window, length in zip(windows, lengths)]
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for length in lengths]


def make_controller(model, args, num_speculative_tokens: int, prompts, device):
    from mtp_ctrl.controllers import InferenceConfig, TextGenerationController

    stride = num_speculative_tokens + 1
    max_requests = min(len(prompts), 8)
    graph_batches = tuple(b for b in (1, 2, 4, 8) if b <= max_requests) if device.type == "cuda" else ()
    config = InferenceConfig(
        num_speculative_tokens=num_speculative_tokens, max_requests=max_requests, block_size_tokens=16,
        max_model_len=max(len(p) for p in prompts) + args.max_new_tokens + stride,
        max_tokens_per_step=max(256, max_requests * stride), mtp_attention=args.mtp_attention,
        cuda_graph_batch_sizes=graph_batches,  # on a GPU every step replays a CUDA graph
        decode_steps_per_launch=args.decode_steps_per_launch)
    proposer = None
    if args.proposer != "mtp" and num_speculative_tokens > 0:
        proposer = load_draft_proposer(args.proposer, model, args.draft_checkpoint, num_speculative_tokens)
    controller = TextGenerationController(model, config, proposer=proposer, seed=0)
    controller.warmup()  # capture every graph shape now, not while serving (nothing on CPU)
    return controller


def _load_head(model, path: str):
    """The head saved by examples/train_eagle.py (sharded for this TP rank); a parallel-drafting
    checkpoint (``mask_token_id`` saved, ``mask_hidden`` in its state_dict) builds a PTD head."""
    import torch

    from demo_model import load_full_state_dict
    from mtp_ctrl.models import build_eagle_head

    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or "aux_layer_ids" not in saved or "state_dict" not in saved:
        raise ValueError(f"{path} is not an EAGLE head checkpoint (examples/train_eagle.py writes one)")
    mask_token_id = saved.get("mask_token_id")
    if (mask_token_id is None) != ("mask_hidden" not in saved["state_dict"]):
        raise ValueError(f"{path} has {'no ' if mask_token_id is None else ''}mask_token_id but "
                         f"{'a' if mask_token_id is None else 'no'} mask_hidden: a parallel-drafting head needs both "
                         "(examples/train_eagle.py --mode ptd saves both)")
    head = build_eagle_head(model, saved["aux_layer_ids"], use_transformer_engine=False,
                            parallel_drafting=mask_token_id is not None, mask_token_id=mask_token_id)
    load_full_state_dict(head, saved["state_dict"])
    return head.to(next(model.parameters()).device)


def load_eagle_proposer(model, path: str):
    """An EagleProposer (serial drafting) with the head saved by examples/train_eagle.py (either mode)."""
    from mtp_ctrl.controllers import EagleProposer

    return EagleProposer(_load_head(model, path))


def load_ptd_proposer(model, path: str):
    """A ParallelDraftingProposer with the head saved by ``examples/train_eagle.py --mode ptd``;
    a checkpoint without ``mask_token_id`` / ``mask_hidden`` raises a ValueError."""
    from mtp_ctrl.controllers import ParallelDraftingProposer

    head = _load_head(model, path)
    if not head.parallel_drafting:
        raise ValueError(f"{path} has no mask_token_id / mask_hidden: it is a serial EAGLE head; parallel drafting "
                         "needs a head trained with examples/train_eagle.py --mode ptd (or use --proposer eagle)")
    return ParallelDraftingProposer(head)


def load_draft_proposer(kind: str, model, path: str, num_speculative_tokens: int):
    """The proposer of ``--proposer kind`` ("eagle", "ptd" or "multi_layer_eagle") with its weights at ``path``."""
    if kind == "eagle":
        return load_eagle_proposer(model, path)
    if kind == "ptd":
        return load_ptd_proposer(model, path)
    if kind == "multi_layer_eagle":
        return load_multi_layer_eagle_proposer(model, path, num_speculative_tokens)
    raise ValueError(f"kind must be 'eagle', 'ptd' or 'multi_layer_eagle', got {kind!r}")


def load_multi_layer_eagle_proposer(model, path: str, num_speculative_tokens: int):
    """A MultiLayerEagleProposer with the layers saved by examples/train_multi_layer_eagle.py."""
    from mtp_ctrl.controllers import MultiLayerEagleProposer
    from train_multi_layer_eagle import load_multi_layer_eagle_heads

    heads = load_multi_layer_eagle_heads(model, path)
    if heads.num_layers != num_speculative_tokens:
        sys.exit(f"error: {path} has {heads.num_layers} draft layers: use --num-speculative-tokens {heads.num_layers}")
    return MultiLayerEagleProposer(heads)


def compare(model, args, prompts, device, repeats: int, show_progress: bool):
    """Warm both modes up, then time them alternately; returns what print_report and the JSON need."""
    import torch
    from tqdm import tqdm

    from mtp_ctrl.controllers import SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=None)
    modes = {"plain": 0, "speculative": args.num_speculative_tokens}
    controllers = {name: make_controller(model, args, S, prompts, device) for name, S in modes.items()}
    seconds = {name: [] for name in modes}
    tokens = {name: 0 for name in modes}
    outputs, metrics = {}, {}
    runs = [(name, warm_up) for name in modes for warm_up in (True,)] + \
        [(name, False) for _ in range(repeats) for name in modes]
    progress = tqdm(runs, desc="generate", unit="run", disable=not (show_progress and sys.stdout.isatty()))
    for name, warm_up in progress:
        controller = controllers[name]
        controller.metrics.reset()
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        results = controller.generate(prompts, params)  # the warm-up compiles kernels, captures graphs
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        tokens[name] = sum(len(result.output_tokens) for result in results)
        outputs[name] = [list(result.output_tokens) for result in results]
        if not warm_up:
            seconds[name].append(elapsed)
            metrics[name] = controller.metrics.as_dict()
        progress.set_postfix_str(f"{name} {tokens[name] / elapsed:.0f} tok/s{' (warm-up)' if warm_up else ''}")
    for controller in controllers.values():
        controller.close()  # frees the graphs (needed before destroy_process_group under TP)
    rates = {name: [tokens[name] / value for value in seconds[name]] for name in modes}
    medians = {name: statistics.median(rates[name]) for name in modes}
    spreads = {name: (max(rates[name]) - min(rates[name])) / medians[name] for name in modes}
    identical = outputs["plain"] == outputs["speculative"]
    comparison = {
        "device": str(device), "tensor_parallel_size": args.tp, "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "num_speculative_tokens": args.num_speculative_tokens,
        "mtp_attention": args.mtp_attention, "repeats": repeats,
        "plain_tokens_per_second": rates["plain"], "speculative_tokens_per_second": rates["speculative"],
        "plain_median_tokens_per_second": medians["plain"],
        "speculative_median_tokens_per_second": medians["speculative"],
        "speed_up": medians["speculative"] / medians["plain"], "outputs_identical": identical,
    }
    return {"rates": rates, "medians": medians, "spreads": spreads, "seconds": seconds, "outputs": outputs,
            "identical": identical, "metrics": metrics,
            "json": {"plain": metrics["plain"], "speculative": metrics["speculative"], "comparison": comparison}}


def verdict(report, repeats: int) -> str:
    """Whether the figures can be trusted, in plain words."""
    shortest = min(min(values) for values in report["seconds"].values())
    noisy = [name for name, spread in report["spreads"].items() if spread > NOISY_SPREAD]
    problems = []
    if shortest < SHORT_RUN_SECONDS:
        problems.append(f"too short to judge: a timed run took {shortest:.2f} s (raise --max-new-tokens or "
                        f"--num-prompts)")
    if noisy:
        problems.append(f"too noisy to judge: {' and '.join(noisy)} varied by more than {NOISY_SPREAD:.0%} "
                        f"between runs (a busy machine? raise --repeats)")
    if repeats < 3:
        problems.append(f"only {repeats} timed run(s) per mode: a rough figure (raise --repeats)")
    return "; ".join(problems) if problems else f"{repeats} runs per mode, spread within {NOISY_SPREAD:.0%}: usable"


def print_report(args, device, prompts, report) -> None:
    from byte_corpus import decode_bytes

    spec = report["metrics"]["speculative"]
    print(f"\n{len(prompts)} prompts, {args.max_new_tokens} new tokens each, {device}, TP {args.tp}, "
          f"S = {args.num_speculative_tokens} ({args.mtp_attention} MTP attention)"
          f"{'' if args.checkpoint or args.load else ', random weights'}")
    for index in range(min(args.show, len(prompts))):
        print(f"  prompt {index}: {decode_bytes(prompts[index])!r}")
        print(f"  output {index}: {decode_bytes(report['outputs']['speculative'][index])!r}")
    print()
    print(f"{'':14}{'tokens/s (median)':>18}{'spread':>18}")
    for name in ("plain", "speculative"):
        rates = report["rates"][name]
        print(f"{name:14}{report['medians'][name]:18.1f}{f'{min(rates):.1f}..{max(rates):.1f}':>18}")
    print(f"speed-up: {report['medians']['speculative'] / report['medians']['plain']:.2f}x")
    depths = ", ".join(f"{rate:.2f}" for rate in spec["acceptance_per_depth"])
    print(f"accepted length: {spec['mean_accepted_length']:.2f} tokens per verify step; "
          f"acceptance per depth: [{depths}]")
    print(f"outputs identical: {'yes' if report['identical'] else 'NO'}")
    step_time = spec["step_time"]
    gpu = f", GPU {step_time['mean_gpu_ms']:.3f} ms" if step_time["mean_gpu_ms"] is not None else ""
    print(f"step time (speculative): {step_time['mean_step_ms']:.3f} ms per step over "
          f"{step_time['steps']} steps{gpu} (up to {args.decode_steps_per_launch} decode steps per launch)")
    print(f"verdict: {verdict(report, len(report['rates']['plain']))}")


if __name__ == "__main__":
    main()
