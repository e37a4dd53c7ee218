"""Prefix caching on vs off: time to first token (TTFT) and throughput, same run, same weights.

    python bench/bench_prefix_cache.py            # GPU: a random-weight ~1B GPT (16 x 2048, bf16, S = 2)
    python bench/bench_prefix_cache.py --quick    # CPU (torch twins): a tiny GPT, small sizes, minutes

Three workloads, each run with ``InferenceConfig(prefix_caching=False)`` then ``True`` on the
same model (greedy, MTP drafting with S = 2 paged depths, CUDA graphs on the GPU):

- **system prompt**: one request warms the cache, then ``--requests`` (64) requests that share a
  ``--system-tokens`` (2048) system prompt, each with its own 32-token question, arrive at once.
  TTFT per request (from ``add_request`` to the step that returns its first token), and the
  throughput of the whole batch (tokens out / wall seconds); plus a single hit request alone vs
  a single cold one (the TTFT of a hit, the issue's target: at least 10x lower).
- **multi-turn chat**: 8 conversations x 4 turns; each turn resends the whole history (system
  prompt, previous questions and answers) plus a new 64-token question.
- **random prompts**: nothing is shared (512 random tokens each): the overhead of caching on
  (hashing at admission, the bookkeeping), as throughput on / off (target: within 2%).
- **TTFT per prefix length** (``--prefix-lengths``, default 2048, 8192, 16384): one request alone
  whose prompt is a long prefix + 32 tokens, cold (caching off, kernels warm) vs a hit (caching on,
  an earlier request computed the prefix): where prefill dominates TTFT.
- **hybrid** (``--parts hybrid``): the same cold vs hit TTFT on a hybrid model (Mamba-2 layers
  ``M*M*M*M*``, 8 x 1024, bf16): the hit restores a recurrent-state snapshot.
- **hybrid, nothing shared** (``--parts hybrid_random``): the random-prompt workload on that
  hybrid, caching on vs off (a hybrid's prompt with caching on ends a chunk at its last cacheable
  block to snapshot the state there: one more prefill step per prompt).

Outputs are compared with caching on and off (equal in fp32; in bf16 a hit's prefill runs other
GEMM shapes than a cold one, so a near-tie argmax of the random model may differ, as S > 0 vs
S = 0 may: the table says which workloads matched). Prints one table; the JSON of every figure
goes to ``--json`` when given.
"""

import argparse
import json
import os
import sys
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU, tiny model and sizes (a smoke run)")
    parser.add_argument("--requests", type=int, default=None, help="system-prompt batch size (default 64; quick 6)")
    parser.add_argument("--system-tokens", type=int, default=None, help="shared prefix length (default 2048; quick 96)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated per request (default 32; quick 4)")
    parser.add_argument("--prefix-lengths", default=None,
                        help="comma-separated prefix lengths of the TTFT sweep (default 2048,8192,16384; quick 96,192)")
    parser.add_argument("--parts", default="batch,sweep,hybrid",
                        help="which parts run: batch (the three workloads), sweep (TTFT per prefix length), hybrid, "
                             "hybrid_random (nothing shared on the hybrid, on vs off)")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args()


