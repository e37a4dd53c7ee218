"""The OpenAI-compatible HTTP API: completions, chat completions, models, health, metrics.

The generation routes (``POST /v1/completions``, ``/v1/chat/completions``) are a plain ASGI
handler (:class:`GenerateRoute`): the body is parsed with ``json`` and checked by hand
(:mod:`mtp_ctrl.serve.checks`: a bad request gets a 400 with an OpenAI-style body
``{"error": {"message", "type": "invalid_request_error", "param", "code"}}`` naming the field, and
nothing reaches the engine), and a streamed reply is written as pre-encoded server-sent events, all
the tokens that arrived while the last chunk was being written in one chunk. A lone request's
first token waits for no timer: the engine's message wakes its handler on the event loop, which
writes the chunk at once. The rare routes (``GET /v1/models``, ``/health``, ``/metrics``) are a
FastAPI app behind it.

Sampling: ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` and ``seed`` map to
:class:`SamplingParams`; ``stop`` (strings) and ``stop_token_ids`` (an extension) end the text;
``n`` must be 1; ``logprobs`` is refused (the sampler does not return log-probabilities);
``num_speculative_tokens`` (an extension) caps the request's drafts per step at a value in
``[0, S]`` (0: no drafts; the text is the same either way).
"""

import asyncio
import json
import time
import uuid
from typing import Any, Dict, List, Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from mtp_ctrl.controllers import FinishReason
from mtp_ctrl.serve.checks import BadRequest, RequestFields, check_request
from mtp_ctrl.serve.frontend import EngineClient, RequestStream
from mtp_ctrl.serve.text import TextStream

FINISH_REASONS = {FinishReason.EOS: "stop", FinishReason.STOP_SEQUENCE: "stop", FinishReason.LENGTH: "length",
                  FinishReason.MAX_MODEL_LEN: "length", FinishReason.ABORTED: "abort"}
GENERATE_ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}  # path: chat
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


def create_app(engine: EngineClient, tokenizer, model_name: str):
    """The ASGI app serving ``engine``'s model under ``model_name``; ``tokenizer`` as in
    :mod:`mtp_ctrl.serve.text`."""
    generate = GenerateRoute(engine, tokenizer, model_name)
    other_routes = _other_routes(engine, model_name)

    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            chat = GENERATE_ROUTES.get(scope["path"])
            if chat is not None:
                return await generate(receive, send, chat)
        return await other_routes(scope, receive, send)

    return app


def _other_routes(engine: EngineClient, model_name: str) -> FastAPI:
    app = FastAPI(title="mtp_ctrl", version="1")
    created = int(time.time())

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "stopped", "error": engine.error}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "mtp_ctrl", "max_model_len": engine.info.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        try:
            figures = await engine.figures()
        except RuntimeError as error:
            return JSONResponse(_error_body(str(error), None, "server_error"), status_code=503)
        return PlainTextResponse(engine.metrics.render(figures), media_type="text/plain; version=0.0.4")

    return app


class GenerateRoute:
    """``/v1/completions`` and ``/v1/chat/completions``, streamed or whole."""

    def __init__(self, engine: EngineClient, tokenizer, model_name: str):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name

    async def __call__(self, receive, send, chat: bool) -> None:
        engine = self.engine
        try:
            fields, prompt_ids = self._read(await _read_body(receive), chat)
            params, stop = check_request(fields, prompt_ids, engine.info, self.model_name, self.tokenizer)
            try:
                stream = engine.submit(prompt_ids, params)
            except RuntimeError as error:
                raise BadRequest(None, str(error), status=503)
        except BadRequest as error:
            return await _send_json(send, error.status, _error_body(error.message, error.param))
        reply = _Reply(self.model_name, chat, len(prompt_ids), TextStream(self.tokenizer.new_decoder(), stop))
        watcher = asyncio.ensure_future(_abort_on_disconnect(receive, engine, stream))
        try:
            if fields.stream:
                await _stream(send, stream, reply)
            else:
                await _whole(send, stream, reply)
        finally:
            engine.abort(stream)  # nothing if it finished
            watcher.cancel()

    def _read(self, body: bytes, chat: bool):
        """(the type-checked fields, the prompt's token ids)."""
        try:
            fields = RequestFields(json.loads(body), chat)
        except ValueError as error:  # json.JSONDecodeError, UnicodeDecodeError
            raise BadRequest(None, f"the request body is not JSON: {error}")
        tokenizer = self.tokenizer
        if chat:
            if not getattr(tokenizer, "has_chat_template", False):
                raise BadRequest("messages", f"model {self.model_name!r} has no chat template: use /v1/completions")
            return fields, tokenizer.encode(tokenizer.apply_chat_template(fields.messages))
        prompt = fields.prompt
        return fields, tokenizer.encode(prompt) if isinstance(prompt, str) else prompt


