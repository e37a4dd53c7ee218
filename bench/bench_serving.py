"""Serving under load: streaming clients against `python -m mtp_ctrl.serve`, speculation on vs off,
and the offline loop as the yardstick.

    python bench/bench_serving.py            # the demo model, S = 0 and 2 (what bench/run_serve_gpu.sh runs)
    python bench/bench_serving.py --quick    # short loads (CPU works too)

For each S, the script starts a server (a subprocess on a free port; `--max-requests` rows) and
runs, with a minimal asyncio HTTP client (one keep-alive connection per stream):
- lone: `--lone` requests one after the other (the engine idle when each arrives): time to first
  token against the offline loop's first step of one request alone;
- open: `--num-requests` with Poisson arrivals at each `--rates` rate;
- closed (saturation): `--saturation-requests` with `--in-flight` in flight, a client sending its
  next request as soon as one ends, so the server's queue never runs dry; from each count of
  `--client-processes`.
Reported: requests/s, output tokens/s end to end and in the steady state (the middle 80 % of the
span from the first to the last text chunk, without the ramp and the tail), time to first token
(submission to the first text chunk) and inter-token latency ((last chunk - first chunk) /
(tokens - 1)) at p50/p90/p99, and where the time goes: the server's own time to first token
(`/metrics`: the frontend's submission to the first tokens from the engine), the HTTP floor (a
request the frontend refuses: client and HTTP path, no engine), and the CPU seconds per second of
the busiest client process, the engine process and the HTTP frontend process (a process near 1.0
is a limit). The offline loop (all prompts added, then `controller.step()` until done, in this
process, the server's controller settings) runs the saturation prompts: its tokens/s end to end
and over the middle 80 % of its run are the ceiling.
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

STARTED = time.perf_counter()  # the script's start: each phase prints its time since


def note(text: str) -> None:
    print(f"[{time.perf_counter() - STARTED:5.0f} s] {text}", flush=True)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short load of each kind (CPU works too)")
    parser.add_argument("--rates", default="16", help="open-loop request rates (Poisson arrivals), comma-separated; "
                        "'inf': all at once; '' for none")
    parser.add_argument("--num-requests", type=int, default=128, help="requests of each open-loop load")
    parser.add_argument("--saturation-requests", type=int, default=1024, help="requests of the closed-loop load")
    parser.add_argument("--in-flight", type=int, default=64,
                        help="closed loop: requests in flight (a client sends its next one when one ends); 0: none")
    parser.add_argument("--client-processes", default="4",
                        help="client processes sharing the closed-loop load, comma-separated: a run each")
    parser.add_argument("--lone", type=int, default=20, help="lone requests, one after the other (TTFT at no load)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-requests", type=int, default=32, help="the server's rows (--max-requests)")
    parser.add_argument("--speculative-tokens", default="0,2", help="S values to serve, comma-separated")
    parser.add_argument("--server-pythonpath", default=None,
                        help="PYTHONPATH of the server process (another checkout's server, same loads)")
    parser.add_argument("--no-offline", action="store_true", help="skip the offline loop")
    parser.add_argument("--offline-only", action="store_true", help="only the offline loop (no server)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.saturation_requests, args.in_flight, args.max_tokens = 16, 48, 8, 24
        args.lone, args.rates, args.max_requests = 3, "4", 4
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
    """A minimal HTTP/1.1 client on asyncio streams: one keep-alive connection, a pre-encoded
    request, the body read as it comes (chunked or not). Far lighter per request and per chunk
    than httpx, so the figures are the server's rather than the client's."""

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


async def stream_one(connection: RawHTTP, prompt: str, max_tokens: int):
    """One streaming completion on ``connection``: (submitted, [(arrival, text bytes)] of its text
    chunks, completion tokens)."""
    body = dict(model="mtp_ctrl-demo", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    chunks, tokens, buffer = [], 0, b""
    submitted = time.perf_counter()
    await connection.post("/v1/completions", body)
    async for piece in connection.pieces():
        now = time.perf_counter()
        *events, buffer = (buffer + piece).split(b"\n\n")
        for event in events:
            if event.startswith(b"data: {"):
                payload = json.loads(event[6:])
                if payload["choices"] and payload["choices"][0]["text"]:
                    chunks.append((now, len(payload["choices"][0]["text"].encode())))
                if payload.get("usage"):
                    tokens = payload["usage"]["completion_tokens"]
    return submitted, chunks, tokens


async def client_records(url: str, prompts, load: str, value: float, max_tokens: int, seed: int, start_at: float):
    """``load`` "open": ``prompts`` as Poisson arrivals of rate ``value`` from ``start_at``
    (perf_counter time; inf: all at once); "closed": ``value`` workers, each sending its next
    prompt when its last one ended; "lone": one after the other. (records (see stream_one), the
    time the last one ended, this process's CPU seconds over the load)."""
    records = []
    queue = list(reversed(prompts))

    async def worker(arrivals):
        connection = RawHTTP(url)
        await connection.connect()  # a pooled connection, as a real client's
        for arrival in arrivals:
            if arrival is not None:
                await asyncio.sleep(max(0.0, start_at + arrival - time.perf_counter()))
            if not queue:
                break
            records.append(await stream_one(connection, queue.pop(), max_tokens))
        connection.close()

    if load == "open":
        rng, clock, arrivals = random.Random(seed), 0.0, []
        for _ in prompts:
            arrivals.append(clock)
            clock += 0.0 if value == float("inf") else rng.expovariate(value)
        workers = [[arrival] for arrival in arrivals]
    else:
        workers = [[0.0] + [None] * len(prompts) for _ in range(int(value) if load == "closed" else 1)]
    cpu = time.process_time()
    await asyncio.gather(*(worker(arrivals) for arrivals in workers))
    return records, time.perf_counter(), time.process_time() - cpu


def client_process(url, prompts, load, value, max_tokens, seed, start_at):
    return asyncio.run(client_records(url, prompts, load, value, max_tokens, seed, start_at))


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc; 0.0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def frontend_pid(engine_pid: int) -> int:
    """The HTTP frontend's pid: the engine process's child that multiprocessing spawned (not its
    resource tracker); the engine's own pid if none is found (not Linux)."""
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    spawned = b"spawn_main" in cmdline.read()
            except (OSError, IndexError, ValueError):
                continue
            if parent == engine_pid and spawned:
                return int(entry)
    return engine_pid


def run_load(url: str, prompts, load: str, value: float, max_tokens: int, processes: int, server_pids):
    """One load from ``processes`` client processes (each a share of ``prompts``; open: each a
    Poisson stream of ``value / processes``, closed: ``value / processes`` workers); its figures."""
    cpu_before = [process_cpu_seconds(pid) for pid in server_pids]
    if processes == 1:
        started = time.perf_counter()
        records, ended, client_cpu = client_process(url, prompts, load, value, max_tokens, 0, started)
        client_cpus = [client_cpu]
    else:
        import concurrent.futures
        import multiprocessing

        share = value / processes
        started = time.perf_counter() + 5.0  # every client process is up by then
        with concurrent.futures.ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = list(pool.map(client_process, [url] * processes, [prompts[i::processes] for i in range(processes)],
                                  [load] * processes, [share] * processes, [max_tokens] * processes,
                                  range(processes), [started] * processes))
        records = [record for part, _, _ in parts for record in part]
        ended = max(end for _, end, _ in parts)
        client_cpus = [cpu for _, _, cpu in parts]
    wall = ended - started
    server_cpu = [(process_cpu_seconds(pid) - before) / wall for pid, before in zip(server_pids, cpu_before)]
    arrivals = []  # (arrival, tokens) of every text chunk: a request's tokens shared by its chunks' text bytes
    for _, chunks, tokens in records:
        text_bytes = sum(size for _, size in chunks)
        arrivals += [(now, tokens * size / text_bytes) for now, size in chunks]
    arrivals.sort()
    first_chunk, last_chunk = arrivals[0][0], arrivals[-1][0]
    low, high = first_chunk + 0.1 * (last_chunk - first_chunk), last_chunk - 0.1 * (last_chunk - first_chunk)
    steady = sum(tokens for now, tokens in arrivals if low <= now < high) / (high - low)
    ttft = [chunks[0][0] - submitted for submitted, chunks, _ in records if chunks]
    itl = [(chunks[-1][0] - chunks[0][0]) / (tokens - 1) for _, chunks, tokens in records
           if len(chunks) > 1 and tokens > 1]
    tokens = sum(record[2] for record in records)
    return dict(load=load, value=value, processes=processes, wall=wall, requests_per_s=len(records) / wall,
                tokens_per_s=tokens / wall, steady_tokens_per_s=steady, ttft=percentiles(ttft),
                itl=percentiles(itl) if itl else (float("nan"),) * 3, tokens_per_chunk=tokens / len(arrivals),
                client_cpu=max(client_cpus) / wall,
                server_cpu=server_cpu, ramp=first_chunk - started)


def server_counters(url: str):
    """The server's ``/metrics`` counters the figures use: the time-to-first-token histogram's
    sum and count (the frontend's submission to the first tokens' arrival from the engine),
    steps launched and seconds inside ``controller.step()``."""
    import re

    import httpx

    text = httpx.get(f"{url}/metrics", timeout=60).text
    names = ("time_to_first_token_seconds_sum", "time_to_first_token_seconds_count", "steps_total",
             "step_seconds_total")
    found = {name: re.search(rf"^mtp_ctrl_{name} (\S+)$", text, re.MULTILINE) for name in names}
    return {name: float(match.group(1)) if match else float("nan") for name, match in found.items()}


async def http_floor(url: str, repeats: int = 30) -> float:
    """Median seconds of a request the frontend refuses (max_tokens = 0: parsed, checked, a 400),
    sent as the load's requests are: the HTTP path of client and server without the engine."""
    times = []
    body = dict(model="mtp_ctrl-demo", prompt="x", max_tokens=0, temperature=0, stream=True)
    connection = RawHTTP(url)
    await connection.connect()
    for _ in range(repeats):
        submitted = time.perf_counter()
        assert await connection.post("/v1/completions", body) == 400
        async for _ in connection.pieces():
            pass
        times.append(time.perf_counter() - submitted)
    connection.close()
    return statistics.median(times)


def start_server(port: int, args, speculative: int):
    import httpx

    command = [sys.executable, "-m", "mtp_ctrl.serve", "--port", str(port), "--num-speculative-tokens", str(speculative),
               "--max-requests", str(args.max_requests)] + (["--device", args.device] if args.device else [])
    environment = {key: value for key, value in os.environ.items()  # a process group of its own
                   if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    if args.server_pythonpath:
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [args.server_pythonpath,
                                                                  environment.get("PYTHONPATH")]))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment,
                               cwd=args.server_pythonpath)  # python -m puts its working directory first
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


