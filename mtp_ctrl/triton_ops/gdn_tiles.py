"""Launch shapes of the Gated DeltaNet verify kernel (:mod:`mtp_ctrl.triton_ops.gdn_replay`),
chosen on the host from the launch's dimensions.

A program holds a ``[K, BLOCK_V]`` fp32 tile of one head's state in registers
through its rows, so ``BLOCK_V`` sets how many programs share a head (``V / BLOCK_V``) and, with
``num_warps``, how many state floats a thread holds (``K BLOCK_V / (32 num_warps)``) and whether
the per-row reductions over K stay inside a warp. The choice reads only Python ints the launcher
has (requests in the launch, rows per request), so it costs no host sync and a captured CUDA graph
keeps the tiles of the shape it was captured at.

``bench/bench_gdn.py --tune`` times the candidates (figures: ``bench/RESULTS.md``, "GDN hybrids");
the table holds one shape (see :data:`DEFAULT_TILES`); a launch outside every bound takes
:data:`DEFAULT_TILES`. When a program loads its rows' inputs (:class:`GDNRowSchedule`) may differ
per R (:data:`ROW_SCHEDULE_TABLE`, ``--tune --schedules``): it changes no bits.
"""

import dataclasses
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class GDNRowSchedule:
    """When a verify program loads its rows' inputs, and its register cap. None of it changes the
    arithmetic (outputs and states stay bit for bit those of every other schedule): it trades the
    loads' latency hidden against registers, so occupancy, at large R.

    ``own_early`` of the step's own rows (None: all) and ``pending_early`` of the slot's pending rows
    (None: all) load before the state, as one batch of loads; every other row loads ``ahead`` rows
    before its step, counting through the pending rows then the own rows (0: just before it).
    ``q_at_row``: an own row's q (needed only for its output) loads just before its step instead.
    ``max_registers``: ptxas ``.maxnreg`` (0: the compiler's choice; 255 at R = 5 gives four 2-warp
    programs an SM)."""

    own_early: Optional[int] = None
    pending_early: Optional[int] = None
    ahead: int = 1
    q_at_row: bool = False
    max_registers: int = 0

    def __post_init__(self):
        for name in ("own_early", "pending_early", "ahead", "max_registers"):
            value = getattr(self, name)
            if value is None and name.endswith("_early"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"GDNRowSchedule.{name} must be an int >= 0, got {value!r}")
        if self.max_registers and not 24 <= self.max_registers <= 255:
            raise ValueError(f"GDNRowSchedule.max_registers must be 0 or in [24, 255], got {self.max_registers!r}")
        if not isinstance(self.q_at_row, bool):
            raise ValueError(f"GDNRowSchedule.q_at_row must be a bool, got {self.q_at_row!r}")

    def label(self) -> str:
        """``own/pending/ahead/q/maxreg`` (``all``: every row early; q: 1 = at its row), as
        ``bench_gdn.py --schedules`` and ``gdn_kernel_registers.py --schedules`` take it."""
        def rows(value):
            return "all" if value is None else str(value)
        return (f"{rows(self.own_early)}/{rows(self.pending_early)}/{self.ahead}/{int(self.q_at_row)}/"
                f"{self.max_registers}")

    def constants(self, rows: int, stored_rows: int) -> dict:
        """The kernel's constexprs at R = ``rows`` after up to ``stored_rows`` pending rows."""
        own = rows if self.own_early is None else min(self.own_early, rows)
        stored = stored_rows if self.pending_early is None else min(self.pending_early, stored_rows)
        return dict(OWN_EARLY=own, PENDING_EARLY=stored, AHEAD=self.ahead, Q_AT_ROW=self.q_at_row)


# Every row's inputs before the state (the third session's choice: at S = 2 it beat loading rows later).
PRELOAD_ALL = GDNRowSchedule()

# The pending rows before the state, each own row's (k, v, g, beta) one row ahead of its step and its
# q at its step, under a cap of 168 registers (six 2-warp programs an SM instead of four). gdn6 kept it
# for R = 5 before the stored deltas; since them it is slower than PRELOAD_ALL at every R (gdn7).
LATE_OWN_ROWS = GDNRowSchedule(own_early=0, q_at_row=True, max_registers=168)


