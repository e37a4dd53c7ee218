import cProfile, pstats, io, sys, time
sys.path.insert(0, "examples")
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
batch, new, S = 32, 96, 2
prompts = [w.tolist() for w in evenly_spaced_windows(held, batch, 64)]
cfg = InferenceConfig(num_speculative_tokens=S, max_requests=batch + 1, block_size_tokens=16, max_model_len=64 + new + 16,
                      max_tokens_per_step=(batch + 1) * 64, cuda_graph_batch_sizes=(batch, batch + 1), decode_steps_per_launch=4)
c = TextGenerationController(m, cfg); c.warmup()
c.generate(prompts, SamplingParams(max_new_tokens=new))
admit, finish = cProfile.Profile(), cProfile.Profile()
for rep in range(3):
    ids = [c.add_request(p, SamplingParams(max_new_tokens=new - 8 * (i % 4))) for i, p in enumerate(prompts)]
    first = True
    while c.has_unfinished_requests():
        live = c.context.table.num_live
        prof = admit if first else None
        if not first and c._in_flight is not None:
            prof = finish
        first = False
        t = time.perf_counter()
        if prof is not None: prof.enable()
        c.step()
        if prof is not None: prof.disable()
    for r in ids: c.pop_result(r)
for name, prof in (("ADMIT (3 calls)", admit), ("ALL LATER CALLS (3 runs)", finish)):
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(28); print(name); print(s.getvalue()[:6000])
