"""Generate with and without MTP speculation on a small megatron-core GPT, time both, compare.

    python examples/generate.py                                               # what `make demo` runs
    python examples/generate.py --random-weights                              # an untrained model
    torchrun --nproc-per-node 2 examples/generate.py --tp 2 --checkpoint ...  # tensor parallel on 2 GPUs
    torchrun --nproc-per-node 2 examples/generate.py --tp 2 --load DIR        # a megatron dist checkpoint
    python examples/generate.py --hf DIR --prompt "Hello" --chat               # a Hugging Face checkpoint, text in/out
    python examples/generate.py --metrics-json metrics.json                   # keep the figures
    python examples/generate.py --proposer eagle --num-speculative-tokens 3   # a shipped draft head
    mtp-ctrl-generate ...                                                     # the same, once pip-installed

Plain decoding (S = 0) and speculative decoding (S = --num-speculative-tokens) are each warmed up
once, then timed --repeats times, alternating, so that a slow phase of the machine hits both
alike; the table shows the median tokens/s and the spread (min..max). The outputs of the two
are compared token for token. The default model is the trained demo checkpoint that ships with
the package (``mtp_ctrl.load_demo_model()``); a checkpoint written by examples/train_mtp.py brings
its own model shape, and prompts come from held-out text. With --random-weights drafts are almost
never accepted: that run shows the outputs are equal, not a speed-up. With the shipped target,
every --proposer has a shipped draft head by default (mtp_ctrl/checkpoints).

On a CPU the run is a correctness demo (identical outputs, tokens accepted per step): the demo
model's step is dominated by per-step overheads there, so its speed-up is not the GPU's. While it
runs it reports progress: a bar over tokens on a terminal, else a plain line per run (and every
few seconds on a CPU) with the phase, run k/N, tokens so far and tokens/s.

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

--hf DIR serves a Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json;
families: docs/hf_checkpoints.md) with its own MTP layers drafting, or a public EAGLE-3 head
(--proposer eagle --draft-hf DIR2, its reduced draft vocabulary mapped back): prompts are text (--prompt,
repeatable; --chat renders them through the checkpoint's chat template), generation stops at the
checkpoint's EOS ids (generation_config.json) and at --stop strings, and outputs print as text.
"""

import argparse
import hashlib
import json
import os
import statistics
import sys
import time

from mtp_ctrl.cli.model_source import add_model_arguments, build_model, check_model_arguments, pick_device, read_model_source

PROPOSER_NAMES = {"mtp": "the model's MTP layers", "eagle": "EAGLE head (serial drafting)",
                  "ptd": "parallel-drafting head (PTD)", "multi_layer_eagle": "multi-layer EAGLE draft layers"}
