"""Rows of per-request host arrays by request id: the draft-length policies' per-request state
(acceptance counts, the controller's outcome buffers) is kept in dense numpy rows, and a batch's
ids are looked up in one call, with no per-request Python."""

from typing import Optional, Tuple

import numpy as np


class RequestRows:
    """Rows of per-request host arrays by request id, looked up for a whole batch at once (numpy,
    no per-request Python): the ids held, sorted, beside their rows; freed rows are reused. While
    the ids held span a short range (ids are handed out in order, so a batch's do), a lookup reads
    a dense table by ``id - lowest`` (made once per set of ids) instead of a binary search: ~4x
    cheaper for ``observe``'s flush of 64 steps at batch 128 (8192 ids)."""

    DENSE_SLACK = 4  # the dense table is used while the ids span at most this many slots per id held (+ 64)

    def __init__(self):
        self._ids = np.zeros(0, dtype=np.int64)  # [m] int64, sorted
        self._rows = np.zeros(0, dtype=np.int64)  # [m] int64, the row of _ids[i]
        self._free = np.zeros(0, dtype=np.int64)  # rows no id holds (a stack)
        self.capacity = 0  # rows handed out so far (the arrays they index must be this long)
        self._last = (self._ids, self._rows)  # (ids, rows) of the last lookup whose ids were all held
        self._removed = []  # ids removed since the last lookup (applied together: a batch drains at once)
        # (lowest id - 1, [span + 2] rows by id - lowest + 1, else -1), None: not made (or too wide) for _ids
        self._dense: Optional[Tuple[int, np.ndarray]] = None

    def rows(self, request_ids: np.ndarray, create: bool = False) -> Tuple[np.ndarray, np.ndarray]:
        """``([n] rows of request_ids (-1: not held), [k] rows given to new ids)``; with ``create``
        every id gets a row (new ones take freed rows, then new rows past ``capacity``)."""
        if self._removed:
            self._apply_removals()
        request_ids = np.asarray(request_ids, dtype=np.int64)
        last_ids, last_rows = self._last
        if request_ids.shape == last_ids.shape and np.array_equal(request_ids, last_ids):
            return last_rows, last_rows[:0]  # the batch of the last lookup (steady decoding): every id held
        rows = self._lookup(request_ids)  # [n], -1: not held
        held = rows >= 0
        if held.all() and request_ids.shape[0] <= self._ids.shape[0]:  # longer: repeats (observe's steps), not a batch
            self._last = (request_ids.copy(), rows)
        if not create or held.all():
            return rows, rows[:0]
        new_ids = np.unique(request_ids[~held])  # [k]
        reused = min(new_ids.shape[0], self._free.shape[0])
        new_rows = np.concatenate([self._free[self._free.shape[0] - reused:],
                                   np.arange(self.capacity, self.capacity + new_ids.shape[0] - reused)])
        self._free = self._free[: self._free.shape[0] - reused]
        self.capacity += new_ids.shape[0] - reused
        ids, all_rows = np.concatenate([self._ids, new_ids]), np.concatenate([self._rows, new_rows])
        order = np.argsort(ids, kind="stable")
        self._ids, self._rows, self._dense = ids[order], all_rows[order], None
        return self.rows(request_ids)[0], new_rows

    def _lookup(self, request_ids: np.ndarray) -> np.ndarray:
        """``[n]`` int64 the rows of ``request_ids`` (-1: not held)."""
        if self._dense is None and self._ids.shape[0]:
            low, span = int(self._ids[0]), int(self._ids[-1]) - int(self._ids[0]) + 1  # Python ints: no int64 wrap
            if span <= self.DENSE_SLACK * self._ids.shape[0] + 64:
                table = np.full(span + 2, -1, dtype=np.int64)
                table[self._ids - (low - 1)] = self._rows
                self._dense = (low - 1, table)
        if self._dense is not None:
            # ids below the range clip to the first slot, above it to the last: both -1 (an id
            # outside int64's reach of `origin` wraps, but never onto a held id: the residues differ)
            origin, table = self._dense
            return table.take(request_ids - origin, mode="clip")
        positions = np.searchsorted(self._ids, request_ids)  # [n]
        held = positions < self._ids.shape[0]
        held[held] = self._ids[positions[held]] == request_ids[held]
        rows = np.full(request_ids.shape, -1, dtype=np.int64)
        rows[held] = self._rows[positions[held]]
        return rows

    def remove(self, request_id: int) -> None:
        """Free the row of ``request_id`` (nothing if it holds none); done at the next lookup."""
        self._removed.append(request_id)

    def _apply_removals(self) -> None:
        gone = np.isin(self._ids, np.array(self._removed, dtype=np.int64))  # [m] bool
        self._removed = []
        if gone.any():
            self._free = np.concatenate([self._free, self._rows[gone]])
            self._ids, self._rows, self._dense = self._ids[~gone], self._rows[~gone], None
            self._last = (self._ids, self._rows)

    def __len__(self) -> int:
        if self._removed:
            self._apply_removals()
        return self._ids.shape[0]
