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

- Wall seconds: the mean of a key's samples while it has fewer than ``1 / smoothing`` (10), then
  an exponential moving average of them (the first sample after a key is new or measured afresh
  weighs 1 / n of the estimate after n samples, not 0.9^n: one unlucky first sample, a collection or
  a catch-up beside it, no longer holds a depth's estimate high for tens of samples while the
  policy, seeing it dear, stops running it). A sample over 3x the key's
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
``batch_dimensions.token_buckets``: one row more can cross a bucket's edge), which decode-only
samples cannot show; while a batch drains the share falls to 0. Timed
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

import numpy as np

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
        self._stale: set = set()  # keys whose next steady sample replaces the wall estimate (remeasure)
        self.outlier_factor = 3.0
        self._outliers: Dict[Key, int] = {}  # wall samples dropped in a row, by key
        self._sample_counts: Dict[tuple, int] = {}  # (table, key) -> samples averaged since the key (re)started
        self.mixed_wall: Dict[Key, float] = {}  # (G, D) -> wall seconds per steady step with prefill chunks
        self.mixed_share = 0.0  # moving average of the applied launches that carried prefill chunks
        self.share_smoothing = 1.0 / 32  # its weight of one launch
        # (G, V) -> decayed sums over every busy call's applied launch (module docstring, "Realised costs"):
        # [wall seconds, the model's seconds of the same steps, steps, tokens emitted, request-steps, tokens the
        # policy expected of those request-steps]
        self.realised: Dict[Key, List[float]] = {}
        self.realised_decay = 0.98  # per step: the sums follow about the last 50 steps of a key
        self.realised_min_steps = 8.0  # a key's own calibration once it holds this many (decayed) steps
        self.realised_clip = 2.0  # a realised sample counts at most this many times the model (a pause is not a cost)
        self.token_calibration_range = (0.5, 1.5)  # token_calibration's bounds (a few odd steps are not a trend)

    @property
    def measured(self) -> Dict[Key, float]:
        """The GPU seconds by (G, D) (the warm-up's, then the loop's)."""
        return self.gpu

    def set_measured(self, measured: Dict[Key, float]) -> None:
        """Seed the GPU seconds with the warm-up's replay times (drops the loop's measurements)."""
        self.gpu = {(int(g), int(d)): float(t) for (g, d), t in measured.items() if t > 0}
        self._gpu_seeded = {key: True for key in self.gpu}
        self.wall, self._outliers, self.mixed_wall, self.realised = {}, {}, {}, {}
        self._sample_counts = {}

    def set_row_costs(self, row_costs: Dict[Tuple[int, int, int, bool], float]) -> None:
        """The warm-up's replay times by (G, token count, D, has prefill) (``controller.warmup()``).
        This model costs whole steps by (G, D): it keeps none (``RowCostModel`` overrides it)."""

    def prices_rows(self, batch_size: int) -> bool:
        """Whether :meth:`RowCostModel.row_seconds` has the warm-up's decode-only row costs at the
        smallest grid >= ``batch_size`` that holds any (this model keeps none)."""
        return False

    def record_prefill_rows(self, rows: int) -> None:
        """An applied step with prefill chunks carried ``rows`` chunk rows. This model keeps none
        (``RowCostModel`` overrides it: a ragged candidate's token bucket depends on them)."""

    def record_prefill_chunks(self, rows: int, chunks: int) -> None:
        """The same step's ``rows`` chunk rows were ``chunks`` prompts' chunks. This model keeps
        none (``RowCostModel`` overrides it: what a joining request adds to a step)."""

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
        if not mixed and key in self._stale:  # measured afresh: the old estimate is dropped
            self._stale.discard(key)
            table.pop(key, None)
        self._average(table, key, wall_seconds, "mixed" if mixed else "wall")
        if mixed:
            return
        if gpu_seconds is not None:
            if self._gpu_seeded.get(key, True):  # the first in-loop measurement replaces the seed
                self.gpu.pop(key, None)
            self._average(self.gpu, key, gpu_seconds, "gpu")
            self._gpu_seeded[key] = False

    def remeasure(self, batch_size: int, num_drafts: int) -> None:
        """Measure depth ``num_drafts`` afresh at the grid a step of ``batch_size`` reads: its next
        steady sample replaces the wall estimate (which stays in use until then) and its realised
        sums restart. The policy calls it when it runs a depth again to correct its estimate: one
        taken while serving started (a cold host, the first steps after capture) would otherwise
        decay away only over many more steps of a depth the policy has stopped running."""
        grid = batch_size if (batch_size, num_drafts) in self.wall else _grid_for(self.wall, batch_size)
        if grid is None:
            return
        key = (grid, int(num_drafts))
        self._stale.add(key)
        self.realised.pop(key, None)

    def record_realised(self, batch_size: int, verify_width: int, wall_seconds: float, steps: int,
                        tokens: int, request_steps: int, mixed: bool = False,
                        expected_tokens: Optional[float] = None) -> None:
        """A busy call applied ``steps`` steps of grid ``batch_size`` verifying ``verify_width``
        drafts in ``wall_seconds`` (the loop's time since the call before returned), whose decode
        requests emitted ``tokens`` in ``request_steps`` request-steps (``mixed``: the launch had
        prefill chunks; ``expected_tokens``: what the policy expected a request-step at that depth,
        None: as many as came). Kept beside the model's cost of the same steps (decode-only or
        mixed), only once the steady model measured that key: the ratio is the depth's calibration
        (:meth:`policy_seconds`); the tokens over the expected ones, its :meth:`token_calibration`."""
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
            sums = self.realised[key] = [0.0] * 6
        keep = self.realised_decay ** steps
        sums[0] = sums[0] * keep + wall
        sums[1] = sums[1] * keep + model
        sums[2] = sums[2] * keep + steps
        sums[3] = sums[3] * keep + tokens
        sums[4] = sums[4] * keep + request_steps
        sums[5] = sums[5] * keep + (tokens if expected_tokens is None else expected_tokens * request_steps)

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

    def policy_decode_seconds(self, batch_size: int, num_drafts: int) -> float:
        """:meth:`policy_seconds` of a decode-only step (no share of steps with prefill chunks): a
        batch that drains admits nobody, so its steps carry no prompt chunks, whatever the share of
        the steps before it did."""
        return self.decode_seconds(batch_size, num_drafts) * self.calibration(batch_size, num_drafts)

    def token_calibration(self, batch_size: int, num_drafts: int) -> float:
        """Tokens the loop's steps at depth ``num_drafts`` emitted over those the policy expected
        of them (the realised sums of the step's grid, with ``realised_min_steps`` steps; else 1),
        within ``token_calibration_range``. What the expectation misses comes out here: a request's
        last step, cut at max_new_tokens; a decode run's steps after a request stopped; acceptance
        estimates that run high (the demo at T = 1, D = 2: 2.35 tokens a request-step realised
        where 2.50 were expected)."""
        sums = self.realised.get((batch_size, num_drafts))
        if sums is None or sums[2] < self.realised_min_steps or sums[5] <= 0:
            return 1.0
        low, high = self.token_calibration_range
        return min(max(sums[3] / sums[5], low), high)

    def realised_tokens(self, batch_size: int, num_drafts: int) -> Optional[float]:
        """Tokens a decode request emitted per step at depth ``num_drafts`` (the realised sums), or None."""
        grid = _grid_for(self.realised, batch_size)
        sums = None if grid is None else self.realised.get((grid, int(num_drafts)))
        return None if sums is None or sums[4] <= 0 else sums[3] / sums[4]

    def _average(self, table: Dict[Key, float], key: Key, sample: float, name: str) -> None:
        """Move ``table[key]`` (``name``: which table) to the mean of its samples so far, or by
        ``smoothing`` once it has 1 / smoothing of them (module docstring, "Wall seconds")."""
        old = table.get(key)
        count = 1 if old is None else self._sample_counts.get((name, key), 1) + 1
        self._sample_counts[(name, key)] = count
        table[key] = float(sample) if old is None else old + max(self.smoothing, 1.0 / count) * (float(sample) - old)

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


