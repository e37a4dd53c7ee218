import os, sys, time, statistics
sys.path.insert(0, "examples"); sys.path.insert(0, "bench")
import mtp_ctrl
mtp_ctrl.quiet_known_warnings(False)
import torch
from byte_corpus import evenly_spaced_windows, load_stdlib_corpus
from demo_model import build_demo_model, init_distributed, load_checkpoint, load_full_state_dict
from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
device = torch.device("cuda"); init_distributed(1, device)
args, sd = load_checkpoint("examples/checkpoints/mtp_demo.pt"); m = build_demo_model(args); load_full_state_dict(m, sd)
m = m.to(device).to(torch.bfloat16).eval()
held = load_stdlib_corpus().held_out
for S in (0, 2):
    batch, new = 32, 96
    prompts = [w.tolist() for w in evenly_spaced_windows(held, batch, 64)]
    cfg = InferenceConfig(num_speculative_tokens=S, max_requests=batch + 1, block_size_tokens=16, max_model_len=64 + new + 16,
                          max_tokens_per_step=(batch + 1) * 64, cuda_graph_batch_sizes=(batch, batch + 1), decode_steps_per_launch=4)
    c = TextGenerationController(m, cfg); t = time.perf_counter(); n = c.warmup(); print("warmup", n, "graphs", time.perf_counter() - t)
    c.generate(prompts, SamplingParams(max_new_tokens=new)); c.metrics.reset()
    launches = []
    orig = c._launch_step
    def ls(step):
        launches.append((step.num_steps, step.num_decode, step.num_prefill, step.graph_padded, (step.dimensions, c._all_greedy, step.num_steps) in c._graphs._graphs))
        return orig(step)
    c._launch_step = ls
    ids = [c.add_request(p, SamplingParams(max_new_tokens=new - 8 * (i % 4))) for i, p in enumerate(prompts)]
    calls = []
    while c.has_unfinished_requests():
        before = len(launches); t = time.perf_counter(); c.step(); calls.append((time.perf_counter() - t, launches[before:]))
    total = sum(w for w, _ in calls)
    print(f"S={S} calls {len(calls)} total {total*1e3:.2f} ms tokens {c.metrics.emitted_tokens}")
    for i, (w, l) in enumerate(calls):
        print(f"  {i:3d} {w*1e3:7.3f} ms {l}")