def offline_figures(args, speculative: int, prompts, lone_prompts):
    """The offline loop (all prompts added, then ``controller.step()`` until done, in this
    process, the server's controller settings): tokens/s end to end and over the middle 80 % of
    the run (as the clients' steady figure is taken), the share of the run inside ``step()``,
    tokens per step launched, and the median seconds to the first token of one request alone
    (``lone_prompts``: not seen before, as the server's lone requests)."""
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
    before = controller.metrics.as_dict()["step_time"]
    started = time.perf_counter()
    request_ids = [controller.add_request(prompt, params) for prompt in ids]
    arrivals = []  # (time, tokens) of each step's outputs
    while controller.has_unfinished_requests():
        outputs = controller.step()
        arrivals.append((time.perf_counter(), sum(len(tokens) for _, tokens, _ in outputs)))
    sync()
    wall = time.perf_counter() - started
    after = controller.metrics.as_dict()["step_time"]
    for request_id in request_ids:
        controller.pop_result(request_id)
    total = sum(tokens for _, tokens in arrivals)
    low, high = started + 0.1 * wall, started + 0.9 * wall
    steady = sum(tokens for now, tokens in arrivals if low <= now < high) / (high - low)
    firsts = []
    for prompt in [tokenizer.encode(prompt) for prompt in lone_prompts]:
        started = time.perf_counter()
        request_id = controller.add_request(prompt, params)
        while not any(rid == request_id and tokens for rid, tokens, _ in controller.step()):
            pass
        firsts.append(time.perf_counter() - started)
        controller.abort_request(request_id)
        controller.pop_result(request_id)
    controller.close()
    return dict(tokens_per_s=total / wall, steady_tokens_per_s=steady, first=statistics.median(firsts),
                step_share=(after["step_seconds"] - before["step_seconds"]) / wall,
                tokens_per_step=total / max(1, after["steps"] - before["steps"]))


