"""Tile shapes of the paged MLA attention kernel (:mod:`mtp_ctrl.triton_ops.mla_attention`),
chosen on the host from the step's dimensions.

The choice reads only Python ints the launcher already has (the local head count, the launch's
request count ``block_table.shape[0]``, the context bound ``max_seq_len`` and the rows bound
``max_query_len``), so it costs no host sync and a captured CUDA graph keeps the tiles of the
shape it was captured at.

The table's entries are the fastest tiles of ``bench/bench_mla.py --tune`` (an H200) and
``--pick`` (an H100) (figures: ``bench/RESULTS.md``, "MLA"). Where the bucket of a step falls
between the measured shapes the neighbouring entry applies; a step outside every bound takes
:data:`DEFAULT_TILES`.
"""

import dataclasses
from typing import Optional, Tuple


# the Gluon kernel's schedules (MLATiles.schedule)
GLUON_SCHEDULES = ("serial", "async", "warp_specialized")


@dataclasses.dataclass(frozen=True)
class MLATiles:
    """One launch configuration of the paged MLA kernel.

    ``block_m`` is the matrix rows a program holds (query rows x heads, heads first: 64 at
    128 heads means two head tiles, so each cached byte is read twice, not once per 32 heads); its
    fp32 accumulator is ``[block_m, C]`` in registers, so ``C = 512`` wants 8 warps from 64 rows.
    Split-K cuts each request's context so that about ``programs_per_sm`` programs run per SM,
    each over at least ``min_split_tokens`` tokens (a split's partial costs ``H x C x 4`` bytes of
    writes and reads in the combine, against ``tokens x (C + R) x 2`` bytes of cache).
    ``whole_waves``: the split count (at most the rounded-up one) whose programs fill their waves
    of ``programs_per_sm`` an SM best, instead of leaving a short last wave (a tail at a fraction
    of the bandwidth); :func:`kv_split_count` says how.
    ``max_registers``: a cap that lets more programs share an SM (128 at 8 warps: two), at the
    price of spills where the kernel wants more.
    ``wgmma``: the Hopper Gluon kernel (:mod:`mtp_ctrl.triton_ops.mla_wgmma`: 64 rows, 64 tokens,
    8 warps, the cache a tile ahead, one program an SM) instead of the Triton kernel; where it
    cannot run (no Gluon, not an sm_90 device, not bf16 / C = 512 / R = 64) the launcher takes
    the table's Triton entry for the shape (``mla_tiles(..., gluon=False)``).
    ``schedule``: the Gluon kernel's schedule (``wgmma`` only; :data:`GLUON_SCHEDULES`):
    ``"serial"`` waits for each dot where it is issued; ``"async"`` keeps the score dots in flight
    while the next tile's copies are issued and the value dots while they are waited for;
    ``"warp_specialized"`` runs :mod:`mtp_ctrl.triton_ops.mla_wgmma_ws` (one warpgroup scores
    and softmaxes a tile while the other multiplies the last one's probabilities into its value
    dims and issues the copies; the serial schedule where it cannot be imported).
    """

    block_m: int  # target matrix rows (query rows x heads) a program; a power of two >= 16
    block_n: int  # cached tokens a loop iteration; a power of two >= 16
    num_warps: int
    num_stages: int  # software-pipeline stages of the cache loads
    programs_per_sm: int  # split-K target
    min_split_tokens: int  # split-K floor, tokens a split
    whole_waves: bool = False  # split count that fills its waves best (else rounded up)
    max_registers: int = 0  # registers a thread at most (ptxas .maxnreg; 0: the compiler's choice)
    wgmma: bool = False  # the Gluon kernel (mla_wgmma) instead of the Triton one
    schedule: str = "serial"  # the Gluon kernel's schedule (GLUON_SCHEDULES)

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"MLATiles.{name} must be a power of two >= 16, got {value!r}")
        for name in ("num_warps", "num_stages", "programs_per_sm", "min_split_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MLATiles.{name} must be a positive int, got {value!r}")
        if not isinstance(self.max_registers, int) or self.max_registers and not 24 <= self.max_registers <= 255:
            raise ValueError(f"MLATiles.max_registers must be 0 or in [24, 255], got {self.max_registers!r}")
        for name in ("whole_waves", "wgmma"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"MLATiles.{name} must be a bool, got {getattr(self, name)!r}")
        if self.wgmma and (self.block_m, self.block_n, self.num_warps, self.programs_per_sm) != (64, 64, 8, 1):
            raise ValueError(f"MLATiles with wgmma=True are the Gluon kernel's fixed tiles: block_m = block_n = 64, "
                             f"num_warps = 8, programs_per_sm = 1; got {self}")
        if self.schedule not in GLUON_SCHEDULES:
            raise ValueError(f"MLATiles.schedule must be one of {GLUON_SCHEDULES}, got {self.schedule!r}")
        if self.schedule != "serial" and not self.wgmma:
            raise ValueError(f"MLATiles.schedule {self.schedule!r} is a schedule of the Gluon kernel: it needs "
                             f"wgmma=True; got {self}")


