"""The OpenAI-compatible server (CPU): a real server process on a free port, driven by the official
``openai`` client. Completions and chat, streamed and whole, equal the offline controller's text
for the same prompts and seeds; 64 requests from 32 concurrent clients (4 rows: a queue) all
complete with the offline outputs and free every KV block; clients that disconnect mid-stream
abort their requests without touching the others; bad requests get a 400 naming the field and
the server keeps serving; TP = 2 (torchrun, gloo) answers as TP = 1 does."""

import asyncio
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from mtp_ctrl.controllers import SamplingParams
from mtp_ctrl.serve.text import ByteTokenizer, TextStream
from tests.unit.megatron_fixtures import free_port

openai = pytest.importorskip("openai")

MODEL = "mtp_ctrl-demo"
SERVER_ARGS = ["--device", "cpu", "--max-requests", "4", "--decode-steps-per-launch", "1"]
PROMPTS = ["def main(", "import os\n", "class Reader:\n    def ", "# Copyright", "return self."]


def _start(port: int, launcher=(sys.executable, "-m", "mtp_ctrl.serve"), extra=()):
    environment = dict(os.environ, PYTHONUNBUFFERED="1")
    environment.pop("TRITON_INTERPRET", None)  # the server runs the ops' torch twins on the CPU
    process = subprocess.Popen([*launcher, "--port", str(port), *SERVER_ARGS, *extra], env=environment,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {process.stdout.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("the server did not come up in 300 s")


def _stop(process):
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture(scope="module")
def server():
    port = free_port()
    process = _start(port)
    yield f"http://127.0.0.1:{port}"
    _stop(process)


@pytest.fixture(scope="module")
def offline():
    """text(prompt, params) of the offline loop: the server's own controller settings, in process."""
    import torch

    from mtp_ctrl.cli.serve import make_server_controller, parse_args
    from mtp_ctrl.models import load_demo_model
    from tests.unit.megatron_fixtures import ensure_single_process_groups, torch_twins

    ensure_single_process_groups()
    model = load_demo_model(device="cpu")
    controller = make_server_controller(model, parse_args(SERVER_ARGS), torch.device("cpu"), 1024)
    tokenizer = ByteTokenizer()

    def text(prompt: str, max_tokens: int, stop=(), **sampling) -> str:
        params = SamplingParams(max_new_tokens=max_tokens, stop_sequences=tokenizer.stop_token_sequences(stop),
                                **sampling)
        with torch_twins():  # as the server runs them
            [result] = controller.generate([tokenizer.encode(prompt)], params)
        stream = TextStream(tokenizer.new_decoder(), stop)
        return stream.push(result.output_tokens) + stream.finish()

    return text


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)


def _metric(url: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{url}/metrics").text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _wait_for_free_blocks(url: str) -> None:
    deadline = time.time() + 120
    while _metric(url, "mtp_ctrl_kv_blocks_used") != 0 and time.time() < deadline:
        time.sleep(0.2)
    assert _metric(url, "mtp_ctrl_kv_blocks_used") == 0


def test_completions_and_chat_equal_the_offline_loop(server, offline):
    client = _client(server)
    assert [model.id for model in client.models.list().data] == [MODEL]
    for prompt, sampling in ((PROMPTS[0], dict(temperature=0)), (PROMPTS[1], dict(temperature=0.8, seed=7, top_p=0.9))):
        want = offline(prompt, 12, **sampling)
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **sampling)
        assert whole.choices[0].text == want and whole.usage.completion_tokens == 12
        streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True, **sampling)
        pieces = [chunk.choices[0].text for chunk in streamed if chunk.choices]
        assert "".join(pieces) == want and len([p for p in pieces if p]) > 1  # token by token, not at the end
        for draft_cap in (0, 1):  # a per-request draft cap (an extension) changes nothing in the text
            capped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                               extra_body={"num_speculative_tokens": draft_cap}, **sampling)
            assert capped.choices[0].text == want
    chat_prompt = ByteTokenizer().apply_chat_template([{"role": "user", "content": "hello"}])
    want = offline(chat_prompt, 10, temperature=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                           max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == want
    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=10, temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == want
    # a stop string ends the text before it (the text stops where the offline text has it first)
    full = offline(PROMPTS[2], 16, temperature=0)
    stop = full[5:7]
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=[stop])
    assert reply.choices[0].text == full[:full.index(stop)] and reply.choices[0].finish_reason == "stop"


