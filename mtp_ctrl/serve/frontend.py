"""The HTTP frontend process: uvicorn and the FastAPI app, talking to the engine process
(:mod:`mtp_ctrl.serve.engine`) over one ``multiprocessing`` connection.

:func:`start_frontend` (in the engine process) spawns :func:`run_frontend`, which waits for the
engine's ``ready`` message, then serves. :class:`EngineClient` is the frontend's end of the
connection: handlers ``submit`` checked requests and read a :class:`RequestStream`; the engine's
messages are read on the event loop itself (``loop.add_reader`` on the connection), so a step's
tokens reach their streams with no thread hop, and tokens that arrive while a handler is still
writing its last chunk go out together in its next one.

The engine going away (its ``fatal`` message, or the connection closing because its process
died) fails every open request and shuts the server down, exit code 1, with the reason on
stderr; the frontend exiting closes the connection, which stops the engine.
"""

import asyncio
import pickle
import select
import sys
import time
from typing import Dict, List, Optional, Tuple


class RequestStream:
    """One request's tokens as they arrive from the engine; its handler takes them in batches."""

    __slots__ = ("key", "prompt_tokens", "submitted_at", "request_id", "tokens", "finish_reason", "error",
                 "done", "aborted", "last_arrival", "_waiter")

    def __init__(self, key: int, prompt_tokens: int):
        self.key = key
        self.prompt_tokens = prompt_tokens
        self.submitted_at = time.perf_counter()
        self.request_id: Optional[int] = None  # the controller's id, once the engine has added it
        self.tokens: List[int] = []  # arrived, not yet taken
        self.finish_reason = None  # a FinishReason once the engine ended it
        self.error: Optional[str] = None
        self.done = False  # nothing more will arrive (finished, failed or aborted)
        self.aborted = False  # its client went away
        self.last_arrival = 0.0
        self._waiter: Optional[asyncio.Future] = None

    async def take(self) -> Tuple[List[int], object]:
        """(the tokens since the last call, the finish reason or None); waits for tokens or the
        end; RuntimeError once the tokens that came before a failure are taken. Returns at once
        once aborted (``aborted``)."""
        while not self.tokens and self.finish_reason is None and self.error is None and not self.aborted:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if not self.tokens and self.error is not None:
            raise RuntimeError(f"generation failed: {self.error}")
        tokens, self.tokens = self.tokens, []
        return tokens, self.finish_reason

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class EngineClient:
    """The frontend's end of the engine connection (event-loop thread only)."""

    def __init__(self, connection, info, metrics):
        self.connection = connection
        self.info = info  # mtp_ctrl.serve.engine.EngineInfo
        self.metrics = metrics  # mtp_ctrl.serve.metrics.ServerMetrics
        self.error: Optional[str] = None  # why the engine went, once it did
        self.clean_exit = False  # the engine went on a signal, not an error
        self.on_engine_exit = None  # called with the reason when the engine goes
        self._by_key: Dict[int, RequestStream] = {}
        self._by_request: Dict[int, RequestStream] = {}  # request id -> stream, once added
        self._figures: Dict[int, asyncio.Future] = {}
        self._next_key = 0
        self._readable = select.poll()  # whether more messages wait (Connection.poll builds a selector a call)
        self._readable.register(connection.fileno(), select.POLLIN)

    @property
    def alive(self) -> bool:
        return self.error is None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_reader(self.connection.fileno(), self._on_readable)

    def submit(self, prompt_ids: List[int], params) -> RequestStream:
        """Hand a checked request to the engine."""
        if self.error is not None:
            raise RuntimeError(f"the engine has stopped: {self.error}")
        stream = RequestStream(self._next_key, len(prompt_ids))
        self._next_key += 1
        self._by_key[stream.key] = stream
        self.metrics.request_started(len(prompt_ids))
        self._send(("add", stream.key, prompt_ids, params))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """The client went away: end its request (nothing if it is over)."""
        if stream.done:
            return
        stream.done = stream.aborted = True
        stream._wake()
        self._by_key.pop(stream.key, None)
        self._by_request.pop(stream.request_id, None)
        self.metrics.request_ended("abort")
        self._send(("abort", stream.key))

    async def figures(self) -> Dict[str, object]:
        """The controller's figures for ``/metrics`` (answered between two steps)."""
        if self.error is not None:
            raise RuntimeError(f"the engine has stopped: {self.error}")
        key = self._next_key
        self._next_key += 1
        self._figures[key] = asyncio.get_running_loop().create_future()
        self._send(("figures", key))
        return await self._figures[key]

    def _send(self, message) -> None:
        try:  # plain pickle: Connection.send builds a ForkingPickler per message
            self.connection.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
        except OSError:
            self._engine_gone("the engine process exited")

    def _on_readable(self) -> None:
        now = time.perf_counter()
        try:
            while self.error is None and self._readable.poll(0):
                message = pickle.loads(self.connection.recv_bytes())
                kind = message[0]
                if kind == "step":
                    for key, request_id in message[1]:  # added before the step: map them first
                        stream = self._by_key.get(key)
                        if stream is not None:  # else aborted before the engine added it
                            stream.request_id = request_id
                            self._by_request[request_id] = stream
                    self._on_step(message[2], message[3], now)
                elif kind == "figures":
                    future = self._figures.pop(message[1], None)
                    if future is not None and not future.done():
                        future.set_result(message[2])
                elif kind == "failed":
                    for request_id in message[1]:
                        stream = self._by_request.pop(request_id, None)
                        if stream is not None:
                            self._fail(stream, message[2])
                elif kind == "fatal":
                    self._engine_gone(message[1])
                elif kind == "shutdown":
                    self._engine_gone(None)
        except (EOFError, OSError):
            self._engine_gone("the engine process exited")

    def _on_step(self, outputs, finished, now: float) -> None:
        streams, metrics = self._by_request, self.metrics
        for request_id, tokens, done in outputs:
            stream = streams.get(request_id)
            if stream is None:  # aborted: its last tokens are dropped
                continue
            if tokens:
                metrics.tokens_arrived(stream.submitted_at, stream.last_arrival, len(tokens), now)
                stream.last_arrival = now
                stream.tokens += tokens
            if done:
                del streams[request_id]
                del self._by_key[stream.key]
                stream.done = True
                stream.finish_reason = finished[request_id]
                metrics.request_ended(stream.finish_reason.value)
            stream._wake()

    def _fail(self, stream: RequestStream, message: str) -> None:
        self._by_key.pop(stream.key, None)
        stream.done = True
        stream.error = message
        self.metrics.request_ended("error")
        stream._wake()

    def _engine_gone(self, reason: Optional[str]) -> None:
        """``reason``: why the engine went; None: it shut down on a signal."""
        if self.error is not None:
            return
        self.error = reason or "the server is shutting down"
        self.clean_exit = reason is None
        try:
            asyncio.get_running_loop().remove_reader(self.connection.fileno())
        except (RuntimeError, OSError, ValueError):
            pass
        for stream in list(self._by_key.values()):
            self._fail(stream, f"the engine stopped: {self.error}")
        self._by_request.clear()
        for future in self._figures.values():
            if not future.done():
                future.set_exception(RuntimeError(f"the engine has stopped: {self.error}"))
        if self.on_engine_exit is not None:
            self.on_engine_exit(reason)


