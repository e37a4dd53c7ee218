"""Where a prefix-cache hit's time to first token goes: step by step, cold vs hit, one request.

    python bench/profile_prefix_hit.py                  # GPU: the ~1B GPT of bench_prefix_cache (bf16, S = 2)
    python bench/profile_prefix_hit.py --quick          # CPU (torch twins): a tiny GPT
    python bench/profile_prefix_hit.py --kernels        # also torch.profiler kernel times of the hit's steps
    python bench/profile_prefix_hit.py --host-profile   # also cProfile of the hit's host calls
    python bench/profile_prefix_hit.py --batch 64       # also the 64 requests sharing a prefix, call by call

For each prefix length: one request (prefix + 32 tokens) alone, cold on a caching-off controller
and as a hit on a caching-on one (an earlier request computed the prefix). Prints, per
``controller.step()`` call until the first token: its wall time, the steps it launched (graph key
or eager, padded dimensions, attention bounds) and whether it emitted the first token. Controllers
are sized by ``--model-len`` (default: the longest prefix + 96), as the TTFT sweep of
``bench_prefix_cache.py`` sizes them. Then the floor of any hit: one steady decode step of the
same model (batch 1, S = 2, graph) and one plain forward of one token (S = 0), synced, median.

``--batch N`` (the first prefix length): ``bench_prefix_cache.py``'s system-prompt workload on its
controller sizes (N rows, 2048 tokens a step, graphs at 1, 8, N): N requests sharing the prefix,
each with its own 32 tokens, added at once; per ``step()`` call its wall time, its launches and
how many requests got their first token; caching on (and off with ``--batch-off``).
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
    parser.add_argument("--batch", type=int, default=0, help="also N requests sharing the first prefix, call by call")
    parser.add_argument("--batch-off", action="store_true", help="--batch with caching off too")
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

    def controller(prefix_caching, rows=1, length=None, speculative=2):
        length = length or model_len
        config = InferenceConfig(num_speculative_tokens=speculative, max_requests=rows, block_size_tokens=block_size,
                                 max_model_len=length, max_tokens_per_step=max(256 if quick else 2048, 3 * rows),
                                 num_kv_blocks=max(rows, 4) * (-(-(length + 6) // block_size) + 1) + 64,
                                 cuda_graph_batch_sizes=tuple(sorted({size for size in (*graphs, 8, rows) if size <= rows}))
                                 if graphs else (),
                                 prefix_caching=prefix_caching)
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
    decode_floor(on, off, model, controller, random_tokens, sync, quick)
    off.close()
    on.close()
    if args.batch:
        batch_profile(args, lengths[0], controller, random_tokens, sync, device)


def _median(values):
    values = sorted(values)
    return values[len(values) // 2]


def decode_floor(on, off, model, controller, random_tokens, sync, quick):
    """The floor of a hit's one step: a steady decode step of one request (S = 2, graph, synced)
    on the caching-on controller, and a plain S = 0 controller's steady step (one token a forward)."""
    from mtp_ctrl.controllers import SamplingParams

    def steady_step_ms(ctrl, prompt_tokens):
        request_id = ctrl.add_request(prompt_tokens, SamplingParams(max_new_tokens=48))
        times = []
        while ctrl.has_unfinished_requests():
            sync()
            before = time.perf_counter()
            ctrl.step()
            sync()
            times.append((time.perf_counter() - before) * 1e3)
        ctrl.pop_result(request_id)
        return _median(times[4:-4] or times)

    prompt = random_tokens(64 if quick else 2048)
    speculative_ms = steady_step_ms(on, prompt)
    plain = controller(False, speculative=0)
    steady_step_ms(plain, prompt)  # warm-up
    plain_ms = steady_step_ms(plain, prompt)
    plain.close()
    print(f"floor of a hit step: a steady decode step (batch 1, {len(prompt)}-token context, synced, median): "
          f"S = 2 {speculative_ms:.2f} ms, S = 0 (one plain forward of one token) {plain_ms:.2f} ms")


def batch_profile(args, system_tokens, controller, random_tokens, sync, device):
    """N requests sharing a ``system_tokens`` prefix, added at once, call by call (module docstring)."""
    from mtp_ctrl.controllers import SamplingParams

    requests = args.batch
    new_tokens = 4 if args.quick else 32
    model_len = system_tokens + 4 * (64 + new_tokens) + 64  # bench_prefix_cache's sizes
    system = random_tokens(system_tokens)
    for prefix_caching in (True, False) if args.batch_off else (True,):
        ctrl = controller(prefix_caching, rows=requests, length=model_len)
        for warm in range(2):  # compile, graphs; warms the cache when on
            ctrl.launches.clear()
            request_id = ctrl.add_request(system + random_tokens(32), SamplingParams(max_new_tokens=new_tokens))
            while ctrl.has_unfinished_requests():
                ctrl.step()
            ctrl.pop_result(request_id)
        ctrl.launches.clear()
        prompts = [system + random_tokens(32) for _ in range(requests)]
        sync()
        start = time.perf_counter()
        ids = [ctrl.add_request(prompt, SamplingParams(max_new_tokens=new_tokens)) for prompt in prompts]
        added = time.perf_counter()
        first, calls = {}, []
        while len(first) < requests:
            before, launched = time.perf_counter(), len(ctrl.launches)
            outputs = ctrl.step()
            now = time.perf_counter()
            fresh = [rid for rid, tokens, _ in outputs if tokens and rid not in first]
            for rid in fresh:
                first[rid] = now - start
            calls.append(dict(start_ms=(before - start) * 1e3, ms=(now - before) * 1e3,
                              launches=ctrl.launches[launched:], first=len(fresh)))
        while ctrl.has_unfinished_requests():
            ctrl.step()
        sync()
        for request_id in ids:
            ctrl.pop_result(request_id)
        ttft = [first[request_id] * 1e3 for request_id in ids]
        print(f"batch of {requests} sharing {system_tokens} tokens, caching {'on' if prefix_caching else 'off'}: "
              f"add_request x{requests} {(added - start) * 1e3:.2f} ms, mean TTFT {sum(ttft) / len(ttft):.2f} ms, "
              f"p50 {_median(ttft):.2f}, max {max(ttft):.2f}; {len(calls)} step() calls to the last first token")
        for index, call in enumerate(calls):
            launches = "; ".join(
                f"{'graph' if launch['graph'] else 'eager'} dims {launch['dims']} rows {launch['real_rows']} "
                f"decode {launch['decode']} prefill {launch['prefill']} max_q {launch['max_q']}" for launch in call["launches"])
            print(f"  call {index}: at {call['start_ms']:.2f} ms, {call['ms']:.2f} ms, first tokens {call['first']}: "
                  f"{launches}")
        ctrl.close()
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
