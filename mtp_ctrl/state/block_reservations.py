"""BlockReservations: which KV blocks each live request holds, and when a decode must pause.

The context asks it, before every build, to give the decode requests their worst-case blocks
(``Scheduler.worst_case_blocks``: every draft of the steps in flight accepted), to give the
prefill chunks theirs, and, while no step is in flight, to pause the decodes the pool cannot serve
and resume paused ones once it can. Blocks are taken from the allocator and written into the
host block table at once; the device learns them with the next step's ``block_writes``, which
this object keeps until the context stages that step (:meth:`take_writes`).
"""

from typing import List, Optional

import numpy as np

from mtp_ctrl.state.kv_block_allocator import KVBlockAllocator
from mtp_ctrl.state.request_table import RequestTable, RowGroup
from mtp_ctrl.state.scheduler import Scheduler


class BlockReservations:
    def __init__(self, table: RequestTable, scheduler: Scheduler, allocator: KVBlockAllocator):
        self.table = table
        self.scheduler = scheduler
        self.allocator = allocator
        self._writes: List[np.ndarray] = []  # [3, k] int64 arrays (slot, column, block id) not yet on the device

    def decode_needs(self, steps_in_flight: int, slots: Optional[np.ndarray] = None, new_steps: int = 1) -> np.ndarray:
        """``[nd]`` int64: blocks each request in ``slots`` (default: the decode requests) still
        needs before the next ``new_steps`` steps."""
        slots = self.table.slots_in(RowGroup.DECODE) if slots is None else slots
        host = self.table.host
        return self.scheduler.blocks_needed(host.known_lengths[slots], host.block_counts[slots], steps_in_flight,
                                            new_steps)

    def blocks_to_resume(self, row: int) -> int:
        """Blocks a paused request in slot ``row`` needs for its next decode step."""
        host = self.table.host
        return int(self.scheduler.blocks_needed(host.known_lengths[row], host.block_counts[row], steps_in_flight=0))

    def reserve(self, rows: np.ndarray, wanted: np.ndarray) -> None:
        """Give the requests in slots ``rows`` (``[n]`` int64) ``wanted`` blocks (``[n]`` int64;
        those holding more keep theirs): host block table and allocator now, the device with the
        next step's block writes."""
        host = self.table.host
        adding = np.maximum(wanted - host.block_counts[rows], 0)  # [n] int64
        total = int(adding.sum())
        if total == 0:
            return
        block_ids = np.array(self.allocator.take(total), dtype=np.int64)  # [k]; KVCacheFullError before any change
        growing = np.flatnonzero(adding)  # [m] int64: the rows that take blocks
        if growing.shape[0] == total:  # one block each: a decode step's usual case, no repeats
            write_rows = rows[growing]  # [k] int64
            write_cols = host.block_counts[write_rows]
        else:
            write_rows = np.repeat(rows, adding)  # [k] int64
            first_of_row = np.cumsum(adding) - adding  # [n] int64, index of each row's first new block
            write_cols = host.block_counts[write_rows] + np.arange(total) - np.repeat(first_of_row, adding)
        host.block_ids[write_rows, write_cols] = block_ids
        host.block_counts[rows] += adding
        self._writes.append(np.stack([write_rows, write_cols, block_ids]))

    def pause_decodes_short_of_blocks(self) -> None:
        """Pause the decode requests the scheduler cannot give their next blocks (no step in flight)."""
        slots = self.table.slots_in(RowGroup.DECODE)
        needs = self.decode_needs(steps_in_flight=0, slots=slots)
        pause = self.scheduler.decodes_to_pause(needs, self.allocator.num_free_blocks)
        for request_id in self.table.host.request_ids[slots[pause]].tolist():  # host-ok: numpy
            self.table.move(request_id, RowGroup.PAUSED)
            self.scheduler.paused_for_kv_space(request_id)

    def resume_requests_paused_for_kv(self) -> None:
        """Resume the paused requests, oldest first, that the blocks left after the decodes' serve."""
        paused = self.scheduler.paused_for_kv
        if not paused:
            return
        spare_blocks = self.allocator.num_free_blocks - int(self.decode_needs(steps_in_flight=0).sum())
        request_ids = list(paused)
        needs = (self.blocks_to_resume(self.table.slot_of(request_id)) for request_id in request_ids)
        for request_id in request_ids[: self.scheduler.num_to_resume(needs, spare_blocks)]:
            self.table.move(request_id, RowGroup.DECODE)
            self.scheduler.resumed(request_id)

    def take_writes(self) -> np.ndarray:
        """``[3, k]`` int64 (table slot, column, block id): the reservations since the last call,
        for the step being staged."""
        writes = np.concatenate(self._writes, axis=1) if self._writes else np.zeros((3, 0), np.int64)
        self._writes = []
        return writes

    def drop_writes(self) -> None:
        """Forget the writes not yet staged (the steps they were for are abandoned)."""
        self._writes = []
