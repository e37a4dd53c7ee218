"""Where a decode step's host time goes: cProfile over the decode steps of the demo model.

    python bench/profile_step_host.py [--batch 8] [--num-speculative-tokens 0] [--no-overlap] [--steps 200]
        [--draft-policy fixed|none|goodput] [--timed]

``--timed``: no cProfile (its per-call cost inflates small numpy calls several times): the wall
time of the host's parts (the draft-length hooks, the MTP plan, metrics, step building, the
read-back's application), each wrapped in ``time.perf_counter``, per steady step.

``--draft-policy none``: every request drafts 0 on an engine of S > 0 (a draft-length policy's
D = 0 steps: what such a step costs the host beside a plain engine's, S = 0).
"""

import argparse
import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def parse_args(description: str, default_batch: int, default_speculative: int, default_steps: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--checkpoint", default="mtp_ctrl/checkpoints/mtp_demo.pt")
    parser.add_argument("--batch", type=int, default=default_batch)
    parser.add_argument("--num-speculative-tokens", type=int, default=default_speculative)
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--steps", type=int, default=default_steps)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--draft-policy", choices=("fixed", "none", "goodput"), default="fixed",
                        help="fixed: S drafts a step (default); none: 0 drafts a step; goodput: GoodputPolicy")
    parser.add_argument("--graphs", action="store_true", help="profile_step_kernels: replay the step's CUDA graphs")
    parser.add_argument("--timed", action="store_true", help="perf_counter per host part instead of cProfile")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args()


def decoding_demo_controller(args, graphs: bool):
    """The demo model (bf16, CUDA) with ``args.batch`` held-out prompts decoding 600 tokens each,
    past warm-up (kernels compiled, graphs captured when ``graphs``): the state both profiles time."""
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)
    import torch
    from byte_corpus import evenly_spaced_windows, load_stdlib_corpus
    from demo_model import init_distributed, load_demo_model
    from mtp_ctrl.controllers import GoodputPolicy, InferenceConfig, SamplingParams, TextGenerationController
    from mtp_ctrl.controllers.draft_policy import DraftLengthPolicy

    class NoDrafts(DraftLengthPolicy):
        decide_every = 64  # a held choice, as a trained policy's

        def warmup_depths(self, num_speculative_tokens):
            return (0,)

        def choose(self, query):
            return query.caps * 0

    device = torch.device("cuda")
    init_distributed(1, device)
    model = load_demo_model(args.checkpoint, device).to(torch.bfloat16)
    prompts = [w.tolist() for w in evenly_spaced_windows(load_stdlib_corpus().held_out, args.batch, 64)]
    config = InferenceConfig(num_speculative_tokens=args.num_speculative_tokens, max_requests=args.batch,
                             block_size_tokens=16, max_model_len=700, max_tokens_per_step=max(64, args.batch * 64),
                             cuda_graph_batch_sizes=(args.batch,) if graphs else (),
                             overlap_scheduling=not args.no_overlap)
    policy = {"fixed": None, "none": NoDrafts, "goodput": GoodputPolicy}[getattr(args, "draft_policy", "fixed")]
    controller = TextGenerationController(model, config, draft_policy=policy() if policy else None)
    controller.generate(prompts, SamplingParams(max_new_tokens=8))  # compile, capture
    for prompt in prompts:
        controller.add_request(prompt, SamplingParams(max_new_tokens=600))
    for _ in range(5):
        controller.step()
    return controller


def main():
    args = parse_args(__doc__.splitlines()[0], default_batch=8, default_speculative=0, default_steps=200)
    controller = decoding_demo_controller(args, graphs=True)
    for _ in range(50):  # first uses: graphs not warmed up are captured here (a policy's other tiers)
        controller.step()
    controller.metrics.reset()
    for _ in range(100):  # unprofiled steady steps: the host share this profile explains
        controller.step()
    print(controller.metrics.summary())
    if args.timed:
        print_timed_parts(controller, args.steps)
        return
    profiler = cProfile.Profile()
    profiler.enable()
    steps = 0
    while controller.has_unfinished_requests() and steps < args.steps:
        controller.step()
        steps += 1
    profiler.disable()
    print(f"{steps} steps")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.top)


def print_timed_parts(controller, steps: int) -> None:
    """Wall microseconds per step of the host's parts over ``steps`` steady steps (perf_counter)."""
    import collections
    import time

    from mtp_ctrl.controllers import controller as controller_module, draft_lengths, metrics, mtp_catch_up, output_rows

    totals = collections.Counter()
    parts = [(draft_lengths.DraftLengths, name) for name in ("choose", "launched", "applied", "step_timing",
                                                              "record_timing")]
    parts += [(metrics.GenerationMetrics, "record_acceptance"), (mtp_catch_up.WindowCatchUp, "plan_launch"),
              (output_rows.OutputRows, "apply"), (controller_module.TextGenerationController, "_build_step"),
              (controller_module.TextGenerationController, "_apply"), (controller_module.TextGenerationController, "step")]
    for owner, name in parts:
        original = getattr(owner, name)

        def timed(*args, _original=original, _name=name, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_name] += time.perf_counter() - started

        setattr(owner, name, timed)
    done = 0
    while controller.has_unfinished_requests() and done < steps:
        controller.step()
        done += 1
    print(f"{done} steps; host parts, us a step: " + ", ".join(
        f"{name} {seconds / max(done, 1) * 1e6:.1f}" for name, seconds in sorted(totals.items())))


if __name__ == "__main__":
    main()
