"""The generation routes' request checks, by hand (no pydantic on the hot path).

:func:`read_fields` takes the parsed JSON body of ``/v1/completions`` or ``/v1/chat/completions``
and checks every field's type; :func:`check_request` checks the values against the model and
builds the :class:`SamplingParams`. Anything wrong raises :class:`BadRequest` naming the field
(``param`` of OpenAI's error body), before anything reaches the engine. ``null`` means the
field's default; unknown fields are ignored, as OpenAI's server does; fields of the API this
server does not implement are refused when set to a non-default value.
"""

from typing import Any, Dict, List, Optional, Tuple

from mtp_ctrl.controllers import SamplingParams

# fields of OpenAI's API with no implementation here: refused unless left at their default
UNSUPPORTED_FIELDS = {"best_of": (None, 1), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
                      "frequency_penalty": (None, 0, 0.0), "suffix": (None, ""), "echo": (None, False),
                      "tools": (None, []), "response_format": (None,), "top_logprobs": (None, 0)}


class BadRequest(Exception):
    def __init__(self, param: Optional[str], message: str, status: int = 400):
        super().__init__(message)
        self.param, self.message, self.status = param, message, status


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer_or_none(value) -> bool:
    return value is None or _integer(value)


def _stop(value) -> bool:
    return value is None or isinstance(value, str) or (isinstance(value, list)
                                                       and all(isinstance(text, str) for text in value))


def _integers(value) -> bool:
    return isinstance(value, list) and all(_integer(token) for token in value)


# name: (check, what it must be, the default a missing or null field takes)
SAMPLING_FIELDS = {
    "max_tokens": (_integer_or_none, "an integer", None),
    "max_completion_tokens": (_integer_or_none, "an integer", None),
    "temperature": (_number, "a number", 1.0),
    "top_p": (_number, "a number", 1.0),
    "top_k": (_integer, "an integer", 0),  # an extension (vLLM's): 0 = all
    "seed": (_integer_or_none, "an integer", None),
    "stop": (_stop, "a string or a list of strings", None),
    "stop_token_ids": (_integers, "a list of integers", []),  # an extension
    "n": (_integer, "an integer", 1),
    "stream": (lambda value: isinstance(value, bool), "a boolean", False),
    "logprobs": (lambda value: value is None or isinstance(value, (bool, int)), "a boolean or an integer", None),
    "num_speculative_tokens": (_integer_or_none, "an integer", None),  # an extension
}


class RequestFields:
    """A generation request's fields, type-checked: the sampling fields as attributes, and
    ``prompt`` (a string or token ids) or ``messages`` (``[{"role", "content"}]``)."""

    def __init__(self, body: Any, chat: bool):
        if not isinstance(body, dict):
            raise BadRequest(None, "the request body must be a JSON object")
        self.chat = chat
        model = body.get("model")
        if not isinstance(model, str):
            raise BadRequest("model", "model is required (a string)")
        self.model = model
        for name, (check, kind, default) in SAMPLING_FIELDS.items():
            value = body.get(name)
            if value is None:
                value = default
            elif not check(value):
                raise BadRequest(name, f"{name} must be {kind}, got {value!r}")
            setattr(self, name, value)
        for name, defaults in UNSUPPORTED_FIELDS.items():
            if body.get(name) not in defaults:
                raise BadRequest(name, f"{name} is not supported by this server")
        if chat:
            self.messages = self._messages(body.get("messages"))
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str) and not _integers(prompt):
                raise BadRequest("prompt", "prompt is required: a string or a list of token ids")
            self.prompt = prompt

    @staticmethod
    def _messages(messages) -> List[Dict[str, str]]:
        if not isinstance(messages, list):
            raise BadRequest("messages", "messages is required: a list of {role, content}")
        if not messages:
            raise BadRequest("messages", "messages is empty")
        for index, message in enumerate(messages):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise BadRequest("messages", f"messages[{index}] must be an object with a string role and content")
        return [{"role": message["role"], "content": message["content"]} for message in messages]


def check_request(fields: RequestFields, prompt_ids: List[int], info, model_name: str,
                  tokenizer) -> Tuple[SamplingParams, List[str]]:
    """400 (404 for another model) for anything the engine would refuse or this server does not
    do; (the request's SamplingParams, its stop strings). ``info``: the engine's EngineInfo."""
    prompt_field = "messages" if fields.chat else "prompt"
    if fields.model != model_name:
        raise BadRequest("model", f"unknown model {fields.model!r}; this server serves {model_name!r}", 404)
    if fields.n != 1:
        raise BadRequest("n", f"n must be 1, got {fields.n}")
    if fields.logprobs not in (None, False, 0):
        raise BadRequest("logprobs", "logprobs are not available: the sampler does not return log-probabilities")
    speculative = info.num_speculative_tokens
    draft_cap = fields.num_speculative_tokens
    if draft_cap is not None and not 0 <= draft_cap <= speculative:
        raise BadRequest("num_speculative_tokens", f"num_speculative_tokens must be an integer in [0, {speculative}] "
                         f"(this server drafts at most {speculative} per step); got {draft_cap!r}")
    if not prompt_ids:
        raise BadRequest(prompt_field, "the prompt is empty")
    vocab_size, max_model_len = info.vocab_size, info.max_model_len
    if any(not 0 <= token < vocab_size for token in prompt_ids):
        raise BadRequest("prompt", f"prompt token ids must be in [0, {vocab_size})")
    if len(prompt_ids) >= max_model_len:
        raise BadRequest(prompt_field, f"the prompt has {len(prompt_ids)} tokens; this model's max_model_len is "
                         f"{max_model_len} (prompt and output together)")
    stop = [fields.stop] if isinstance(fields.stop, str) else list(fields.stop or [])
    if len(stop) > 4 or any(not text for text in stop):
        raise BadRequest("stop", "stop takes up to 4 non-empty strings")
    if any(not 0 <= token < vocab_size for token in fields.stop_token_ids):
        raise BadRequest("stop_token_ids", f"stop_token_ids must be in [0, {vocab_size})")
    max_tokens = fields.max_completion_tokens if fields.max_completion_tokens is not None else fields.max_tokens
    if max_tokens is None:  # OpenAI's defaults: 16 for completions, the rest of the context for chat
        max_tokens = max_model_len - len(prompt_ids) if fields.chat else 16
    sampling = dict(max_new_tokens=("max_tokens", max_tokens), temperature=("temperature", fields.temperature),
                    top_p=("top_p", fields.top_p), top_k=("top_k", fields.top_k), seed=("seed", fields.seed))
    try:
        params = SamplingParams(**{name: value for name, (_, value) in sampling.items()},
                                eos_token_ids=tuple(tokenizer.eos_token_ids) + tuple(fields.stop_token_ids),
                                stop_sequences=tokenizer.stop_token_sequences(stop), num_speculative_tokens=draft_cap)
        params.check_vocab(vocab_size)
    except (ValueError, TypeError) as error:
        named = [api for name, (api, _) in sampling.items() if name in str(error)]
        raise BadRequest(named[0] if named else None, str(error).replace("max_new_tokens", "max_tokens"))
    return params, stop
