"""Each running request's output on the host, and the stop rules applied to a whole step at once.

Per table row (numpy rows that move with their request, see ``RequestTable.add_host_rows``):
the output tokens so far, the stop parameters (max_new_tokens, eos ids, prompt length), the
verify counters, and whether the request has finished. One step's read-back
``[accepted, bonus, accepted drafts]`` per sampling request becomes new tokens with a few
vectorised numpy operations, whatever the batch size; Python runs per request only for requests
that finish, or that carry stop sequences (rare: a suffix match per new token).

Example, S = 2, eos 7, a request with 3 output tokens and max_new_tokens 5 whose step accepted
2 drafts ``[4, 7]`` and the bonus ``9``: the new tokens are ``[4, 7, 9]``; ``7`` is an eos, so
``[4, 7]`` are emitted, the request finishes with reason EOS and ``9`` is dropped.
"""

from typing import List, Optional, Tuple

import numpy as np

from mtp_ctrl.controllers.config import SamplingParams
from mtp_ctrl.controllers.stop_rules import FinishReason
from mtp_ctrl.state.request_table import RequestTable

EOS_COLUMNS = 4  # eos ids kept in the vectorised check; requests with more take the per-request path
# reason codes of the vectorised stop check, in priority order within one token (0 = no stop)
_EOS, _LENGTH, _MODEL_LEN, _STOP_SEQUENCE = 1, 2, 3, 4
_REASONS = {_EOS: FinishReason.EOS, _LENGTH: FinishReason.LENGTH, _MODEL_LEN: FinishReason.MAX_MODEL_LEN,
            _STOP_SEQUENCE: FinishReason.STOP_SEQUENCE}


