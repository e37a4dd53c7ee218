"""Per-request rows: host bookkeeping (numpy) and the device rows the step kernels read and write.

Letters: R = max_requests, MB = max_blocks_per_request, S = num_speculative_tokens.

Rows are grouped, in this order: decode requests, prefill requests, paused requests, free rows::

    rows  [0, num_decode)                      DECODE   run 1 + S query rows per step
          [num_decode, + num_prefill)          PREFILL  run a chunk of their prompt
          [.., + num_paused)                   PAUSED   keep their blocks, run nothing
          [num_live, R)                        free

so a step over ``n`` requests reads plain prefixes (``table.device.kv_length_offsets[:n]``), and
a CUDA-graph batch padded to ``B`` reads rows ``[0, B)`` with ``num_active_requests = n``.

Who owns what (each fact has one owner):

- The device owns a request's KV length and what follows from it: ``kv_length_offsets``,
  ``last_kv_block_offset``, ``kv_block_counts``, ``last_kv_block_id``. Every step grows them by
  its query rows and the fused verify kernel rewinds them past rejected drafts; the host never
  writes them after a request's row is reset at admission.
- The host owns which KV blocks a request holds (``host.block_ids``, the allocator's view) and
  sends each new block to the device as a ``(row, column, block id)`` write with the next step.
  A request holds blocks for the longest its KV can get before the host hears back (all drafts
  accepted), so the device never needs a block the host has not given it. Rewound blocks stay
  with the request as that reserve; all of them return to the allocator when it ends.
- The host's ``known_lengths`` is a lagging copy of the device length: exact for prefill and
  paused requests, and for decode requests as of the last step whose read-back it processed.

Free rows (past the live ones, and rows just released) hold no request: on the device they point
only at the context's scratch KV block and scratch Mamba slot (:meth:`set_free_row_targets`,
:meth:`reset_free_rows`), never at a block or slot another request may hold, and never at -1, so
a captured graph replayed over them (padding, or a stale replay) stays inside the pools.

KV fields of request ``r`` with ``kv_len = kv_length_offsets[r]`` rows written to its cache
(block size ``bs``): ``kv_block_counts = ceil(kv_len / bs)``, ``last_kv_block_id =
kv_block_ids[r, count - 1]`` (-1 when count == 0), ``last_kv_block_offset = (kv_len - 1) mod bs``.

Moving a request between groups swaps whole rows on both sides (host numpy rows, device rows by
stream-ordered copies, so no host sync), together with every row buffer callers registered
(:meth:`add_device_rows`, :meth:`add_host_rows`). Removing one copies the last row of each group
from its own on into the hole before it (one row copy per group boundary: the removed row is
not kept).

Joining and leaving cost a fixed number of device launches per call, not per request:
:meth:`insert` writes only the host rows, and :meth:`write_inserted_rows` (the context calls it
before it stages a step) resets the device rows of every request inserted since, from one
staged host-to-device copy; :meth:`remove` takes many requests and moves the surviving rows
with one gather per row buffer.
"""

import dataclasses
import enum
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np
import torch

from mtp_ctrl.state.engine_shape import EngineShape
from mtp_ctrl.state.staging import StagingBuffers

# Int fields of a request on the device, the rows of one [len(DEVICE_FIELDS), R + 1] int64 tensor.
DEVICE_FIELDS = (
    "kv_length_offsets",  # KV rows written (device-owned)
    "last_kv_block_offset",
    "kv_block_counts",
    "last_kv_block_id",
    "prefill_status",  # 1 = prefill (no rewind), 0 = decode
    "mamba_slot_ids",  # Mamba state slot of the request; -1 without Mamba layers
)


_PREFILL_FIELD = DEVICE_FIELDS.index("prefill_status")
_MAMBA_SLOT_FIELD = DEVICE_FIELDS.index("mamba_slot_ids")


class RowGroup(enum.IntEnum):
    DECODE = 0
    PREFILL = 1
    PAUSED = 2
    FREE = 3


