"""What one step costs, as the serving loop sees it: the draft-length policy's cost model.

The cost of a step is the loop's wall time per step: the time between two consecutive
``step()`` returns (per step of the launch, for a decode run). In the overlapped loop
(``controller.py``) a call builds and launches step N + 1, waits for step N and applies it, so
that wall time holds everything a step costs the user: the host's work, the GPU's, and the
bubbles between them that neither alone shows (the demo at batch 128: GPU 0.71 ms and host
0.55 ms at D = 2, yet ~0.9 ms between returns), and whatever the caller does between calls.
It is measured per key ``(G, D)``, the step's grid (its CUDA-graph batch) and its draft depths,
on steady calls only: a call that applied one decode-only launch verifying what it drafted
(V = D) and launched as many steps, right after a call that did the same at the same key (so a
switch of depth, a prefill or an idle pause between calls is never a sample).

- Wall seconds: an exponential moving average of those samples. A sample over 3x the key's
  estimate (for a key not measured yet, the cheapest wall time at its grid) is dropped unless it
  is the third in a row: a garbage collection or a paused host would otherwise make a depth look
  expensive for good (the policy stops running it, so nothing corrects the estimate).
- GPU seconds (reported beside it, and the seed of a depth not measured yet): the warm-up's graph
  replay times (``controller.warmup()``), then a moving average of the launches' CUDA-event times.

A depth not measured at a grid costs its GPU seed (an optimistic guess: a step's wall time is
never below its GPU time) or, off CUDA, the cheapest wall time at the grid; the policy does not
rely on the guess: it runs every depth it may choose until it is measured
(:meth:`StepCostModel.is_measured`, ``GoodputPolicy``'s exploration). Without any measurement (CPU
before the first step, eager steps) the analytic default ``base + G * (per_row * (1 + D) +
per_draft_depth * D)`` (arbitrary units: only ratios matter) is used. Under tensor parallelism
every rank records the first rank's measurements (``TPLockstep`` carries them), so every rank's
policy makes the same choices.
"""

from typing import Dict, Optional, Tuple

Key = Tuple[int, int]  # (G, D)


class StepCostModel:
    """Seconds of one steady step by grid ``G`` and draft depths ``D`` (module docstring). A query
    for a grid between measured ones uses the next larger measured grid. ``smoothing``: the weight
    of a new measurement in the moving averages."""

    def __init__(self, base: float = 1.0, per_row: float = 0.02, per_draft_depth: float = 0.02,
                 smoothing: float = 0.1):
        for name, value in (("base", base), ("per_row", per_row), ("per_draft_depth", per_draft_depth),
                            ("smoothing", smoothing)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.base, self.per_row, self.per_draft_depth, self.smoothing = base, per_row, per_draft_depth, smoothing
        self.wall: Dict[Key, float] = {}  # (G, D) -> the loop's wall seconds per steady step (moving average)
        self.gpu: Dict[Key, float] = {}  # (G, D) -> GPU seconds of a step (warm-up seed, then the loop's average)
        self._gpu_seeded: Dict[Key, bool] = {}  # True while gpu[key] is only the warm-up's replay time
        self.outlier_factor = 3.0
        self._outliers: Dict[Key, int] = {}  # wall samples dropped in a row, by key

    @property
    def measured(self) -> Dict[Key, float]:
        """The GPU seconds by (G, D) (the warm-up's, then the loop's)."""
        return self.gpu

    def set_measured(self, measured: Dict[Key, float]) -> None:
        """Seed the GPU seconds with the warm-up's replay times (drops the loop's measurements)."""
        self.gpu = {(int(g), int(d)): float(t) for (g, d), t in measured.items() if t > 0}
        self._gpu_seeded = {key: True for key in self.gpu}
        self.wall, self._outliers = {}, {}

    def record(self, batch_size: int, num_drafts: int, wall_seconds: float, gpu_seconds: Optional[float]) -> None:
        """One steady step of grid ``batch_size`` that ran ``num_drafts`` depths: the loop's wall
        seconds per step and the GPU's (None off CUDA)."""
        key = (int(batch_size), int(num_drafts))
        reference = self.wall.get(key)
        if reference is None:  # a new key: the grid's cheapest wall time
            reference = min((t for (g, _), t in self.wall.items() if g == key[0]), default=None)
        if reference is not None and wall_seconds > self.outlier_factor * reference:
            self._outliers[key] = self._outliers.get(key, 0) + 1
            if self._outliers[key] < 3:
                return  # a pause of the host, a collection, is not what a step costs; a lasting change is
        self._outliers[key] = 0
        self._average(self.wall, key, wall_seconds)
        if gpu_seconds is not None:
            if self._gpu_seeded.get(key, True):  # the first in-loop measurement replaces the seed
                self.gpu.pop(key, None)
            self._average(self.gpu, key, gpu_seconds)
            self._gpu_seeded[key] = False

    def _average(self, table: Dict[Key, float], key: Key, sample: float) -> None:
        old = table.get(key)
        table[key] = float(sample) if old is None else old + self.smoothing * (float(sample) - old)

    def is_measured(self, batch_size: int, num_drafts: int) -> bool:
        """Whether the loop has timed depth ``num_drafts`` at the grid a step of ``batch_size`` reads."""
        grid = _grid_for(self.wall, batch_size)
        return grid is not None and (grid, int(num_drafts)) in self.wall

    def seconds(self, batch_size: int, num_drafts: int) -> float:
        grid = _grid_for(self.wall, batch_size)
        if grid is not None and (grid, num_drafts) in self.wall:
            return self.wall[(grid, num_drafts)]
        gpu = self._lookup(self.gpu, batch_size, num_drafts)
        if gpu is not None:  # not run yet at this grid: the GPU seed (optimistic)
            return gpu
        if grid is not None:  # off CUDA: the cheapest wall time seen at the grid
            return min(t for (g, _), t in self.wall.items() if g == grid)
        return self.base + batch_size * (self.per_row * (1 + num_drafts) + self.per_draft_depth * num_drafts)

    @staticmethod
    def _lookup(table: Dict[Key, float], batch_size: int, num_drafts: int) -> Optional[float]:
        """The value at the smallest grid >= ``batch_size`` measured for ``num_drafts``, or None."""
        grids = [g for g, d in table if d == num_drafts and g >= batch_size]
        return table[(min(grids), num_drafts)] if grids else None

    def table(self) -> Dict[str, Dict[str, Optional[float]]]:
        """Plain data for reports: ``{"G=.., D=..": {"wall_ms", "gpu_ms", "step_ms"}}`` (step_ms:
        what the policy uses)."""
        rows = {}
        for g, d in sorted(set(self.gpu) | set(self.wall)):
            gpu, wall = self.gpu.get((g, d)), self.wall.get((g, d))
            rows[f"G={g}, D={d}"] = {"wall_ms": None if wall is None else wall * 1e3,
                                     "gpu_ms": None if gpu is None else gpu * 1e3,
                                     "step_ms": self.seconds(g, d) * 1e3}
        return rows


def _grid_for(table: Dict[Key, float], batch_size: int) -> Optional[int]:
    """The smallest grid >= ``batch_size`` with any entry in ``table``, or None."""
    grids = [g for g, _ in table if g >= batch_size]
    return min(grids) if grids else None
