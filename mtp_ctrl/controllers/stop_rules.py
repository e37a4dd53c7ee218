"""Stop rules, applied on the host to the tokens a step verified for one request.

A step can verify several tokens at once (the base token plus accepted drafts); tokens after
the first stop are dropped even though the target accepted them.
"""

import enum
from typing import List, Optional, Sequence, Tuple

from mtp_ctrl.controllers.config import SamplingParams


class FinishReason(str, enum.Enum):
    EOS = "eos"  # emitted one of eos_token_ids
    STOP_SEQUENCE = "stop_sequence"  # output ends with one of stop_sequences
    LENGTH = "length"  # max_new_tokens reached
    MAX_MODEL_LEN = "max_model_len"  # prompt + output filled max_model_len
    ABORTED = "aborted"  # its step raised (a hook, the proposer): the output so far is kept


def accept_new_tokens(
    output_tokens: List[int],
    new_tokens: Sequence[int],
    params: SamplingParams,
    prompt_len: int,
    max_model_len: int,
) -> Tuple[List[int], Optional[FinishReason]]:
    """Append ``new_tokens`` to ``output_tokens`` up to the first stop.

    Returns (the tokens actually emitted, the finish reason or None). ``output_tokens`` is
    extended in place. Example: eos 2, new tokens [5, 2, 7] -> emits [5, 2], reason EOS.
    """
    emitted: List[int] = []
    for token in new_tokens:
        output_tokens.append(token)
        emitted.append(token)
        if token in params.eos_token_ids:
            return emitted, FinishReason.EOS
        if any(_ends_with(output_tokens, seq) for seq in params.stop_sequences):
            return emitted, FinishReason.STOP_SEQUENCE
        if len(output_tokens) >= params.max_new_tokens:
            return emitted, FinishReason.LENGTH
        if prompt_len + len(output_tokens) >= max_model_len:
            return emitted, FinishReason.MAX_MODEL_LEN
    return emitted, None


def _ends_with(tokens: List[int], suffix: Tuple[int, ...]) -> bool:
    return len(tokens) >= len(suffix) and tuple(tokens[-len(suffix):]) == suffix
