"""Per-request slots: host bookkeeping (numpy) and the device rows the step kernels read and write.

Letters: R = max_requests, MB = max_blocks_per_request, S = num_speculative_tokens.

A request takes a table *slot* ``s`` in ``[0, R)`` when it is admitted and keeps it until it
leaves; nothing ever moves. Every per-request row, on the host (``HostRows``, :meth:`add_host_rows`)
and on the device (``RequestRows``, :meth:`add_device_rows`), is row ``s`` of an ``[R + 1, ...]``
buffer; row ``R`` is the *scratch slot*, which padding requests of a CUDA-graph batch read and
write. Each step stages the slots of its requests (``StepMetadata.slot_ids``, decode requests
first, padding -> the scratch slot) and the kernels index by them.

The groups are ordered lists of slots, not row ranges::

    DECODE   run 1 + S query rows per step, in this order
    PREFILL  run a chunk of their prompt, in this order (only the step's last chunk may stop mid-prompt)
    PAUSED   keep their blocks, run nothing

Moving a request between groups (:meth:`move`) is a host list operation: no device row moves.

Who owns what (each fact has one owner):

- The device owns a request's KV length and what follows from it: ``kv_length_offsets``,
  ``last_kv_block_offset``, ``kv_block_counts``, ``last_kv_block_id``. Every step grows them by
  its query rows and the fused verify kernel rewinds them past rejected drafts; the host never
  writes them after a request's slot is reset at admission.
- The host owns which KV blocks a request holds (``host.block_ids``, the allocator's view) and
  sends each new block to the device as a ``(slot, column, block id)`` write with the next step.
  A request holds blocks for the longest its KV can get before the host hears back (all drafts
  accepted), so the device never needs a block the host has not given it. Rewound blocks stay
  with the request as that reserve; all of them return to the allocator when it ends.
- The host's ``known_lengths`` is a lagging copy of the device length: exact for prefill and
  paused requests, and for decode requests as of the last step whose read-back it processed.

Free slots and the scratch slot hold no request: on the device they point only at the
context's scratch KV block and scratch Mamba slot (:meth:`set_free_row_targets`,
:meth:`reset_free_rows`; the slots :meth:`remove` frees are reset by the next
:meth:`write_inserted_rows`, stream-ordered after any step in flight and before the next step the
context stages), never at a block or slot another request may hold, so a captured graph replayed
over them (padding, or a stale replay) stays inside the pools.

KV fields of the request in slot ``s`` with ``kv_len = kv_length_offsets[s]`` rows written to its
cache (block size ``bs``): ``kv_block_counts = ceil(kv_len / bs)``, ``last_kv_block_id =
kv_block_ids[s, count - 1]`` (-1 when count == 0), ``last_kv_block_offset = (kv_len - 1) mod bs``.

Joining and leaving cost a fixed number of device launches per call, not per request:
:meth:`insert` and :meth:`remove` write only the host rows, and :meth:`write_inserted_rows` (the
context calls it before it stages a step) resets the device rows of every slot freed or taken since,
from one staged host-to-device copy. A slot freed and taken again in between (a queue's finished
request making room for the next) is written once, as the new request's.
"""

import dataclasses
import enum
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

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


_KV_LENGTH_FIELD = DEVICE_FIELDS.index("kv_length_offsets")
_PREFILL_FIELD = DEVICE_FIELDS.index("prefill_status")
_MAMBA_SLOT_FIELD = DEVICE_FIELDS.index("mamba_slot_ids")


class RowGroup(enum.IntEnum):
    DECODE = 0
    PREFILL = 1
    PAUSED = 2


@dataclasses.dataclass(frozen=True)
class RequestRows:
    """Views of every device row of the table, by slot, the scratch slot ``R`` last."""

    kv_length_offsets: torch.Tensor  # [R + 1] int64
    last_kv_block_offset: torch.Tensor  # [R + 1] int64
    kv_block_counts: torch.Tensor  # [R + 1] int64
    last_kv_block_id: torch.Tensor  # [R + 1] int64
    prefill_status: torch.Tensor  # [R + 1] int64
    mamba_slot_ids: torch.Tensor  # [R + 1] int64
    kv_block_ids: torch.Tensor  # [R + 1, MB] int64, -1 = none


