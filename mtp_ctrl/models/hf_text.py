"""Text in, text out for a Hugging Face checkpoint: its tokenizer, EOS ids, chat template and stop strings.

:class:`HFText` reads the checkpoint directory's ``tokenizer.json`` with the ``tokenizers``
library (encode, decode), the EOS ids of ``generation_config.json`` (else ``config.json``), and
renders ``apply_chat_template`` through ``transformers``' tokenizer (the chat template is Jinja
with transformers' own helpers; only this method needs ``transformers``).

Stop strings: the controller stops on token sequences (``SamplingParams.stop_sequences``), but a
string can be spelled by several token sequences. :class:`StopStrings` finds the first stop string
in decoded text and says how many of a step's new tokens to keep, so a controller's
``accept_tokens`` hook can finish a request exactly there (``mtp_ctrl.cli.hf_generate.StopStringController``).
"""

import json
import os
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union


def _read_json(path: Path) -> Optional[dict]:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None
    return value if isinstance(value, dict) else None


def _as_ids(value) -> Tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    return tuple(int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)


class HFText:
    """The tokenizer and text settings of a Hugging Face checkpoint directory.

    >>> text = HFText("Qwen3-0.6B/")
    >>> ids = text.encode("Hello")                   # [int, ...]
    >>> text.decode(ids)                               # "Hello"
    >>> text.eos_token_ids                             # (151645, 151643) from generation_config.json
    >>> text.apply_chat_template([{"role": "user", "content": "Hi"}])   # prompt ids, generation prompt added
    """

    def __init__(self, path: Union[str, os.PathLike]):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        self.path = Path(path)
        tokenizer_file = self.path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file} does not exist (a 'fast' tokenizer file is needed)")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError("reading tokenizer.json needs the tokenizers package: pip install tokenizers") from None
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises its own Exception subclass for a bad file
            raise ValueError(f"{tokenizer_file} is not a readable tokenizers file ({error})") from None
        self.tokenizer_config = _read_json(self.path / "tokenizer_config.json") or {}
        generation = _read_json(self.path / "generation_config.json") or {}
        model_config = _read_json(self.path / "config.json") or {}
        self.eos_token_ids: Tuple[int, ...] = _as_ids(generation.get("eos_token_id")) or \
            _as_ids(model_config.get("eos_token_id")) or self._eos_from_tokenizer_config()
        self._chat_tokenizer = None

    def _special_token(self, name: str) -> Optional[str]:
        token = self.tokenizer_config.get(name)
        if isinstance(token, dict):
            token = token.get("content")
        return token if isinstance(token, str) and token else None

    def _eos_from_tokenizer_config(self) -> Tuple[int, ...]:
        eos = self._special_token("eos_token")
        token_id = self.tokenizer.token_to_id(eos) if eos is not None else None
        return () if token_id is None else (token_id,)

    @property
    def bos_token(self) -> Optional[str]:
        """The tokenizer config's BOS string (e.g. ``"<|begin_of_text|>"``), None without one."""
        return self._special_token("bos_token")

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer_config.get("chat_template")) or (self.path / "chat_template.jinja").is_file()

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows (added tokens included); the model's vocabulary may be larger (padded)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """Token ids of ``text`` (``add_special_tokens``: the tokenizer's BOS etc., as its post-processor says)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> List[int]:
        """Prompt ids of a chat (``[{"role": ..., "content": ...}, ...]``) through the checkpoint's
        chat template, rendered by ``transformers`` (ImportError naming it when missing; ValueError
        when the checkpoint has no template). The rendered text holds its own special tokens."""
        return self.encode(self.render_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    def render_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The chat template's text for ``messages`` (what :meth:`apply_chat_template` encodes)."""
        if not self.has_chat_template:
            raise ValueError(f"{self.path} has no chat template (tokenizer_config.json 'chat_template' or "
                             "chat_template.jinja)")
        if self._chat_tokenizer is None:
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise ImportError("apply_chat_template needs the transformers package: pip install transformers") from None
            from transformers.utils import logging as transformers_logging

            verbosity = transformers_logging.get_verbosity()
            transformers_logging.set_verbosity_error()  # its notice that config.json's model_type (e.g. mimo) is unknown
            try:
                self._chat_tokenizer = AutoTokenizer.from_pretrained(str(self.path))
            finally:
                transformers_logging.set_verbosity(verbosity)
        return self._chat_tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                        add_generation_prompt=add_generation_prompt)

    def stop_strings(self, strings: Sequence[str]) -> "StopStrings":
        return StopStrings(self, strings)

    def new_stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


class StreamDecoder:
    """Text of one output as its tokens arrive: ``decode(new_ids)`` returns the text they add.

    A token may end inside a character (a byte-level piece), and some decoders change a token's
    text by what precedes it (a leading space), so the new text is the difference between two
    decodes of a short window: the ids since the last emitted text (``_read``) after a few ids of
    context (``_prefix``). Text ending in U+FFFD (an incomplete character) waits for more ids.
    Example: ids ``[a, b]`` emitted "ab"; then ``c`` -> decode([a, b, c]) minus decode([a, b])
    over the window starting at ``_prefix``.
    """

    def __init__(self, text: HFText):
        self._text = text
        self._ids: List[int] = []
        self._prefix = 0  # window start: context decoded but not emitted again
        self._read = 0  # ids before this have been emitted

    def decode(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(int(token) for token in token_ids)
        before = self._text.decode(self._ids[self._prefix:self._read])
        after = self._text.decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def flush(self) -> str:
        """What is left (an incomplete character decodes as U+FFFD)."""
        before = self._text.decode(self._ids[self._prefix:self._read])
        after = self._text.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return after[len(before):] if len(after) > len(before) else ""


class StopStrings:
    """Where generated text first contains one of ``strings``, in tokens.

    ``keep_count(output, new_tokens)``: of a step's ``new_tokens`` (after ``output``, the tokens
    kept so far), the number to keep so that the output ends at the first token whose text
    completes a stop string; None when no stop string appears. The output keeps that token (as
    the controller keeps a stop sequence); :meth:`cut` removes the stop string and what follows
    from the text. Only the last few tokens are re-decoded per call (the window covers the
    longest stop string), so a call costs O(new tokens), not O(output).
    """

    def __init__(self, text: HFText, strings: Sequence[str]):
        if isinstance(strings, str) or any(not isinstance(s, str) or not s for s in strings):
            raise ValueError(f"stop strings must be a sequence of non-empty str, got {strings!r}")
        self.text = text
        self.strings = tuple(strings)
        self._window = max((len(s) for s in self.strings), default=0) + 8  # tokens: each holds >= 1 char, or merges

    def keep_count(self, output: Sequence[int], new_tokens: Sequence[int]) -> Optional[int]:
        if not self.strings:
            return None
        start = max(0, len(output) - self._window)
        tokens = list(output[start:])
        before = self.text.decode(tokens)
        already = any(s in before for s in self.strings)  # an earlier call saw it (never kept past it)
        for index, token in enumerate(new_tokens):
            tokens.append(int(token))
            decoded = self.text.decode(tokens)
            if not already and any(s in decoded for s in self.strings):
                return index + 1
        return None

    def cut(self, text: str) -> str:
        """``text`` up to (without) the first stop string."""
        positions = [text.find(s) for s in self.strings if s in text]
        return text[:min(positions)] if positions else text
