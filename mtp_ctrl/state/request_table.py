"""Per-request rows: the KV bookkeeping the step kernels consume, on host and device.

Letters: R = max_requests, MB = max_blocks_per_request, S = num_speculative_tokens.

Rows are grouped, in this order: decode requests, prefill requests, paused requests, free rows::

    rows  [0, num_decode)                      DECODE   run 1 + S query rows per step
          [num_decode, + num_prefill)          PREFILL  run a chunk of their prompt
          [.., + num_paused)                   PAUSED   keep their blocks, run nothing
          [num_live, R)                        free

so a step over ``n`` requests reads plain prefixes (``table.device.kv_length_offsets[:n]``), and
a CUDA-graph batch padded to ``B`` reads rows ``[0, B)`` with ``num_active_requests = n``.

The host rows are the source of truth. The device rows are refreshed by the one host-to-device
copy of each step (:class:`~mtp_ctrl.state.staging.StagingBuffers`); between that copy and
the context's ``commit_step`` the step kernels advance the device rows and ``commit_step``
applies the same change on the host. Moving a request between groups swaps rows on both sides
by row copies (no host sync), together with the device-only token rows.

KV fields of request ``r`` with ``kv_len = kv_length_offsets[r]`` rows written to its cache,
counting this step's rows from ``build_step`` until the rewind (block size ``bs``):

    kv_block_counts[r]       = ceil(kv_len / bs)
    kv_block_ids[r, :count]  = its blocks in position order; -1 past them
    last_kv_block_id[r]      = kv_block_ids[r, count - 1]            (-1 when count == 0)
    last_kv_block_offset[r]  = (kv_len - 1) mod bs, the offset of the last written row in
                               its block (bs - 1 when kv_len == 0: "the next row opens a block")

Example, ``bs = 4``, ``S = 3``: a request with 5 committed tokens in blocks ``[7, 2]`` runs a
decode step. ``build_step`` adds its 1 + S = 4 rows (positions 5..8), so ``kv_len = 9``, blocks
``[7, 2, 9]``, ``last_kv_block_id = 9``, ``last_kv_block_offset = 0``. One draft is accepted:
``rewind_kv_cache`` rewinds ``S - 1 = 2`` rows, ``0 - 2 < 0`` crosses back into block 2, so
``kv_len = 7``, ``last_kv_block_offset = 2``, blocks ``[7, 2]``, ``last_kv_block_id = 2``, and
block 9 goes back to the allocator.
"""

import dataclasses
import enum
from typing import Dict, List, Optional, Tuple

import torch

from mtp_ctrl.state.staging import SectionSpec, StagingBuffers

# Int fields packed as the rows of one [len(ROW_FIELDS), R + 1] int64 section.
ROW_FIELDS = (
    "request_ids",  # the caller's request id; -1 on free rows
    "kv_length_offsets",  # KV rows written (see the module docstring)
    "last_kv_block_offset",
    "kv_block_counts",
    "last_kv_block_id",
    "prefill_status",  # 1 = prefill (no rewind), 0 = decode
    "mamba_slot_ids",  # Mamba state slot of the request; -1 without Mamba layers
)


class RowGroup(enum.IntEnum):
    DECODE = 0
    PREFILL = 1
    PAUSED = 2
    FREE = 3


@dataclasses.dataclass(frozen=True)
class RequestRows:
    """Views of every row of the table on one side (host or device); index with ``[:n]``."""

    request_ids: torch.Tensor  # [R] int64
    kv_length_offsets: torch.Tensor  # [R] int64
    last_kv_block_offset: torch.Tensor  # [R] int64
    kv_block_counts: torch.Tensor  # [R] int64
    last_kv_block_id: torch.Tensor  # [R] int64
    prefill_status: torch.Tensor  # [R] int64
    mamba_slot_ids: torch.Tensor  # [R] int64
    kv_block_ids: torch.Tensor  # [R, MB] int64, -1 = none