@dataclasses.dataclass(frozen=True)
class GDNTiles:
    """One launch configuration: ``block_v`` value dims a program (a power of two, capped at the
    next power of two of V) and ``num_warps``; ``schedule`` (None: :func:`gdn_row_schedule` of R)
    when the rows' inputs load."""

    block_v: int
    num_warps: int
    schedule: Optional[GDNRowSchedule] = None

    def __post_init__(self):
        for name in ("block_v", "num_warps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"GDNTiles.{name} must be a power of two >= 1, got {value!r}")
        if self.schedule is not None and not isinstance(self.schedule, GDNRowSchedule):
            raise TypeError(f"GDNTiles.schedule must be GDNRowSchedule or None, got {type(self.schedule).__name__}")


# One shape for every launch, on purpose. The reductions over K run in an order set by the launch
# shape, so a verify row, the same row applied as a pending row in the next step, and an S = 0 row
# agree bit for bit only when they share it, and plain and speculative decoding must commit the
# same state. (32, 2) was the fastest or within 3 % of it at every batch for R = 1 verify and for
# the separate replay kernel of the third session, and the fastest for R = 3 verify at batch >= 32;
# R = 5 verify gave up <= 9 % (H100 tune, RESULTS "GDN hybrids"; before the deferred commit).
# With the deferred commit (H100, graph-timed `bench_gdn.py --tune` of a variant of this kernel with
# one reduction over K a row, fifth session; RESULTS "GDN hybrids") (32, 2) stayed the one shape:
# fastest or within 1 % at S = 0 (90 / 97 % of the copy at batch 32 / 128); the one-warp (16, 1)
# (no cross-warp sums) was faster at S = 2 (73 / 81 % against 69 / 76 %) and S = 4 (53 / 58 %
# against 52 / 57 %) but lost at S = 0 (74 / 76 %), plain decoding's step.
DEFAULT_TILES = GDNTiles(block_v=32, num_warps=2)

# The shapes `bench_gdn.py --tune` times and `tests/functional/test_gdn_gpu.py` checks bit for bit
# (S = 4 verify steps == R = 1 steps under each), so DEFAULT_TILES can move to any of them on figures.
CANDIDATE_TILES = tuple(GDNTiles(*shape) for shape in ((32, 2), (16, 2), (32, 4), (16, 4), (16, 1), (8, 1)))

# (requests at most, rows per request at most) -> tiles; None: no bound. The first entry whose
# bounds hold the launch's dims wins.
TileTable = Tuple[Tuple[Tuple[Optional[int], Optional[int]], GDNTiles], ...]

VERIFY_TILE_TABLE: TileTable = (
    ((None, None), DEFAULT_TILES),
)


def _lookup(table: TileTable, num_requests: int, rows_per_request: int) -> GDNTiles:
    for (max_requests, max_rows), tiles in table:
        if ((max_requests is None or num_requests <= max_requests)
                and (max_rows is None or rows_per_request <= max_rows)):
            return tiles
    return DEFAULT_TILES


def gdn_verify_tiles(num_requests: int, rows_per_request: int) -> GDNTiles:
    """The verify kernel's tiles for ``num_requests`` decode requests of ``rows_per_request`` (1 + S) rows."""
    return _lookup(VERIFY_TILE_TABLE, num_requests, rows_per_request)


# The row schedules `bench_gdn.py --tune --schedules candidates` times under DEFAULT_TILES and
# `tests/functional/test_gdn_gpu.py` checks bit for bit (S = 3 and 4 steps == R = 1 steps under each).
# With the stored deltas (gdn7) a pending row holds k, u, g only. Registers / spill bytes at R = 5
# after 5 pending rows (ptxas 13.4 for sm_90a, `gdn_kernel_registers.py`): 255 / 0, 168 / 0, 167 / 0,
# 144 / 64, 209 / 0 (main before gdn7: 255 / 0 preloading all, 168 / 56 for LATE_OWN_ROWS).
CANDIDATE_SCHEDULES = (
    PRELOAD_ALL,
    LATE_OWN_ROWS,
    GDNRowSchedule(own_early=0, pending_early=0, q_at_row=True, max_registers=168),
    GDNRowSchedule(own_early=0, ahead=0, q_at_row=True, max_registers=144),
    GDNRowSchedule(own_early=0, q_at_row=True),
)

# rows per request at most -> the schedule (None: no bound); the first entry that holds R wins.
# H100, graph-timed, main's kernel (before the stored deltas) in the same process (`run_gdn_gpu.sh
# delta`, P = R stored rows, every candidate's two steps torch.equal to main's; RESULTS "GDN hybrids",
# gdn7): PRELOAD_ALL is the fastest at R = 3, 4, 5 (S = 4: 74.7 / 266.5 us at batch 32 / 128, 61 / 69 %
# of the copy; LATE_OWN_ROWS 82.8 / 280.8; the other candidates slower still) and within 1 % of the
# others at R = 1. R > 5 was not timed: PRELOAD_ALL too (255 registers, no spills at R = 7).
ROW_SCHEDULE_TABLE: Tuple[Tuple[Optional[int], GDNRowSchedule], ...] = (
    (None, PRELOAD_ALL),
)


def gdn_row_schedule(rows_per_request: int) -> GDNRowSchedule:
    """When the verify kernel loads the inputs of requests of ``rows_per_request`` (1 + S) rows."""
    for max_rows, schedule in ROW_SCHEDULE_TABLE:
        if max_rows is None or rows_per_request <= max_rows:
            return schedule
    return PRELOAD_ALL
