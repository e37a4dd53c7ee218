"""Serving under load: streaming clients with Poisson arrivals against `python -m mtp_ctrl.serve`,
speculation on vs off at the same request rates, and the offline loop as the yardstick.

    python bench/bench_serving.py                       # the demo model, S = 0 and 2, rates 4, 16, 64 req/s and all at once
    python bench/bench_serving.py --quick               # fewer requests and tokens (CPU works too)

For each S, the script starts a server (a subprocess on a free port; `--max-requests` rows), then
for each rate sends ``--num-requests`` streaming completions (greedy, ``--max-tokens`` each, prompts
from the byte corpus) whose arrival times are a Poisson process of that rate ("inf": all at
once), and reports: request throughput, output tokens/s, time to first token (submission to the
first text chunk) and inter-token latency (per request: (last chunk - first chunk) / (tokens - 1))
at p50/p90/p99. The same prompts then run through the offline loop (`controller.generate` in this
process, the server's controller settings): its tokens/s is the ceiling the server's saturated
tokens/s is compared with, and its first-step time for one request alone the floor of the
server's time to first token at light load. Also: tokens/s from the first to the last text chunk
(without the ramp-up of connections and requests, which dominates a short load), the server's
own time to first token (``/metrics``: submission in the frontend to the first tokens from the
engine), and the round trip of a request the frontend refuses (client and HTTP path, no engine).
``--client-processes 1,4`` also runs the all-at-once load from 4 client processes: one Python
client reads only some 10^4 SSE chunks/s.
"""

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 requests of 32 tokens, rates 4 and inf")
    parser.add_argument("--rates", default="4,16,64,inf", help="requests per second, comma-separated ('inf': all at once)")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-requests", type=int, default=32, help="the server's rows (--max-requests)")
    parser.add_argument("--speculative-tokens", default="0,2", help="S values to serve, comma-separated")
    parser.add_argument("--client-processes", default="1",
                        help="client processes sharing the load, comma-separated: the all-at-once rate runs with "
                             "each count, the others with one (one Python client reads some 10^4 SSE chunks/s)")
    parser.add_argument("--http-client", choices=("raw", "httpx"), default="raw",
                        help="raw: a minimal asyncio HTTP/1.1 client (the default: light, so the figures are the "
                             "server's); httpx: as before 2026-11-26")
    parser.add_argument("--device", default=None)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.max_tokens, args.rates = 40, 32, "4,inf"
    return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentiles(values):
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return pick(0.5), pick(0.9), pick(0.99)


class RawHTTP:
    """A minimal HTTP/1.1 client on asyncio streams: one connection, a pre-encoded request, the
    body read as it comes (chunked or not). Far lighter per request and per chunk than httpx, so
    the figures are the server's rather than the client's (``--http-client httpx`` for httpx)."""

    def __init__(self, url: str):
        self.host, port = url.split("//")[1].split(":")
        self.port = int(port)
        self.reader = self.writer = None
        self._chunked, self._length = False, 0

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def post(self, path: str, body: dict) -> int:
        """Send the request, read the status and headers; the status code."""
        payload = json.dumps(body).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json"
                          f"\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        status = int((await self.reader.readline()).split()[1])
        self._chunked, self._length = False, 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                return status
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                self._length = int(value)
            elif name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
                self._chunked = True

    async def pieces(self):
        """The body, piece by piece as it arrives."""
        if not self._chunked:
            yield await self.reader.readexactly(self._length)
            return
        while True:
            size = int((await self.reader.readline()).split(b";")[0], 16)
            if size == 0:
                await self.reader.readline()
                return
            yield (await self.reader.readexactly(size + 2))[:-2]

    def close(self) -> None:
        self.writer.close()


