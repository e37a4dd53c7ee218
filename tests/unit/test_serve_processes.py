"""The server's two processes, each against a stand-in for the other (CPU).

- The engine loop (in this process, the demo model) serves the frontend's messages: a request's
  tokens equal the offline loop's, a request that arrives while the engine is busy is launched in
  the next step at the latest, an abort frees its blocks, ``figures`` is answered, and the
  frontend closing its end ends the loop.
- The HTTP frontend (a spawned process, no model) streams the tokens this test sends as the
  engine, answers bad requests with no message to the engine, and when the engine goes away
  (its end of the connection closes, as when its process dies) ends the open stream with an
  error and exits with code 1 and the reason: never a hang.
"""

import subprocess
import sys
import threading
import time

import httpx
import pytest

from mtp_ctrl.controllers import SamplingParams
from tests.unit.megatron_fixtures import free_port

pytest.importorskip("fastapi")

MODEL = "mtp_ctrl-demo"


def _receive(connection, timeout: float = 120.0):
    assert connection.poll(timeout), "no message in time"
    return connection.recv()


def test_engine_loop_serves_the_frontend_and_stops_when_it_goes(torch_twins):
    import multiprocessing

    import torch

    from mtp_ctrl.cli.serve import make_server_controller, parse_args
    from mtp_ctrl.models import load_demo_model
    from mtp_ctrl.serve.engine import EngineLoop
    from tests.unit.megatron_fixtures import ensure_single_process_groups

    ensure_single_process_groups()
    arguments = parse_args(["--device", "cpu", "--max-requests", "2", "--decode-steps-per-launch", "1"])
    controller = make_server_controller(load_demo_model(device="cpu"), arguments, torch.device("cpu"), 1024)
    prompt, params = list(b"def main("), SamplingParams(max_new_tokens=10)
    [want] = controller.generate([prompt], params)
    engine_end, frontend_end = multiprocessing.Pipe()
    seen, failures = {}, []
    launches = []  # the request ids of each launch, in order (the on_launch debug hook)
    controller.on_launch = lambda step, graph_key: launches.append(set(step.host_request_ids.tolist()))

    def frontend():  # this thread plays the frontend process
        try:
            kind, info = _receive(frontend_end)
            seen["info"] = info
            frontend_end.send(("add", 10, list(b"import os\n"), SamplingParams(max_new_tokens=500)))
            frontend_end.send(("add", 11, prompt, params))
            frontend_end.send(("add", 12, prompt, params))
            frontend_end.send(("abort", 12))  # at once: never added, or aborted in the next step
            tokens, reasons, request_of = {}, {}, {}

            def read_until(done):
                while not done():
                    message = _receive(frontend_end)
                    assert message[0] == "step", message
                    request_of.update(message[1])  # added before the step's outputs
                    key_of = {request_id: key for key, request_id in request_of.items()}
                    for request_id, step_tokens, finished in message[2]:
                        tokens.setdefault(key_of[request_id], []).extend(step_tokens)
                        if finished:
                            reasons[key_of[request_id]] = message[3][request_id]

            read_until(lambda: 11 in reasons and 10 in tokens)
            # the engine is busy with 10 and a row is free: a request sent now is launched in the
            # step after the one running now at the latest
            frontend_end.send(("add", 13, prompt, SamplingParams(max_new_tokens=3)))
            launched_by_then = len(launches)
            read_until(lambda: 13 in reasons)
            seen["first launch of 13"] = min(index for index, ids in enumerate(launches) if request_of[13] in ids)
            seen["launches by then"] = launched_by_then
            frontend_end.send(("abort", 10))  # its client went away mid-stream
            seen.update(tokens=tokens, reasons=reasons, added=sorted(request_of))
            deadline = time.time() + 120
            while True:
                frontend_end.send(("figures", 99))
                message = _receive(frontend_end)
                while message[0] != "figures":  # the aborted request's last step may still come
                    message = _receive(frontend_end)
                if message[2]["kv_blocks_used"] == 0 or time.time() > deadline:
                    seen["figures"] = message[2]
                    break
        except BaseException as error:  # noqa: BLE001  reported by the test's thread
            failures.append(error)
        finally:
            frontend_end.close()

    thread = threading.Thread(target=frontend)
    thread.start()
    ended_by = EngineLoop(controller, engine_end).run("test")
    thread.join(60)
    assert not failures, failures
    assert ended_by == "frontend"
    assert seen["info"].max_model_len == controller.shape.max_model_len and seen["info"].description == "test"
    assert {10, 11, 13} <= set(seen["added"]) and 12 not in seen["reasons"]
    assert seen["first launch of 13"] < seen["launches by then"] + 2  # 0-based index < count + 2
    assert seen["tokens"][13] == list(want.output_tokens[:3])
    assert seen["tokens"][11] == list(want.output_tokens) and seen["reasons"][11] == want.finish_reason
    assert seen["figures"]["kv_blocks_used"] == 0 and seen["figures"]["queued_requests"] == 0
    controller.close()


def test_frontend_streams_and_exits_when_the_engine_dies(capfd):
    from mtp_ctrl.serve.engine import EngineInfo
    from mtp_ctrl.serve.frontend import start_frontend

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process, connection = start_frontend(None, MODEL, "127.0.0.1", port)
    try:
        connection.send(("ready", EngineInfo(max_model_len=64, vocab_size=512, num_speculative_tokens=2,
                                             description="a stand-in engine")))
        deadline = time.time() + 300
        while True:
            assert process.is_alive() and time.time() < deadline, "the frontend did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        bad = httpx.post(f"{url}/v1/completions", json=dict(model=MODEL, prompt="a" * 64), timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        assert not connection.poll(0.2)  # nothing reached the engine
        lines = []

        def client():
            body = dict(model=MODEL, prompt="hi", max_tokens=8, temperature=0, stream=True)
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
                lines.extend(line for line in response.iter_lines() if line)

        thread = threading.Thread(target=client)
        thread.start()
        kind, key, prompt_ids, params = _receive(connection)
        assert kind == "add" and prompt_ids == list(b"hi") and params.max_new_tokens == 8 and params.temperature == 0
        connection.send(("step", [(key, 3)], [(3, list(b"ab"), False)], None))
        connection.send(("step", [], [(3, list(b"c"), False), (4, [1], True)], {4: None}))  # 4: not this frontend's
        connection.close()  # the engine dies mid-stream
        thread.join(120)
        assert not thread.is_alive()
        import json

        payloads = [json.loads(line[len("data: "):]) for line in lines]
        assert "".join(p["choices"][0]["text"] for p in payloads if p.get("choices")) == "abc"
        assert "the engine stopped" in payloads[-1]["error"]["message"]
        process.join(60)
        assert process.exitcode == 1
        assert "the engine stopped (the engine process exited)" in capfd.readouterr().err
    finally:
        if process.is_alive():
            process.kill()


def test_the_http_frontend_imports_no_torch():
    """The frontend process (spawned: it imports what it uses afresh) loads the API, the request
    checks and the byte tokenizer without torch or megatron-core: it starts in a fraction of a
    second of CPU, not the ~8 s those imports cost."""
    code = ("import sys\nimport mtp_ctrl\nmtp_ctrl.quiet_known_warnings(False)\n"
            "from mtp_ctrl.serve.api import create_app\nfrom mtp_ctrl.serve.metrics import ServerMetrics\n"
            "from mtp_ctrl.serve.text import ByteTokenizer\nfrom mtp_ctrl.serve.frontend import run_frontend\n"
            "print(sorted(name for name in ('torch', 'megatron', 'triton') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