def main():
    args = parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)  # before megatron-core is imported
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from demo_model import DEMO_MODEL_ARGS, build_demo_model

    quick = args.quick
    device = torch.device("cpu" if quick or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu":
        os.environ.pop("TRITON_INTERPRET", None)  # CPU tensors then run the torch twins
    mtp_ctrl.init_single_process(device)
    requests = args.requests or (6 if quick else 64)
    system_tokens = args.system_tokens or (96 if quick else 2048)
    new_tokens = args.new_tokens or (4 if quick else 32)
    if quick:
        model_args = dict(DEMO_MODEL_ARGS, num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                          num_query_groups=2, mtp_num_layers=2, vocab_size=256, max_sequence_length=1024)
        name = "tiny GPT 2x64 (fp32, random, CPU twins)"
    else:
        model_args = dict(DEMO_MODEL_ARGS, num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16,
                          num_query_groups=4, mtp_num_layers=2, vocab_size=32000, max_sequence_length=4096)
        name = "GPT 16x2048 (~1B, bf16, random)"
    parts = set(args.parts.split(","))
    lengths = [int(length) for length in (args.prefix_lengths or ("96,192" if quick else "2048,8192,16384")).split(",")]
    model_args["max_sequence_length"] = max(model_args["max_sequence_length"], max(lengths) + 256)
    torch.manual_seed(0)
    model = build_demo_model(model_args).to(device).eval()
    if not quick:
        model.to(torch.bfloat16)
    vocab = model_args["vocab_size"]
    generator = torch.Generator().manual_seed(1)

    def random_tokens(count):
        return torch.randint(0, vocab, (count,), generator=generator).tolist()

    block_size = 16
    max_model_len = system_tokens + 4 * (64 + new_tokens) + 64
    max_requests = min(requests, 64)
    graphs = () if device.type == "cpu" else tuple(sorted({1, 8, max_requests}))

    def controller_for(prefix_caching, on_model=None, model_len=None, rows=None):
        from mtp_ctrl.controllers import InferenceConfig, TextGenerationController

        model_len, rows = model_len or max_model_len, rows or max_requests
        config = InferenceConfig(num_speculative_tokens=2, max_requests=rows, block_size_tokens=block_size,
                                 max_model_len=model_len, max_tokens_per_step=max(2048 if not quick else 256, rows * 3),
                                 num_kv_blocks=max(rows, 3) * (-(-(model_len + 6) // block_size) + 1) + 64,
                                 cuda_graph_batch_sizes=graphs if rows == max_requests else tuple(b for b in graphs if b <= rows),
                                 prefix_caching=prefix_caching)
        controller = TextGenerationController(on_model if on_model is not None else model, config)
        if graphs:
            controller.warmup()
        return controller

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def run_batch(controller, prompts):
        """Add every prompt now, step until done: (outputs, TTFT seconds per request, wall seconds)."""
        from mtp_ctrl.controllers import SamplingParams

        sync()
        start = time.perf_counter()
        ids = [controller.add_request(prompt, SamplingParams(max_new_tokens=new_tokens)) for prompt in prompts]
        first = {}
        while controller.has_unfinished_requests():
            for request_id, tokens, _ in controller.step():
                if tokens and request_id not in first:
                    first[request_id] = time.perf_counter() - start
        sync()
        wall = time.perf_counter() - start
        outputs = [controller.pop_result(request_id).output_tokens for request_id in ids]
        return outputs, [first[request_id] for request_id in ids], wall

    system = random_tokens(system_tokens)
    questions = [random_tokens(32) for _ in range(requests)]
    chats = [[random_tokens(64) for _ in range(4)] for _ in range(8 if not quick else 2)]
    random_prompts = [random_tokens(512 if not quick else 64) for _ in range(requests)]
    results = {"model": name, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "requests": requests, "system_tokens": system_tokens, "new_tokens": new_tokens}
    outputs = {}
    for prefix_caching in (False, True) if "batch" in parts else ():
        key = "on" if prefix_caching else "off"
        controller = controller_for(prefix_caching)
        run_batch(controller, [system + random_tokens(32)])  # warm-up: compile, graphs; warms the cache when on
        cold_or_hit = run_batch(controller, [system + questions[0]])  # one request alone: a hit when on
        controller.metrics.reset()
        batch_outputs, ttft, wall = run_batch(controller, [system + question for question in questions])
        sys_stats = controller.metrics.as_dict()["prefix_cache"]
        tokens_out = sum(len(output) for output in batch_outputs)
        # multi-turn chat: turn k of every conversation at once, each resending its history
        histories = [list(system) for _ in chats]
        chat_wall, chat_ttft, chat_out, chat_tokens = 0.0, [], [], 0
        for turn in range(4):
            prompts = [history + chat[turn] for history, chat in zip(histories, chats)]
            turn_outputs, turn_ttft, turn_wall = run_batch(controller, prompts)
            chat_wall += turn_wall
            chat_ttft += turn_ttft
            chat_out.append(turn_outputs)
            chat_tokens += sum(len(output) for output in turn_outputs)
            histories = [prompt + list(output) for prompt, output in zip(prompts, turn_outputs)]
        random_outputs, random_ttft, random_wall = run_batch(controller, random_prompts)
        outputs[key] = (cold_or_hit[0], batch_outputs, chat_out, random_outputs)
        results[key] = {
            "single_ttft_ms": cold_or_hit[1][0] * 1e3,
            "system_ttft_mean_ms": sum(ttft) / len(ttft) * 1e3,
            "system_ttft_p50_ms": sorted(ttft)[len(ttft) // 2] * 1e3,
            "system_tokens_per_s": tokens_out / wall,
            "system_hit_rate": sys_stats["hit_rate"],
            "chat_ttft_mean_ms": sum(chat_ttft) / len(chat_ttft) * 1e3,
            "chat_tokens_per_s": chat_tokens / chat_wall,
            "random_tokens_per_s": sum(len(output) for output in random_outputs) / random_wall,
            "random_ttft_mean_ms": sum(random_ttft) / len(random_ttft) * 1e3,
            "cached_blocks": controller.metrics.as_dict()["prefix_cache"]["cached_blocks"],
            "evictions": controller.metrics.as_dict()["prefix_cache"]["evictions"],
        }
        controller.close()
        del controller
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "batch" in parts:
        print_batch_table(results, outputs, name, requests, system_tokens, new_tokens)
    if "sweep" in parts:
        results["sweep"] = ttft_sweep(model, lengths, random_tokens, controller_for, run_batch, device)
        print_sweep(f"{name}: single-request TTFT, cold (caching off) vs hit", results["sweep"])
    if "hybrid" in parts:
        hybrid, hybrid_name = build_hybrid(quick, max(lengths) + 256, device)
        results["hybrid"] = ttft_sweep(hybrid, lengths, random_tokens, controller_for, run_batch, device)
        print_sweep(f"{hybrid_name}: single-request TTFT, cold (caching off) vs hit (state snapshot restored)",
                    results["hybrid"])
    if "hybrid_random" in parts:
        hybrid, hybrid_name = build_hybrid(quick, max(max(lengths), max_model_len) + 256, device)
        hybrid_rows = {}
        for prefix_caching in (False, True):
            controller = controller_for(prefix_caching, hybrid)
            run_batch(controller, random_prompts[:2])  # warm-up
            hybrid_outputs, hybrid_ttft, hybrid_wall = run_batch(controller, random_prompts)
            hybrid_rows["on" if prefix_caching else "off"] = dict(
                tokens_per_s=sum(len(output) for output in hybrid_outputs) / hybrid_wall,
                ttft_mean_ms=sum(hybrid_ttft) / len(hybrid_ttft) * 1e3, outputs=hybrid_outputs)
            controller.close()
        off, on = hybrid_rows["off"], hybrid_rows["on"]
        results["hybrid_random"] = {key: {k: v for k, v in row.items() if k != "outputs"} for key, row in hybrid_rows.items()}
        results["hybrid_random"]["outputs_equal"] = off["outputs"] == on["outputs"]
        print(f"{hybrid_name}: {len(random_prompts)} random prompts (nothing shared), caching off vs on: tokens/s "
              f"{off['tokens_per_s']:.1f} vs {on['tokens_per_s']:.1f} ({(on['tokens_per_s'] / off['tokens_per_s'] - 1) * 100:+.1f}%), "
              f"mean TTFT {off['ttft_mean_ms']:.1f} vs {on['ttft_mean_ms']:.1f} ms, outputs equal "
              f"{results['hybrid_random']['outputs_equal']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    equal = list(results.get("outputs_equal", {}).values()) + \
        [row["outputs_equal"] for part in ("sweep", "hybrid") for row in results.get(part, [])] + \
        ([results["hybrid_random"]["outputs_equal"]] if "hybrid_random" in results else [])
    if not all(equal) and next(model.parameters()).dtype == torch.float32:
        sys.exit("outputs differ with prefix caching on and off (fp32)")


def ttft_sweep(model, lengths, random_tokens, controller_for, run_batch, device):
    """Per prefix length: TTFT of one request (prefix + 32 tokens) cold on a caching-off controller
    (after a warm-up request of the same length) vs a hit on a caching-on one (after two requests
    with the same prefix). One controller each, sized for the longest prefix."""
    import torch

    model_len = max(lengths) + 32 + 64
    off, on = controller_for(False, model, model_len, 1), controller_for(True, model, model_len, 1)
    rows = []
    for length in lengths:
        prefix = random_tokens(length)
        run_batch(off, [random_tokens(length + 32)])  # warm-up: this length's kernels
        question = random_tokens(32)
        cold_out, cold_ttft, _ = run_batch(off, [prefix + question])
        for _ in range(2):  # computes and caches the prefix (a hybrid: the second snapshots where they part)
            run_batch(on, [prefix + random_tokens(32)])
        hits_before = on.metrics.as_dict()["prefix_cache"]["hit_tokens"]
        hit_out, hit_ttft, _ = run_batch(on, [prefix + question])
        rows.append(dict(prefix_tokens=length, cold_ttft_ms=cold_ttft[0] * 1e3, hit_ttft_ms=hit_ttft[0] * 1e3,
                         speedup=cold_ttft[0] / hit_ttft[0], outputs_equal=cold_out == hit_out,
                         hit_tokens=on.metrics.as_dict()["prefix_cache"]["hit_tokens"] - hits_before))
    for controller in (off, on):
        controller.close()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def build_hybrid(quick, max_sequence_length, device):
    """A hybrid GPT (Mamba-2 and attention layers "M*M*..."), random weights; bf16 on the GPU."""
    import torch
    from megatron.core.transformer import TransformerConfig

    from mtp_ctrl.models import build_gpt_model

    layers, hidden = (4, 64) if quick else (8, 1024)
    dtype = torch.float32 if quick else torch.bfloat16
    config = TransformerConfig(num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * hidden,
                               num_attention_heads=4 if quick else 16, num_query_groups=2 if quick else 4,
                               mtp_num_layers=2, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                               params_dtype=dtype, bf16=not quick, mamba_state_dim=16 if quick else 128,
                               mamba_head_dim=16 if quick else 64, mamba_num_groups=2 if quick else 8)
    torch.manual_seed(0)
    model = build_gpt_model(config, vocab_size=256 if quick else 32000, max_sequence_length=max_sequence_length,
                            layer_pattern="M*" * (layers // 2)).to(device).eval()
    return model, f"hybrid {'M*' * (layers // 2)} {layers}x{hidden} ({'fp32' if quick else 'bf16'}, random)"


def print_sweep(title, rows):
    print(title)
    print(f"| {'prefix tokens':>13} | {'tokens hit':>10} | {'cold TTFT ms':>12} | {'hit TTFT ms':>11} | {'cold / hit':>10} "
          "| outputs equal |")
    print(f"|{'-' * 15}|{'-' * 12}|{'-' * 14}|{'-' * 13}|{'-' * 12}|{'-' * 15}|")
    for row in rows:
        print(f"| {row['prefix_tokens']:>13} | {row['hit_tokens']:>10} | {row['cold_ttft_ms']:>12.1f} | "
              f"{row['hit_ttft_ms']:>11.1f} | {row['speedup']:>9.2f}x | {str(row['outputs_equal']):>13} |")


def print_batch_table(results, outputs, name, requests, system_tokens, new_tokens):
    workloads = ("single", "system prompt", "chat", "random")
    results["outputs_equal"] = {name: on_out == off_out for name, on_out, off_out in zip(workloads, outputs["on"], outputs["off"])}
    off, on = results["off"], results["on"]
    print(f"{name} on {results['device']}: {requests} requests, {system_tokens}-token system prompt, "
          f"{new_tokens} new tokens, S = 2 (MTP, paged), outputs on == off: {results['outputs_equal']}")
    rows = [("single request TTFT (ms): cold vs hit", "single_ttft_ms", True),
            (f"system prompt x{requests}: mean TTFT (ms)", "system_ttft_mean_ms", True),
            (f"system prompt x{requests}: p50 TTFT (ms)", "system_ttft_p50_ms", True),
            (f"system prompt x{requests}: tokens/s", "system_tokens_per_s", False),
            ("multi-turn chat: mean TTFT (ms)", "chat_ttft_mean_ms", True),
            ("multi-turn chat: tokens/s", "chat_tokens_per_s", False),
            ("random prompts (nothing shared): tokens/s", "random_tokens_per_s", False),
            ("random prompts: mean TTFT (ms)", "random_ttft_mean_ms", True)]
    print(f"| {'workload':<46} | {'off':>10} | {'on':>10} | {'on vs off':>10} |")
    print(f"|{'-' * 48}|{'-' * 12}|{'-' * 12}|{'-' * 12}|")
    for label, field, lower_better in rows:
        ratio = off[field] / on[field] if lower_better else on[field] / off[field]
        print(f"| {label:<46} | {off[field]:>10.1f} | {on[field]:>10.1f} | {ratio:>9.2f}x |")
    print(f"system prompt batch hit rate {on['system_hit_rate']:.3f}; cached blocks at the end {on['cached_blocks']}, "
          f"evictions {on['evictions']}")


if __name__ == "__main__":
    main()