class _Reply:
    """The OpenAI response objects of one request (a whole reply or stream chunks). A text chunk
    is a pre-encoded JSON head and tail around the JSON string of its text."""

    def __init__(self, model_name: str, chat: bool, prompt_tokens: int, text: TextStream):
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.model, self.chat, self.prompt_tokens, self.text = model_name, chat, prompt_tokens, text
        self.created = int(time.time())
        self.completion_tokens = 0
        head = json.dumps({"id": self.id, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": self.created, "model": model_name})[:-1]
        if chat:
            self._text_head = f'data: {head}, "choices": [{{"index": 0, "delta": {{"content": '
            self._text_tail = '}, "finish_reason": null}]}\n\n'
        else:
            self._text_head = f'data: {head}, "choices": [{{"index": 0, "text": '
            self._text_tail = ', "logprobs": null, "finish_reason": null}]}\n\n'

    def text_chunk(self, text: str) -> bytes:
        """The SSE event of a chunk of text with no finish reason (== ``_sse(self.chunk(text, None))``)."""
        return (self._text_head + json.dumps(text) + self._text_tail).encode()

    def role_chunk(self) -> bytes:
        """A chat stream's first event: the role, as OpenAI's."""
        return _sse(self.chunk(None, None, first=True))

    def last_chunks(self, text: str, finish_reason: str) -> bytes:
        """The last events: the rest of the text with the finish reason, the usage, ``[DONE]``."""
        return (_sse(self.chunk(text, finish_reason)) + _sse({**self.chunk(None, None), "choices": [],
                                                               "usage": self.usage()}) + b"data: [DONE]\n\n")

    def chunk(self, text: Optional[str], finish_reason: Optional[str], first: bool = False) -> Dict[str, Any]:
        if self.chat:
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def whole(self, text: str, finish_reason: str) -> Dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage()}

    def usage(self) -> Dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def finish_reason(self, reason: FinishReason) -> str:
        return "stop" if self.text.stopped else FINISH_REASONS[reason]


async def _stream(send, stream: RequestStream, reply: _Reply) -> None:
    """Server-sent events as the engine's tokens arrive: every token that came while the last
    chunk was being written goes out in the next one."""
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    if reply.chat:
        await send({"type": "http.response.body", "body": reply.role_chunk(), "more_body": True})
    text_stream = reply.text
    try:
        while True:
            tokens, finished = await stream.take()
            if stream.aborted:  # the client went away
                return
            reply.completion_tokens += len(tokens)
            text = text_stream.push(tokens) if tokens else ""
            if finished is None:
                if text:
                    await send({"type": "http.response.body", "body": reply.text_chunk(text), "more_body": True})
                continue
            last = reply.last_chunks(text + text_stream.finish(), reply.finish_reason(finished))
            return await send({"type": "http.response.body", "body": last, "more_body": False})
    except RuntimeError as error:  # the request failed in the engine, or the engine went
        failure = _sse(_error_body(str(error), None, "server_error"))
        await send({"type": "http.response.body", "body": failure, "more_body": False})


async def _whole(send, stream: RequestStream, reply: _Reply) -> None:
    pieces: List[str] = []
    try:
        while True:
            tokens, finished = await stream.take()
            if stream.aborted:  # the client went away
                return
            reply.completion_tokens += len(tokens)
            pieces.append(reply.text.push(tokens))
            if finished is not None:
                pieces.append(reply.text.finish())
                return await _send_json(send, 200, reply.whole("".join(pieces), reply.finish_reason(finished)))
    except RuntimeError as error:
        await _send_json(send, 500, _error_body(str(error), None, "server_error"))


async def _abort_on_disconnect(receive, engine: EngineClient, stream: RequestStream) -> None:
    """Once the body is read, ``receive`` returns only when the client disconnects (or the
    response is complete: then the abort does nothing)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    engine.abort(stream)


async def _read_body(receive) -> bytes:
    message = await receive()
    body = message.get("body", b"")
    while message.get("more_body"):
        message = await receive()
        body += message.get("body", b"")
    return body


async def _send_json(send, status: int, payload: Dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _sse(payload: Dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def _error_body(message: str, param: Optional[str], kind: str = "invalid_request_error") -> Dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