@dataclasses.dataclass(frozen=True)
class HostRows:
    """The host's per-slot numpy arrays (``[R + 1]``: the last row is the scratch slot)."""

    request_ids: np.ndarray  # [R + 1] int64, -1 on free slots
    known_lengths: np.ndarray  # [R + 1] int64, KV rows as far as the host knows (see module docstring)
    block_counts: np.ndarray  # [R + 1] int64, blocks the request holds
    block_ids: np.ndarray  # [R + 1, MB] int64, -1 past block_counts
    prefill_status: np.ndarray  # [R + 1] int64
    mamba_slot_ids: np.ndarray  # [R + 1] int64


class RequestTable:
    """Slots of live requests, in groups decode | prefill | paused.

    Device-only rows the controller writes each step: ``next_tokens`` ``[R]`` int64, the base
    token of the next decode step (the token sampled last), and ``draft_tokens`` ``[R, S]``
    int64, the drafts of the next decode step. Callers register more with
    :meth:`add_device_rows` and host rows with :meth:`add_host_rows`.
    """

    def __init__(self, shape: EngineShape):
        self.shape = shape
        max_requests, max_blocks_per_request, device = shape.max_requests, shape.max_blocks_per_request, shape.device
        self._scratch_row = max_requests  # the scratch slot: padding requests' reads and writes
        rows = max_requests + 1
        self._device_fields = torch.zeros(len(DEVICE_FIELDS), rows, dtype=torch.int64, device=device)  # [F, R + 1]
        self._device_block_ids = torch.full((rows, max_blocks_per_request), -1, dtype=torch.int64, device=device)
        # the values a slot gets at admission: no KV, no blocks (prefill status and Mamba slot set after)
        self._fresh_fields = np.array([self._fresh_value(name) for name in DEVICE_FIELDS], dtype=np.int64)  # [F]
        self._device_rows: Dict[str, torch.Tensor] = {}  # name -> [R + 1, ...] device rows
        self._set_on_insert: List[str] = []  # device rows every insert gives a value (add_device_rows)
        self._kv_start_rows: List[str] = []  # of those, rows whose value is the request's first KV length
        self._cached_prefixes = False  # inserts may start with cached blocks (enable_cached_prefixes)
        self._host_rows: Dict[str, np.ndarray] = {}  # name -> [R + 1, ...] host rows
        # request id -> (prefill status, Mamba slot, values of _set_on_insert, first KV length) not on the device yet
        self._pending_inserts: Dict[int, Tuple[int, int, Mapping[str, float], int]] = {}
        self._pending_resets: Set[int] = set()  # slots freed since the last write_inserted_rows, not taken again
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
        # what free slots hold on the device (set_free_row_targets): fresh fields, the scratch block and slot
        self._free_fields = torch.as_tensor(self._fresh_fields[:, None], device=self._device_fields.device)  # [F, 1]
        self._free_block = -1
        self._groups: Tuple[List[int], List[int], List[int]] = ([], [], [])  # slots of each RowGroup, in order
        self._group_of: Dict[int, RowGroup] = {}  # slot -> its group
        self._slot_of: Dict[int, int] = {}  # request id -> slot
        self._free_slots = list(range(max_requests - 1, -1, -1))  # popped from the end: the lowest slot first

    def set_free_row_targets(self, scratch_block: int, scratch_slot: int) -> None:
        """The scratch KV block and Mamba slot (-1: no Mamba layers) free slots and the scratch slot
        point at; resets every one of them."""
        values = dict(zip(DEVICE_FIELDS, self._fresh_fields.tolist()), last_kv_block_id=scratch_block,  # host-ok: numpy
                      mamba_slot_ids=scratch_slot)
        self._free_fields = torch.tensor([[values[name]] for name in DEVICE_FIELDS], dtype=torch.int64,
                                         device=self._device_fields.device)  # [F, 1] int64: a free slot's fields
        self._free_block = scratch_block
        self.reset_free_rows()

    @property
    def scratch_block(self) -> int:
        """The KV block free slots and the scratch slot point at (-1 until :meth:`set_free_row_targets`)."""
        return self._free_block

    def reset_free_rows(self, slots: Optional[Iterable[int]] = None) -> None:
        """Point the device rows of ``slots`` (default: every free slot and the scratch slot) at
        the scratch block and Mamba slot, with no KV: one staged index copy and two indexed
        writes, stream-ordered, no host sync. A stale replay of a captured graph may have
        written free slots; this restores them."""
        if slots is None:
            slots, self._pending_resets = [*self._free_slots, self._scratch_row], set()
        slots = list(slots)
        if not slots:
            return
        staging = self._staging()
        staging.wait_until_host_writable()
        staging.host_arrays["reset_slots"][: len(slots)] = slots
        staging.copy_to_device()
        self._write_free_targets(staging.device["reset_slots"][: len(slots)])

    def _write_free_targets(self, slots: torch.Tensor) -> None:
        """Point the device rows of ``slots`` (``[k]`` int64, staged on the device) at the free targets."""
        self._device_fields.index_copy_(1, slots, self._free_fields.expand(-1, slots.shape[0]))
        self._device_block_ids.index_fill_(0, slots, self._free_block)

    def enable_cached_prefixes(self) -> None:
        """Let :meth:`insert` take ``cached_block_ids`` (prefix caching): the batched row reset
        then stages each inserted row's block ids (one ``[R + 1, MB]`` section more in its copy)."""
        self._cached_prefixes = True
        self._row_staging = None  # its layout gains a section

    def add_device_rows(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype, fill: float = 0,
                        set_on_insert: bool = False, kv_start: bool = False) -> torch.Tensor:
        """Allocate a device-only ``[R + 1, *shape]`` buffer whose row ``s`` belongs to the request
        in slot ``s`` (callers' per-request state: sampling parameters, a proposer's token
        history, ...; the last row is the scratch slot). Returns the ``[R, *shape]`` view.
        ``set_on_insert`` (scalar rows only): every :meth:`insert` names the row's first value,
        written with the batch of :meth:`write_inserted_rows`; other rows keep what the slot held
        until the caller writes them. ``kv_start`` (implies ``set_on_insert``): the first value is
        the request's first KV length (a cached prefix it attached, :meth:`insert`'s
        ``cached_block_ids``), not a ``row_values`` entry."""
        set_on_insert = set_on_insert or kv_start
        if name in self._device_rows:
            raise ValueError(f"device rows {name!r} already exist")
        if set_on_insert and shape != ():
            raise ValueError(f"set_on_insert needs scalar rows; {name!r} has shape {shape}")
        if set_on_insert and self._pending_inserts:
            raise RuntimeError(f"add_device_rows({name!r}, set_on_insert=True) with inserts not written yet")
        rows = torch.full((self.shape.max_requests + 1, *shape), fill, dtype=dtype, device=self._device_fields.device)
        self._device_rows[name] = rows  # [R + 1, *shape]: the last row is the scratch slot
        if set_on_insert:
            self._set_on_insert.append(name)
            if kv_start:
                self._kv_start_rows.append(name)
            self._row_staging = None  # its layout gains a section
        return rows[: self.shape.max_requests]

    def device_rows_with_scratch(self, name: str) -> torch.Tensor:
        """The whole ``[R + 1, *shape]`` buffer of :meth:`add_device_rows`: row ``scratch_row`` is a
        sink that padding requests of a CUDA-graph batch may write without touching a request."""
        return self._device_rows[name]

    def add_host_rows(self, name: str, shape: Tuple[int, ...], dtype=np.int64, fill=0) -> np.ndarray:
        """Allocate a host ``[R + 1, *shape]`` numpy buffer, row ``s`` for the request in slot ``s``."""
        if name in self._host_rows:
            raise ValueError(f"host rows {name!r} already exist")
        rows = np.full((self.shape.max_requests + 1, *shape), fill, dtype=dtype)
        self._host_rows[name] = rows
        return rows

    @property
    def scratch_row(self) -> int:
        """The scratch slot ``R``."""
        return self._scratch_row

    # ----- where requests are -------------------------------------------------------------

    def slots_in(self, group: RowGroup) -> np.ndarray:
        """``[k]`` int64: the slots of ``group``, in order."""
        return np.array(self._groups[group], dtype=np.int64)

    def group_size(self, group: RowGroup) -> int:
        return len(self._groups[group])

    @property
    def num_live(self) -> int:
        return len(self._slot_of)

    def live_slots(self) -> np.ndarray:
        """``[n]`` int64: every live request's slot (decode, prefill, paused)."""
        return np.array([*self._groups[0], *self._groups[1], *self._groups[2]], dtype=np.int64)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._slot_of

    def slot_of(self, request_id: int) -> int:
        return self._slot_of[request_id]

    def group_of(self, request_id: int) -> RowGroup:
        return self._group_of[self._slot_of[request_id]]

    def request_ids_in(self, group: RowGroup) -> List[int]:
        return self.host.request_ids[self._groups[group]].tolist()  # host-ok: numpy

    # ----- joining, moving, leaving ---------------------------------------------------------

    def insert(self, request_id: int, group: RowGroup, mamba_slot_id: int = -1,
               row_values: Optional[Mapping[str, float]] = None, cached_block_ids: Sequence[int] = ()) -> int:
        """Give a new request with an empty KV cache the lowest free slot, at the end of ``group``;
        return the slot. ``cached_block_ids``: full KV blocks it starts with (a cached prompt
        prefix, already written by others): its KV length starts at ``len(cached_block_ids) *
        block_size_tokens``.

        Writes the host rows only. ``row_values`` gives the first value of every device row
        registered with ``set_on_insert``; the device rows are reset (no KV, no blocks) and set by
        the next :meth:`write_inserted_rows`, which must run before anything reads or writes them
        on the device (the context's ``build_step`` runs it first)."""
        if not self._free_slots:
            raise RuntimeError(f"the request table is full ({self.shape.max_requests} slots)")
        row_values = {} if row_values is None else row_values
        given_rows = [name for name in self._set_on_insert if name not in self._kv_start_rows]
        if sorted(row_values) != sorted(given_rows):
            raise ValueError(f"row_values must name the rows {sorted(given_rows)}, got {sorted(row_values)}")
        cached_block_ids = [int(block_id) for block_id in cached_block_ids]
        if cached_block_ids and not self._cached_prefixes:
            raise ValueError("cached_block_ids needs enable_cached_prefixes() first")
        if len(cached_block_ids) > self.shape.max_blocks_per_request:
            raise ValueError(f"cached_block_ids has {len(cached_block_ids)} blocks, a request holds at most "
                             f"{self.shape.max_blocks_per_request}")
        kv_length = len(cached_block_ids) * self.shape.block_size_tokens
        row_values = {**row_values, **{name: kv_length for name in self._kv_start_rows}}
        slot = self._free_slots.pop()
        self._pending_resets.discard(slot)  # the insert's write resets it
        prefill = 1 if group == RowGroup.PREFILL else 0
        for name, rows in self._host_rows.items():
            rows[slot] = -1 if name in ("request_ids", "block_ids", "mamba_slot_ids") else 0
        host = self.host
        host.request_ids[slot], host.prefill_status[slot], host.mamba_slot_ids[slot] = request_id, prefill, mamba_slot_id
        host.known_lengths[slot], host.block_counts[slot] = kv_length, len(cached_block_ids)
        host.block_ids[slot, : len(cached_block_ids)] = cached_block_ids
        self._pending_inserts[request_id] = (prefill, mamba_slot_id, row_values, kv_length)
        self._slot_of[request_id] = slot
        self._group_of[slot] = group
        self._groups[group].append(slot)
        return slot

    def write_inserted_rows(self) -> None:
        """Write the device rows of every slot taken or freed since the last call: the inserted
        requests' rows and the freed slots' free targets, from one host-to-device copy, then one
        indexed write per row buffer, however many requests joined or left."""
        if not self._pending_inserts:
            if self._pending_resets:
                self.reset_free_rows(sorted(self._pending_resets))
                self._pending_resets.clear()
            return
        staging = self._staging()
        staging.wait_until_host_writable()
        host = staging.host_arrays
        count, resets = len(self._pending_inserts), sorted(self._pending_resets)
        self._pending_resets.clear()
        host["reset_slots"][: len(resets)] = resets
        for index, (request_id, (prefill, mamba_slot_id, values, kv_length)) in enumerate(self._pending_inserts.items()):
            host["insert_rows"][index] = self._slot_of[request_id]
            if self._cached_prefixes:
                host["insert_block_ids"][index] = self.host.block_ids[self._slot_of[request_id]]  # -1 but a cached prefix
            host["insert_fields"][:, index] = self._fresh_fields
            host["insert_fields"][_KV_LENGTH_FIELD, index] = kv_length
            host["insert_fields"][_PREFILL_FIELD, index] = prefill
            host["insert_fields"][_MAMBA_SLOT_FIELD, index] = mamba_slot_id
            for name in self._set_on_insert:
                host[name][index] = values[name]
        self._pending_inserts.clear()
        staging.copy_to_device()
        device = staging.device
        rows = device["insert_rows"][:count]  # [n] int64
        self._device_fields.index_copy_(1, rows, device["insert_fields"][:, :count])
        if self._cached_prefixes:
            self._device_block_ids.index_copy_(0, rows, device["insert_block_ids"][:count])
        else:
            self._device_block_ids.index_fill_(0, rows, -1)
        for name in self._set_on_insert:
            self._device_rows[name].index_copy_(0, rows, device[name][:count])
        if resets:
            self._write_free_targets(device["reset_slots"][: len(resets)])

    def remove(self, request_ids: Iterable[int]) -> None:
        """Free requests' slots (their blocks and Mamba slots must already be released): the host
        rows are cleared now, the device rows reset to the free targets by the next
        :meth:`write_inserted_rows` (with the inserts since, one batch), stream-ordered after any
        step in flight (which may still read and write them). No other slot changes."""
        request_ids = list(request_ids)
        unknown = [request_id for request_id in request_ids if request_id not in self._slot_of]
        if unknown or len(set(request_ids)) != len(request_ids):  # checked before anything changes
            raise ValueError(f"request_ids must be distinct live requests; unknown: {unknown}, given: {request_ids}")
        freed = []
        for request_id in request_ids:
            self._pending_inserts.pop(request_id, None)
            slot = self._slot_of.pop(request_id)
            self._groups[self._group_of.pop(slot)].remove(slot)
            self.host.request_ids[slot] = -1
            self.host.block_counts[slot] = 0
            self.host.block_ids[slot] = -1
            self.host.mamba_slot_ids[slot] = -1
            freed.append(slot)
        self._free_slots = sorted(self._free_slots + freed, reverse=True)  # the lowest slot is taken first
        self._pending_resets.update(freed)

    def move(self, request_id: int, group: RowGroup) -> None:
        """Move a request to the end of ``group`` (host bookkeeping only: its slot stays)."""
        slot = self._slot_of[request_id]
        self._groups[self._group_of[slot]].remove(slot)
        self._groups[group].append(slot)
        self._group_of[slot] = group

    def _staging(self) -> StagingBuffers:
        """The host-to-device staging of batched row writes (inserted slots, reset slots)."""
        if self._row_staging is None:
            rows = self.shape.max_requests + 1
            sections = {"insert_rows": ((rows,), torch.int64), "insert_fields": ((len(DEVICE_FIELDS), rows), torch.int64),
                        "reset_slots": ((rows,), torch.int64)}
            sections.update({name: ((rows,), self._device_rows[name].dtype) for name in self._set_on_insert})
            if self._cached_prefixes:
                sections["insert_block_ids"] = ((rows, self.shape.max_blocks_per_request), torch.int64)
            # a few host buffers: a call's copy may wait behind the step in flight; the buffer it
            # read is written again only calls later (joins and leaves)
            self._row_staging = StagingBuffers(sections, self._device_fields.device, num_host_buffers=4)
        return self._row_staging

    # ----- host values -------------------------------------------------------------------

    def _fresh_value(self, name: str) -> int:
        """A slot's value of device field ``name`` before its request writes any KV."""
        if name in ("last_kv_block_id", "mamba_slot_ids"):
            return -1
        if name == "last_kv_block_offset":
            return self.shape.block_size_tokens - 1  # (0 - 1) mod block size: "the next row opens a block"
        return 0

    def set_prefill_status(self, slot: int, value: int) -> None:
        """Write one slot's prefill status on both sides (a request that finished its prompt)."""
        self.write_inserted_rows()  # a pending insert's reset must not overwrite this write
        self.host.prefill_status[slot] = value
        self._device_fields[_PREFILL_FIELD, slot].fill_(value)

    def mismatched_rows(self) -> List[str]:
        """Names of the facts on which the device disagrees with what the host knows, over the
        live slots: the held block ids, and (for slots whose length the host knows exactly,
        i.e. when no step is in flight) the KV lengths. Reads the device: for tests only."""
        slots = torch.from_numpy(self.live_slots())
        names = []
        device_block_ids = self._device_block_ids.cpu()[slots].numpy()  # host-ok: check
        if not np.array_equal(self.host.block_ids[slots.numpy()], device_block_ids):
            names.append("kv_block_ids")
        device_lengths = self.device.kv_length_offsets.cpu()[slots].numpy()  # host-ok: check
        if not np.array_equal(self.host.known_lengths[slots.numpy()], device_lengths):
            names.append("kv_length_offsets")
        return names
