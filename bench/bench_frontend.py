"""The HTTP frontend alone, against a stand-in engine: how many tokens and requests per second it
streams, and at what CPU, with no model and no GPU (so any machine measures it).

    python bench/bench_frontend.py                        # this checkout's frontend
    PYTHONPATH=../other python bench/bench_frontend.py    # another checkout's (same pipe protocol)

This process spawns the frontend (`mtp_ctrl.serve.frontend.start_frontend`) and plays the engine
on the other end of its pipe: every `--step-ms` it sends one step message giving each running
request `--tokens-per-step` tokens (up to `--max-requests` rows; more requests wait, as in the
controller's queue), until each has `--max-tokens`. Closed-loop clients (`bench_serving.py`'s
minimal asyncio client, from `--client-processes` processes, `--in-flight` streams) keep it full.
Reported per load: tokens/s the clients received against what the stand-in sent, requests/s,
tokens per SSE chunk (above `--tokens-per-step` once the frontend coalesces: it is behind), and the
CPU seconds per second of the frontend process (near 1.0: the frontend is the limit).
"""

import argparse
import asyncio
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serving  # noqa: E402  (the client, the CPU reader)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", default="1.0,0.5,0.25", help="stand-in step intervals, comma-separated")
    parser.add_argument("--tokens-per-step", type=int, default=4)
    parser.add_argument("--max-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    return parser.parse_args()


class StandInEngine(threading.Thread):
    """The engine's side of the pipe: adds join the rows (or the queue), a step message every
    ``step_s`` gives every row ``tokens`` tokens; a request ends at ``max_tokens``."""

    def __init__(self, connection, step_s: float, tokens: int, max_requests: int, max_tokens: int):
        super().__init__(daemon=True)
        self.connection, self.step_s, self.tokens = connection, step_s, tokens
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.stop = False
        self.offered = 0  # tokens sent

    def run(self) -> None:
        from mtp_ctrl.controllers import FinishReason

        connection, rows, queue, next_id, added = self.connection, {}, [], 0, []
        step = [97] * self.tokens  # "a"
        next_step = time.perf_counter()
        while not self.stop:
            while connection.poll(max(0.0, next_step - time.perf_counter())):
                message = connection.recv()
                if message[0] == "add":
                    added.append((message[1], next_id))  # told with the next step, as the engine does
                    queue.append(next_id)
                    next_id += 1
                elif message[0] == "abort":
                    pass  # the clients here never leave early
                elif message[0] == "figures":
                    connection.send(("figures", message[1], {}))
            next_step += self.step_s
            while queue and len(rows) < self.max_requests:
                rows[queue.pop(0)] = 0
            if not rows:
                if added:
                    connection.send(("step", added, [], None))
                    added = []
                continue
            outputs, finished = [], {}
            for request_id in list(rows):
                rows[request_id] += self.tokens
                done = rows[request_id] >= self.max_tokens
                outputs.append((request_id, step, done))
                if done:
                    finished[request_id] = FinishReason.LENGTH
                    del rows[request_id]
            self.offered += self.tokens * len(outputs)
            connection.send(("step", added, outputs, finished or None))
            added = []


def main():
    args = parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)
    from mtp_ctrl.serve.engine import EngineInfo
    from mtp_ctrl.serve.frontend import start_frontend

    port = bench_serving.free_port()
    process, connection = start_frontend(None, "mtp_ctrl-demo", "127.0.0.1", port)
    connection.send(("ready", EngineInfo(max_model_len=1024, vocab_size=512, num_speculative_tokens=0,
                                         description="a stand-in engine")))
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    import httpx

    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            if time.time() > deadline:
                sys.exit("the frontend did not come up")
            time.sleep(0.2)
    prompts = ["x" * 32] * args.requests
    floor = asyncio.run(bench_serving.http_floor(url))
    print(f"frontend of {os.path.dirname(sys.modules['mtp_ctrl'].__file__)}; HTTP floor {floor * 1e3:.2f} ms; "
          f"{args.requests} requests of {args.max_tokens} tokens, {args.in_flight} in flight from "
          f"{args.client_processes} client processes, {args.max_requests} rows, {args.tokens_per_step} tokens a step")
    print(f"{'step ms':>7} {'offered tok/s':>13} {'got tok/s':>10} {'req/s':>7} {'tok/chunk':>9} {'frontend CPU':>12} "
          f"{'client CPU':>10} {'ramp s':>6}")
    for step_ms in (float(value) for value in args.step_ms.split(",")):
        engine = StandInEngine(connection, step_ms / 1e3, args.tokens_per_step, args.max_requests, args.max_tokens)
        engine.start()
        result = bench_serving.run_load(url, prompts, "closed", args.in_flight, args.max_tokens,
                                        args.client_processes, [process.pid])
        engine.stop = True
        engine.join()
        offered = engine.offered / result["wall"]  # what the stand-in sent (it waits when the pipe is full)
        print(f"{step_ms:7.2f} {offered:13.0f} {result['tokens_per_s']:10.0f} {result['requests_per_s']:7.1f} "
              f"{result['tokens_per_chunk']:9.1f} {result['server_cpu'][0]:12.2f} {result['client_cpu']:10.2f} "
              f"{result['ramp']:6.2f}",
              flush=True)
    process.kill()


if __name__ == "__main__":
    main()
