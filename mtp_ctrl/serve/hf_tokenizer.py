"""The server's tokenizer adapter (the interface of :mod:`mtp_ctrl.serve.text`) for a Hugging Face
checkpoint's tokenizer (:class:`mtp_ctrl.models.hf_text.HFText`)."""

from typing import Dict, List, Sequence, Tuple


class HFTokenizer:
    """``encode``, a streaming decoder, EOS ids, the chat template; stop strings are matched on the
    text by the server's ``TextStream`` (a string may be spelled by several token sequences)."""

    def __init__(self, text):
        self.text = text  # mtp_ctrl.models.hf_text.HFText
        self.name = text.path.name
        self.eos_token_ids: Tuple[int, ...] = text.eos_token_ids

    @property
    def has_chat_template(self) -> bool:
        return self.text.has_chat_template

    def encode(self, text: str) -> List[int]:
        """Ids of ``text`` with the tokenizer's special tokens, unless the text already begins with
        its BOS (a rendered chat template carries its own): no doubled BOS."""
        bos = self.text.bos_token
        return self.text.encode(text, add_special_tokens=not (bos and text.startswith(bos)))

    def new_decoder(self):
        return self.text.new_stream_decoder()

    def stop_token_sequences(self, stop: Sequence[str]) -> Tuple[Tuple[int, ...], ...]:
        return ()  # no exact token spelling of a string: the text match stops the request

    def apply_chat_template(self, messages: Sequence[Dict[str, str]]) -> str:
        return self.text.render_chat_template(messages)
