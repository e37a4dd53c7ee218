"""Each running request's output on the host, and the stop rules applied to a whole step at once.

Per table row (numpy rows that move with their request, see ``RequestTable.add_host_rows``):
the output tokens so far, the stop parameters (max_new_tokens, eos ids, prompt length), the
verify counters, and whether the request has finished. A launch's read-back
``[accepted, bonus, accepted drafts]`` per step and sampling request becomes new tokens with a
few vectorised numpy operations (the stop rules of ``stop_rules.py``), whatever the batch size
and however many steps the launch ran (a decode run); Python runs per request only for requests
that finish, or that carry stop sequences (rare: a suffix match per new token).

Example, S = 2, eos 7, a request with 3 output tokens and max_new_tokens 5 whose step accepted
2 drafts ``[4, 7]`` and the bonus ``9``: the new tokens are ``[4, 7, 9]``; ``7`` is an eos, so
``[4, 7]`` are emitted, the request finishes with reason EOS and ``9`` is dropped.
"""

from typing import List, Optional, Tuple

import numpy as np

from mtp_ctrl.controllers.config import SamplingParams
from mtp_ctrl.controllers.stop_rules import EOS_COLUMNS, REASONS, eos_columns, first_stops, needs_slow_stop, slow_stop
from mtp_ctrl.state.request_table import RequestTable