@dataclasses.dataclass(frozen=True)
class RequestRows:
    """Views of every device row of the table, the scratch slot ``R`` last."""

    kv_length_offsets: torch.Tensor  # [R + 1] int64
    last_kv_block_offset: torch.Tensor  # [R + 1] int64
    kv_block_counts: torch.Tensor  # [R + 1] int64
    last_kv_block_id: torch.Tensor  # [R + 1] int64
    prefill_status: torch.Tensor  # [R + 1] int64
    mamba_slot_ids: torch.Tensor  # [R + 1] int64
    kv_block_ids: torch.Tensor  # [R + 1, MB] int64, -1 = none


@dataclasses.dataclass(frozen=True)
class HostRows:
    """The host's per-row numpy arrays (``[R + 1]``: the last row is the swap scratch row)."""

    request_ids: np.ndarray  # [R + 1] int64, -1 on free rows
    known_lengths: np.ndarray  # [R + 1] int64, KV rows as far as the host knows (see module docstring)
    block_counts: np.ndarray  # [R + 1] int64, blocks the request holds
    block_ids: np.ndarray  # [R + 1, MB] int64, -1 past block_counts
    prefill_status: np.ndarray  # [R + 1] int64
    mamba_slot_ids: np.ndarray  # [R + 1] int64