class RowCostModel(StepCostModel):
    """:class:`StepCostModel` (the loop's wall time per (G, D)) and the GPU time of a step by its
    token count (the goodput policies' model: per-request candidates, and a queue's depths):
    ``row_gpu[(G, T, D, has_prefill)]``, the warm-up's replay times of the decode-only token counts
    (each tier's, and with ragged rows the ragged ones) and of the token buckets of steps with prefill chunks
    (``controller.warmup()``; ``set_row_costs``), and the prefill rows of the recent steps with
    prefill chunks (``record_prefill_rows``, from the loop: ``prefill_rows`` is their moving average,
    for reports; the cost takes the last ``PREFILL_SAMPLES`` of them one by one, since a bucket's
    edge makes the cost of the average rows not the average cost)."""

    PREFILL_SAMPLES = 32

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.row_gpu: Dict[Tuple[int, int, int, bool], float] = {}  # (G, T, D, has prefill) -> replay seconds
        # G -> ([D + 1, T + 1] decode-only, [D + 1, T' + 1] mixed or None): the replay seconds of the
        # smallest timed token count >= t (the largest past them), NaN for a depth not timed
        self._dense: Dict[int, Tuple[np.ndarray, Optional[np.ndarray]]] = {}
        self.prefill_rows: Optional[float] = None
        self._prefill_ring = np.zeros(self.PREFILL_SAMPLES, dtype=np.int64)  # the last mixed steps' prefill rows
        self._prefill_count = 0
        # moving average of the rows a prompt chunk brings (a mixed step's chunk rows over its prefill
        # requests): what a joining request adds to the step it joins (queue_seconds)
        self.chunk_rows: Optional[float] = None
        self.version = 0  # bumped when the row costs are set (a policy's kept price is then stale)

    def set_row_costs(self, row_costs: Dict[Tuple[int, int, int, bool], float]) -> None:
        self.version += 1
        self.row_gpu = {(int(g), int(t), int(d), bool(p)): float(s) for (g, t, d, p), s in row_costs.items() if s > 0}
        tables: Dict[Tuple[int, bool], Dict[int, list]] = {}
        for (g, t, d, p), seconds in sorted(self.row_gpu.items()):
            tables.setdefault((g, p), {}).setdefault(d, []).append((t, seconds))
        self._dense = {}
        for g in sorted({g for g, _ in tables}):
            self._dense[g] = tuple(None if (g, p) not in tables else _dense_table(tables[(g, p)]) for p in (False, True))

    def prices_rows(self, batch_size: int) -> bool:
        grid = min((g for g in self._dense if g >= batch_size), default=None)
        return grid is not None and self._dense[grid][0] is not None

    def record_prefill_rows(self, rows: int) -> None:
        """A step with prefill chunks carried ``rows`` chunk rows."""
        old = self.prefill_rows
        self.prefill_rows = float(rows) if old is None else old + self.share_smoothing * (rows - old)
        self._prefill_ring[self._prefill_count % self.PREFILL_SAMPLES] = rows
        self._prefill_count += 1

    def record_prefill_chunks(self, rows: int, chunks: int) -> None:
        """The same step's ``rows`` chunk rows were ``chunks`` prompts' chunks: ``chunk_rows``, the
        rows a joining request brings (:meth:`queue_seconds`)."""
        per_chunk, old = rows / max(chunks, 1), self.chunk_rows
        self.chunk_rows = per_chunk if old is None else old + self.share_smoothing * (per_chunk - old)

    def row_seconds(self, batch_size: int, rows: np.ndarray, depths: np.ndarray,
                    prefill_scale: Optional[np.ndarray] = None, mixed_rows: Optional[np.ndarray] = None) -> np.ndarray:
        """``[c]`` seconds of a step at grid ``batch_size`` whose decode requests run ``rows[i]`` rows
        and draft ``depths[i]`` depths: what the loop adds over the GPU at that depth once measured
        (``decode_seconds(G, D) - gpu(G, D)``: host work, bubbles) plus the GPU time of the rows:
        the replay time of the decode-only token count that holds them, blended by ``mixed_share``
        with the mean over the recent mixed steps of the token bucket that holds the rows and that
        step's prefill rows (a step with prefill chunks pads its rows to a token bucket: one row more
        can cross a bucket's edge). Without the mixed buckets' times (or prefill rows), the decode-only count's
        time plus ``seconds(G, D) - gpu(G, D)`` (the mixed steps' measured average as a constant);
        without row costs (CPU, eager) ``seconds(G, D)`` linear in rows from ``seconds(G, 0)`` at G
        rows. ``prefill_scale`` ``[c]`` (None: 1): each candidate's recent prefill rows times it (in a
        queue a step's chunks come with the requests that finish: the goodput policies scale them by
        a candidate's tokens a step over the recent steps'). ``mixed_rows`` ``[c]`` (None: ``rows``):
        the decode rows of a step with prefill chunks (ragged rows are for decode-only steps: there
        each decode request runs ``1 + V``). A depth the warm-up did not time takes
        the linear guess. A fixed number of numpy calls (and a Python loop over the depths, not the
        candidates)."""
        rows, depths = np.asarray(rows, dtype=np.int64), np.asarray(depths, dtype=np.int64)
        mixed_rows = rows if mixed_rows is None else np.asarray(mixed_rows, dtype=np.int64)
        linear, priced = self._decode_part(batch_size, rows, depths)
        if priced is None:
            return linear
        decode, gaps, mixed_table = priced
        out = decode + gaps[0, depths]
        samples = min(self._prefill_count, self.PREFILL_SAMPLES)
        if mixed_table is not None and samples and self.mixed_share >= 1e-3:
            values, counts = np.unique(self._prefill_ring[:samples], return_counts=True)  # [u] each
            prefill = values[None, :] if prefill_scale is None else \
                np.rint(values[None, :] * np.asarray(prefill_scale, dtype=np.float64)[:, None]).astype(np.int64)
            tokens = np.minimum(mixed_rows[:, None] + prefill, mixed_table.shape[1] - 1)  # [c, u]
            mixed = mixed_table[np.minimum(depths, mixed_table.shape[0] - 1)[:, None], tokens] @ (counts / samples)
            mixed[depths >= mixed_table.shape[0]] = np.nan  # a depth the warm-up did not time
            blended = gaps[1, depths] + decode + self.mixed_share * (mixed - decode)
            out = np.where(np.isnan(mixed), out, blended)
        return np.where(np.isnan(decode), linear, out)

    def queue_seconds(self, batch_size: int, rows: np.ndarray, depths: np.ndarray, drafting: np.ndarray,
                      joins: np.ndarray, finish_groups: np.ndarray, period: float,
                      mixed_rows: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
        """``[c]`` seconds a step costs in a queue, with the prompt chunks its finishing requests bring
        (every freed slot takes a waiting request, whose first chunk of ``chunk_rows`` rows joins a
        step): candidate i's decode requests run ``rows[i]`` rows and draft ``depths[i]`` depths,
        a share ``drafting[i]`` of them draft at all, and their tokens finish ``joins[i]`` requests a
        step.

        - Requests that draft nothing emit one token a step, so they finish in the groups they are in
          now, ``finish_groups`` ``[g]`` (requests that finish at the same step, as many as wait: a
          batch in lockstep, or spread), each group once a ``period`` (the joining requests'
          length): a step of its prompts' chunks, ``(mixed(rows + group chunks) - decode(rows)) /
          period`` a step, for the ``1 - drafting[i]`` share of the batch;
        - the requests that draft spread their finishes over steps (accepted drafts differ between
          requests): ``k ~ Poisson(drafting[i] joins[i])`` joins a step (at most the batch),
          each step priced by the token bucket its rows and k chunks pad to (``mixed(rows + k
          chunk_rows)``; a step past the largest bucket in proportion).

        So plain decoding of equal-length requests is priced at its one bulk prefill step a period,
        where drafting spreads the same prompts over many mixed steps (each padded to a bucket, each
        a mixed step's cost): what a queue's recent chunks (:meth:`row_seconds`) cannot tell while
        the batch runs in lockstep. Plus the loop's measured wall over the GPU of a decode step at
        the depth. ``mixed_rows`` ``[c]`` (None: ``rows``): the decode rows of a step with prompt
        chunks (:meth:`row_seconds`). None without the mixed buckets' times or a chunk measured (then
        :meth:`row_seconds`)."""
        rows, depths = np.asarray(rows, dtype=np.int64), np.asarray(depths, dtype=np.int64)
        mixed_rows = rows if mixed_rows is None else np.asarray(mixed_rows, dtype=np.int64)
        linear, priced = self._decode_part(batch_size, rows, depths)
        if priced is None or priced[2] is None or not self.chunk_rows:
            return None
        decode, gaps, mixed_table = priced
        chunk, largest = self.chunk_rows, mixed_table.shape[1] - 1
        table_depths = np.minimum(depths, mixed_table.shape[0] - 1)  # [c]

        def mixed(extra_rows: np.ndarray) -> np.ndarray:  # [c, k]: a step of mixed_rows + extra_rows ([c, k] or [k])
            tokens = mixed_rows[:, None] + extra_rows
            seconds = mixed_table[table_depths[:, None], np.minimum(tokens, largest)]
            return seconds * np.maximum(tokens / largest, 1.0)  # past the largest bucket: in proportion

        drafting = np.clip(np.nan_to_num(np.asarray(drafting, dtype=np.float64)), 0.0, 1.0)  # [c]
        # the drafting requests' joins a step: at most the batch (a finish frees one slot)
        joins = np.clip(np.nan_to_num(np.asarray(joins, dtype=np.float64)) * drafting, 0.0, float(batch_size))  # [c]
        most = float(joins.max()) if joins.shape[0] else 0.0
        K = min(int(np.ceil(most + 6.0 * np.sqrt(most))) + 2, batch_size)  # k = 0..K joins
        k = np.arange(K + 1, dtype=np.float64)  # [K + 1]
        # Poisson weights in log space (exp(-lambda) underflows past ~745), renormalised over 0..K
        log_factorials = np.concatenate([[0.0], np.cumsum(np.log(k[1:]))])  # [K + 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            log_weights = k[None, :] * np.log(joins)[:, None] - log_factorials[None, :]  # [c, K + 1]
        log_weights[joins == 0.0] = np.where(k == 0, 0.0, -np.inf)  # lambda = 0: no join
        weights = np.exp(log_weights - log_weights.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        steps = mixed(np.rint(k * chunk).astype(np.int64)[None, :])  # [c, K + 1]
        steps[:, 0] = decode
        spread_extra = (weights * steps).sum(axis=1) - decode  # [c]
        groups = np.asarray(finish_groups, dtype=np.int64)
        bulk_extra = (mixed(np.rint(groups * chunk).astype(np.int64)[None, :]) - decode[:, None]).sum(axis=1) \
            / max(float(period), 1.0) if groups.shape[0] else np.zeros_like(decode)  # [c]
        out = gaps[1, depths] + decode + (1.0 - drafting) * bulk_extra + spread_extra
        out[depths >= mixed_table.shape[0]] = np.nan  # a depth the warm-up did not time
        return np.where(np.isnan(out) | np.isnan(decode), linear, out)

    def _decode_part(self, batch_size: int, rows: np.ndarray, depths: np.ndarray):
        """``(linear [c], (decode [c], gaps [2, D + 1], mixed table or None) or None)``: the linear
        guess (rows between G and G (1 + D) from the wall times; module docstring), and with the
        warm-up's decode-only row costs at the grid the replay time of each candidate's decode-only
        token count (NaN at a depth not timed) and the loop's wall over the GPU at each depth once
        measured (row 0: the blended wall, row 1: the decode-only wall)."""
        num_depths = int(depths.max()) + 1 if depths.shape[0] else 1
        wall = np.array([self.seconds(batch_size, d) for d in range(num_depths)])  # [D + 1]
        # the linear guess: rows between G (a plain step's) and G (1 + D) (the tier's)
        slope = (wall - wall[0]) / (batch_size * np.maximum(np.arange(num_depths), 1))  # [D + 1]
        linear = wall[0] + slope[depths] * (rows - batch_size)  # [c]
        grid = min((g for g in self._dense if g >= batch_size), default=None)
        if grid is None or self._dense[grid][0] is None:
            return linear, None
        decode_table, mixed_table = self._dense[grid]
        timed = depths < decode_table.shape[0]  # [c] a depth past the table's: not timed (NaN, as a row of NaN)
        decode = np.where(timed, decode_table[np.minimum(depths, decode_table.shape[0] - 1),
                                              np.minimum(rows, decode_table.shape[1] - 1)], np.nan)  # [c]
        gaps = np.zeros((2, num_depths))  # [2, D + 1]: the loop over the GPU (wall; decode-only wall) once measured
        for d in range(num_depths):
            gpu = self._lookup(self.gpu, batch_size, d)
            if gpu is not None and self.is_measured(batch_size, d):
                gaps[:, d] = max(0.0, wall[d] - gpu), max(0.0, self.decode_seconds(batch_size, d) - gpu)
        return linear, (decode, gaps, mixed_table)

def _dense_table(by_depth: Dict[int, list]) -> np.ndarray:
    """``[D + 1, T + 1]``: at depth d and t rows the seconds of the smallest timed count >= t of
    ``by_depth[d]`` (``[(count, seconds)]``, increasing), the largest past them; NaN: d not timed."""
    last = max(t for rows in by_depth.values() for t, _ in rows)
    out = np.full((max(by_depth) + 1, last + 1), np.nan)
    for d, rows in by_depth.items():
        tokens, seconds = np.array([t for t, _ in rows]), np.array([s for _, s in rows])
        out[d] = seconds[np.searchsorted(tokens, np.arange(last + 1)).clip(max=tokens.shape[0] - 1)]
    return out


def _grid_for(table: Dict[Key, float], batch_size: int) -> Optional[int]:
    """The smallest grid >= ``batch_size`` with any entry in ``table``, or None."""
    grids = [g for g, _ in table if g >= batch_size]
    return min(grids) if grids else None
