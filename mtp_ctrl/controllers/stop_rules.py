"""Stop rules, applied on the host to the tokens a step verified, for a whole batch at once.

A step can verify several tokens per request at once (the accepted drafts and the bonus token);
tokens after the first stop are dropped even though the target accepted them. The rules, in
order of priority at one token: an eos id, a stop sequence the output now ends with,
max_new_tokens reached, max_model_len filled.

There is one implementation: :func:`first_stops` checks eos ids (up to ``EOS_COLUMNS`` per
request), max_new_tokens and max_model_len for every request with a few numpy operations, and
:func:`slow_stop` walks the tokens of the rare request with stop sequences or more eos ids. The
controller's batch path (``OutputRows``) and the per-request :func:`accept_new_tokens` (the
default ``accept_tokens`` hook, which a subclass may call) both run them.

Example, eos 7, max_new_tokens 5, a request with 3 output tokens that verified ``[4, 7, 9]``:
``7`` is an eos, so ``[4, 7]`` are emitted with reason EOS and ``9`` is dropped.
"""

import enum
from typing import List, Optional, Sequence, Tuple

import numpy as np

from mtp_ctrl.controllers.config import SamplingParams


class FinishReason(str, enum.Enum):
    EOS = "eos"  # emitted one of eos_token_ids
    STOP_SEQUENCE = "stop_sequence"  # output ends with one of stop_sequences
    LENGTH = "length"  # max_new_tokens reached
    MAX_MODEL_LEN = "max_model_len"  # prompt + output filled max_model_len
    ABORTED = "aborted"  # its step raised (a hook, the proposer): the output so far is kept


EOS_COLUMNS = 4  # eos ids kept in the vectorised check; requests with more also take slow_stop
# reason codes of the vectorised check (0 = no stop); priority within one token: EOS, LENGTH, MODEL_LEN
NO_STOP, EOS, LENGTH, MODEL_LEN, STOP_SEQUENCE = 0, 1, 2, 3, 4
REASONS = {EOS: FinishReason.EOS, LENGTH: FinishReason.LENGTH, MODEL_LEN: FinishReason.MAX_MODEL_LEN,
           STOP_SEQUENCE: FinishReason.STOP_SEQUENCE}


def eos_columns(params: SamplingParams) -> np.ndarray:
    """``[EOS_COLUMNS]`` int64: the request's first eos ids, -1 for none."""
    row = np.full(EOS_COLUMNS, -1, dtype=np.int64)
    eos = params.eos_token_ids[:EOS_COLUMNS]
    row[: len(eos)] = eos
    return row


def needs_slow_stop(params: SamplingParams) -> bool:
    """Whether :func:`slow_stop` must look at the request's tokens (stop sequences, many eos ids)."""
    return bool(params.stop_sequences) or len(params.eos_token_ids) > EOS_COLUMNS


def first_stops(new_tokens: np.ndarray, new_counts: np.ndarray, output_counts: np.ndarray,
                max_new_tokens: np.ndarray, prompt_lengths: np.ndarray, eos: np.ndarray,
                max_model_len: int) -> Tuple[np.ndarray, np.ndarray]:
    """Where each of ``n`` requests stops among its new tokens, by eos id, max_new_tokens or max_model_len.

    new_tokens: ``[n, W]`` int64, the first ``new_counts[i]`` of row ``i`` verified (``[n]`` int64);
    output_counts, max_new_tokens, prompt_lengths: ``[n]`` int64; eos: ``[n, EOS_COLUMNS]`` int64
    (-1 = none). Returns ``(emitted [n] int64, reason codes [n] int64)``: the tokens kept (through
    the first stop) and its code (``NO_STOP`` when none).

    Example, W = 3, eos 7, 3 output tokens, max_new_tokens 5: ``[4, 7, 9]`` (all verified) gives
    emitted 2 and EOS; ``[4, 6, 9]`` gives 2 and LENGTH (the output reaches 5 at ``6``).
    """
    num_rows, width = new_tokens.shape
    if width == 0:  # nothing verified: nothing emitted, no stop
        return np.zeros(num_rows, dtype=np.int64), np.zeros(num_rows, dtype=np.int64)
    column = np.arange(width)[None, :]
    valid = column < new_counts[:, None]  # [n, W] bool
    lengths_after = output_counts[:, None] + column + 1  # [n, W]: output length once each token is in
    is_eos = (new_tokens[:, :, None] == eos[:, None, :]).any(-1)
    is_length = lengths_after >= max_new_tokens[:, None]
    is_model_len = prompt_lengths[:, None] + lengths_after >= max_model_len
    codes = np.where(is_eos, EOS, np.where(is_length, LENGTH, np.where(is_model_len, MODEL_LEN, NO_STOP))) * valid
    stops = codes > 0
    first = np.where(stops.any(1), stops.argmax(1), width)  # [n] int64
    emitted = np.minimum(new_counts, first + 1)  # [n] int64
    reasons = np.where(first < width, codes[np.arange(num_rows), np.minimum(first, width - 1)], NO_STOP)
    return emitted, reasons


def slow_stop(output: List[int], new_tokens: Sequence[int], params: SamplingParams, emitted: int,
              code: int) -> Tuple[int, int]:
    """Refine one request's :func:`first_stops` result ``(emitted, code)`` with its stop sequences and
    eos ids past ``EOS_COLUMNS``, token by token (``output``: its tokens so far, not extended)."""
    output = list(output)
    for index, token in enumerate(int(token) for token in new_tokens[:emitted]):
        output.append(token)
        if token in params.eos_token_ids:
            return index + 1, EOS
        if any(len(output) >= len(seq) and tuple(output[-len(seq):]) == seq for seq in params.stop_sequences):
            return index + 1, STOP_SEQUENCE
    return emitted, code


def accept_new_tokens(output_tokens: List[int], new_tokens: Sequence[int], params: SamplingParams,
                      prompt_len: int, max_model_len: int) -> Tuple[List[int], Optional[FinishReason]]:
    """The stop rules for one request: append ``new_tokens`` to ``output_tokens`` up to the first stop.

    Returns (the tokens actually emitted, the finish reason or None). ``output_tokens`` is
    extended in place. Example: eos 2, new tokens [5, 2, 7] -> emits [5, 2], reason EOS.
    """
    new = np.asarray(list(new_tokens), dtype=np.int64)[None, :]  # [1, W]
    as_row = lambda value: np.array([value], dtype=np.int64)  # noqa: E731
    emitted, codes = first_stops(new, as_row(new.shape[1]), as_row(len(output_tokens)), as_row(params.max_new_tokens),
                                 as_row(prompt_len), eos_columns(params)[None, :], max_model_len)
    count, code = int(emitted[0]), int(codes[0])
    if needs_slow_stop(params):
        count, code = slow_stop(output_tokens, new[0].tolist(), params, count, code)  # host-ok: numpy
    kept = new[0, :count].tolist()  # host-ok: numpy
    output_tokens.extend(kept)
    return kept, REASONS.get(code)
