"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health, metrics.

Every request is checked here, before anything reaches the engine: a bad one gets a 400 with an
OpenAI-style body ``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``
naming the field, and nothing else is affected. Sampling: ``max_tokens``, ``temperature``,
``top_p``, ``top_k`` and ``seed`` map to :class:`SamplingParams`; ``stop`` (strings) and
``stop_token_ids`` (an extension) end the text; ``n`` must be 1; ``logprobs`` is refused (the
sampler does not return log-probabilities); ``num_speculative_tokens`` (an extension) caps the
request's drafts per step at a value in ``[0, S]`` (0: no drafts; the text is the same either way). Unknown fields are ignored, as OpenAI's server does;
fields of the API this server does not implement are refused when set to a non-default value.
"""

import asyncio
import json
import time
import uuid
from typing import Any, Dict, List, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from mtp_ctrl.controllers import FinishReason, SamplingParams
from mtp_ctrl.serve.frontend import EngineClient, RequestStream
from mtp_ctrl.serve.text import TextStream

FINISH_REASONS = {FinishReason.EOS: "stop", FinishReason.STOP_SEQUENCE: "stop", FinishReason.LENGTH: "length",
                  FinishReason.MAX_MODEL_LEN: "length", FinishReason.ABORTED: "abort"}
# fields of OpenAI's API with no implementation here: refused unless left at their default
UNSUPPORTED_FIELDS = {"best_of": (None, 1), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
                      "frequency_penalty": (None, 0, 0.0), "suffix": (None, ""), "echo": (None, False),
                      "tools": (None, []), "response_format": (None,), "top_logprobs": (None, 0)}


class BadRequest(Exception):
    def __init__(self, param: Optional[str], message: str, status: int = 400):
        super().__init__(message)
        self.param, self.message, self.status = param, message, status


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields this server ignores

    model: str
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension (vLLM's): 0 = all
    seed: Optional[int] = None
    stop: Union[str, List[str], None] = None
    stop_token_ids: List[int] = []  # extension
    n: int = 1
    stream: bool = False
    logprobs: Union[bool, int, None] = None
    num_speculative_tokens: Optional[int] = None  # extension


class CompletionRequest(SamplingFields):
    prompt: Union[str, List[int]]


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatCompletionRequest(SamplingFields):
    messages: List[ChatMessage]


def create_app(engine: EngineClient, tokenizer, model_name: str) -> FastAPI:
    """The app serving ``engine``'s model under ``model_name``; ``tokenizer`` as in
    :mod:`mtp_ctrl.serve.text`."""
    app = FastAPI(title="mtp_ctrl", version="1")
    info = engine.info
    max_model_len = info.max_model_len
    created = int(time.time())

    @app.exception_handler(BadRequest)
    async def bad_request(_, error: BadRequest):
        return _error(error.status, error.message, error.param)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_, error: RequestValidationError):
        first = error.errors()[0]
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        return _error(400, f"{'.'.join(location) or 'body'}: {first.get('msg')}", location[0] if location else None)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "stopped", "error": engine.error}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "mtp_ctrl", "max_model_len": max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        try:
            figures = await engine.figures()
        except RuntimeError as error:
            return _error(503, str(error), None, kind="server_error")
        return PlainTextResponse(engine.metrics.render(figures), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if isinstance(body.prompt, str):
            prompt_ids = tokenizer.encode(body.prompt)
        else:
            prompt_ids = list(body.prompt)
        return await _generate(request, body, prompt_ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if not getattr(tokenizer, "has_chat_template", False):
            raise BadRequest("messages", f"model {model_name!r} has no chat template: use /v1/completions")
        if not body.messages:
            raise BadRequest("messages", "messages is empty")
        text = tokenizer.apply_chat_template([message.model_dump() for message in body.messages])
        return await _generate(request, body, tokenizer.encode(text), chat=True)

    async def _generate(request: Request, body: SamplingFields, prompt_ids: List[int], chat: bool):
        params, stop = _check(body, prompt_ids)
        try:
            stream = engine.submit(prompt_ids, params)
        except RuntimeError as error:
            raise BadRequest(None, str(error), status=503)
        reply = _Reply(body, model_name, chat, len(prompt_ids), TextStream(tokenizer.new_decoder(), stop))
        if body.stream:
            return StreamingResponse(_stream(engine, stream, reply), media_type="text/event-stream")
        return await _whole(request, engine, stream, reply)

    def _check(body: SamplingFields, prompt_ids: List[int]):
        """400 for anything the engine would refuse or this server does not do; (params, stop strings)."""
        if body.model != model_name:
            raise BadRequest("model", f"unknown model {body.model!r}; this server serves {model_name!r}", 404)
        for field, defaults in UNSUPPORTED_FIELDS.items():
            value = getattr(body, field, None)
            if value not in defaults:
                raise BadRequest(field, f"{field} is not supported by this server")
        if body.n != 1:
            raise BadRequest("n", f"n must be 1, got {body.n}")
        if body.logprobs not in (None, False, 0):
            raise BadRequest("logprobs", "logprobs are not available: the sampler does not return log-probabilities")
        speculative = info.num_speculative_tokens
        draft_cap = body.num_speculative_tokens
        if draft_cap is not None and not (isinstance(draft_cap, int) and 0 <= draft_cap <= speculative):
            raise BadRequest("num_speculative_tokens", f"num_speculative_tokens must be an integer in [0, {speculative}] "
                             f"(this server drafts at most {speculative} per step); got {draft_cap!r}")
        if not prompt_ids:
            raise BadRequest("prompt" if isinstance(body, CompletionRequest) else "messages", "the prompt is empty")
        vocab_size = info.vocab_size
        if any(not 0 <= token < vocab_size for token in prompt_ids):
            raise BadRequest("prompt", f"prompt token ids must be in [0, {vocab_size})")
        if len(prompt_ids) >= max_model_len:
            raise BadRequest("prompt" if isinstance(body, CompletionRequest) else "messages",
                             f"the prompt has {len(prompt_ids)} tokens; this model's max_model_len is {max_model_len} "
                             "(prompt and output together)")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4 or any(not text for text in stop):
            raise BadRequest("stop", "stop takes up to 4 non-empty strings")
        if any(not 0 <= token < vocab_size for token in body.stop_token_ids):
            raise BadRequest("stop_token_ids", f"stop_token_ids must be in [0, {vocab_size})")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # OpenAI's defaults: 16 for completions, the rest of the context for chat
            max_tokens = 16 if isinstance(body, CompletionRequest) else max_model_len - len(prompt_ids)
        fields = dict(max_new_tokens=("max_tokens", max_tokens), temperature=("temperature", body.temperature),
                      top_p=("top_p", body.top_p), top_k=("top_k", body.top_k), seed=("seed", body.seed))
        try:
            params = SamplingParams(**{name: value for name, (_, value) in fields.items()},
                                    eos_token_ids=tuple(tokenizer.eos_token_ids) + tuple(body.stop_token_ids),
                                    stop_sequences=tokenizer.stop_token_sequences(stop),
                                    num_speculative_tokens=draft_cap)
            params.check_vocab(vocab_size)
        except (ValueError, TypeError) as error:
            named = [api for name, (api, _) in fields.items() if name in str(error)]
            raise BadRequest(named[0] if named else None, str(error).replace("max_new_tokens", "max_tokens"))
        return params, stop

    return app


class _Reply:
    """The OpenAI response objects of one request (a whole reply or stream chunks). A text chunk
    is a pre-encoded JSON head and tail around the JSON string of its text."""

    def __init__(self, body: SamplingFields, model_name: str, chat: bool, prompt_tokens: int, text: TextStream):
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

    def text_chunk(self, text: str) -> str:
        """The SSE event of a chunk of text with no finish reason (== ``_sse(self.chunk(text, None))``)."""
        return self._text_head + json.dumps(text) + self._text_tail

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


async def _texts(stream: RequestStream, reply: _Reply):
    """(text to send, finish reason or None) as the engine's tokens arrive: all tokens that came
    while the handler was busy (writing the last chunk) at once."""
    while True:
        tokens, finished = await stream.take()
        if tokens:
            reply.completion_tokens += len(tokens)
            text = reply.text.push(tokens)
            if text and finished is None:
                yield text, None
                continue
        else:
            text = ""
        if finished is not None:
            yield text + reply.text.finish(), reply.finish_reason(finished)
            return


async def _stream(engine: EngineClient, stream: RequestStream, reply: _Reply):
    """Server-sent events; a client that disconnects cancels this generator, which aborts the request."""
    try:
        if reply.chat:
            yield _sse(reply.chunk(None, None, first=True))  # the role, as OpenAI's first chat chunk
        async for text, finish_reason in _texts(stream, reply):
            if finish_reason is None:
                yield reply.text_chunk(text)
            else:
                yield _sse(reply.chunk(text, finish_reason))
        yield _sse({**reply.chunk(None, None), "choices": [], "usage": reply.usage()})
        yield "data: [DONE]\n\n"
    except RuntimeError as error:
        yield _sse({"error": {"message": str(error), "type": "server_error", "param": None, "code": None}})
    finally:
        engine.abort(stream)  # nothing if it finished


async def _whole(request: Request, engine: EngineClient, stream: RequestStream, reply: _Reply):
    pieces: List[str] = []
    texts = _texts(stream, reply).__aiter__()
    try:
        while True:
            next_text = asyncio.ensure_future(texts.__anext__())
            while not next_text.done():
                await asyncio.wait({next_text}, timeout=0.5)
                if not next_text.done() and await request.is_disconnected():
                    next_text.cancel()
                    return JSONResponse({}, status_code=499)
            text, finish_reason = next_text.result()
            pieces.append(text)
            if finish_reason is not None:
                return reply.whole("".join(pieces), finish_reason)
    except StopAsyncIteration:
        raise RuntimeError("the engine ended the request without a result")
    except RuntimeError as error:
        return _error(500, str(error), None, kind="server_error")
    finally:
        engine.abort(stream)  # the client went away (nothing if it finished)


def _sse(payload: Dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _error(status: int, message: str, param: Optional[str], kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status)