class OutputRows:
    def __init__(self, table: RequestTable):
        self.shape = table.shape  # S and max_model_len
        width = self.shape.max_model_len + 2 * self.shape.stride  # room for a step run past the stop
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
        self.eos[row] = eos_columns(params)
        self.slow_stops[row] = int(needs_slow_stop(params))
        self.finished[row] = 0
        self.greedy[row] = params.greedy
        self.decode_steps[row], self.accepted_drafts[row] = decode_steps, accepted_drafts

    def output_of(self, row: int) -> List[int]:
        return self.tokens[row, : self.counts[row]].tolist()  # host-ok: numpy

    def length_budgets(self, num_rows: int) -> Tuple[int, int]:
        """``(fewest tokens any unfinished row of [0, num_rows) may still emit before max_model_len,
        most tokens any may emit before max_new_tokens or max_model_len)``: what
        ``scheduler.decode_run_steps`` reads; ``(0, 0)`` when no row is unfinished."""
        live = self.finished[:num_rows] == 0
        if not live.any():
            return 0, 0
        counts = self.counts[:num_rows][live]
        to_model_len = self.shape.max_model_len - self.prompt_lengths[:num_rows][live] - counts  # [n] int64
        left = np.minimum(self.max_new_tokens[:num_rows][live] - counts, to_model_len)
        return int(to_model_len.min()), int(left.max())

    def apply(self, readbacks: np.ndarray, decode: np.ndarray, params_of_row,
              present: Optional[np.ndarray] = None) -> Tuple[np.ndarray, list]:
        """Append a launch's verified tokens to rows ``[0, n)`` up to each stop (``readbacks``:
        ``[k, n, S + 2]`` int64 host values of the sampling requests of each of the launch's
        ``k`` steps, in the table's current row order). ``decode`` ``[n]`` bool: the rows that ran
        as decodes (they count a verify per step); ``present`` ``[n]`` bool or None (all): the
        rows the launch ran (others are left alone).

        ``params_of_row(row)`` gives a row's SamplingParams (only rows with slow stop rules ask).
        Rows that have finished (steps run past their stop) are left alone. Returns
        ``(emitted counts [k, n], finished: [(row, reason)])``; the tokens are in :attr:`tokens`.
        """
        num_steps, num_rows = readbacks.shape[:2]
        if present is None and self._no_stop_possible(num_rows, num_steps):
            return self._append_all(readbacks, decode), []
        emitted = np.zeros((num_steps, num_rows), dtype=np.int64)
        finished = []
        for step in range(num_steps):
            emitted[step], step_finished = self._apply_step(readbacks[step], decode, params_of_row, present)
            finished += step_finished
        return emitted, finished

    def _apply_step(self, readback: np.ndarray, decode: np.ndarray, params_of_row,
                    present: Optional[np.ndarray]) -> Tuple[np.ndarray, list]:
        """:meth:`apply` for one step (``readback`` ``[n, S + 2]``): ``(emitted [n], finished)``."""
        num_rows, stride = readback.shape[0], self.shape.stride
        rows = np.arange(num_rows)
        accepted = readback[:, 0]
        live = self.finished[:num_rows] == 0  # [n] bool
        if present is not None:
            live &= present
        new_tokens = np.empty((num_rows, stride), dtype=np.int64)  # drafts then the bonus at `accepted`
        new_tokens[:, : stride - 1] = readback[:, 2:]
        new_tokens[rows, accepted] = readback[:, 1]
        new_counts = accepted + 1  # [n] int64
        emitted, reasons = first_stops(new_tokens, new_counts, self.counts[:num_rows], self.max_new_tokens[:num_rows],
                                       self.prompt_lengths[:num_rows], self.eos[:num_rows], self.shape.max_model_len)
        emitted *= live
        reasons *= live
        for row in np.flatnonzero(self.slow_stops[:num_rows] * live):  # stop sequences: per request
            emitted[row], reasons[row] = slow_stop(self.output_of(row), new_tokens[row, : new_counts[row]],
                                                   params_of_row(row), int(emitted[row]), int(reasons[row]))
        column = np.arange(stride)[None, :]
        write = column < emitted[:, None]  # [n, 1 + S] bool
        write_rows = np.repeat(rows, emitted)
        self.tokens[write_rows, (self.counts[:num_rows, None] + column)[write]] = new_tokens[write]
        self.counts[:num_rows] += emitted
        verified = live & decode
        self.decode_steps[:num_rows] += verified
        self.accepted_drafts[:num_rows] += accepted * verified
        finished = []
        for row in np.flatnonzero(reasons):
            self.finished[row] = 1
            finished.append((int(row), REASONS[int(reasons[row])]))
        return emitted, finished

    def _no_stop_possible(self, num_rows: int, num_steps: int) -> bool:
        """No row of ``[0, n)`` can stop in these ``num_steps`` steps whatever they accept: none has
        finished, none has eos ids or stop sequences, and ``num_steps * (1 + S)`` more tokens
        reach neither max_new_tokens nor max_model_len (the common decode launch: 5 numpy
        reductions instead of the full check)."""
        counts = self.counts[:num_rows] + num_steps * self.shape.stride  # [n] int64, the output length after full accepts
        return not (self.finished[:num_rows].any() or self.slow_stops[:num_rows].any() or (self.eos[:num_rows] >= 0).any()
                    or (counts >= self.max_new_tokens[:num_rows]).any()
                    or (self.prompt_lengths[:num_rows] + counts >= self.shape.max_model_len).any())

    def _append_all(self, readbacks: np.ndarray, decode: np.ndarray) -> np.ndarray:
        """:meth:`apply` when no row can stop: every verified token of every step is emitted.
        Returns the emitted counts ``[k, n]``.

        Example, S = 1, one row with 5 output tokens, two steps: step 0 accepted its draft ``a``
        (bonus ``b``), step 1 none (bonus ``c``): emitted ``[[2], [1]]``, the tokens go to output
        positions 5, 6 (step 0 starts at 5) and 7 (step 1 starts at 5 + 2)."""
        num_steps, num_rows = readbacks.shape[:2]
        S = self.shape.stride - 1
        accepted = readbacks[:, :, 0]  # [k, n] int64
        emitted = accepted + 1  # [k, n] int64
        rows = np.arange(num_rows)
        if S == 0:  # one token a step: step j's goes to output position counts + j
            self.tokens[rows[None, :], self.counts[None, :num_rows] + np.arange(num_steps)[:, None]] = readbacks[:, :, 1]
        else:
            new_tokens = np.empty((num_steps, num_rows, self.shape.stride), dtype=np.int64)  # drafts, bonus at `accepted`
            new_tokens[:, :, :S] = readbacks[:, :, 2:]
            np.put_along_axis(new_tokens, accepted[:, :, None], readbacks[:, :, 1:2], axis=2)
            starts = self.counts[None, :num_rows] + np.cumsum(emitted, axis=0) - emitted  # [k, n] each step's first position
            column = np.arange(self.shape.stride)
            write = column < emitted[:, :, None]  # [k, n, 1 + S] bool
            write_rows = np.broadcast_to(rows[None, :, None], write.shape)[write]
            self.tokens[write_rows, (starts[:, :, None] + column)[write]] = new_tokens[write]
        self.counts[:num_rows] += emitted.sum(0)
        self.decode_steps[:num_rows] += decode * num_steps
        self.accepted_drafts[:num_rows] += accepted.sum(0) * decode
        return emitted

    def apply_with_hook(self, readbacks: np.ndarray, decode: np.ndarray, records: list, accept_tokens,
                        owner: str) -> Tuple[np.ndarray, list]:
        """:meth:`apply` through a subclass's ``accept_tokens(record, new_tokens)`` hook, step by
        step and request by request (``records``: each row's RequestRecord), enforcing its
        contract: it keeps a non-empty prefix of the new tokens and gives a finish reason when it
        drops any (the device has moved on with every verified token). A row whose record is
        None did not run in the launch (see :meth:`apply`'s ``present``)."""
        num_steps, num_rows = readbacks.shape[:2]
        emitted = np.zeros((num_steps, num_rows), dtype=np.int64)
        finished = []
        for step in range(num_steps):
            finished += self._apply_step_with_hook(readbacks[step], decode, records, accept_tokens, owner, emitted[step])
        return emitted, finished

    def _apply_step_with_hook(self, readback: np.ndarray, decode: np.ndarray, records: list, accept_tokens,
                              owner: str, emitted: np.ndarray) -> list:
        """One step of :meth:`apply_with_hook`: fills ``emitted`` ``[n]``, returns the finished rows."""
        finished = []
        for row in range(readback.shape[0]):
            accepted = int(readback[row, 0])
            tokens = readback[row, 2 : 2 + accepted].tolist() + [int(readback[row, 1])]  # host-ok: numpy
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
        return finished


def realign_readback(readbacks: np.ndarray, rows: np.ndarray, num_decode: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A launch's read-back ``[k, n, S + 2]`` (in the step's row order) moved to the table's
    current rows: ``rows`` ``[n]`` int64 is where each of the step's requests sits now, -1 for one
    that finished since. Returns ``(readbacks [k, m, S + 2], decode [m] bool, present [m] bool)``
    over the current rows ``[0, m)``; rows the launch did not run (a request admitted since) are
    not present.

    Example: the step ran requests (a, b, c), a finished, c moved into a's row 0 -> rows
    ``[-1, 1, 0]``: the result's row 0 is c's read-back, row 1 b's."""
    kept = rows >= 0
    num_rows = int(rows.max()) + 1 if kept.any() else 0
    aligned = np.zeros((readbacks.shape[0], num_rows, readbacks.shape[2]), dtype=readbacks.dtype)
    aligned[:, rows[kept]] = readbacks[:, kept]
    present = np.zeros(num_rows, dtype=bool)
    present[rows[kept]] = True
    decode = np.zeros(num_rows, dtype=bool)
    decode[rows[kept]] = (np.arange(rows.shape[0]) < num_decode)[kept]
    return aligned, decode, present