def test_many_concurrent_clients(server, offline):
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=600)
    cases = [(PROMPTS[index % len(PROMPTS)], index % 10) for index in range(64)]  # 10 distinct (prompt, seed)
    wanted = {case: offline(case[0], 3, temperature=0.7, seed=case[1]) for case in set(cases)}
    gate = asyncio.Semaphore(32)

    async def one(index):
        async with gate:
            prompt, seed = cases[index]
            reply = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0.7,
                                                    seed=seed, stream=index % 3 == 0)
            if index % 3 == 0:
                return "".join([chunk.choices[0].text async for chunk in reply if chunk.choices])
            return reply.choices[0].text

    async def all_of_them():
        return await asyncio.gather(*(one(index) for index in range(len(cases))))

    got = asyncio.run(all_of_them())
    assert got == [wanted[case] for case in cases]
    _wait_for_free_blocks(server)


def test_disconnected_clients_are_aborted(server, offline):
    aborted_before = _metric(server, 'mtp_ctrl_requests_ended_total{reason="abort"}')
    body = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=400, temperature=0, stream=True)
    for _ in range(2):  # leave after the first chunk
        with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=120) as response:
            next(response.iter_lines())
    survivor = _client(server).completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=12, temperature=0)
    assert survivor.choices[0].text == offline(PROMPTS[4], 12, temperature=0)
    deadline = time.time() + 120
    while _metric(server, 'mtp_ctrl_requests_ended_total{reason="abort"}') < aborted_before + 2:
        assert time.time() < deadline, "the disconnected requests were not aborted"
        time.sleep(0.2)
    _wait_for_free_blocks(server)


@pytest.mark.parametrize("body, status, param", [
    (dict(model="other", prompt="a"), 404, "model"),
    (dict(prompt=""), 400, "prompt"),
    (dict(prompt="a" * 1100), 400, "prompt"),
    (dict(prompt=[1, 2, 99999]), 400, "prompt"),
    (dict(prompt="a", temperature=-1), 400, "temperature"),
    (dict(prompt="a", top_p=1.5), 400, "top_p"),
    (dict(prompt="a", top_k=-2), 400, "top_k"),
    (dict(prompt="a", max_tokens=0), 400, "max_tokens"),
    (dict(prompt="a", seed=-1), 400, "seed"),
    (dict(prompt="a", n=3), 400, "n"),
    (dict(prompt="a", logprobs=1), 400, "logprobs"),
    (dict(prompt="a", best_of=2), 400, "best_of"),
    (dict(prompt="a", stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (dict(prompt="a", stop_token_ids=[600]), 400, "stop_token_ids"),
    (dict(prompt="a", num_speculative_tokens=5), 400, "num_speculative_tokens"),
    (dict(prompt="a", max_tokens="many"), 400, "max_tokens"),
    (dict(prompt="a", temperature="hot"), 400, "temperature"),
    (dict(prompt="a", stream="yes"), 400, "stream"),
    (dict(prompt="a", stop=[1]), 400, "stop"),
    (dict(prompt=[1, "a"]), 400, "prompt"),
    (dict(), 400, "prompt"),
])
def test_bad_requests_get_a_400_naming_the_field(server, body, status, param):
    response = httpx.post(f"{server}/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert httpx.get(f"{server}/health").status_code == 200
    for messages in ([], [{"role": "user"}], "hi"):
        bad_chat = httpx.post(f"{server}/v1/chat/completions", json={"model": MODEL, "messages": messages}, timeout=60)
        assert bad_chat.status_code == 400 and bad_chat.json()["error"]["param"] == "messages"


def test_a_body_that_is_not_json_gets_a_400(server):
    response = httpx.post(f"{server}/v1/completions", content=b"{not json", timeout=60)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{server}/health").status_code == 200


def test_tensor_parallel_server_answers_as_tp1(server):
    port = free_port()
    process = _start(port, launcher=(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                     "--master-port", str(free_port()), "-m", "mtp_ctrl.serve"), extra=("--tp", "2"))
    try:
        for prompt in PROMPTS[:2]:
            want = _client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
            got = _client(f"http://127.0.0.1:{port}").completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                                           temperature=0)
            assert got.choices[0].text == want.choices[0].text
    finally:
        _stop(process)
