"""Overlapped step loop: step wall time vs the GPU work of the same step, overlap on vs off, one
step per launch vs decode runs, speculative (S = 2) vs plain (S = 0), and a mixed prefill +
decode step vs a decode step.

    python bench/bench_overlap.py [--quick] [--decode-steps-per-launch 4] [--checkpoint mtp_ctrl/checkpoints/mtp_demo.pt]
    torchrun --nproc-per-node 2 bench/bench_overlap.py --tp 2   # tensor parallel on 2 GPUs (rank 0 prints)

For each model (the shipped demo checkpoint; a random-weight GPT of about 1B parameters: 16
layers, hidden 2048, 16 heads over 4 KV groups, 2 MTP layers, bf16) and batch 1, 8, 32:

- step wall: median wall time of ``controller.step()`` over the decode phase (host work,
  launches, and any wait for the GPU), per step; GPU: the GPU time of the same steps, between
  CUDA events around each launch's work (its CUDA graph replay and copies); tokens/s of the
  whole run. Three loops: overlap off, overlap on with one step per launch, and overlap on with
  decode runs of up to ``--decode-steps-per-launch`` steps (a call that launches a run of k
  steps counts as k steps of a k-th of its wall time);
- mixed: wall time of a step that also prefills a 64-token prompt chunk (the two ``step()``
  calls that admit and launch it, less a decode step), vs a decode-only step of the same batch
  (both synchronised); and the GPU time of that step vs a decode step's.

Greedy decoding, the requests of a batch ending at different steps (96, 88, 80, 72 new tokens);
`controller.warmup()` captures every graph shape first (decode-only, and mixed steps padded to a
token bucket), so the mixed step replays a graph. Outputs are checked: overlap on == off (same
shapes, so bit for bit), and == plain (S = 0; in bf16 a near-tie can differ, see the README).
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="mtp_ctrl/checkpoints/mtp_demo.pt")
    parser.add_argument("--quick", action="store_true", help="demo model only (batch 1 and 8 unless --batches)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32)")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--decode-steps-per-launch", type=int, default=4, help="the decode-run loop's k")
    parser.add_argument("--hybrid", action="store_true",
                        help="also a random hybrid GPT (bench_controller's: 8 layers M*M*M*M*, hidden 1024, Mamba-2)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (= processes under torchrun)")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp < 1 or world_size != args.tp:
        parser.error(f"--tp {args.tp} needs {args.tp} processes, got {world_size} (torchrun --nproc-per-node {args.tp})")
    if args.hybrid and args.tp > 1:
        parser.error("--hybrid runs at --tp 1 only (bench_controller's hybrid model is built unsharded)")
    return args


PROMPT_LEN = 64


def _run(model, prompts, num_speculative_tokens, overlap, new_tokens, decode_steps_per_launch=1):
    from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
    import torch

    batch = len(prompts)
    config = InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=batch + 1,
                             block_size_tokens=16, max_model_len=PROMPT_LEN + new_tokens + 16,
                             max_tokens_per_step=max((batch + 1) * PROMPT_LEN, 256),
                             cuda_graph_batch_sizes=(batch, batch + 1), overlap_scheduling=overlap,
                             decode_steps_per_launch=decode_steps_per_launch)
    controller = TextGenerationController(model, config)
    controller.warmup()  # every graph shape, the mixed steps' included
    params = SamplingParams(max_new_tokens=new_tokens)
    controller.generate(prompts, params)  # warm-up: compile, capture the graphs
    controller.metrics.reset()
    # requests end at different steps (new_tokens, - 8, - 16, - 24): rows are freed mid-run
    ids = [controller.add_request(prompt, SamplingParams(max_new_tokens=new_tokens - 8 * (index % 4)))
           for index, prompt in enumerate(prompts)]
    metrics = controller.metrics
    wall = []  # per step: a call that launched a run of k steps gives k entries of a k-th of its time
    while controller.has_unfinished_requests():
        steps_before = metrics.steps
        started = time.perf_counter()
        controller.step()
        steps = metrics.steps - steps_before
        wall += [(time.perf_counter() - started) / steps] * steps
    outputs = [controller.pop_result(rid).output_tokens for rid in ids]
    total = sum(wall)
    decode_wall = statistics.median(wall[3:-3]) if len(wall) > 8 else statistics.median(wall)
    gpu_steps = list(metrics.gpu_step_seconds)
    gpu = statistics.median(gpu_steps[3:-3]) if len(gpu_steps) > 8 else statistics.median(gpu_steps)
    tokens_per_second = metrics.emitted_tokens / total
    if decode_steps_per_launch > 1:  # the mixed step is measured in the one-step loop
        controller.close()
        return dict(wall=decode_wall, gpu=gpu, tps=tokens_per_second, accepted=metrics.mean_accepted_length,
                    outputs=outputs)

    # a mixed step: batch - 0 decodes running plus one new prompt's chunk, vs a decode-only step
    for rid in [controller.add_request(prompt, SamplingParams(max_new_tokens=new_tokens)) for prompt in prompts]:
        pass
    for _ in range(4):
        controller.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    controller.step()
    torch.cuda.synchronize()
    decode_step = time.perf_counter() - started
    controller.add_request(prompts[0], SamplingParams(max_new_tokens=2))
    gpu_before = len(metrics.gpu_step_seconds)
    torch.cuda.synchronize()
    started = time.perf_counter()
    controller.step()
    controller.step()  # the first call admits (no sync: the new row is past the step in flight) and launches the chunk
    torch.cuda.synchronize()
    mixed_step = (time.perf_counter() - started) - decode_step
    controller.step()  # applies the mixed step: its GPU time is recorded
    mixed_gpu = max(list(metrics.gpu_step_seconds)[gpu_before:])  # the step that carried the chunk
    while controller.has_unfinished_requests():
        controller.step()
    controller.close()
    return dict(wall=decode_wall, gpu=gpu, tps=tokens_per_second, accepted=metrics.mean_accepted_length,
                outputs=outputs, decode_step=decode_step, mixed_step=mixed_step, mixed_gpu=mixed_gpu)


def main():
    args = parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)  # before megatron-core is imported
    import torch
    import torch.distributed as dist
    from byte_corpus import evenly_spaced_windows, load_stdlib_corpus
    from demo_model import DEMO_MODEL_ARGS, build_demo_model, init_distributed, load_checkpoint, load_full_state_dict

    device = torch.device("cuda")
    init_distributed(args.tp, device)
    if dist.get_rank() != 0:
        sys.stdout = open(os.devnull, "w")  # rank 0 prints
    models = []
    model_args, state_dict = load_checkpoint(args.checkpoint)
    demo = build_demo_model(model_args, tensor_parallel_size=args.tp)
    load_full_state_dict(demo, state_dict)
    models.append(("demo (4.9M, bf16)", demo.to(device).eval(), model_args["vocab_size"]))
    if not args.quick:
        big_args = dict(DEMO_MODEL_ARGS, num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16,
                        num_query_groups=4, mtp_num_layers=2, vocab_size=32000, max_sequence_length=4096)
        torch.manual_seed(0)
        big = build_demo_model(big_args, tensor_parallel_size=args.tp).to(device=device, dtype=torch.bfloat16).eval()
        models.append(("GPT 16x2048 (~1B, bf16, random)", big, big_args["vocab_size"]))
    if args.hybrid:  # Mamba layers: steps with prefill chunks replay graphs too (state passed on the device)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_controller import VOCAB_SIZE, build_model

        models.append(("hybrid M*M*M*M* (random)", build_model("M*M*M*M*"), VOCAB_SIZE))
    held_out = load_stdlib_corpus().held_out
    rows = []
    for name, model, vocab in models:
        if next(model.parameters()).dtype != torch.bfloat16:
            model.to(torch.bfloat16)
        batches = (1, 8) if args.quick else (1, 8, 32)
        if args.batches:
            batches = tuple(int(size) for size in args.batches.split(","))
        for batch in batches:
            prompts = [[t % vocab for t in w.tolist()] for w in evenly_spaced_windows(held_out, batch, PROMPT_LEN)]
            results = {}
            K = args.decode_steps_per_launch
            for S in (0, 2):
                for overlap, steps in ((False, 1), (True, 1), (True, K)):
                    results[S, overlap, steps] = _run(model, prompts, S, overlap, args.new_tokens, steps)
            plain = results[0, True, 1]["outputs"]
            for S in (0, 2):
                off, on, runs = results[S, False, 1], results[S, True, 1], results[S, True, K]
                same_shapes = on["outputs"] == off["outputs"] == runs["outputs"]
                rows.append((name, batch, S, off["wall"], on["wall"], on["gpu"], on["wall"] / on["gpu"], runs["wall"],
                             runs["gpu"], runs["wall"] / runs["gpu"], on["tps"], runs["tps"],
                             runs["tps"] / results[0, True, K]["tps"], on["accepted"],
                             on["mixed_step"] / on["decode_step"], on["mixed_gpu"] / on["gpu"], same_shapes,
                             all(result["outputs"] == plain for result in (off, on, runs))))
                print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()} x {args.tp} (TP {args.tp}); greedy, {PROMPT_LEN}-token prompts, {args.new_tokens} new tokens, "
          "CUDA graphs; times per step (median), GPU = CUDA events around each launch; "
          f"'k=1': one step per launch, 'k={args.decode_steps_per_launch}': decode runs of up to that many steps")
    print(f"{'model':>32} {'B':>3} {'S':>2} {'wall off':>8} {'wall k=1':>8} {'GPU k=1':>7} {'w/GPU':>5} "
          f"{'wall k=K':>8} {'GPU k=K':>7} {'w/GPU':>5} {'tok/s k=1':>9} {'tok/s k=K':>9} {'vs S=0':>7} {'acc len':>7} "
          f"{'mixed/dec wall':>14} {'GPU':>5} {'off==on==runs':>13} {'==plain':>7}")
    for (name, batch, S, off, on, gpu, ratio, runs, runs_gpu, runs_ratio, tps, runs_tps, speedup, accepted, mixed,
         mixed_gpu, same_shapes, same) in rows:
        print(f"{name:>32} {batch:3d} {S:2d} {off * 1e3:8.3f} {on * 1e3:8.3f} {gpu * 1e3:7.3f} {ratio:5.2f} "
              f"{runs * 1e3:8.3f} {runs_gpu * 1e3:7.3f} {runs_ratio:5.2f} {tps:9.0f} {runs_tps:9.0f} {speedup:6.2f}x "
              f"{accepted:7.2f} {mixed:14.2f} {mixed_gpu:5.2f} {str(same_shapes):>13} {str(same):>7}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
