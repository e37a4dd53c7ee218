"""The engine loop's own cost: the server's engine process (`mtp_ctrl.serve.engine.EngineLoop`, the
demo model) against the real frontend's end of the pipe (`EngineClient`, in a spawned process, no
HTTP), closed-loop: `--in-flight` requests outstanding, a new one sent as soon as one ends.

    python bench/profile_engine_loop.py --device cuda             # what the GPU call runs
    python bench/profile_engine_loop.py --device cpu --quick      # CPU: the between-step microseconds
    python bench/profile_engine_loop.py --device cpu --quick --cprofile   # where they go

Reported: tokens/s, the share of the loop's wall inside `controller.step()`, and the engine's
microseconds per step call outside it (pipe reads, adds, result pops, step messages); then the
offline loop (all requests added, `step()` until done) on the same prompts, the yardstick.
"""

import argparse
import asyncio
import cProfile
import gc
import multiprocessing
import pstats
import sys
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--speculative-tokens", type=int, default=2)
    parser.add_argument("--max-requests", type=int, default=32, help="the controller's rows")
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="a short load (CPU)")
    parser.add_argument("--cprofile", action="store_true", help="print the engine loop's cProfile (top 25)")
    parser.add_argument("--stand-in-step-us", type=float, default=None,
                        help="no model: a stand-in controller whose step() spins this long and gives every row "
                             "--stand-in-tokens tokens (the loop's own cost alone, any machine)")
    parser.add_argument("--stand-in-tokens", type=int, default=8)
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.in_flight, args.max_tokens, args.max_requests = 24, 8, 48, 4
    return args


def frontend_side(connection, prompts, in_flight: int, max_tokens: int, result_queue) -> None:
    """The frontend's end (a spawned process): closed-loop requests through the real EngineClient."""
    from mtp_ctrl.controllers import SamplingParams
    from mtp_ctrl.serve.frontend import EngineClient
    from mtp_ctrl.serve.metrics import ServerMetrics

    kind, info = connection.recv()
    assert kind == "ready", kind
    client = EngineClient(connection, info, ServerMetrics())
    params = SamplingParams(max_new_tokens=max_tokens)
    queue = list(reversed(prompts))

    async def worker(tokens):
        while queue:
            stream = client.submit(queue.pop(), params)
            while True:
                got, reason = await stream.take()
                tokens[0] += len(got)
                if reason is not None:
                    break

    async def run():
        client.attach(asyncio.get_running_loop())
        counts = [[0] for _ in range(in_flight)]
        started = time.perf_counter()
        await asyncio.gather(*(worker(count) for count in counts))
        return sum(count[0] for count in counts), time.perf_counter() - started

    tokens, wall = asyncio.run(run())
    result_queue.put((tokens, wall))
    connection.close()


class StandInController:
    """What the engine loop uses of a controller, without a model: ``step()`` spins ``step_s`` and
    gives every running row ``tokens`` tokens (a request ends at its max_new_tokens), rows are
    refilled from the queue at once, as the controller's admission does."""

    def __init__(self, rows: int, step_s: float, tokens: int):
        from mtp_ctrl.controllers import FinishReason, GenerationResult

        self.rows, self.step_s, self.tokens = rows, step_s, tokens
        self.shape = type("Shape", (), dict(max_model_len=1024, vocab_size=512, num_speculative_tokens=2))()
        self._left, self._queue, self._done, self._next = {}, [], {}, 0
        self._result = lambda request_id: GenerationResult(request_id, (), (), FinishReason.LENGTH, 0, 0, 2, 0)

    def add_request(self, prompt_ids, params) -> int:
        request_id, self._next = self._next, self._next + 1
        self._queue.append((request_id, params.max_new_tokens))
        return request_id

    def abort_request(self, request_id: int) -> None:
        self._left.pop(request_id, None)
        self._done[request_id] = True

    def has_unfinished_requests(self) -> bool:
        return bool(self._left or self._queue)

    def pop_result(self, request_id: int):
        del self._done[request_id]
        return self._result(request_id)

    def result(self, request_id: int):
        return self._result(request_id)

    def step(self):
        until = time.perf_counter() + self.step_s
        while self._queue and len(self._left) < self.rows:
            request_id, budget = self._queue.pop(0)
            self._left[request_id] = budget
        outputs = []
        for request_id in list(self._left):
            count = min(self.tokens, self._left[request_id])
            self._left[request_id] -= count
            done = self._left[request_id] == 0
            if done:
                del self._left[request_id]
                self._done[request_id] = True
            outputs.append((request_id, [97] * count, done))
        while time.perf_counter() < until:
            pass
        return outputs

    def close(self) -> None:
        pass