def corpus_prompts(count: int, length: int, offset: int = 0):
    from mtp_ctrl.cli.byte_corpus import evenly_spaced_windows, load_stdlib_corpus
    from mtp_ctrl.serve.text import ByteDecoder

    prompts = []
    for window in evenly_spaced_windows(load_stdlib_corpus().held_out, count + offset, length).tolist()[offset:]:
        decoder = ByteDecoder()
        prompts.append((decoder.decode(window) + decoder.flush()) or "x")
    return prompts


def serve_loads(args, speculative: int, prompts, saturation_prompts, lone_prompts):
    """Every load against one server of S = ``speculative``: [result dicts]."""
    port = free_port()
    server = start_server(port, args, speculative)
    note(f"S = {speculative}: the server is up")
    url = f"http://127.0.0.1:{port}"
    server_pids = [server.pid, frontend_pid(server.pid)]
    results = []

    def measured(load, value, load_prompts, processes=1):
        before = server_counters(url)
        result = run_load(url, load_prompts, load, value, args.max_tokens, processes, server_pids)
        after = server_counters(url)
        change = {name: after[name] - before[name] for name in after}
        result.update(server_ttft=change["time_to_first_token_seconds_sum"]
                      / max(1.0, change["time_to_first_token_seconds_count"]),
                      step_share=change["step_seconds_total"] / result["wall"],
                      tokens_per_step=result["tokens_per_s"] * result["wall"] / max(1.0, change["steps_total"]),
                      speculative=speculative)
        results.append(result)
        note(f"S = {speculative}: {result}")

    try:
        floor = asyncio.run(http_floor(url))
        if args.lone:
            run_load(url, lone_prompts[:2], "lone", 1, args.max_tokens, 1, server_pids)  # warm the path
            measured("lone", 1, lone_prompts[2:])
        for rate in (float(value) for value in args.rates.split(",") if value):
            measured("open", rate, prompts)
        if args.in_flight:
            for processes in (int(count) for count in args.client_processes.split(",")):
                measured("closed", args.in_flight, saturation_prompts, processes)
        for result in results:
            result["floor"] = floor
    finally:
        server.terminate()
        server.wait(60)
    return results