NOISY_SPREAD = 0.15  # (max - min) / median of a mode's timed runs above this: too noisy to judge
SHORT_RUN_SECONDS = 0.5  # a timed run shorter than this: too short to judge
PROGRESS_SECONDS = 10.0  # without a terminal: a progress line at most this often within a run


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts per timed run (default: 8 on CPU; 128 on CUDA, where a run of 8 is too short "
                             "to time)")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens of the first prompt (+3 per prompt, over 8 lengths)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per mode, alternating plain and speculative (default: 5 on CUDA, 3 on CPU)")
    parser.add_argument("--show", type=int, default=3, help="outputs printed as text")
    parser.add_argument("--metrics-json", default=None, metavar="PATH", help="write the metrics to PATH as JSON")
    parser.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                        help="a text prompt for --hf (repeatable; cycled to --num-prompts)")
    parser.add_argument("--chat", action="store_true", help="--hf: each prompt is a user message through the "
                        "checkpoint's chat template")
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="--hf: stop a request once its text contains TEXT (repeatable)")
    args = parser.parse_args(argv)
    if args.hf is None:
        for flag in ("prompt", "chat", "stop"):
            if getattr(args, flag):
                parser.error(f"--{flag} goes with --hf")
    for name in ("num_prompts", "prompt_len", "max_new_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    check_model_arguments(parser, args)
    return args


def main(argv=None):
    args = parse_args(argv)  # argument errors come here, before torch is imported
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)  # before megatron-core is imported
    if args.hf is not None:
        from mtp_ctrl.cli.hf_generate import run_hf

        return run_hf(args)
    import torch
    import torch.distributed as dist

    from mtp_ctrl.models.demo_model import DEMO_MODEL_ARGS

    checkpoint = read_model_source(args)
    device = pick_device(args)
    repeats = args.repeats or (5 if device.type == "cuda" else 3)  # the CPU path is slow: fewer
    if args.num_prompts is None:
        args.num_prompts = 128 if device.type == "cuda" else 8
    rank_zero = int(os.environ.get("RANK", "0")) == 0
    if rank_zero:
        print(header(args, device, repeats), flush=True)
        if device.type == "cpu":
            print(choose_cpu_threads(torch), flush=True)

    from mtp_ctrl.cli.distributed import init_distributed

    init_distributed(args.tp, device)
    model = build_model(args, checkpoint, device)
    prompts = make_prompts(args, vocab_size=(checkpoint[0] if checkpoint else DEMO_MODEL_ARGS)["vocab_size"])
    report = compare(model, args, prompts, device, repeats, show_progress=dist.get_rank() == 0)
    if dist.get_rank() == 0:
        print_report(args, device, prompts, report)
        write_metrics(args, report)
    dist.destroy_process_group()


def write_metrics(args, report) -> None:
    """--metrics-json: the report's metrics as JSON (rank 0 calls it)."""
    if args.metrics_json:
        with open(args.metrics_json, "w") as handle:
            json.dump(report["json"], handle, indent=2)
        print(f"metrics written to {args.metrics_json}")


def drafter_name(args) -> str:
    """The drafter in words, with its checkpoint, for the header and the report."""
    if args.proposer == "mtp":
        return f"{PROPOSER_NAMES['mtp']} ({args.mtp_attention} attention)"
    if getattr(args, "draft_hf", None) is not None:
        return f"EAGLE-3 head from {os.path.basename(os.path.normpath(args.draft_hf))}"
    return f"{PROPOSER_NAMES[args.proposer]} from {os.path.basename(args.draft_checkpoint)}"


def header(args, device, repeats: int) -> str:
    """What this run is, before anything slow happens."""
    model = ("random weights" if args.random_weights else
             os.path.basename(args.checkpoint) if args.checkpoint else args.load or args.hf)
    lines = [f"generate: {model} on {device}, TP {args.tp}; drafter: {drafter_name(args)}, "
             f"S = {args.num_speculative_tokens}",
             f"  {args.num_prompts} prompts x {args.max_new_tokens} new tokens; plain and speculative decoding, "
             f"each warmed up once, then timed {repeats} times, alternating"]
    if device.type == "cpu":
        lines.append("  on a CPU this is a correctness demo (outputs identical, tokens accepted per step); "
                     "the speed-up of speculation is a GPU figure")
    return "\n".join(lines)