def make_tokenizer(hf_path: Optional[str]):
    """The byte demo tokenizer, or a Hugging Face checkpoint's (``--hf DIR``)."""
    if hf_path is None:
        from mtp_ctrl.serve.text import ByteTokenizer

        return ByteTokenizer()
    from mtp_ctrl.models.hf_text import HFText
    from mtp_ctrl.serve.hf_tokenizer import HFTokenizer

    return HFTokenizer(HFText(hf_path))


def run_frontend(connection, hf_path: Optional[str], model_name: str, host: str, port: int, verbose: bool) -> None:
    """The frontend process's body: serve until the engine goes (exit 1) or a signal (exit 0)."""
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(verbose)  # an HF tokenizer's loader may import megatron-core; the API does not
    import uvicorn

    from mtp_ctrl.serve.api import create_app
    from mtp_ctrl.serve.metrics import ServerMetrics

    tokenizer = make_tokenizer(hf_path)
    try:
        kind, info = connection.recv()
    except (EOFError, OSError):
        sys.exit(1)  # the engine failed to start and says why itself
    assert kind == "ready", kind
    client = EngineClient(connection, info, ServerMetrics())
    server = uvicorn.Server(uvicorn.Config(create_app(client, tokenizer, model_name), host=host, port=port,
                                          log_level="warning", timeout_graceful_shutdown=5))

    def engine_exit(reason: Optional[str]) -> None:
        if reason is not None:
            print(f"error: the engine stopped ({reason}); shutting the server down", file=sys.stderr, flush=True)
        server.should_exit = True

    client.on_engine_exit = engine_exit

    async def serve() -> None:
        client.attach(asyncio.get_running_loop())
        print(f"serving {model_name} ({info.description}) on http://{host}:{port}/v1", flush=True)
        await server.serve()

    asyncio.run(serve())
    sys.exit(0 if client.clean_exit or (client.error is None and server.started) else 1)


def start_frontend(hf_path: Optional[str], model_name: str, host: str, port: int, verbose: bool = False):
    """In the engine process: spawn the frontend; (the process, the engine's end of the connection).
    Spawned, not forked: the engine process holds CUDA and process-group threads."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    engine_end, frontend_end = context.Pipe(duplex=True)
    process = context.Process(target=run_frontend, name="mtp_ctrl-http", daemon=True,
                              args=(frontend_end, hf_path, model_name, host, port, verbose))
    process.start()
    frontend_end.close()  # so the engine sees EOF once the frontend is gone
    return process, engine_end