DEFAULT_TILES = MLATiles(block_m=32, block_n=64, num_warps=8, num_stages=2, programs_per_sm=2, min_split_tokens=64)
# verify rows at <= 16 heads (1 + S <= 4 rows x 16 heads in one 64-row tile: the cache read once), one
# program an SM (255 registers a thread), whole waves: an H100 --pick at batch 32 / 8k, 3 rows (RESULTS)
VERIFY_TILES_16_HEADS = MLATiles(64, 64, 8, 2, programs_per_sm=1, min_split_tokens=128, whole_waves=True)
# > 32 heads (TP 1 / 2) in Triton: 64-head tiles, the cache read once per 64 heads (twice at 128)
TRITON_TILES_64_ROWS = MLATiles(64, 64, 8, 2, programs_per_sm=2, min_split_tokens=128)
# the Gluon kernel (64 rows: 64 heads of one decode row, or 1 + S <= 4 verify rows x 16 heads): 224
# KiB of shared memory, one program an SM, whole waves; where it cannot run, the launcher takes the
# bucket's next (Triton) entry
WGMMA_TILES = MLATiles(64, 64, 8, 2, programs_per_sm=1, min_split_tokens=128, whole_waves=True, wgmma=True)
# the same tiles in the Gluon kernel's other schedules: async (H100: 1.04-1.07x the serial one at 128
# heads, 1.00-1.02x at 64; not in the table) and warp-specialized (mla_wgmma_ws: 1.27-1.37x at 128
# heads, 1.04-1.06x at 64 heads, batch 32 / 128 x 8k / 32k; 16-head verify rows 1.02-1.04x)
WGMMA_ASYNC_TILES = dataclasses.replace(WGMMA_TILES, schedule="async")
WGMMA_WS_TILES = dataclasses.replace(WGMMA_TILES, schedule="warp_specialized")

# (heads at most, requests at most, context tokens at most, query rows a request at most) -> tiles;
# None: no bound. The first entry whose bounds hold the step's dims wins; a Gluon entry (wgmma) is
# followed by the Triton entry of its bucket (the fallback where the Gluon kernel cannot run). From
# six runs (RESULTS "MLA"): the 16-head batch-32 / 8k decode entry and the 16-head verify entries
# from H100 --pick runs (2026-11-26, fourth session: mla3, mla4), the Gluon entries from an H200's
# --wgmma run (fifth session: mla5) and the warp-specialized schedule's from an H100's (mla6, mla7), the
# rest from an H200's --tune at batch 1 / 32 / 128 x context 2k-128k, 16 and 128 heads.
TILE_TABLE: Tuple[Tuple[Tuple[Optional[int], Optional[int], Optional[int], Optional[int]], MLATiles], ...] = (
    # <= 16 heads (DeepSeek-V3 at TP 8), decode rows: batch 1 (up to 128 splits) and batch 128 take
    # the default; batch 5-64 the default at 2k, at 8k 32-token tiles, two programs an SM (128
    # registers a thread), whole waves (H100: 80 % of the copy, the default 64 %), 8 programs an
    # SM from 32k
    ((16, 4, None, 1), DEFAULT_TILES),
    ((16, 64, 4096, 1), DEFAULT_TILES),
    ((16, 64, 16384, 1), MLATiles(32, 32, 8, 2, programs_per_sm=2, min_split_tokens=64, whole_waves=True,
                                  max_registers=128)),
    ((16, 64, None, 1), MLATiles(32, 64, 8, 2, programs_per_sm=8, min_split_tokens=32)),
    ((16, None, None, 1), DEFAULT_TILES),
    # verify rows (1 + S <= 4 a request): one 64-row tile holds them all, so the cache is read once
    # (the default's 32-row tiles read it twice): on an H100 1.7-2.1x as fast as the default at batch
    # 32 / 128, 1.1-1.3x at batch 1 from 8k; batch 1-4 to 4k keeps the default (2k: 20 us against 26).
    # The Gluon kernel's 64-row tile: 1.57-1.67x the Triton one at batch 32 / 128 x 8k / 32k (H200);
    # from batch 5 in the warp-specialized schedule (H100, mla7: 1.02-1.04x the serial one at batch
    # 32 / 128 x 8k / 32k), batch 1-4 in the serial one (batch 1: 1.00-1.01x the other way)
    ((16, 4, 4096, 4), DEFAULT_TILES),
    ((16, 4, None, 4), WGMMA_TILES),
    ((16, None, None, 4), WGMMA_WS_TILES),
    ((16, None, None, 4), VERIFY_TILES_16_HEADS),
    # more rows (prefill chunks): the default, 8 programs an SM from 32k at batch 5-64
    ((16, 64, 16384, None), DEFAULT_TILES),
    ((16, 64, None, None), MLATiles(32, 64, 8, 2, programs_per_sm=8, min_split_tokens=32)),
    ((32, None, None, None), DEFAULT_TILES),
    # > 32 heads (TP 1 / 2): 64-head tiles read the cache once per 64 heads (twice at 128 heads);
    # decode rows in the Gluon kernel's warp-specialized schedule (H100, batch 32 / 128 x 8k / 32k:
    # 128 heads 67-82 % of the copy, 2.3-2.9x the Triton tiles, 1.27-1.37x mla5's serial kernel; 64
    # heads 85-120 %, 1.04-1.06x; batch 1 from 8k 0.91-1.22x), more rows in Triton's
    ((None, 4, 4096, None), DEFAULT_TILES),
    ((None, None, None, 1), WGMMA_WS_TILES),
    ((None, None, None, None), TRITON_TILES_64_ROWS),
)


