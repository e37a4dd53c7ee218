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
:data:`DEFAULT_TILES`.
"""

import dataclasses
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class GDNTiles:
    """One launch configuration: ``block_v`` value dims a program (a power of two, capped at the
    next power of two of V) and ``num_warps``."""

    block_v: int
    num_warps: int

    def __post_init__(self):
        for name in ("block_v", "num_warps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"GDNTiles.{name} must be a power of two >= 1, got {value!r}")


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