class RequestTable:
    """Rows of live requests, grouped decode | prefill | paused.

    Device-only rows the controller writes each step (they move with their request):
    ``next_tokens`` ``[R]`` int64, the base token of the next decode step (the token sampled
    last), and ``draft_tokens`` ``[R, S]`` int64, the drafts of the next decode step. Callers
    register more with :meth:`add_device_rows` and host rows with :meth:`add_host_rows`.
    """

    def __init__(self, shape: EngineShape):
        self.shape = shape
        max_requests, max_blocks_per_request, device = shape.max_requests, shape.max_blocks_per_request, shape.device
        self._scratch_row = max_requests  # one spare row for swaps and padding writes
        rows = max_requests + 1
        self._device_fields = torch.zeros(len(DEVICE_FIELDS), rows, dtype=torch.int64, device=device)  # [F, R + 1]
        self._device_block_ids = torch.full((rows, max_blocks_per_request), -1, dtype=torch.int64, device=device)
        # the values a row gets at admission: no KV, no blocks (prefill status and slot set after)
        self._fresh_fields = np.array([self._fresh_value(name) for name in DEVICE_FIELDS], dtype=np.int64)  # [F]
        self._device_rows: Dict[str, torch.Tensor] = {}  # name -> [R + 1, ...] device rows
        self._set_on_insert: List[str] = []  # device rows every insert gives a value (add_device_rows)
        self._host_rows: Dict[str, np.ndarray] = {}  # name -> [R + 1, ...] host rows
        # request id -> (prefill status, Mamba slot, values of _set_on_insert) not on the device yet
        self._pending_inserts: Dict[int, Tuple[int, int, Mapping[str, float]]] = {}
        self._row_staging: Optional[StagingBuffers] = None  # built at the first batched device write
        self.host = HostRows(
            request_ids=self.add_host_rows("request_ids", (), fill=-1),
            known_lengths=self.add_host_rows("known_lengths", ()),
            block_counts=self.add_host_rows("block_counts", ()),
            block_ids=self.add_host_rows("block_ids", (max_blocks_per_request,), fill=-1),
            prefill_status=self.add_host_rows("prefill_status", ()),
            mamba_slot_ids=self.add_host_rows("mamba_slot_ids", (), fill=-1),
        )
        self.device = RequestRows(kv_block_ids=self._device_block_ids,
                                  **{name: self._device_fields[i] for i, name in enumerate(DEVICE_FIELDS)})
        for index, name in enumerate(DEVICE_FIELDS):
            self._device_fields[index].fill_(self._fresh_value(name))
        self.next_tokens = self.add_device_rows("next_tokens", (), torch.int64)  # [R] int64
        self.draft_tokens = self.add_device_rows("draft_tokens", (shape.num_speculative_tokens,), torch.int64)  # [R, S]
        # what free rows hold on the device (set_free_row_targets): fresh fields, the scratch block and slot
        self._free_fields = torch.as_tensor(self._fresh_fields[:, None], device=self._device_fields.device)  # [F, 1]
        self._free_block = -1
        self._group_ends = [0, 0, 0, max_requests]  # exclusive end row of each RowGroup
        self._row_of: Dict[int, int] = {}
        # row swaps and removals so far: a step built at another count reads some rows as other
        # requests' (the controller then realigns its read-back by request id)
        self.num_moves = 0

    def set_free_row_targets(self, scratch_block: int, scratch_slot: int) -> None:
        """The scratch KV block and Mamba slot (-1: no Mamba layers) free rows point at; resets every free row."""
        values = dict(zip(DEVICE_FIELDS, self._fresh_fields.tolist()), last_kv_block_id=scratch_block,  # host-ok: numpy
                      mamba_slot_ids=scratch_slot)
        self._free_fields = torch.tensor([[values[name]] for name in DEVICE_FIELDS], dtype=torch.int64,
                                         device=self._device_fields.device)  # [F, 1] int64: a free row's fields
        self._free_block = scratch_block
        self.reset_free_rows()
        self.reset_free_rows(self._scratch_row, self._scratch_row + 1)  # padding requests use the scratch slot

    @property
    def scratch_block(self) -> int:
        """The KV block free and scratch slots point at (-1 until :meth:`set_free_row_targets`)."""
        return self._free_block

    def reset_free_rows(self, start: Optional[int] = None, end: Optional[int] = None) -> None:
        """Point the device rows ``[start, end)`` (default: every free row) at the scratch block and
        slot, with no KV: two device writes, no host sync. A stale replay of a captured graph may
        have written free rows; this restores them."""
        start, end = self.num_live if start is None else start, self.shape.max_requests if end is None else end
        if start >= end:
            return
        self._device_fields[:, start:end].copy_(self._free_fields)  # broadcast over the rows
        self._device_block_ids[start:end].fill_(self._free_block)

    def add_device_rows(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype, fill: float = 0,
                        set_on_insert: bool = False) -> torch.Tensor:
        """Allocate a device-only ``[R, *shape]`` buffer whose row ``r`` belongs to the request at
        table row ``r`` and moves with it (callers' per-request state: sampling parameters, a
        proposer's token history, ...). Returns the ``[R, *shape]`` view. ``set_on_insert``
        (scalar rows only): every :meth:`insert` names the row's first value, written with the
        batch of :meth:`write_inserted_rows`; other rows keep what the row held until the caller
        writes them."""
        if name in self._device_rows:
            raise ValueError(f"device rows {name!r} already exist")
        if set_on_insert and shape != ():
            raise ValueError(f"set_on_insert needs scalar rows; {name!r} has shape {shape}")
        if set_on_insert and self._pending_inserts:
            raise RuntimeError(f"add_device_rows({name!r}, set_on_insert=True) with inserts not written yet")
        rows = torch.full((self.shape.max_requests + 1, *shape), fill, dtype=dtype, device=self._device_fields.device)
        self._device_rows[name] = rows  # [R + 1, *shape]: the last row is the scratch row
        if set_on_insert:
            self._set_on_insert.append(name)
            self._row_staging = None  # its layout gains a section
        return rows[: self.shape.max_requests]

    def device_rows_with_scratch(self, name: str) -> torch.Tensor:
        """The whole ``[R + 1, *shape]`` buffer of :meth:`add_device_rows`: row ``scratch_row`` is a
        sink that padding requests of a CUDA-graph batch may write without touching a request."""
        return self._device_rows[name]

    def add_host_rows(self, name: str, shape: Tuple[int, ...], dtype=np.int64, fill=0) -> np.ndarray:
        """Allocate a host ``[R + 1, *shape]`` numpy buffer whose rows move with their requests."""
        if name in self._host_rows:
            raise ValueError(f"host rows {name!r} already exist")
        rows = np.full((self.shape.max_requests + 1, *shape), fill, dtype=dtype)
        self._host_rows[name] = rows
        return rows

    def device_block_ids_with_scratch(self) -> torch.Tensor:
        """``[R + 1, MB]`` int64: the device block table including the scratch row."""
        return self._device_block_ids

    @property
    def scratch_row(self) -> int:
        return self._scratch_row

    # ----- where requests are -------------------------------------------------------------

    def group_rows(self, group: RowGroup) -> Tuple[int, int]:
        """``(start, end)`` rows of ``group``."""
        start = 0 if group == 0 else self._group_ends[group - 1]
        return start, self._group_ends[group]

    def group_size(self, group: RowGroup) -> int:
        start, end = self.group_rows(group)
        return end - start

    @property
    def num_live(self) -> int:
        return self._group_ends[RowGroup.PAUSED]

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._row_of

    def row_of(self, request_id: int) -> int:
        return self._row_of[request_id]

    def group_of(self, request_id: int) -> RowGroup:
        row = self._row_of[request_id]
        return RowGroup(next(g for g in RowGroup if row < self._group_ends[g]))

    def request_ids_in(self, group: RowGroup) -> List[int]:
        start, end = self.group_rows(group)
        return self.host.request_ids[start:end].tolist()  # host-ok: numpy

    # ----- moving requests ----------------------------------------------------------------

    def insert(self, request_id: int, group: RowGroup, mamba_slot_id: int = -1,
               row_values: Optional[Mapping[str, float]] = None) -> int:
        """Put a new request with an empty KV cache at the end of ``group``; return its row.

        Writes the host rows only. ``row_values`` gives the first value of every device row
        registered with ``set_on_insert``; the device rows are reset (no KV, no blocks) and set by
        the next :meth:`write_inserted_rows`, which must run before anything reads or writes them
        on the device (the context's ``build_step`` runs it first)."""
        if self.num_live == self.shape.max_requests:
            raise RuntimeError(f"the request table is full ({self.shape.max_requests} rows)")
        row_values = {} if row_values is None else row_values
        if sorted(row_values) != sorted(self._set_on_insert):
            raise ValueError(f"row_values must name the rows {sorted(self._set_on_insert)}, got {sorted(row_values)}")
        row = self.num_live  # first free row
        prefill = 1 if group == RowGroup.PREFILL else 0
        for name, rows in self._host_rows.items():
            rows[row] = -1 if name in ("request_ids", "block_ids", "mamba_slot_ids") else 0
        host = self.host
        host.request_ids[row], host.prefill_status[row], host.mamba_slot_ids[row] = request_id, prefill, mamba_slot_id
        self._pending_inserts[request_id] = (prefill, mamba_slot_id, row_values)
        self._row_of[request_id] = row
        self.move(request_id, group)
        return self._row_of[request_id]

    def write_inserted_rows(self) -> None:
        """Reset the device rows of every request inserted since the last call, wherever its row
        is now (moves in between carried the stale row; this overwrites it): one host-to-device
        copy, then one indexed write per row buffer, however many requests joined."""
        if not self._pending_inserts:
            return
        staging = self._staging()
        staging.wait_until_host_writable()
        host = staging.host_arrays
        count = len(self._pending_inserts)
        for index, (request_id, (prefill, mamba_slot_id, values)) in enumerate(self._pending_inserts.items()):
            host["insert_rows"][index] = self._row_of[request_id]
            host["insert_fields"][:, index] = self._fresh_fields
            host["insert_fields"][_PREFILL_FIELD, index] = prefill
            host["insert_fields"][_MAMBA_SLOT_FIELD, index] = mamba_slot_id
            for name in self._set_on_insert:
                host[name][index] = values[name]
        self._pending_inserts.clear()
        staging.copy_to_device()
        device = staging.device
        rows = device["insert_rows"][:count]  # [n] int64
        self._device_fields.index_copy_(1, rows, device["insert_fields"][:, :count])
        self._device_block_ids.index_fill_(0, rows, -1)
        for name in self._set_on_insert:
            self._device_rows[name].index_copy_(0, rows, device[name][:count])

    def remove(self, request_ids: Iterable[int]) -> None:
        """Drop requests' rows (their blocks and slots must already be released).

        The rows keep their grouping as :meth:`move` to FREE would, but a removed request's row
        need not survive, so its hole is filled by one row copy per group boundary instead of
        row swaps. Example, ``DECODE [a, b, c] | PREFILL [d, e]``, ``remove([a])``: ``c`` moves
        into ``a``'s row, then ``e`` into ``c``'s -> ``DECODE [c, b] | PREFILL [e, d]``, and the
        last live row is free. The host rows move one removal at a time; the device rows move
        once at the end, each surviving row straight from where it was (:meth:`_move_device_rows`)."""
        request_ids = list(request_ids)
        unknown = [request_id for request_id in request_ids if request_id not in self._row_of]
        if unknown or len(set(request_ids)) != len(request_ids):  # checked before anything changes
            raise ValueError(f"request_ids must be distinct live requests; unknown: {unknown}, given: {request_ids}")
        origin = np.arange(self.shape.max_requests + 1)  # [R + 1]: the row whose device content row r should hold
        for request_id in request_ids:
            self._pending_inserts.pop(request_id, None)
            hole = self._row_of.pop(request_id)
            group = RowGroup(next(g for g in RowGroup if hole < self._group_ends[g]))
            for current in range(group, RowGroup.FREE):
                last = self._group_ends[current] - 1  # the group's last row fills the hole, and is the next hole
                if last != hole:
                    for rows in self._host_rows.values():
                        rows[hole] = rows[last]
                    self._row_of[int(self.host.request_ids[hole])] = hole
                    origin[hole] = origin[last]
                    self.num_moves += 1
                self._group_ends[current] -= 1
                hole = last
            self.num_moves += 1  # its row may be taken by the next request: a step built before reads it as this one's
            self.host.request_ids[hole] = -1
            self.host.block_counts[hole] = 0
            self.host.block_ids[hole] = -1
        live_rows = np.arange(self.num_live)
        targets = live_rows[origin[: self.num_live] != live_rows]  # [m] rows whose request moved
        self._move_device_rows(origin[targets], targets)
        self.reset_free_rows(self.num_live, self.num_live + len(request_ids))  # the rows just freed
    def move(self, request_id: int, group: RowGroup) -> None:
        """Move a request to ``group``: it becomes the first row of a later group, or the last
        row of an earlier one. Each boundary crossed costs one row swap.

        Example, groups ``DECODE [a, b] | PREFILL [c, d]``, ``move(a, PREFILL)``: swap ``a`` with
        the last decode row ``b`` -> ``[b, a, c, d]``, then the decode group ends before ``a``:
        ``DECODE [b] | PREFILL [a, c, d]``.
        """
        current = self.group_of(request_id)
        while current < group:  # cross the end of `current`
            self._swap_rows(self._row_of[request_id], self._group_ends[current] - 1)
            self._group_ends[current] -= 1
            current = RowGroup(current + 1)
        while current > group:  # cross the start of `current`
            self._swap_rows(self._row_of[request_id], self._group_ends[current - 1])
            self._group_ends[current - 1] += 1
            current = RowGroup(current - 1)

    def _move_device_rows(self, sources: np.ndarray, targets: np.ndarray) -> None:
        """Device row ``targets[i]`` of every row buffer takes what row ``sources[i]`` holds
        (``[m]`` int64 each; a source may be another move's target: every source is read first).
        One row: plain row copies. More: one staged index copy, then a gather and a scatter per
        buffer, whatever ``m`` is."""
        buffers = (self._device_fields.T, self._device_block_ids, *self._device_rows.values())
        if targets.shape[0] == 1:
            for rows in buffers:
                rows[int(targets[0])].copy_(rows[int(sources[0])])  # stream-ordered, no host sync
            return
        if targets.shape[0] == 0:
            return
        staging = self._staging()
        staging.wait_until_host_writable()
        count = targets.shape[0]
        staging.host_arrays["move_sources"][:count] = sources
        staging.host_arrays["move_targets"][:count] = targets
        staging.copy_to_device()
        source_rows, target_rows = staging.device["move_sources"][:count], staging.device["move_targets"][:count]
        self._device_fields.index_copy_(1, target_rows, self._device_fields.index_select(1, source_rows))
        for rows in buffers[1:]:
            rows.index_copy_(0, target_rows, rows.index_select(0, source_rows))

    def _staging(self) -> StagingBuffers:
        """The host-to-device staging of batched row writes (inserted rows, move indices)."""
        if self._row_staging is None:
            rows = self.shape.max_requests + 1
            sections = {"insert_rows": ((rows,), torch.int64), "insert_fields": ((len(DEVICE_FIELDS), rows), torch.int64),
                        "move_sources": ((rows,), torch.int64), "move_targets": ((rows,), torch.int64)}
            sections.update({name: ((rows,), self._device_rows[name].dtype) for name in self._set_on_insert})
            # a few host buffers: a call's copy may wait behind the step in flight; the buffer it
            # read is written again only calls later (joins, leaves, and moves of many rows)
            self._row_staging = StagingBuffers(sections, self._device_fields.device, num_host_buffers=4)
        return self._row_staging

    def _swap_rows(self, row_a: int, row_b: int) -> None:
        if row_a == row_b:
            return
        self.num_moves += 1
        pair, swapped = [row_a, row_b], [row_b, row_a]
        for rows in self._host_rows.values():
            rows[pair] = rows[swapped]
        for rows in (self._device_fields.T, self._device_block_ids, *self._device_rows.values()):
            # through the scratch row: plain row copies, stream-ordered, no index tensors to upload
            rows[self._scratch_row].copy_(rows[row_a])
            rows[row_a].copy_(rows[row_b])
            rows[row_b].copy_(rows[self._scratch_row])
        for row in pair:
            request_id = int(self.host.request_ids[row])
            if request_id in self._row_of:
                self._row_of[request_id] = row

    # ----- host values -------------------------------------------------------------------

    def _fresh_value(self, name: str) -> int:
        """A row's value of device field ``name`` before its request writes any KV."""
        if name in ("last_kv_block_id", "mamba_slot_ids"):
            return -1
        if name == "last_kv_block_offset":
            return self.shape.block_size_tokens - 1  # (0 - 1) mod block size: "the next row opens a block"
        return 0

    def set_prefill_status(self, row: int, value: int) -> None:
        """Write one row's prefill status on both sides (a request that finished its prompt)."""
        self.write_inserted_rows()  # a pending insert's reset must not overwrite this write
        self.host.prefill_status[row] = value
        self._device_fields[_PREFILL_FIELD, row].fill_(value)

    def mismatched_rows(self) -> List[str]:
        """Names of the facts on which the device disagrees with what the host knows, over the
        live rows: the held block ids, and (for rows whose length the host knows exactly,
        i.e. when no step is in flight) the KV lengths. Reads the device: for tests only."""
        rows = self.num_live
        names = []
        if not np.array_equal(self.host.block_ids[:rows], self._device_block_ids[:rows].cpu().numpy()):  # host-ok: check
            names.append("kv_block_ids")
        if not np.array_equal(self.host.known_lengths[:rows], self.device.kv_length_offsets[:rows].cpu().numpy()):  # host-ok
            names.append("kv_length_offsets")
        return names