def mla_tiles(num_heads: int, batch_size: int, kv_token_bound: int, query_rows: int = 1,
              gluon: bool = True) -> MLATiles:
    """The table's tiles for a launch of ``num_heads`` local heads, ``batch_size`` requests,
    contexts of at most ``kv_token_bound`` tokens and at most ``query_rows`` rows a request (1: a
    decode step, 1 + S: a verify); ``gluon=False`` skips the Gluon kernel's entries.

    Example: ``mla_tiles(16, 32, 32768)`` is the fourth entry (16 heads, decode rows, batch 5-64,
    context above 16k): 8 programs an SM; ``mla_tiles(16, 32, 8192, 3)`` (a verify at 8k) the
    Gluon kernel's 64-row tile that holds all three rows, in the warp-specialized schedule
    (:data:`WGMMA_WS_TILES`), with ``gluon=False`` Triton's (:data:`VERIFY_TILES_16_HEADS`).
    """
    dims = (num_heads, batch_size, kv_token_bound, query_rows)
    for bounds, tiles in TILE_TABLE:
        if (gluon or not tiles.wgmma) and all(bound is None or dim <= bound for dim, bound in zip(dims, bounds)):
            return tiles
    return DEFAULT_TILES


def kv_split_count(tiles: MLATiles, num_sms: int, programs_per_split: int, kv_token_bound: int,
                   max_splits: int) -> int:
    """Split-K programs a request for a launch of ``programs_per_split`` programs a split (query
    tiles x requests x head tiles): about ``tiles.programs_per_sm`` programs an SM (rounded up),
    each over at least ``tiles.min_split_tokens`` tokens (and one ``block_n`` tile), at most
    ``max_splits``. With ``tiles.whole_waves`` (``programs_per_sm`` then being what an SM holds at
    once), the count up to that one whose programs fill their waves best (the larger on a tie).

    Example: 132 SMs, 32 requests of one head tile, 1 program an SM: 5 splits (160 programs: a
    second wave of 28), or with ``whole_waves`` 4 (128 programs, one wave on 128 of the 132 SMs).
    """
    wave = tiles.programs_per_sm * num_sms
    longest = kv_token_bound // max(tiles.min_split_tokens, tiles.block_n)
    most = max(1, min(-(-wave // programs_per_split), longest, max_splits))
    if not tiles.whole_waves:
        return most
    # fill of s splits: programs / (waves x wave); the first best from the top
    return max(range(most, 0, -1), key=lambda s: s * programs_per_split / (-(-s * programs_per_split // wave) * wave))