class RequestTable:
    """Rows of live requests, grouped decode | prefill | paused, mirrored host -> device.

    Device-only rows the controller writes each step (they move with their request):
    ``next_tokens`` ``[R]`` int64, the base token of the next decode step (the token sampled
    last), and ``draft_tokens`` ``[R, S]`` int64, the drafts of the next decode step. Callers
    register more with :meth:`add_device_rows`.

    ``staging``: buffers holding :meth:`sections` (a context shares one with its step buffers,
    so one copy moves both); None allocates the table's own on ``device``.
    """

    def __init__(
        self,
        max_requests: int,
        max_blocks_per_request: int,
        num_speculative_tokens: int,
        block_size_tokens: int,
        device: torch.device,
        staging: Optional[StagingBuffers] = None,
    ):
        self.max_requests = max_requests
        self.max_blocks_per_request = max_blocks_per_request
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size_tokens = block_size_tokens
        if staging is None:
            staging = StagingBuffers(self.sections(max_requests, max_blocks_per_request), device)
        self.staging = staging
        self._scratch_row = max_requests  # one spare row for swaps
        self._host_fields = staging.host["row_fields"]  # [F, R + 1] int64
        self._device_fields = staging.device["row_fields"]  # [F, R + 1] int64
        self._host_block_ids = staging.host["kv_block_ids"]  # [R + 1, MB] int64
        self._device_block_ids = staging.device["kv_block_ids"]  # [R + 1, MB] int64
        self._device_rows: Dict[str, torch.Tensor] = {}  # name -> [R + 1, ...] device-only rows
        self.next_tokens = self.add_device_rows("next_tokens", (), torch.int64)  # [R] int64
        self.draft_tokens = self.add_device_rows("draft_tokens", (num_speculative_tokens,), torch.int64)  # [R, S] int64
        self.host = self._rows(self._host_fields, self._host_block_ids)
        self.device = self._rows(self._device_fields, self._device_block_ids)
        for rows in (self._host_fields, self._device_fields):
            for index, name in enumerate(ROW_FIELDS):
                rows[index].fill_(self._free_row_value(name))
        self._host_block_ids.fill_(-1)
        self._device_block_ids.fill_(-1)
        self._group_ends = [0, 0, 0, max_requests]  # exclusive end row of each RowGroup
        self._row_of: Dict[int, int] = {}

    @staticmethod
    def sections(max_requests: int, max_blocks_per_request: int) -> Dict[str, SectionSpec]:
        """The staging sections the table lives in (a context adds its own step sections)."""
        return {
            "row_fields": ((len(ROW_FIELDS), max_requests + 1), torch.int64),
            "kv_block_ids": ((max_requests + 1, max_blocks_per_request), torch.int64),
        }

    def add_device_rows(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype, fill: float = 0) -> torch.Tensor:
        """Allocate a device-only ``[R, *shape]`` buffer whose row ``r`` belongs to the request at
        table row ``r`` and moves with it (callers' per-request state: sampling parameters, a
        proposer's token history, ...). Returns the ``[R, *shape]`` view."""
        if name in self._device_rows:
            raise ValueError(f"device rows {name!r} already exist")
        rows = torch.full((self.max_requests + 1, *shape), fill, dtype=dtype, device=self._device_fields.device)
        self._device_rows[name] = rows  # [R + 1, *shape]: the last row is the swap scratch row
        return rows[: self.max_requests]

    def device_rows_with_scratch(self, name: str) -> torch.Tensor:
        """The whole ``[R + 1, *shape]`` buffer of :meth:`add_device_rows`: row ``scratch_row`` is a
        sink that padding requests of a CUDA-graph batch may write without touching a request."""
        return self._device_rows[name]

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
        return self.host.request_ids[start:end].tolist()  # host-ok: host rows

    # ----- moving requests ----------------------------------------------------------------

    def insert(self, request_id: int, group: RowGroup, mamba_slot_id: int = -1) -> int:
        """Put a new request with an empty KV cache at the end of ``group``; return its row.

        Only the host row is written; the device row follows with the next step's copy.
        """
        if self.num_live == self.max_requests:
            raise RuntimeError(f"the request table is full ({self.max_requests} rows)")
        row = self.num_live  # first free row
        self._set_host_field("request_ids", row, request_id)
        self._set_host_field("prefill_status", row, 1 if group == RowGroup.PREFILL else 0)
        self._set_host_field("mamba_slot_ids", row, mamba_slot_id)
        self._row_of[request_id] = row
        self.move(request_id, group)
        return self._row_of[request_id]

    def remove(self, request_id: int) -> None:
        """Drop a request's row (its blocks and slot must already be released)."""
        self.move(request_id, RowGroup.FREE)
        row = self._row_of.pop(request_id)
        for name in ROW_FIELDS:
            self._set_host_field(name, row, self._free_row_value(name))
        self._host_block_ids[row].fill_(-1)

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

    def _swap_rows(self, row_a: int, row_b: int) -> None:
        if row_a == row_b:
            return
        self._copy_row(row_a, self._scratch_row)
        self._copy_row(row_b, row_a)
        self._copy_row(self._scratch_row, row_b)
        id_a, id_b = int(self._host_fields[0, row_a]), int(self._host_fields[0, row_b])
        for request_id, row in ((id_a, row_a), (id_b, row_b)):
            if request_id in self._row_of:
                self._row_of[request_id] = row

    def _copy_row(self, src: int, dst: int) -> None:
        for fields, block_ids in ((self._host_fields, self._host_block_ids), (self._device_fields, self._device_block_ids)):
            fields[:, dst].copy_(fields[:, src])
            block_ids[dst].copy_(block_ids[src])
        for rows in self._device_rows.values():
            rows[dst].copy_(rows[src])

    # ----- host values -------------------------------------------------------------------

    def _free_row_value(self, name: str) -> int:
        """A free row's value of field ``name``: no request, no blocks, no slot."""
        if name in ("request_ids", "last_kv_block_id", "mamba_slot_ids"):
            return -1
        if name == "last_kv_block_offset":
            return self.block_size_tokens - 1  # (0 - 1) mod block size
        return 0

    def _set_host_field(self, name: str, row: int, value: int) -> None:
        self._host_fields[ROW_FIELDS.index(name), row] = value

    def set_prefill_status(self, row: int, value: int) -> None:
        """Write one row's prefill status on both sides (a request that finished its prompt)."""
        index = ROW_FIELDS.index("prefill_status")
        self._host_fields[index, row] = value
        self._device_fields[index, row].fill_(value)

    def mismatched_fields(self, rows: Optional[int] = None) -> List[str]:
        """Names of the fields whose first ``rows`` rows (default: every live row) differ
        between host and device. Reads the device: a test / debugging check, not for the step.
        """
        rows = self.num_live if rows is None else rows
        names = [
            name
            for index, name in enumerate(ROW_FIELDS)
            if not torch.equal(self._host_fields[index, :rows], self._device_fields[index, :rows].cpu())  # host-ok: check
        ]
        if not torch.equal(self._host_block_ids[:rows], self._device_block_ids[:rows].cpu()):  # host-ok: check
            names.append("kv_block_ids")
        return names

    def _rows(self, fields: torch.Tensor, block_ids: torch.Tensor) -> RequestRows:
        count = self.max_requests
        views = {name: fields[index, :count] for index, name in enumerate(ROW_FIELDS)}
        return RequestRows(kv_block_ids=block_ids[:count], **views)