async def client_records(url: str, prompts, rate: float, max_tokens: int, seed: int, start_at: float,
                         http_client: str = "raw"):
    """Stream ``prompts`` with Poisson arrivals of ``rate`` from ``start_at`` (perf_counter time);
    [(submitted, [chunk arrival times], completion tokens)], and the time the last one ended."""
    import httpx

    rng = random.Random(seed)
    arrivals, clock = [], 0.0
    for _ in prompts:
        arrivals.append(clock)
        clock += 0.0 if rate == float("inf") else rng.expovariate(rate)
    records = []

    def on_event(event: bytes, chunks: list, now: float):
        """An SSE event's completion tokens (its usage), else None; notes the time of text."""
        if event.startswith(b"data: {"):
            payload = json.loads(event[6:])
            if payload["choices"] and payload["choices"][0]["text"]:
                chunks.append(now)
            if payload.get("usage"):
                return payload["usage"]["completion_tokens"]
        return None

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(prompts))) as client:
        async def one(prompt, arrival):
            body = dict(model="mtp_ctrl-demo", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
            chunks, tokens = [], None
            if http_client == "raw":
                connection = RawHTTP(url)
                await connection.connect()  # a pooled connection, as a real client's
                await asyncio.sleep(max(0.0, start_at + arrival - time.perf_counter()))
                submitted = time.perf_counter()
                await connection.post("/v1/completions", body)
                buffer = b""
                async for piece in connection.pieces():
                    now = time.perf_counter()
                    *events, buffer = (buffer + piece).split(b"\n\n")
                    for event in events:
                        tokens = on_event(event, chunks, now) or tokens
                connection.close()
            else:
                await asyncio.sleep(max(0.0, start_at + arrival - time.perf_counter()))
                submitted = time.perf_counter()
                async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        tokens = on_event(line.encode(), chunks, time.perf_counter()) or tokens
            records.append((submitted, chunks, tokens))

        await asyncio.gather(*(one(prompt, arrival) for prompt, arrival in zip(prompts, arrivals)))
    return records, time.perf_counter()


def client_process(url, prompts, rate, max_tokens, seed, start_at, http_client):
    return asyncio.run(client_records(url, prompts, rate, max_tokens, seed, start_at, http_client))


def run_load(url: str, prompts, rate: float, max_tokens: int, seed: int, processes: int = 1,
             http_client: str = "raw"):
    """The load of one rate, from ``processes`` client processes (each a Poisson stream of
    ``rate / processes``: together a Poisson stream of ``rate``)."""
    if processes == 1:
        started = time.perf_counter()
        records, ended = client_process(url, prompts, rate, max_tokens, seed, started, http_client)
    else:
        import concurrent.futures
        import multiprocessing

        started = time.perf_counter() + 5.0  # every client process is up by then
        with concurrent.futures.ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = list(pool.map(client_process, [url] * processes, [prompts[i::processes] for i in range(processes)],
                                  [rate / processes] * processes, [max_tokens] * processes,
                                  [seed + i for i in range(processes)], [started] * processes,
                                  [http_client] * processes))
        records = [record for part, _ in parts for record in part]
        ended = max(end for _, end in parts)
    wall = ended - started
    first_chunk = min(chunks[0] for _, chunks, _ in records if chunks)
    last_chunk = max(chunks[-1] for _, chunks, _ in records if chunks)
    ttft = [chunks[0] - submitted for submitted, chunks, _ in records if chunks]
    itl = [(chunks[-1] - chunks[0]) / (tokens - 1) for _, chunks, tokens in records if len(chunks) > 1 and tokens > 1]
    tokens = sum(record[2] for record in records)
    chunks = sum(len(record[1]) for record in records)
    return dict(wall=wall, requests_per_s=len(records) / wall, tokens_per_s=tokens / wall, ttft=percentiles(ttft),
                itl=percentiles(itl) if itl else (float("nan"),) * 3, tokens_per_chunk=tokens / max(1, chunks),
                streaming_tokens_per_s=tokens / (last_chunk - first_chunk), ramp=first_chunk - started)


def server_ttft(url: str):
    """(sum, count) of the server's time-to-first-token histogram (the frontend's submission to
    the first tokens' arrival from the engine)."""
    import re

    import httpx

    text = httpx.get(f"{url}/metrics", timeout=60).text
    found = [re.search(rf"^mtp_ctrl_time_to_first_token_seconds_{name} (\S+)$", text, re.MULTILINE)
             for name in ("sum", "count")]
    return float(found[0].group(1)), float(found[1].group(1))


async def http_floor(url: str, http_client: str, repeats: int = 30) -> float:
    """Median seconds of a request the frontend refuses (max_tokens = 0: parsed, checked, a 400),
    sent as the load's requests are: the HTTP path of client and server without the engine."""
    import httpx

    times = []
    body = dict(model="mtp_ctrl-demo", prompt="x", max_tokens=0, temperature=0, stream=True)
    async with httpx.AsyncClient(timeout=60) as client:
        connection = RawHTTP(url)
        await connection.connect()
        for _ in range(repeats):
            submitted = time.perf_counter()
            if http_client == "raw":
                assert await connection.post("/v1/completions", body) == 400
                async for _ in connection.pieces():
                    pass
            else:
                async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                    await response.aread()
            times.append(time.perf_counter() - submitted)
        connection.close()
    return statistics.median(times)


def start_server(port: int, args, speculative: int):
    import httpx

    command = [sys.executable, "-m", "mtp_ctrl.serve", "--port", str(port), "--num-speculative-tokens", str(speculative),
               "--max-requests", str(args.max_requests)] + (["--device", args.device] if args.device else [])
    environment = {key: value for key, value in os.environ.items()  # a process group of its own
                   if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment)
    deadline = time.time() + 600
    while time.time() < deadline:
        if process.poll() is not None:
            sys.exit(f"the server exited: {process.stdout.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    sys.exit("the server did not come up")


def offline_figures(args, speculative: int, prompts):
    """(tokens/s of controller.generate over the prompts, seconds to the first token of one request alone)."""
    import torch

    from mtp_ctrl.cli.serve import make_server_controller, parse_args as serve_args
    from mtp_ctrl.controllers import SamplingParams
    from mtp_ctrl.models import load_demo_model
    from mtp_ctrl.serve.text import ByteTokenizer

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    options = ["--num-speculative-tokens", str(speculative), "--max-requests", str(args.max_requests)]
    controller = make_server_controller(load_demo_model(device=device), serve_args(options), device, 1024)
    tokenizer = ByteTokenizer()
    ids = [tokenizer.encode(prompt) for prompt in prompts]
    params = SamplingParams(max_new_tokens=args.max_tokens)
    controller.generate(ids[:args.max_requests], params)  # warm-up
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    results = controller.generate(ids, params)
    sync()
    tokens_per_s = sum(len(result.output_tokens) for result in results) / (time.perf_counter() - started)
    firsts = []
    for prompt in ids[:5]:
        started = time.perf_counter()
        request_id = controller.add_request(prompt, params)
        while not any(rid == request_id and tokens for rid, tokens, _ in controller.step()):
            pass
        firsts.append(time.perf_counter() - started)
        controller.abort_request(request_id)
        controller.pop_result(request_id)
    controller.close()
    return tokens_per_s, statistics.median(firsts)


def main():
    args = parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)
    from mtp_ctrl.cli.byte_corpus import evenly_spaced_windows, load_stdlib_corpus
    from mtp_ctrl.cli.distributed import init_distributed
    from mtp_ctrl.serve.text import ByteDecoder

    windows = evenly_spaced_windows(load_stdlib_corpus().held_out, args.num_requests, args.prompt_len)
    prompts = []
    for window in windows.tolist():
        decoder = ByteDecoder()
        prompts.append((decoder.decode(window) + decoder.flush()) or "x")
    rates = [float(rate) for rate in args.rates.split(",")]
    import torch

    init_distributed(1, torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    rows = []
    for speculative in (int(value) for value in args.speculative_tokens.split(",")):
        port = free_port()
        server = start_server(port, args, speculative)
        try:
            for rate in rates:
                for processes in (int(count) for count in args.client_processes.split(",")):
                    if processes > 1 and rate != float("inf"):
                        continue  # light load: one client process is enough
                    url = f"http://127.0.0.1:{port}"
                    before = server_ttft(url)
                    result = run_load(url, prompts, rate, args.max_tokens, 0, processes, args.http_client)
                    after = server_ttft(url)
                    result.update(processes=processes, floor=asyncio.run(http_floor(url, args.http_client)),
                                  server_ttft=(after[0] - before[0]) / max(1.0, after[1] - before[1]))
                    rows.append((speculative, rate, result))
                    print(speculative, rate, result, flush=True)
        finally:
            server.terminate()
            server.wait(60)
        offline_tps, offline_first = offline_figures(args, speculative, prompts)
        rows.append((speculative, "offline", dict(tokens_per_s=offline_tps, first=offline_first)))
        print(speculative, "offline", rows[-1][2], flush=True)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "CPU"
    print(f"\n{where}; demo model; {args.num_requests} streaming requests of {args.max_tokens} tokens (greedy), "
          f"{args.prompt_len}-byte prompts, server --max-requests {args.max_requests}, "
          f"'clients': client processes ({args.http_client} HTTP client)")
    print(f"{'S':>2} {'rate':>6} {'clients':>7} {'req/s':>7} {'tok/s':>8} {'/offline':>8} {'stream tok/s':>12} "
          f"{'/offline':>8} {'TTFT p50/p90/p99 ms':>22} {'server TTFT':>11} {'HTTP floor':>10} "
          f"{'ITL p50/p90/p99 ms':>21} {'tok/chunk':>9}")
    offline = {speculative: result["tokens_per_s"] for speculative, rate, result in rows if rate == "offline"}
    for speculative, rate, result in rows:
        if rate == "offline":
            print(f"{speculative:2d} {'offline':>6} {'':>7} {'':>7} {result['tokens_per_s']:8.0f}   first token alone "
                  f"{result['first'] * 1e3:.2f} ms (controller.generate / step in process)")
            continue
        ttft = "/".join(f"{value * 1e3:.1f}" for value in result["ttft"])
        itl = "/".join(f"{value * 1e3:.2f}" for value in result["itl"])
        print(f"{speculative:2d} {rate:6.0f} {result['processes']:7d} {result['requests_per_s']:7.1f} "
              f"{result['tokens_per_s']:8.0f} {result['tokens_per_s'] / offline[speculative]:8.2f} "
              f"{result['streaming_tokens_per_s']:12.0f} "
              f"{result['streaming_tokens_per_s'] / offline[speculative]:8.2f} "
              f"{ttft:>22} {result['server_ttft'] * 1e3:11.2f} {result['floor'] * 1e3:10.2f} {itl:>21} "
              f"{result['tokens_per_chunk']:9.1f}")
    print("tok/s: all tokens over the wall time of the load; stream tok/s: over the first to the last text chunk "
          "(no ramp-up of connections and requests); server TTFT (mean): the frontend's submission to the first "
          "tokens from the engine; HTTP floor (median): a refused request's round trip (client + HTTP path, no engine)")


if __name__ == "__main__":
    main()
