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

Steps with prefill chunks (mixed steps) are timed apart, in their own table per ``(G, D)``
(steady the same way: V = D, after a call at the same key, decode-only or mixed), and the model
keeps the share of recent steps that were mixed (``mixed_share``, a moving average over applied
launches). What a step at depth D costs the policy is the blend ``(1 - share) decode(G, D) +
share mixed(G, D)``: in a queued workload (a request joins almost every step) most steps are
mixed, and a mixed step's cost grows with V differently (its rows round up to a token bucket,
powers of two: at batch 64 with one 64-token chunk, 1 + V = 3 fills 256 rows, 1 + V = 4 pads to
512), which decode-only samples cannot show; while a batch drains the share falls to 0. Timed
apart, a depth measured in a queued phase is not compared with one measured while draining. A
depth whose mixed cost is not measured yet takes its decode cost times the mean mixed / decode
ratio of the depths measured at its grid (1 if none).

**Realised costs.** The steady samples leave out what a loop pays around them: the first calls
after a switch of depth, the calls that apply a launch with nothing launched after it (a batch's
end), decisions, forced catch-ups landing off the sampled calls. So every busy call that applied
one launch with decode requests verifying what it drafted (V = D: a switch's own launch is left
out, ``DraftLengths.step_timing``) adds (:meth:`StepCostModel.record_realised`, keyed by the
launch's grid and D) its wall time, and the model's cost
of the same steps, to decayed sums per key (weight ``realised_decay`` per step): the ratio is the
depth's *calibration* (realised wall / model), and the policy pays ``seconds(G, D) *
calibration(G, D)`` (:meth:`StepCostModel.policy_seconds`). A depth with fewer than
``realised_min_steps`` realised steps takes the grid's pooled ratio (1 if none): what is common to
every depth (a batch's end) then costs every depth alike. A sample is clipped at
``realised_clip`` (2) x the model (a collection pause is not what a depth costs; a batch's last
call, host and GPU in series, is under it). The same sums
count the tokens the steps' decode requests emitted and their request-steps
(``realised_tokens``: tokens per request-step, for reports beside the wall).

A depth not measured at a grid costs its GPU seed (an optimistic guess: a step's wall time is
never below its GPU time) or, off CUDA, the cheapest wall time at the grid; the policy does not
rely on the guess: it runs every depth it may choose until it is measured
(:meth:`StepCostModel.is_measured`, ``GoodputPolicy``'s exploration). Without any measurement (CPU
before the first step, eager steps) the analytic default ``base + G * (per_row * (1 + D) +
per_draft_depth * D)`` (arbitrary units: only ratios matter) is used. Under tensor parallelism
every rank records the first rank's measurements (``TPLockstep`` carries them), so every rank's
policy makes the same choices.
"""

from typing import Dict, List, Optional, Tuple

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
        self.mixed_wall: Dict[Key, float] = {}  # (G, D) -> wall seconds per steady step with prefill chunks
        self.mixed_share = 0.0  # moving average of the applied launches that carried prefill chunks
        self.share_smoothing = 1.0 / 32  # its weight of one launch
        # (G, V) -> decayed sums over every busy call's applied launch (module docstring, "Realised costs"):
        # [wall seconds, the model's seconds of the same steps, steps, tokens emitted, request-steps]
        self.realised: Dict[Key, List[float]] = {}
        self.realised_decay = 0.98  # per step: the sums follow about the last 50 steps of a key
        self.realised_min_steps = 8.0  # a key's own calibration once it holds this many (decayed) steps
        self.realised_clip = 2.0  # a realised sample counts at most this many times the model (a pause is not a cost)

    @property
    def measured(self) -> Dict[Key, float]:
        """The GPU seconds by (G, D) (the warm-up's, then the loop's)."""
        return self.gpu

    def set_measured(self, measured: Dict[Key, float]) -> None:
        """Seed the GPU seconds with the warm-up's replay times (drops the loop's measurements)."""
        self.gpu = {(int(g), int(d)): float(t) for (g, d), t in measured.items() if t > 0}
        self._gpu_seeded = {key: True for key in self.gpu}
        self.wall, self._outliers, self.mixed_wall, self.realised = {}, {}, {}, {}

    def set_row_costs(self, row_costs: Dict[Tuple[int, int, int, bool], float]) -> None:
        """The warm-up's replay times by (G, token count, D, has prefill) of ragged rows
        (``controller.warmup()`` times them for a per-request policy only). This model costs whole
        steps by (G, D): it keeps none (``RowCostModel`` overrides it)."""

    def record_prefill_rows(self, rows: int) -> None:
        """An applied step with prefill chunks carried ``rows`` chunk rows. This model keeps none
        (``RowCostModel`` overrides it: a ragged candidate's token bucket depends on them)."""

    def record_launches(self, mixed: int, total: int) -> None:
        """``total`` launches were applied, ``mixed`` of them with prefill chunks: moves
        ``mixed_share`` (every TP rank applies the same launches, so every rank's share agrees)."""
        if total == 1:  # the overlapped loop applies one launch a call
            self.mixed_share += self.share_smoothing * (float(mixed > 0) - self.mixed_share)
            return
        for index in range(total):
            self.mixed_share += self.share_smoothing * (float(index < mixed) - self.mixed_share)

    def record(self, batch_size: int, num_drafts: int, wall_seconds: float, gpu_seconds: Optional[float],
               mixed: bool = False) -> None:
        """One steady step of grid ``batch_size`` that ran ``num_drafts`` depths: the loop's wall
        seconds per step and the GPU's (None off CUDA); ``mixed``: a step with prefill chunks (its
        wall time goes to ``mixed_wall``; its GPU time is not kept)."""
        key = (int(batch_size), int(num_drafts))
        table = self.mixed_wall if mixed else self.wall
        outlier_key = key + (1,) if mixed else key
        reference = table.get(key)
        if reference is None:  # a new key: the grid's cheapest wall time
            reference = min((t for (g, _), t in table.items() if g == key[0]), default=None)
        if reference is not None and wall_seconds > self.outlier_factor * reference:
            self._outliers[outlier_key] = self._outliers.get(outlier_key, 0) + 1
            if self._outliers[outlier_key] < 3:
                return  # a pause of the host, a collection, is not what a step costs; a lasting change is
        self._outliers[outlier_key] = 0
        self._average(table, key, wall_seconds)
        if mixed:
            return
        if gpu_seconds is not None:
            if self._gpu_seeded.get(key, True):  # the first in-loop measurement replaces the seed
                self.gpu.pop(key, None)
            self._average(self.gpu, key, gpu_seconds)
            self._gpu_seeded[key] = False

    def record_realised(self, batch_size: int, verify_width: int, wall_seconds: float, steps: int,
                        tokens: int, request_steps: int, mixed: bool = False) -> None:
        """A busy call applied ``steps`` steps of grid ``batch_size`` verifying ``verify_width``
        drafts in ``wall_seconds`` (the loop's time since the call before returned), whose decode
        requests emitted ``tokens`` in ``request_steps`` request-steps (``mixed``: the launch had
        prefill chunks). Kept beside the model's cost of the same steps (decode-only or mixed), only
        once the steady model measured that key: the ratio is the depth's calibration
        (:meth:`policy_seconds`)."""
        key = (int(batch_size), int(verify_width))
        # the step's own grid measured at this depth (every steady call of a batch): is_measured and
        # decode_seconds read that entry (per step: no scan of the grids)
        decode = self.wall.get(key)
        if steps <= 0 or (decode is None and not self.is_measured(batch_size, verify_width)):
            return
        if mixed:
            model = self.mixed_seconds(batch_size, verify_width) * steps
        else:
            model = (self.decode_seconds(batch_size, verify_width) if decode is None else decode) * steps
        wall = min(float(wall_seconds), self.realised_clip * model)
        sums = self.realised.get(key)
        if sums is None:
            sums = self.realised[key] = [0.0] * 5
        keep = self.realised_decay ** steps
        sums[0] = sums[0] * keep + wall
        sums[1] = sums[1] * keep + model
        sums[2] = sums[2] * keep + steps
        sums[3] = sums[3] * keep + tokens
        sums[4] = sums[4] * keep + request_steps

    def calibration(self, batch_size: int, num_drafts: int) -> float:
        """Realised wall / the model's seconds of depth ``num_drafts`` at the step's grid: its own
        with ``realised_min_steps`` realised steps, else the grid's pooled ratio, else 1."""
        sums = self.realised.get((batch_size, num_drafts))  # the step's own grid (then it is the one read)
        if sums is not None and sums[2] >= self.realised_min_steps:
            return sums[0] / sums[1]
        grid = _grid_for(self.realised, batch_size)
        if grid is None:
            return 1.0
        sums = self.realised.get((grid, int(num_drafts)))
        if sums is not None and sums[2] >= self.realised_min_steps:
            return sums[0] / sums[1]
        pooled = [sums for (g, _), sums in self.realised.items() if g == grid and sums[2] >= self.realised_min_steps]
        return sum(s[0] for s in pooled) / sum(s[1] for s in pooled) if pooled else 1.0

    def policy_seconds(self, batch_size: int, num_drafts: int) -> float:
        """What a step at depth ``num_drafts`` costs the policy: :meth:`seconds` times the depth's
        :meth:`calibration` (what the loop realised around its steady steps)."""
        return self.seconds(batch_size, num_drafts) * self.calibration(batch_size, num_drafts)

    def realised_tokens(self, batch_size: int, num_drafts: int) -> Optional[float]:
        """Tokens a decode request emitted per step at depth ``num_drafts`` (the realised sums), or None."""
        grid = _grid_for(self.realised, batch_size)
        sums = None if grid is None else self.realised.get((grid, int(num_drafts)))
        return None if sums is None or sums[4] <= 0 else sums[3] / sums[4]

    def _average(self, table: Dict[Key, float], key: Key, sample: float) -> None:
        old = table.get(key)
        table[key] = float(sample) if old is None else old + self.smoothing * (float(sample) - old)

    def is_measured(self, batch_size: int, num_drafts: int) -> bool:
        """Whether the loop has timed depth ``num_drafts`` at the grid a step of ``batch_size`` reads."""
        if (batch_size, num_drafts) in self.wall:  # the step's own grid (then it is the one read)
            return True
        grid = _grid_for(self.wall, batch_size)
        return grid is not None and (grid, int(num_drafts)) in self.wall

    def seconds(self, batch_size: int, num_drafts: int) -> float:
        """What a step at depth ``num_drafts`` costs the policy: decode-only and mixed steps'
        costs blended by ``mixed_share`` (module docstring)."""
        decode = self.decode_seconds(batch_size, num_drafts)
        if self.mixed_share < 1e-3 or not self.mixed_wall:
            return decode
        return decode + self.mixed_share * (self.mixed_seconds(batch_size, num_drafts, decode) - decode)

    def mixed_seconds(self, batch_size: int, num_drafts: int, decode: Optional[float] = None) -> float:
        """A step with prefill chunks at depth ``num_drafts``: its measured wall time, else the
        decode-only cost (``decode``, computed if None) times the mean mixed / decode ratio of the
        depths measured at the grid (1 if none)."""
        grid = _grid_for(self.mixed_wall, batch_size)
        if grid is not None and (grid, num_drafts) in self.mixed_wall:
            return self.mixed_wall[(grid, num_drafts)]
        decode = self.decode_seconds(batch_size, num_drafts) if decode is None else decode
        ratios = [t / self.decode_seconds(g, d) for (g, d), t in self.mixed_wall.items() if g == grid]
        return decode * (sum(ratios) / len(ratios) if ratios else 1.0)

    def decode_seconds(self, batch_size: int, num_drafts: int) -> float:
        """A decode-only step at depth ``num_drafts`` (module docstring)."""
        wall = self.wall.get((batch_size, num_drafts))  # the step's own grid (then it is the one read)
        if wall is not None:
            return wall
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
        """Plain data for reports: ``{"G=.., D=..": {"wall_ms", "gpu_ms", "mixed_ms", "step_ms",
        "realised_ms", "calibration", "realised_steps", "tokens"}}`` (wall and GPU: decode-only
        steps; mixed: steps with prefill chunks; step_ms: the model's blend at the current
        ``mixed_share``; realised_ms: every busy call's wall a step, over ``realised_steps``
        decayed steps; calibration: what the policy multiplies step_ms by; tokens: realised tokens
        a decode request emitted a step)."""
        rows = {}
        for g, d in sorted(set(self.gpu) | set(self.wall) | set(self.mixed_wall) | set(self.realised)):
            gpu, wall, mixed = self.gpu.get((g, d)), self.wall.get((g, d)), self.mixed_wall.get((g, d))
            realised = self.realised.get((g, d))
            rows[f"G={g}, D={d}"] = {"wall_ms": None if wall is None else wall * 1e3,
                                     "gpu_ms": None if gpu is None else gpu * 1e3,
                                     "mixed_ms": None if mixed is None else mixed * 1e3,
                                     "step_ms": self.seconds(g, d) * 1e3,
                                     "realised_ms": None if realised is None else realised[0] / realised[2] * 1e3,
                                     "calibration": self.calibration(g, d),
                                     "realised_steps": None if realised is None else realised[2],
                                     "tokens": self.realised_tokens(g, d)}
        return rows


def _grid_for(table: Dict[Key, float], batch_size: int) -> Optional[int]:
    """The smallest grid >= ``batch_size`` with any entry in ``table``, or None."""
    grids = [g for g, _ in table if g >= batch_size]
    return min(grids) if grids else None
