"""Each running request's output on the host, and the stop rules applied to a whole step at once.

Per table slot (numpy rows, see ``RequestTable.add_host_rows``):
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
        """Set the slot ``row`` of a newly admitted request (``output``: tokens generated before a preemption)."""
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

    def length_budgets(self, slots: np.ndarray) -> Tuple[int, int]:
        """``(fewest tokens any unfinished request in ``slots`` may still emit before max_model_len,
        most tokens any may emit before max_new_tokens or max_model_len)``: what
        ``scheduler.decode_run_steps`` reads; ``(0, 0)`` when none is unfinished."""
        slots = slots[self.finished[slots] == 0]
        if slots.shape[0] == 0:
            return 0, 0
        to_model_len = self.shape.max_model_len - self.prompt_lengths[slots] - self.counts[slots]  # [n] int64
        return int(to_model_len.min()), int(self.tokens_left(slots).max())

    def tokens_left(self, slots: np.ndarray) -> np.ndarray:
        """``[n]`` int64: the most tokens each request in ``slots`` may still emit (before its
        max_new_tokens or max_model_len; a stop token may end it sooner)."""
        counts = self.counts[slots]
        to_model_len = self.shape.max_model_len - self.prompt_lengths[slots] - counts  # [n] int64
        return np.minimum(self.max_new_tokens[slots] - counts, to_model_len)

    def emitted_since(self, slots: np.ndarray, request_ids: np.ndarray, counts_before: np.ndarray,
                      finished: list) -> List[Tuple[int, List[int], bool]]:
        """What a launch emitted, as the controller's step outputs ``(request_id, tokens,
        finished)``: the tokens each request in ``slots`` ``[n]`` gained since its count was
        ``counts_before`` ``[n]``; ``finished``: ``(index, reason)`` pairs from :meth:`apply`."""
        finished_indices = {index for index, _ in finished}
        counts_after = self.counts[slots]  # [n] int64
        indices = np.flatnonzero(counts_after > counts_before)  # [m] the requests that emitted
        if indices.shape[0] == 0:
            return []
        # one gather of every new token ([m, most emitted], clipped columns past a row's count),
        # one tolist, then a slice a request: per-row numpy slicing cost ~1 us a request
        starts, lengths = counts_before[indices], counts_after[indices] - counts_before[indices]  # [m] each
        columns = np.minimum(starts[:, None] + np.arange(int(lengths.max())), self.tokens.shape[1] - 1)
        rows = self.tokens[slots[indices][:, None], columns].tolist()  # host-ok: numpy
        return [(request_id, row[:length], index in finished_indices)
                for request_id, row, length, index in zip(request_ids[indices].tolist(), rows, lengths.tolist(),  # host-ok: numpy
                                                          indices.tolist())]  # host-ok: numpy

    def apply(self, readbacks: np.ndarray, decode: np.ndarray, slots: np.ndarray, params_of_row,
              present: Optional[np.ndarray] = None) -> Tuple[np.ndarray, list]:
        """Append a launch's verified tokens to the requests in ``slots`` (``[n]`` int64, the
        step's order) up to each stop (``readbacks``: ``[k, n, S + 2]`` int64 host values of the
        sampling requests of each of the launch's ``k`` steps, in the step's order). ``decode``
        ``[n]`` bool: the requests that ran as decodes (they count a verify per step); ``present``
        ``[n]`` bool or None (all): the requests still in their slot (others are left alone).

        ``params_of_row(i)`` gives the SamplingParams of the step's request ``i`` (only requests
        with slow stop rules ask). Requests that have finished (steps run past their stop) are
        left alone. Returns ``(emitted counts [k, n], finished: [(i, reason)])``, in the step's
        order; the tokens are in :attr:`tokens`.
        """
        num_steps = readbacks.shape[0]
        if present is None and self._no_stop_possible(slots, readbacks[:, :, 0]):
            return self._append_all(readbacks, decode, slots), []
        emitted = np.zeros((num_steps, slots.shape[0]), dtype=np.int64)
        finished = []
        for step in range(num_steps):
            emitted[step], step_finished = self._apply_step(readbacks[step], decode, slots, params_of_row, present)
            finished += step_finished
        return emitted, finished

    def _apply_step(self, readback: np.ndarray, decode: np.ndarray, slots: np.ndarray, params_of_row,
                    present: Optional[np.ndarray]) -> Tuple[np.ndarray, list]:
        """:meth:`apply` for one step (``readback`` ``[n, S + 2]``): ``(emitted [n], finished)``."""
        num_rows, stride = readback.shape[0], self.shape.stride
        rows = np.arange(num_rows)
        accepted = readback[:, 0]
        live = self.finished[slots] == 0  # [n] bool
        if present is not None:
            live &= present
        new_tokens = np.empty((num_rows, stride), dtype=np.int64)  # drafts then the bonus at `accepted`
        new_tokens[:, : stride - 1] = readback[:, 2:]
        new_tokens[rows, accepted] = readback[:, 1]
        new_counts = accepted + 1  # [n] int64
        counts = self.counts[slots]  # [n] int64
        emitted, reasons = first_stops(new_tokens, new_counts, counts, self.max_new_tokens[slots],
                                       self.prompt_lengths[slots], self.eos[slots], self.shape.max_model_len)
        emitted *= live
        reasons *= live
        for row in np.flatnonzero(self.slow_stops[slots] * live):  # stop sequences: per request
            emitted[row], reasons[row] = slow_stop(self.output_of(slots[row]), new_tokens[row, : new_counts[row]],
                                                   params_of_row(row), int(emitted[row]), int(reasons[row]))
        column = np.arange(stride)[None, :]
        write = column < emitted[:, None]  # [n, 1 + S] bool
        write_slots = np.repeat(slots, emitted)
        self.tokens[write_slots, (counts[:, None] + column)[write]] = new_tokens[write]
        self.counts[slots] = counts + emitted
        verified = live & decode
        self.decode_steps[slots] += verified
        self.accepted_drafts[slots] += accepted * verified
        finished = []
        for row in np.flatnonzero(reasons):
            self.finished[slots[row]] = 1
            finished.append((int(row), REASONS[int(reasons[row])]))
        return emitted, finished

    def _no_stop_possible(self, slots: np.ndarray, accepted: np.ndarray) -> bool:
        """No request in ``slots`` stops in the launch whose steps accepted ``accepted`` (``[k, n]``
        int64) drafts: none has finished, none has eos ids or stop sequences, and the tokens it
        emitted (``accepted + 1`` a step) reach neither max_new_tokens nor max_model_len (the common
        decode launch: a few numpy reductions instead of the full check)."""
        counts = self.counts[slots] + (accepted + 1).sum(axis=0)  # [n] int64, the output length after the launch
        return not (self.finished[slots].any() or self.slow_stops[slots].any() or (self.eos[slots] >= 0).any()
                    or (counts >= self.max_new_tokens[slots]).any()
                    or (self.prompt_lengths[slots] + counts >= self.shape.max_model_len).any())

    def _append_all(self, readbacks: np.ndarray, decode: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """:meth:`apply` when no row can stop: every verified token of every step is emitted.
        Returns the emitted counts ``[k, n]``.

        Example, S = 1, one row with 5 output tokens, two steps: step 0 accepted its draft ``a``
        (bonus ``b``), step 1 none (bonus ``c``): emitted ``[[2], [1]]``, the tokens go to output
        positions 5, 6 (step 0 starts at 5) and 7 (step 1 starts at 5 + 2)."""
        num_steps, num_rows = readbacks.shape[:2]
        S = self.shape.stride - 1
        accepted = readbacks[:, :, 0]  # [k, n] int64
        emitted = accepted + 1  # [k, n] int64
        counts = self.counts[slots]  # [n] int64
        if S == 0 or not accepted.any():  # one token a step: step j's goes to output position counts + j
            self.tokens[slots[None, :], counts[None, :] + np.arange(num_steps)[:, None]] = readbacks[:, :, 1]
        else:
            new_tokens = np.empty((num_steps, num_rows, self.shape.stride), dtype=np.int64)  # drafts, bonus at `accepted`
            new_tokens[:, :, :S] = readbacks[:, :, 2:]
            np.put_along_axis(new_tokens, accepted[:, :, None], readbacks[:, :, 1:2], axis=2)
            starts = counts[None, :] + np.cumsum(emitted, axis=0) - emitted  # [k, n] each step's first position
            column = np.arange(self.shape.stride)
            write = column < emitted[:, :, None]  # [k, n, 1 + S] bool
            write_slots = np.broadcast_to(slots[None, :, None], write.shape)[write]
            self.tokens[write_slots, (starts[:, :, None] + column)[write]] = new_tokens[write]
        self.counts[slots] = counts + emitted.sum(0)
        self.decode_steps[slots] += decode * num_steps
        self.accepted_drafts[slots] += accepted.sum(0) * decode
        return emitted

    def apply_with_hook(self, readbacks: np.ndarray, decode: np.ndarray, slots: np.ndarray, records: list,
                        accept_tokens, owner: str) -> Tuple[np.ndarray, list]:
        """:meth:`apply` through a subclass's ``accept_tokens(record, new_tokens)`` hook, step by
        step and request by request (``records``: each request's Request, in the step's order),
        enforcing its contract: it keeps a non-empty prefix of the new tokens and gives a finish
        reason when it drops any (the device has moved on with every verified token). A request
        whose record is None has left its slot (see :meth:`apply`'s ``present``)."""
        num_steps, num_rows = readbacks.shape[:2]
        emitted = np.zeros((num_steps, num_rows), dtype=np.int64)
        finished = []
        for step in range(num_steps):
            finished += self._apply_step_with_hook(readbacks[step], decode, slots, records, accept_tokens, owner,
                                                   emitted[step])
        return emitted, finished

    def _apply_step_with_hook(self, readback: np.ndarray, decode: np.ndarray, slots: np.ndarray, records: list,
                              accept_tokens, owner: str, emitted: np.ndarray) -> list:
        """One step of :meth:`apply_with_hook`: fills ``emitted`` ``[n]``, returns the finished requests."""
        finished = []
        for index in range(readback.shape[0]):
            accepted = int(readback[index, 0])
            tokens = readback[index, 2 : 2 + accepted].tolist() + [int(readback[index, 1])]  # host-ok: numpy
            record, row = records[index], int(slots[index])
            if record is None or self.finished[row]:
                continue  # a request that left its slot, or a step run past its stop
            kept, reason = accept_tokens(record, tokens)
            kept = list(kept)
            if kept != tokens[: len(kept)] or not kept or (len(kept) < len(tokens) and reason is None):
                raise ValueError(f"{owner}.accept_tokens must keep a non-empty prefix of the new tokens "
                                 f"and give a finish reason when it drops any (got {kept} of {tokens}, {reason})")
            self.tokens[row, self.counts[row] : self.counts[row] + len(kept)] = kept
            self.counts[row] += len(kept)
            emitted[index] = len(kept)
            if decode[index]:
                self.decode_steps[row] += 1
                self.accepted_drafts[row] += accepted
            if reason is not None:
                self.finished[row] = 1
                finished.append((index, reason))
        return finished