def choose_cpu_threads(torch) -> str:
    """Torch's intra-op threads for the CPU run: one per core that other processes leave free.

    torch starts one OpenMP thread per core; on a machine busy with other work they wait for each
    other (a 2-core CPU under load: 5-13 minutes for what took 47 s with one thread). An explicit
    OMP_NUM_THREADS is kept."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if os.environ.get("OMP_NUM_THREADS"):
        threads = torch.get_num_threads()
        message = f"CPU: {cores} cores, load {load:.1f}; {threads} torch threads (OMP_NUM_THREADS)"
    else:
        threads = max(1, min(cores, int(cores - load + 0.5)))
        torch.set_num_threads(threads)
        message = (f"CPU: {cores} cores, load {load:.1f}; using {threads} torch thread{'s' if threads > 1 else ''} "
                   "(set OMP_NUM_THREADS to choose)")
    if load + threads > cores + 0.5:
        message += "; the machine is busy with other work: expect a slow run and noisy timings"
    return message


def make_prompts(args, vocab_size: int):
    """Prompt i has prompt_len + 3 i tokens: held-out text with a checkpoint, random ids without."""
    import torch

    from mtp_ctrl.cli.byte_corpus import evenly_spaced_windows, load_stdlib_corpus

    lengths = [args.prompt_len + 3 * (i % 8) for i in range(args.num_prompts)]
    if args.checkpoint or (args.load and vocab_size >= 256):
        windows = evenly_spaced_windows(load_stdlib_corpus().held_out, args.num_prompts, max(lengths))
        return [window[:length].tolist() for window, length in zip(windows, lengths)]
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for length in lengths]


def make_controller(model, args, num_speculative_tokens: int, prompts, device, on_tokens=None, controller_class=None):
    """The controller of one mode; ``on_tokens(n)`` is called after every step with the tokens it
    emitted (through the controller's ``on_step_end`` hook), for progress on a CPU."""
    from mtp_ctrl.controllers import InferenceConfig, TextGenerationController

    stride = num_speculative_tokens + 1
    max_requests = min(len(prompts), 8)
    graph_batches = tuple(b for b in (1, 2, 4, 8) if b <= max_requests) if device.type == "cuda" else ()
    config = InferenceConfig(
        num_speculative_tokens=num_speculative_tokens, max_requests=max_requests, block_size_tokens=16,
        max_model_len=max(len(p) for p in prompts) + args.max_new_tokens + stride,
        max_tokens_per_step=max(256, max_requests * stride), mtp_attention=args.mtp_attention,
        cuda_graph_batch_sizes=graph_batches,  # on a GPU every step replays a CUDA graph
        decode_steps_per_launch=args.decode_steps_per_launch, prefix_caching=args.prefix_caching,
        mtp_reuse_last_layer=args.mtp_reuse_last_layer)
    proposer = None
    if args.proposer != "mtp" and num_speculative_tokens > 0:
        from mtp_ctrl.cli.draft_heads import load_cli_proposer

        proposer = load_cli_proposer(args, model, num_speculative_tokens)
    controller_class = controller_class or TextGenerationController
    if on_tokens is not None:
        class ReportingController(controller_class):
            def on_step_end(self, outputs):
                on_tokens(sum(len(tokens) for _, tokens, _ in outputs))

        controller_class = ReportingController
    controller = controller_class(model, config, proposer=proposer, seed=0)
    controller.warmup()  # capture every graph shape now, not while serving (nothing on CPU)
    return controller


class Progress:
    """The demo's progress over its runs: a tqdm bar over tokens on a terminal; otherwise plain
    lines (phase, run k/N, tokens so far, tokens/s): one when a run ends, and within a run at
    most every PROGRESS_SECONDS when steps report their tokens (``add``)."""

    def __init__(self, num_runs: int, tokens_per_run: int, enabled: bool):
        self.num_runs, self.tokens_per_run, self.enabled = num_runs, tokens_per_run, enabled
        self.run_index, self.run_tokens, self.total_tokens = 0, 0, 0
        self.bar = None
        if enabled and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=num_runs * tokens_per_run, unit="tok", desc="generate", dynamic_ncols=True)

    def start_run(self, phase: str, mode: str) -> None:
        self.run_index += 1
        self.label = f"{phase} run {self.run_index}/{self.num_runs} ({mode})"
        self.run_tokens, self.run_started = 0, time.perf_counter()
        self.last_line = self.run_started
        if self.bar is not None:
            self.bar.set_description(self.label)

    def add(self, tokens: int) -> None:
        self.run_tokens += tokens
        if self.bar is not None:
            self.bar.update(tokens)
        elif self.enabled and time.perf_counter() - self.last_line >= PROGRESS_SECONDS:
            self.last_line = time.perf_counter()
            self._line(self.run_tokens, self.last_line - self.run_started, "so far")

    def end_run(self, tokens: int, seconds: float) -> None:
        if self.bar is not None:
            self.bar.update(max(0, tokens - self.run_tokens))  # what the steps did not report
            self.bar.set_postfix_str(f"{tokens / seconds:.0f} tok/s")
        self.total_tokens += tokens
        if self.bar is None and self.enabled:
            self._line(tokens, seconds, "done")

    def _line(self, tokens: int, seconds: float, state: str) -> None:
        print(f"{self.label}: {tokens}/{self.tokens_per_run} tokens {state}, {tokens / max(seconds, 1e-9):.1f} tok/s "
              f"({self.total_tokens + (tokens if state == 'so far' else 0)} tokens in all)", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def compare(model, args, prompts, device, repeats: int, show_progress: bool, params=None, controller_class=None):
    """Warm both modes up, then time them alternately; returns what print_report and the JSON need.
    ``params``: the requests' SamplingParams (default: greedy or --temperature, no stop tokens);
    ``controller_class``: a TextGenerationController subclass (default: the class itself)."""
    import torch

    from mtp_ctrl.controllers import SamplingParams

    if params is None:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=None)
    modes = {"plain": 0, "speculative": args.num_speculative_tokens}
    runs = [(name, True) for name in modes] + [(name, False) for _ in range(repeats) for name in modes]
    progress = Progress(len(runs), len(prompts) * args.max_new_tokens, enabled=show_progress)
    # per-step progress on a CPU only: there a run takes seconds to minutes; on a GPU the hook's
    # host work would weigh on the timing of a small model's sub-millisecond steps
    on_tokens = progress.add if device.type == "cpu" else None
    controllers = {name: make_controller(model, args, S, prompts, device, on_tokens, controller_class)
                   for name, S in modes.items()}
    seconds = {name: [] for name in modes}
    tokens = {name: 0 for name in modes}
    outputs, metrics = {}, {}
    for name, warm_up in runs:
        controller = controllers[name]
        controller.metrics.reset()
        progress.start_run("warm-up" if warm_up else "timed", name)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        results = controller.generate(prompts, params)  # the warm-up compiles kernels, captures graphs
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        tokens[name] = sum(len(result.output_tokens) for result in results)
        outputs[name] = [list(result.output_tokens) for result in results]
        progress.end_run(tokens[name], elapsed)
        if not warm_up:
            seconds[name].append(elapsed)
            metrics[name] = controller.metrics.as_dict()
    progress.close()
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
        # one digest of the plain outputs: runs at other TP sizes or on other machines compare by it
        "plain_outputs_sha256": hashlib.sha256(json.dumps(outputs["plain"]).encode()).hexdigest(),
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


def print_report(args, device, prompts, report, decode=None) -> None:
    """The run's table and verdict; ``decode`` turns token ids into text (default: bytes)."""
    from mtp_ctrl.cli.byte_corpus import decode_bytes

    decode = decode or decode_bytes
    spec = report["metrics"]["speculative"]
    print(f"\n{len(prompts)} prompts, {args.max_new_tokens} new tokens each, {device}, TP {args.tp}, "
          f"drafter: {drafter_name(args)}, S = {args.num_speculative_tokens}"
          f"{', random weights' if args.random_weights else ''}")
    for index in range(min(args.show, len(prompts))):
        print(f"  prompt {index}: {decode(prompts[index])!r}")
        print(f"  output {index}: {decode(report['outputs']['speculative'][index])!r}")
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
    if device.type == "cpu":
        print("on a CPU this is a correctness demo: the outputs and the accepted length are the figures; "
              "the speed-up is a GPU figure (README, 'The two commands')")


if __name__ == "__main__":
    main()
