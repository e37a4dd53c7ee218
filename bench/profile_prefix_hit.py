"""Where a prefix-cache hit's time to first token goes: step by step, cold vs hit, one request.

    python bench/profile_prefix_hit.py                  # GPU: the ~1B GPT of bench_prefix_cache (bf16, S = 2)
    python bench/profile_prefix_hit.py --quick          # CPU (torch twins): a tiny GPT
    python bench/profile_prefix_hit.py --kernels        # also torch.profiler kernel times of the hit's steps
    python bench/profile_prefix_hit.py --host-profile   # also cProfile of the hit's host calls

For each prefix length: one request (prefix + 32 tokens) alone, cold on a caching-off controller
and as a hit on a caching-on one (an earlier request computed the prefix). Prints, per
``controller.step()`` call until the first token: its wall time, the steps it launched (graph key
or eager, padded dimensions, attention bounds) and whether it emitted the first token. Controllers
are sized by ``--model-len`` (default: the longest prefix + 96), as the TTFT sweep of
``bench_prefix_cache.py`` sizes them.
"""

import argparse
import os
import sys
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU, tiny model (torch twins)")
    parser.add_argument("--prefix-lengths", default=None, help="comma-separated (default 2048,16384; quick 256,1024)")
    parser.add_argument("--model-len", type=int, default=None, help="max_model_len of both controllers")
    parser.add_argument("--repeats", type=int, default=3, help="hit / cold measurements per length (median shown)")
    parser.add_argument("--kernels", action="store_true", help="torch.profiler kernel table of one hit and one cold")
    parser.add_argument("--host-profile", action="store_true", help="cProfile of one hit's step() calls")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args()


