"""Where a queued workload's time goes: its steps by kind and their padding (issue 34).

    python bench/profile_queue_steps.py --batch 256                 # GPU: the ~1B model
    python bench/profile_queue_steps.py --quick                     # CPU smoke run

The 1B model of ``bench_adaptive.py`` with its acceptance oracle (requests labelled 0.9 / 0.6 /
0.2), ``4 x batch`` requests of 48 tokens queued on ``batch`` slots (a freed slot takes the next
request). Each engine (fixed S in ``--fixed``, and ``GoodputPolicy`` at S_max = 3 with
``--goodput``) runs once per mixed-step token-bucket scheme of ``--per-octave`` (1: powers of two;
k: each octave split in k steps; ``InferenceConfig.cuda_graph_token_counts``). Timed
``--repeats`` times interleaved round-robin after an untimed warm-up generate; printed per engine:
median tokens/s, the steps of the last timed run by kind (decode-only, mixed: with prefill
chunks), a mixed step's mean real and padded token counts (the graph it replays), and the padded
rows' share of every mixed row; the graphs each engine captured and its warm-up seconds.
"""

import argparse
import os
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU, tiny shapes")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--fixed", type=int, nargs="*", default=[0, 1], help="fixed S engines (default 0 1)")
    parser.add_argument("--goodput", action="store_true", help="also GoodputPolicy at S_max = 3")
    parser.add_argument("--per-octave", type=int, nargs="+", default=[1, 4], help="token-bucket schemes (default 1 4)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # noqa: E402
from bench_adaptive import PROMPT_LEN, QUEUED, AcceptanceOracle, widen_logit_margins  # noqa: E402
from bench_forward import FULL_MODEL, QUICK_MODEL, build_model  # noqa: E402

import mtp_ctrl  # noqa: E402
from mtp_ctrl.controllers import GoodputPolicy, InferenceConfig, SamplingParams, TextGenerationController  # noqa: E402
from mtp_ctrl.state.batch_dimensions import token_buckets  # noqa: E402


class StepLog:
    """Wraps a context's ``build_step``: per built step (num_decode, real tokens, padded tokens, V, D, prefill)."""

    def __init__(self, context):
        self.rows, self._build = [], context.build_step

        def build_step(*args, **kwargs):
            step = self._build(*args, **kwargs)
            if step is not None:
                self.rows.append((step.num_decode, int(step.host_query_start_loc[-1]), step.dimensions.token_count,
                                  step.verify_width, step.num_drafts, step.num_prefill > 0))
            return step

        context.build_step = build_step

    def summary(self):
        rows = np.array(self.rows, dtype=np.int64).reshape(-1, 6)
        mixed = rows[rows[:, 5] == 1]
        decode = rows[rows[:, 5] == 0]
        padded = int(mixed[:, 2].sum()) if mixed.shape[0] else 0
        return dict(steps=rows.shape[0], decode_steps=decode.shape[0], mixed_steps=mixed.shape[0],
                    mixed_real=round(float(mixed[:, 1].mean()), 1) if mixed.shape[0] else None,
                    mixed_padded=round(float(mixed[:, 2].mean()), 1) if mixed.shape[0] else None,
                    mixed_pad_share=round(1 - int(mixed[:, 1].sum()) / padded, 3) if padded else None,
                    decode_V=np.bincount(decode[:, 3], minlength=4).tolist())


def main(args):
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    mtp_ctrl.init_single_process(device)
    shape = QUICK_MODEL if args.quick else FULL_MODEL
    batch = 4 if args.quick else args.batch
    new_tokens = 8 if args.quick else args.new_tokens
    max_model_len = PROMPT_LEN + new_tokens + 8
    model = build_model(shape, device, max_model_len + 8)
    if device.type == "cpu":
        model = model.float()
    widen_logit_margins(model)
    total = QUEUED * batch
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, shape["vocab_size"], (total, PROMPT_LEN), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=new_tokens)
    max_tokens = max(batch * PROMPT_LEN, 256)

    def build(S, policy, per_octave, proposer=None):
        config = InferenceConfig(num_speculative_tokens=S, max_requests=batch, block_size_tokens=16,
                                 max_model_len=max_model_len, max_tokens_per_step=max_tokens,
                                 cuda_graph_batch_sizes=(batch,) if device.type == "cuda" else (),
                                 cuda_graph_token_counts=token_buckets(max_tokens, per_octave=per_octave))
        controller = TextGenerationController(model, config, proposer=proposer, draft_policy=policy)
        started = time.perf_counter()
        graphs = controller.warmup()
        return controller, graphs, time.perf_counter() - started

    plain, _, _ = build(0, None, 1)
    outputs = [r.output_tokens for r in plain.generate(prompts, params)]
    plain.close()
    sequences = torch.zeros(total, PROMPT_LEN + new_tokens + 16, dtype=torch.int64)
    for index, (prompt, output) in enumerate(zip(prompts, outputs)):
        sequences[index, : len(prompt) + len(output)] = torch.tensor(list(prompt) + list(output))
    sequences = sequences.to(device)
    rates = torch.tensor([(0.9, 0.6, 0.2)[i % 3] for i in range(total)], device=device)
    first_id = torch.zeros((), dtype=torch.int64, device=device)
    engines = []
    for per_octave in args.per_octave:
        kinds = [(S, None) for S in args.fixed] + ([(3, "goodput")] if args.goodput else [])
        for S, name in kinds:
            policy = GoodputPolicy() if name else None
            controller, graphs, seconds = build(S, policy, per_octave, AcceptanceOracle(sequences, rates, first_id))
            label = f"{name or f'S={S}'} /{per_octave}"
            engines.append(dict(label=label, controller=controller, policy=policy, graphs=graphs,
                                warmup_s=round(seconds, 1), runs=[]))
            print(f"warm-up {label}: {graphs} graphs in {seconds:.1f} s", flush=True)
    for entry in engines:  # untimed: compile, the policy's exploration
        for _ in range(2 if entry["policy"] else 1):
            first_id.fill_(entry["controller"].debug_view().next_request_id)
            entry["controller"].generate(prompts, params)
    for _ in range(args.repeats):
        for entry in engines:
            controller = entry["controller"]
            first_id.fill_(controller.debug_view().next_request_id)
            log = StepLog(controller.context)
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            results = controller.generate(prompts, params)
            seconds = time.perf_counter() - started
            del controller.context.build_step  # the instance attribute StepLog set: the class method again
            assert [r.output_tokens for r in results] == outputs, entry["label"]
            entry["runs"].append(sum(len(r.output_tokens) for r in results) / seconds)
            entry["steps"] = log.summary()
            if entry["policy"] is not None:
                counts = controller.metrics.as_dict()["draft_length_counts"]
                entry["steps"]["goodput_D_counts"] = list(counts)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\n{name}; batch {batch}, {total} requests queued, {new_tokens} tokens each; tokens/s median of "
          f"{args.repeats}; == plain on every run")
    for entry in engines:
        print(f"{entry['label']:>14}: {np.median(entry['runs']):9.0f} tok/s (runs {[round(r) for r in entry['runs']]}), "
              f"{entry['graphs']} graphs, warm-up {entry['warmup_s']} s, {entry['steps']}", flush=True)
    for entry in engines:
        entry["controller"].close()


if __name__ == "__main__":
    main(ARGS)
