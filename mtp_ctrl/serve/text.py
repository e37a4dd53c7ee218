"""Text in, text out for the server: a tokenizer adapter and a streaming detokenizer.

The server needs four things of a tokenizer: ``encode(text) -> ids``, a streaming decoder (a
token may end mid-character), the ids that end generation, and, for chat, how messages become a
prompt. :class:`ByteTokenizer` is the demo model's: UTF-8 bytes are the ids 0..255 (ids past 255,
which its padded vocabulary allows, decode to nothing), no EOS, and a plain chat template
(``"role: content"`` lines, then ``"assistant: "``).

Stop strings are matched on the text (:class:`TextStream`): OpenAI's ``stop`` may end inside a
token of another tokenizer. With byte tokens the controller stops on them by itself too (they are
passed as ``stop_sequences``), so no token is generated past one.
"""

import codecs
from typing import Dict, List, Optional, Sequence, Tuple

BYTE_VOCAB = 256


class ByteTokenizer:
    """The shipped demo model's tokenizer: UTF-8 bytes."""

    name = "bytes"
    eos_token_ids: Tuple[int, ...] = ()
    has_chat_template = True

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def new_decoder(self) -> "ByteDecoder":
        return ByteDecoder()

    def stop_token_sequences(self, stop: Sequence[str]) -> Tuple[Tuple[int, ...], ...]:
        """Token sequences the controller can stop on by itself (exact for bytes)."""
        return tuple(tuple(text.encode("utf-8")) for text in stop)

    def apply_chat_template(self, messages: Sequence[Dict[str, str]]) -> str:
        return "".join(f"{message['role']}: {message['content']}\n" for message in messages) + "assistant: "


class ByteDecoder:
    """Incremental UTF-8: bytes of a character split over two steps come out once complete."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, token_ids: Sequence[int]) -> str:
        try:
            data = bytes(token_ids)
        except ValueError:  # ids past 255
            data = bytes(t for t in token_ids if 0 <= t < BYTE_VOCAB)
        return self._decoder.decode(data)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class TextStream:
    """One request's output text as its tokens arrive, cut at the first stop string.

    ``push(ids)`` returns the text that is safe to send now: with stop strings, the last
    ``len(longest stop) - 1`` characters wait until more text shows they start no stop string.
    ``finish()`` returns the rest. ``stopped`` tells whether a stop string ended the text (the
    stop string itself is not part of the output, as in OpenAI's API).
    """

    def __init__(self, decoder, stop: Sequence[str] = ()):
        self._decoder = decoder
        self._stop = [text for text in stop if text]
        self._hold = max((len(text) for text in self._stop), default=1) - 1
        self._text = ""  # decoded, not yet sent
        self.sent = ""  # everything sent so far (kept only with stop strings)
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        if not self._stop:  # nothing to hold back or look for
            return self._decoder.decode(token_ids)
        if self.stopped:
            return ""
        self._text += self._decoder.decode(token_ids)
        cut = self._first_stop()
        if cut is not None:
            self.stopped = True
            return self._send(self._text[:cut])
        return self._send(self._text[:len(self._text) - self._hold] if self._hold else self._text)

    def finish(self) -> str:
        if not self._stop:
            return self._decoder.flush()
        if self.stopped:
            return ""
        self._text += self._decoder.flush()
        cut = self._first_stop()
        self.stopped = cut is not None
        return self._send(self._text if cut is None else self._text[:cut])

    def _first_stop(self) -> Optional[int]:
        full = self.sent + self._text  # a stop string may start in text already sent (it never does: held back)
        positions = [full.find(text, max(0, len(self.sent) - len(text) + 1)) for text in self._stop]
        found = [position for position in positions if position >= 0]
        return min(found) - len(self.sent) if found else None

    def _send(self, text: str) -> str:
        self._text = self._text[len(text):]
        self.sent += text
        return text