def main():
    args = parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from demo_model import DEMO_MODEL_ARGS, build_demo_model

    from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController

    quick = args.quick
    device = torch.device("cpu" if quick or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu":
        os.environ.pop("TRITON_INTERPRET", None)  # CPU tensors run the torch twins
    mtp_ctrl.init_single_process(device)
    lengths = [int(x) for x in (args.prefix_lengths or ("256,1024" if quick else "2048,16384")).split(",")]
    model_len = args.model_len or max(lengths) + 96
    if quick:
        model_args = dict(DEMO_MODEL_ARGS, num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                          num_query_groups=2, mtp_num_layers=2, vocab_size=256)
    else:
        model_args = dict(DEMO_MODEL_ARGS, num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16,
                          num_query_groups=4, mtp_num_layers=2, vocab_size=32000)
    model_args["max_sequence_length"] = model_len + 256
    torch.manual_seed(0)
    model = build_demo_model(model_args).to(device).eval()
    if not quick:
        model.to(torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    vocab = model_args["vocab_size"]

    def random_tokens(count):
        return torch.randint(0, vocab, (count,), generator=generator).tolist()

    class Recording(TextGenerationController):
        """Records every launch (the documented on_launch hook) for the table."""
        launches = []

        def on_launch(self, step, graph_key):
            attention = step.attention
            self.launches.append(dict(graph=graph_key is not None, dims=(step.dimensions.token_count, step.dimensions.request_count),
                                      real_rows=attention.num_actual_tokens, max_q=attention.max_query_len,
                                      max_kv=attention.max_seq_len, decode=step.num_decode, prefill=step.num_prefill,
                                      steps=step.num_steps))

    block_size = 16
    graphs = () if device.type == "cpu" else (1,)

    def controller(prefix_caching):
        config = InferenceConfig(num_speculative_tokens=2, max_requests=1, block_size_tokens=block_size,
                                 max_model_len=model_len, max_tokens_per_step=256 if quick else 2048,
                                 num_kv_blocks=4 * (-(-(model_len + 6) // block_size) + 1) + 64,
                                 cuda_graph_batch_sizes=graphs, prefix_caching=prefix_caching)
        ctrl = Recording(model, config)
        if graphs:
            ctrl.warmup()
        return ctrl

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def first_token(ctrl, prompt, synced=False, on_first=None):
        """Add ``prompt`` alone, step until its first token: (TTFT s, add_request ms, [per-call rows]),
        then finish it. ``synced``: wait for the device after every call (its time then includes the
        GPU work it launched). ``on_first``: called once the first token is out (before finishing)."""
        ctrl.launches.clear()
        sync()
        start = time.perf_counter()
        request_id = ctrl.add_request(prompt, SamplingParams(max_new_tokens=8))
        added = time.perf_counter()
        calls, ttft = [], None
        while ttft is None:
            before, launched = time.perf_counter(), len(ctrl.launches)
            outputs = ctrl.step()
            if synced:
                sync()
            now = time.perf_counter()
            emitted = any(rid == request_id and tokens for rid, tokens, _ in outputs)
            calls.append(dict(ms=(now - before) * 1e3, launches=ctrl.launches[launched:], emitted=emitted))
            if emitted:
                ttft = now - start
        if on_first is not None:
            on_first()
        while ctrl.has_unfinished_requests():
            ctrl.step()
        ctrl.pop_result(request_id)
        sync()
        return ttft, (added - start) * 1e3, calls

    def print_calls(calls):
        for index, call in enumerate(calls):
            print(f"  call {index}: {call['ms']:.2f} ms, emitted first token: {call['emitted']}")
            for launch in call["launches"]:
                print(f"    launch {'graph' if launch['graph'] else 'eager'} dims {launch['dims']} rows "
                      f"{launch['real_rows']} decode {launch['decode']} prefill {launch['prefill']} steps "
                      f"{launch['steps']} max_query_len {launch['max_q']} max_seq_len {launch['max_kv']}")

    off, on = controller(False), controller(True)
    for length in lengths:
        prefix = random_tokens(length)
        first_token(off, random_tokens(length + 32))  # warm-up of this length
        for _ in range(2):
            first_token(on, prefix + random_tokens(32))  # caches the prefix
        for label, ctrl, make in (("cold", off, lambda: random_tokens(length + 32)),
                                  ("hit", on, lambda: prefix + random_tokens(32))):
            runs = sorted((first_token(ctrl, make()) for _ in range(args.repeats)), key=lambda run: run[0])
            ttft, add_ms, calls = runs[len(runs) // 2]
            print(f"prefix {length}, {label}: TTFT {ttft * 1e3:.2f} ms (median of {args.repeats}; all "
                  f"{', '.join(f'{run[0] * 1e3:.2f}' for run in runs)}), add_request {add_ms:.2f} ms, "
                  f"{len(calls)} step() calls")
            print_calls(calls)
            ttft, add_ms, calls = first_token(ctrl, make(), synced=True)
            print(f"prefix {length}, {label}, the device synced after each call: TTFT {ttft * 1e3:.2f} ms, "
                  f"add_request {add_ms:.2f} ms")
            print_calls(calls)
        if args.host_profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            first_token(on, prefix + random_tokens(32))
            profiler.disable()
            print(f"prefix {length}, hit: cProfile (tottime)")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
        if args.kernels and device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            for label, ctrl, prompt in (("hit", on, prefix + random_tokens(32)),
                                        ("cold", off, random_tokens(length + 32))):
                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                prof.start()
                first_token(ctrl, prompt, on_first=lambda: (sync(), prof.stop()))
                try:
                    kernels = [event for event in prof.key_averages() if str(event.device_type).endswith("CUDA")]
                    total_us = sum(event.self_device_time_total for event in kernels)
                    print(f"prefix {length}, {label}: GPU kernels from add_request to the first token: "
                          f"{sum(event.count for event in kernels)} launches, {total_us / 1e3:.3f} ms")
                    for event in sorted(kernels, key=lambda event: -event.self_device_time_total)[:12]:
                        print(f"    {event.self_device_time_total / 1e3:8.3f} ms {event.count:5d}x  {event.key[:90]}")
                except (AttributeError, RuntimeError) as error:  # another torch's profiler API
                    print(f"kernel summary failed ({error}); the profiler's table:")
                    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    off.close()
    on.close()


if __name__ == "__main__":
    main()