class OutputRows:
    def __init__(self, table: RequestTable, max_model_len: int, num_speculative_tokens: int):
        self.max_model_len = max_model_len
        self.stride = num_speculative_tokens + 1
        width = max_model_len + 2 * self.stride  # room for a step run past the stop
        self.tokens = table.add_host_rows("output_tokens", (width,))  # [R + 1, width] int64
        self.counts = table.add_host_rows("output_counts", ())  # [R + 1] int64, output tokens so far
        self.max_new_tokens = table.add_host_rows("max_new_tokens", ())
        self.prompt_lengths = table.add_host_rows("prompt_lengths", ())  # the original prompt's
        self.eos = table.add_host_rows("eos_token_ids", (EOS_COLUMNS,), fill=-1)  # [R + 1, E] int64, -1 = none
        self.slow_stops = table.add_host_rows("slow_stop_rules", ())  # 1: stop sequences or many eos ids
        self.finished = table.add_host_rows("finished", ())  # 1 once a stop was emitted
        self.greedy = table.add_host_rows("greedy", (), dtype=bool)  # the request samples greedily
        self.decode_steps = table.add_host_rows("decode_steps", ())
        self.accepted_drafts = table.add_host_rows("accepted_drafts", ())

    def start(self, row: int, params: SamplingParams, prompt_length: int, output: List[int],
              decode_steps: int, accepted_drafts: int) -> None:
        """Set a newly admitted row (``output``: tokens generated before a preemption)."""
        self.tokens[row, : len(output)] = output
        self.counts[row] = len(output)
        self.max_new_tokens[row] = params.max_new_tokens
        self.prompt_lengths[row] = prompt_length
        self.eos[row] = -1
        eos = params.eos_token_ids[:EOS_COLUMNS]
        self.eos[row, : len(eos)] = eos
        self.slow_stops[row] = int(bool(params.stop_sequences) or len(params.eos_token_ids) > EOS_COLUMNS)
        self.finished[row] = 0
        self.greedy[row] = params.greedy
        self.decode_steps[row], self.accepted_drafts[row] = decode_steps, accepted_drafts

    def output_of(self, row: int) -> List[int]:
        return self.tokens[row, : self.counts[row]].tolist()  # host-ok: numpy

    def apply(self, readback: np.ndarray, decode: np.ndarray, params_of_row,
              present: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray, list]:
        """Append one step's verified tokens to rows ``[0, n)`` (``readback``: ``[n, S + 2]`` int64
        host values of the step's sampling requests, in the table's current row order) up to
        each stop. ``decode`` ``[n]`` bool: the rows that ran as decodes (they count a verify);
        ``present`` ``[n]`` bool or None (all): the rows the step ran (others are left alone).

        ``params_of_row(row)`` gives a row's SamplingParams (only rows with slow stop rules ask).
        Rows that had already finished (a step run past their stop) are left alone. Returns
        ``(new_tokens [n, 1 + S], emitted counts [n], finished: [(row, reason)])``.
        """
        num_rows, S = readback.shape[0], self.stride - 1
        if present is None and self._no_stop_possible(num_rows):
            return self._append_all(readback, decode)
        rows = np.arange(num_rows)
        accepted = readback[:, 0]
        live = self.finished[:num_rows] == 0  # [n] bool
        if present is not None:
            live &= present
        new_tokens = np.empty((num_rows, self.stride), dtype=np.int64)  # drafts then the bonus at `accepted`
        new_tokens[:, :S] = readback[:, 2:]
        new_tokens[rows, accepted] = readback[:, 1]
        new_counts = accepted + 1  # [n] int64
        column = np.arange(self.stride)[None, :]
        valid = column < new_counts[:, None]  # [n, 1 + S] bool
        lengths_after = self.counts[:num_rows, None] + column + 1  # output length once each token is in
        is_eos = (new_tokens[:, :, None] == self.eos[:num_rows, None, :]).any(-1)
        is_length = lengths_after >= self.max_new_tokens[:num_rows, None]
        is_model_len = self.prompt_lengths[:num_rows, None] + lengths_after >= self.max_model_len
        reason_codes = np.where(is_eos, _EOS, np.where(is_length, _LENGTH, np.where(is_model_len, _MODEL_LEN, 0))) * valid
        stops = reason_codes > 0
        first_stop = np.where(stops.any(1), stops.argmax(1), self.stride)  # [n] int64
        emitted = np.minimum(new_counts, first_stop + 1) * live  # [n] int64
        reasons = reason_codes[rows, np.minimum(first_stop, S)] * (first_stop < self.stride) * live

        finished = []
        for row in np.flatnonzero(self.slow_stops[:num_rows] * live):  # stop sequences: per request
            emitted[row], code = self._slow_stop(row, new_tokens[row, : new_counts[row]], params_of_row(row),
                                                 int(emitted[row]), int(reasons[row]))
            reasons[row] = code
        write = column < emitted[:, None]  # [n, 1 + S] bool
        write_rows = np.repeat(rows, emitted)
        self.tokens[write_rows, (self.counts[:num_rows, None] + column)[write]] = new_tokens[write]
        self.counts[:num_rows] += emitted
        verified = live & decode
        self.decode_steps[:num_rows] += verified
        self.accepted_drafts[:num_rows] += accepted * verified
        for row in np.flatnonzero(reasons):
            self.finished[row] = 1
            finished.append((int(row), _REASONS[int(reasons[row])]))
        return new_tokens, emitted, finished

    def _no_stop_possible(self, num_rows: int) -> bool:
        """No row of ``[0, n)`` can stop in this step whatever it accepts: none has finished,
        none has eos ids or stop sequences, and 1 + S more tokens reach neither max_new_tokens
        nor max_model_len (the common decode step: 5 numpy reductions instead of the full check)."""
        counts = self.counts[:num_rows] + self.stride  # [n] int64, the output length after a full accept
        return not (self.finished[:num_rows].any() or self.slow_stops[:num_rows].any() or (self.eos[:num_rows] >= 0).any()
                    or (counts >= self.max_new_tokens[:num_rows]).any()
                    or (self.prompt_lengths[:num_rows] + counts >= self.max_model_len).any())

    def _append_all(self, readback: np.ndarray, decode: np.ndarray) -> Tuple[np.ndarray, np.ndarray, list]:
        """:meth:`apply` when no row can stop: every verified token is emitted."""
        num_rows, S = readback.shape[0], self.stride - 1
        accepted = readback[:, 0]  # [n] int64
        new_tokens = np.empty((num_rows, self.stride), dtype=np.int64)
        new_tokens[:, :S] = readback[:, 2:]
        rows = np.arange(num_rows)
        new_tokens[rows, accepted] = readback[:, 1]
        emitted = accepted + 1  # [n] int64
        if S == 0:
            self.tokens[rows, self.counts[:num_rows]] = new_tokens[:, 0]
        else:
            column = np.arange(self.stride)[None, :]
            write = column < emitted[:, None]  # [n, 1 + S] bool
            self.tokens[np.repeat(rows, emitted), (self.counts[:num_rows, None] + column)[write]] = new_tokens[write]
        self.counts[:num_rows] += emitted
        self.decode_steps[:num_rows] += decode
        self.accepted_drafts[:num_rows] += accepted * decode
        return new_tokens, emitted, []

    def apply_with_hook(self, readback: np.ndarray, decode: np.ndarray, records: list, accept_tokens,
                        owner: str) -> Tuple[np.ndarray, np.ndarray, list]:
        """:meth:`apply` through a subclass's ``accept_tokens(record, new_tokens)`` hook, request
        by request (``records``: each row's RequestRecord), enforcing its contract: it keeps a
        non-empty prefix of the new tokens and gives a finish reason when it drops any (the
        device has moved on with every verified token). A row whose record is None did not run
        in the step (see :meth:`apply`'s ``present``)."""
        num_rows = readback.shape[0]
        new_tokens = np.empty((num_rows, self.stride), dtype=np.int64)
        emitted = np.zeros(num_rows, dtype=np.int64)
        finished = []
        for row in range(num_rows):
            accepted = int(readback[row, 0])
            tokens = readback[row, 2 : 2 + accepted].tolist() + [int(readback[row, 1])]  # host-ok: numpy
            new_tokens[row, : accepted + 1] = tokens
            record = records[row]
            if self.finished[row] or record is None:
                continue  # a step run past this request's stop, or a row the step did not run
            kept, reason = accept_tokens(record, tokens)
            kept = list(kept)
            if kept != tokens[: len(kept)] or not kept or (len(kept) < len(tokens) and reason is None):
                raise ValueError(f"{owner}.accept_tokens must keep a non-empty prefix of the new tokens "
                                 f"and give a finish reason when it drops any (got {kept} of {tokens}, {reason})")
            self.tokens[row, self.counts[row] : self.counts[row] + len(kept)] = kept
            self.counts[row] += len(kept)
            emitted[row] = len(kept)
            if decode[row]:
                self.decode_steps[row] += 1
                self.accepted_drafts[row] += accepted
            if reason is not None:
                self.finished[row] = 1
                finished.append((row, reason))
        return new_tokens, emitted, finished

    def _slow_stop(self, row: int, new_tokens: np.ndarray, params: SamplingParams, emitted: int,
                   code: int) -> Tuple[int, int]:
        """Stop sequences (and eos lists longer than EOS_COLUMNS), token by token."""
        output = self.output_of(row)
        for index, token in enumerate(new_tokens.tolist()[:emitted]):  # host-ok: numpy
            output.append(token)
            if token in params.eos_token_ids:
                return index + 1, _EOS
            if any(len(output) >= len(seq) and tuple(output[-len(seq):]) == seq for seq in params.stop_sequences):
                return index + 1, _STOP_SEQUENCE
        return emitted, code


def realign_readback(readback: np.ndarray, rows: np.ndarray, num_decode: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A step's read-back ``[n, S + 2]`` (in the step's row order) moved to the table's current
    rows: ``rows`` ``[n]`` int64 is where each of the step's requests sits now, -1 for one that
    finished since. Returns ``(readback [m, S + 2], decode [m] bool, present [m] bool)`` over the
    current rows ``[0, m)``; rows the step did not run (a request admitted since) are not present.

    Example: the step ran requests (a, b, c), a finished, c moved into a's row 0 -> rows
    ``[-1, 1, 0]``: the result's row 0 is c's read-back, row 1 b's."""
    kept = rows >= 0
    num_rows = int(rows.max()) + 1 if kept.any() else 0
    aligned = np.zeros((num_rows, readback.shape[1]), dtype=readback.dtype)
    aligned[rows[kept]] = readback[kept]
    present = np.zeros(num_rows, dtype=bool)
    present[rows[kept]] = True
    decode = np.zeros(num_rows, dtype=bool)
    decode[rows[kept]] = (np.arange(rows.shape[0]) < num_decode)[kept]
    return aligned, decode, present
