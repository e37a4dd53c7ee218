"""What one step costs, as the serving loop sees it: the draft-length policy's cost model.

The overlapped loop (``controller.py``) builds and launches step N + 1, then waits for step N and
applies it, so a steady step takes ``max(GPU time, host time)``: the GPU's work of the step, or
the host's work per step (building, launching and applying; everything but the wait), whichever
is longer. A host-bound step (a small model at a large batch) costs its host time whatever it
drafts; a GPU-bound one (a large model) costs its GPU time. Both are measured per key
``(G, D)``, the step's grid (its CUDA-graph batch) and its draft depths, on steady steps (decode
only, verify width V = D: the step verifies what the step before drafted):

- GPU seconds: seeded by the warm-up's graph replay times (``controller.warmup()``), then an
  exponential moving average of the loop's own launches (CUDA events around each launch; the
  warm-up replays steps that hold no request, which can cost less than real ones);
- host seconds: an exponential moving average of the loop's host time per step.

A sample over 3x the key's estimate (for a key not measured yet, the cheapest host time at its
grid) is dropped unless it is the third in a row: a garbage collection or a paused host would
otherwise make a depth look expensive for good (the policy stops running it, so nothing corrects
the estimate).
A depth not run yet at a grid costs its warm-up GPU seed alone: an optimistic guess, so the
policy tries it (a steady step or two), and from then on it is measured. Off CUDA (no seed) it
takes the cheapest host time seen at that grid.

Without any measurement (CPU before the first step, eager steps) the analytic default
``base + G * (per_row * (1 + D) + per_draft_depth * D)`` (arbitrary units: only ratios matter) is used.
Under tensor parallelism every rank records the first rank's measurements (``TPLockstep`` carries
them), so every rank's policy makes the same choices.
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
        self.gpu: Dict[Key, float] = {}  # (G, D) -> GPU seconds of a step (warm-up seed, then the loop's average)
        self.host: Dict[Key, float] = {}  # (G, D) -> host seconds per step (the loop's average)
        self._gpu_seeded: Dict[Key, bool] = {}  # True while gpu[key] is only the warm-up's replay time
        self.outlier_factor = 3.0
        self._outliers: Dict[Tuple[str, Key], int] = {}  # outliers dropped in a row, by (table, key)

    @property
    def measured(self) -> Dict[Key, float]:
        """The GPU seconds by (G, D) (the warm-up's, then the loop's)."""
        return self.gpu

    def set_measured(self, measured: Dict[Key, float]) -> None:
        """Seed the GPU seconds with the warm-up's replay times (drops the loop's measurements)."""
        self.gpu = {(int(g), int(d)): float(t) for (g, d), t in measured.items() if t > 0}
        self._gpu_seeded = {key: True for key in self.gpu}
        self.host, self._outliers = {}, {}

    def record(self, batch_size: int, num_drafts: int, host_seconds: float, gpu_seconds: Optional[float]) -> None:
        """One steady step of grid ``batch_size`` that ran ``num_drafts`` depths: the host's
        seconds per step and the GPU's (None off CUDA)."""
        key = (int(batch_size), int(num_drafts))
        reference = self.host.get(key)
        if reference is None:  # a new key: the grid's cheapest host time
            reference = min((t for (g, _), t in self.host.items() if g == key[0]), default=None)
        self._update(self.host, "host", key, host_seconds, reference)
        if gpu_seconds is not None:
            if self._gpu_seeded.get(key, True):  # the first in-loop measurement replaces the seed
                self.gpu.pop(key, None)
            self._update(self.gpu, "gpu", key, gpu_seconds, self.gpu.get(key))
            self._gpu_seeded[key] = False

    def _update(self, table: Dict[Key, float], name: str, key: Key, sample: float, reference: Optional[float]) -> None:
        """Move ``table[key]`` toward ``sample``; a sample over ``outlier_factor`` x ``reference``
        (the key's estimate, or the cheapest host time at its grid) is dropped unless it is the third
        such in a row (a pause of the host, a collection, is not what a step costs; a lasting change is)."""
        if reference is not None and sample > self.outlier_factor * reference:
            count = self._outliers.get((name, key), 0) + 1
            self._outliers[(name, key)] = count
            if count < 3:
                return
        self._outliers[(name, key)] = 0
        old = table.get(key)
        table[key] = float(sample) if old is None else old + self.smoothing * (float(sample) - old)

    def seconds(self, batch_size: int, num_drafts: int) -> float:
        gpu = self._lookup(self.gpu, batch_size, num_drafts)
        host = self._lookup(self.host, batch_size, num_drafts)
        if gpu is None and host is None:  # nothing of this depth: the cheapest host time seen at the grid
            grid = _grid_for(self.host, batch_size)
            host = min((t for (g, _), t in self.host.items() if g == grid), default=None)
            if host is None:
                return self.base + batch_size * (self.per_row * (1 + num_drafts) + self.per_draft_depth * num_drafts)
        return max(gpu or 0.0, host or 0.0)

    @staticmethod
    def _lookup(table: Dict[Key, float], batch_size: int, num_drafts: int) -> Optional[float]:
        """The value at the smallest grid >= ``batch_size`` measured for ``num_drafts``, or None."""
        grids = [g for g, d in table if d == num_drafts and g >= batch_size]
        return table[(min(grids), num_drafts)] if grids else None

    def table(self) -> Dict[str, Dict[str, Optional[float]]]:
        """Plain data for reports: ``{"G=.., D=..": {"gpu_ms", "host_ms", "step_ms"}}``."""
        rows = {}
        for g, d in sorted(set(self.gpu) | set(self.host)):
            gpu, host = self.gpu.get((g, d)), self.host.get((g, d))
            rows[f"G={g}, D={d}"] = {"gpu_ms": None if gpu is None else gpu * 1e3,
                                     "host_ms": None if host is None else host * 1e3,
                                     "step_ms": self.seconds(g, d) * 1e3}
        return rows


def _grid_for(table: Dict[Key, float], batch_size: int) -> Optional[int]:
    grids = [g for g, _ in table if g >= batch_size]
    return min(grids) if grids else None