def main():
    args = parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)
    import torch

    from mtp_ctrl.controllers import SamplingParams
    from mtp_ctrl.serve.engine import EngineLoop

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from bench_serving import corpus_prompts
    from mtp_ctrl.serve.text import ByteTokenizer

    tokenizer = ByteTokenizer()
    prompts = [tokenizer.encode(prompt) for prompt in corpus_prompts(args.requests, args.prompt_len)]
    params = SamplingParams(max_new_tokens=args.max_tokens)
    stand_in = args.stand_in_step_us is not None
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not stand_in else "cpu"))
    if stand_in:
        controller = StandInController(args.max_requests, args.stand_in_step_us / 1e6, args.stand_in_tokens)
        where = f"CPU, a stand-in controller ({args.stand_in_step_us:g} us a step, {args.stand_in_tokens} tokens a row)"
    else:
        from mtp_ctrl.cli.distributed import init_distributed
        from mtp_ctrl.cli.serve import make_server_controller, parse_args as serve_args
        from mtp_ctrl.models import load_demo_model

        init_distributed(1, device)
        options = ["--num-speculative-tokens", str(args.speculative_tokens), "--max-requests", str(args.max_requests)]
        controller = make_server_controller(load_demo_model(device=device), serve_args(options), device, 1024)
        controller.generate(prompts[:args.max_requests], params)  # warm-up
        where = f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, demo model"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    # the engine loop against the frontend's end in another process
    context = multiprocessing.get_context("spawn")
    engine_end, frontend_end = context.Pipe(duplex=True)
    results = context.Queue()
    process = context.Process(target=frontend_side, args=(frontend_end, prompts, args.in_flight, args.max_tokens,
                                                         results), daemon=True)
    process.start()
    frontend_end.close()
    step_seconds, step_cpu, calls = [0.0], [0.0], [0]
    plain_step = controller.step

    def timed_step():
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            return plain_step()
        finally:
            step_seconds[0] += time.perf_counter() - started
            step_cpu[0] += time.thread_time() - cpu
            calls[0] += 1

    controller.step = timed_step  # an instance attribute: the loop calls this one
    profile = cProfile.Profile(time.thread_time) if args.cprofile else None  # CPU time: a busy machine
    loop = EngineLoop(controller, engine_end)
    gc.collect()
    gc.freeze()  # so that a loop that collects at its start (this checkout's) spends no CPU on it here
    if profile is not None:
        profile.enable()
    cpu = time.thread_time()
    loop.run("profile")
    loop_cpu = time.thread_time() - cpu
    if profile is not None:
        profile.disable()
    tokens, busy = results.get(timeout=60)  # the frontend's first submission to its last token
    process.join(30)
    del controller.step
    outside = busy - step_seconds[0]
    print(f"{where}; S = {args.speculative_tokens}, {args.max_requests} rows, {args.requests} requests of "
          f"{args.max_tokens} tokens, {args.in_flight} in flight; engine loop of {mtp_ctrl.__file__.rsplit('/', 2)[0]}")
    print(f"engine:  {tokens / busy:9.0f} tok/s, in step {step_seconds[0] / busy:.3f} of the wall, {calls[0]} step "
          f"calls, {outside / max(1, calls[0]) * 1e6:.1f} us per call outside step(), "
          f"{step_seconds[0] / max(1, calls[0]) * 1e6:.1f} us inside; CPU outside step() "
          f"{(loop_cpu - step_cpu[0]) / max(1, calls[0]) * 1e6:.1f} us per call (the loop's CPU with idle waits)")

    # the offline loop on the same prompts
    sync()
    step_seconds[0], calls[0] = 0.0, 0
    controller.step = timed_step
    started = time.perf_counter()
    request_ids = [controller.add_request(prompt, params) for prompt in prompts]
    total = 0
    while controller.has_unfinished_requests():
        total += sum(len(tokens) for _, tokens, _ in controller.step())
    sync()
    wall = time.perf_counter() - started
    del controller.step
    for request_id in request_ids:
        controller.pop_result(request_id)
    print(f"offline: {total / wall:9.0f} tok/s, in step {step_seconds[0] / wall:.3f} of the wall, {calls[0]} step "
          f"calls, {(wall - step_seconds[0]) / max(1, calls[0]) * 1e6:.1f} us per call outside step(); "
          f"engine / offline {tokens / busy / (total / wall):.3f}")
    controller.close()
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