def main():
    args = parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(args.verbose)
    from mtp_ctrl.cli.distributed import init_distributed

    prompts = corpus_prompts(args.num_requests, args.prompt_len)
    saturation_prompts = corpus_prompts(args.saturation_requests, args.prompt_len)
    # lone requests' prompts share no prefix-cache block with the others (997 windows start where
    # none of 128 or 1024 evenly spaced ones do, but the first), so none is a cache hit
    lone_prompts = corpus_prompts(997, args.prompt_len)[1:args.lone + 3]
    import torch

    init_distributed(1, torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    rows, offline = [], {}
    for speculative in (int(value) for value in args.speculative_tokens.split(",")):
        if not args.offline_only:
            rows += serve_loads(args, speculative, prompts, saturation_prompts, lone_prompts)
        if not args.no_offline:
            offline[speculative] = offline_figures(args, speculative, saturation_prompts, lone_prompts[2:])
            note(f"S = {speculative}: offline {offline[speculative]}")
    where = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "CPU"
    print_table(args, where, rows, offline)


def print_table(args, where: str, rows, offline) -> None:
    print(f"\n{where}; demo model; streaming completions of {args.max_tokens} tokens (greedy), {args.prompt_len}-byte "
          f"prompts, server --max-requests {args.max_requests}{', server ' + args.server_pythonpath if args.server_pythonpath else ''}; "
          f"lone: {args.lone} one after the other; open: {args.num_requests} Poisson arrivals at the rate; closed: "
          f"{args.saturation_requests} requests, {args.in_flight} in flight from 'clients' processes")
    print(f"{'S':>2} {'load':>10} {'clients':>7} {'req/s':>6} {'tok/s':>8} {'/off':>5} {'steady':>8} {'/off':>5} "
          f"{'TTFT p50/p90/p99 ms':>20} {'srv TTFT':>8} {'floor':>5} {'ITL p50/p90/p99 ms':>18} {'tok/ch':>6} "
          f"{'CPU client/engine/frontend':>26} {'in step':>7} {'tok/step':>8}")
    for result in rows:
        speculative = result["speculative"]
        base = offline.get(speculative, dict(tokens_per_s=float("nan"), steady_tokens_per_s=float("nan")))
        load = {"lone": "lone", "open": f"{result['value']:g}/s", "closed": f"closed {result['value']:g}"}[result["load"]]
        ttft = "/".join(f"{value * 1e3:.1f}" for value in result["ttft"])
        itl = "/".join(f"{value * 1e3:.2f}" for value in result["itl"])
        cpu = "/".join(f"{value:.2f}" for value in [result["client_cpu"]] + result["server_cpu"])
        print(f"{speculative:2d} {load:>10} {result['processes']:7d} {result['requests_per_s']:6.1f} "
              f"{result['tokens_per_s']:8.0f} {result['tokens_per_s'] / base['tokens_per_s']:5.2f} "
              f"{result['steady_tokens_per_s']:8.0f} {result['steady_tokens_per_s'] / base['steady_tokens_per_s']:5.2f} "
              f"{ttft:>20} {result['server_ttft'] * 1e3:8.2f} {result['floor'] * 1e3:5.2f} {itl:>18} "
              f"{result['tokens_per_chunk']:6.1f} {cpu:>26} {result['step_share']:7.2f} {result['tokens_per_step']:8.1f}")
    for speculative, base in offline.items():
        print(f"{speculative:2d} {'offline':>10} {'':>7} {'':>6} {base['tokens_per_s']:8.0f} {1:5.2f} "
              f"{base['steady_tokens_per_s']:8.0f} {1:5.2f}   first token alone {base['first'] * 1e3:.2f} ms; in step "
              f"{base['step_share']:.2f}, tok/step {base['tokens_per_step']:.1f}")
    print("tok/s: all tokens over the load's wall; steady: over the middle 80 % from the first to the last text chunk "
          "(offline: of the step loop's run); srv TTFT (mean): the frontend's submission to the first tokens from the "
          "engine; floor (median): a refused request's round trip (client + HTTP path, no engine); CPU: CPU seconds per "
          "second of the load (client: the busiest client process; engine, frontend: the server's processes); in step: "
          "the share of the load's wall the engine spent inside controller.step(); tok/step: tokens per step launched")


if __name__ == "__main__":
    main()
