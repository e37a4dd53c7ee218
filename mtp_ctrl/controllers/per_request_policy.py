"""A goodput policy that picks each request's own draft length (ragged verify rows).

With ragged rows (``InferenceConfig.ragged_rows``, docs/draft_lengths.md) a decode request runs
``1 + s_r`` forward rows, so a request whose drafts seldom land costs one row while one whose
drafts land drafts S. :class:`PerRequestGoodputPolicy` keeps :class:`GoodputPolicy`'s acceptance
estimates, exploration and objectives, and replaces "one depth D for the batch" by a choice per
request:

- the candidates are the batch's drafts ``(r, k)`` sorted by their expected tokens
  ``m_{r,k} = prod_{j <= k} a_{r,j}`` (a request's k-th draft before its k + 1-th: ``m`` falls
  with k); taking the first ``m`` of them gives lengths ``s_r``, ``n + m`` decode rows and
  ``D = max s_r`` depths;
- each candidate costs :meth:`RowCostModel.row_seconds` ``(G, n + m, D)``: the warm-up's replay
  time of the ragged token count its rows pad to, blended by the share of steps with prefill
  chunks with the token bucket its rows and the recent chunk rows pad to, plus the loop's
  measured wall-over-GPU time at ``(G, D)`` (host work, bubbles);
- one depth for the whole batch (``min(D, cap_r)`` each, ``GoodputPolicy``'s candidates) joins them;
- while requests wait the policy takes the candidate with the most expected tokens per second
  (``n`` plus its drafts' expected tokens, over its cost), when none waits (``drain_objective``)
  the one with the least expected time to finish the batch (``expected_drain_steps`` of its
  lengths x its cost), over 16 prefixes spread along the list (and the first of each depth) and
  the one-depth candidates: the batch ends with its slowest requests, so drafts of a request that
  finishes early save nothing there.

Worked example (S = 3, three requests of acceptance 0.9 / 0.6 / 0.2 at every depth, a step
costing ``1 + 0.1 (rows - 3)``, depth costs left out): the drafts sorted by expected tokens are
0.9, 0.81, 0.729 (request 0), 0.6 (request 1), 0.36, 0.216, 0.2, ...; tokens per unit of cost
after the first m: 3.0, 3.55, 3.93, 4.18, **4.31** (m = 4), 4.27, ...; so s = (3, 1, 0): 6.04
tokens for 1.4, where fixed S = 1 / 2 / 3 get 3.62 / 3.69 / 3.61.
"""

import collections
from typing import Deque, Dict, Optional, Tuple

import numpy as np

from mtp_ctrl.controllers.draft_policy import DraftLengthQuery, GoodputPolicy, expected_drain_steps
from mtp_ctrl.controllers.step_costs import StepCostModel

DRAIN_CANDIDATES = 16  # prefixes the drain objective evaluates (evenly spread, and each depth's first)


class RowCostModel(StepCostModel):
    """:class:`StepCostModel` (the loop's wall time per (G, D)) and, for ragged rows, the GPU time
    of a step by its token count: ``row_gpu[(G, T, D, has_prefill)]``, the warm-up's replay times
    of the decode-only ragged token counts and of the token buckets of steps with prefill chunks
    (``controller.warmup()``; ``set_row_costs``), and the moving average of the prefill rows a step
    with prefill chunks carries (``prefill_rows``, from the loop: ``record_prefill_rows``)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.row_gpu: Dict[Tuple[int, int, int, bool], float] = {}  # (G, T, D, has prefill) -> replay seconds
        # (G, D, has prefill) -> ([k] token counts, [k] seconds), increasing
        self._row_tables: Dict[Tuple[int, int, bool], Tuple[np.ndarray, np.ndarray]] = {}
        self.prefill_rows: Optional[float] = None

    def set_row_costs(self, row_costs: Dict[Tuple[int, int, int, bool], float]) -> None:
        self.row_gpu = {(int(g), int(t), int(d), bool(p)): float(s) for (g, t, d, p), s in row_costs.items() if s > 0}
        tables: Dict[Tuple[int, int, bool], list] = {}
        for (g, t, d, p), seconds in sorted(self.row_gpu.items()):
            tables.setdefault((g, d, p), []).append((t, seconds))
        self._row_tables = {key: (np.array([t for t, _ in rows], dtype=np.float64), np.array([s for _, s in rows]))
                            for key, rows in tables.items()}

    def record_prefill_rows(self, rows: int) -> None:
        """A step with prefill chunks carried ``rows`` chunk rows (moving average, the share's weight)."""
        old = self.prefill_rows
        self.prefill_rows = float(rows) if old is None else old + self.share_smoothing * (rows - old)

    def _rows_gpu(self, grid: Optional[int], depth: int, mixed: bool, rows: np.ndarray) -> Optional[np.ndarray]:
        """Replay seconds of the smallest timed token count that holds ``rows`` (the largest past them), or None."""
        table = self._row_tables.get((grid, depth, mixed))
        if table is None:
            return None
        tokens, seconds = table
        return seconds[np.searchsorted(tokens, rows).clip(max=tokens.shape[0] - 1)]

    def row_seconds(self, batch_size: int, rows: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """``[c]`` seconds of a step at grid ``batch_size`` whose decode requests run ``rows[i]`` rows
        and draft ``depths[i]`` depths: what the loop adds over the GPU at that depth once measured
        (``decode_seconds(G, D) - gpu(G, D)``: host work, bubbles) plus the GPU time of the rows:
        the replay time of the decode-only token count that holds them, blended by ``mixed_share``
        with the token bucket that holds them and the recent prefill rows (a step with prefill
        chunks pads its rows to a power of two: one row more can double it). Without the mixed
        buckets' times (or prefill rows), the decode-only count's time plus ``seconds(G, D) -
        gpu(G, D)`` (the mixed steps' measured average as a constant); without row costs (CPU,
        eager) ``seconds(G, D)`` linear in rows from ``seconds(G, 0)`` at G rows."""
        rows, depths = np.asarray(rows, dtype=np.float64), np.asarray(depths, dtype=np.int64)
        out = np.empty(rows.shape[0])
        grid = min((g for g, _, _ in self._row_tables if g >= batch_size), default=None)
        base = self.seconds(batch_size, 0)
        for depth in range(int(depths.max()) + 1 if depths.shape[0] else 0):
            chosen = depths == depth
            wall = self.seconds(batch_size, depth)
            decode = self._rows_gpu(grid, depth, False, rows[chosen])
            if decode is None:
                if depth == 0:
                    out[chosen] = base
                else:  # rows between G (a plain step's) and G (1 + D) (the tier's)
                    out[chosen] = base + (wall - base) * (rows[chosen] - batch_size) / (batch_size * depth)
                continue
            gpu = self._lookup(self.gpu, batch_size, depth)
            measured = gpu is not None and self.is_measured(batch_size, depth)
            mixed = None if self.prefill_rows is None else \
                self._rows_gpu(grid, depth, True, rows[chosen] + self.prefill_rows)
            if mixed is None or self.mixed_share < 1e-3:
                out[chosen] = decode + (max(0.0, wall - gpu) if measured else 0.0)
            else:
                gap = max(0.0, self.decode_seconds(batch_size, depth) - gpu) if measured else 0.0
                out[chosen] = gap + decode + self.mixed_share * (mixed - decode)
        return out


class PerRequestGoodputPolicy(GoodputPolicy):
    """:class:`GoodputPolicy` with a draft length per request (module docstring): same arguments.
    Its lengths differ between requests (``per_request_lengths``): the controller runs ragged rows
    where the proposer and the model take them. A request that joins while a choice holds drafts
    what a request with the batch's average acceptance would get (``join_length``), capped; its
    own acceptance counts start with its first outcome (``observe``)."""

    per_request_lengths = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._join_length: Optional[int] = None
        self.last_lengths = np.zeros(0, dtype=np.int64)  # the last choice (for benchmarks)
        self._forgotten: Deque[int] = collections.deque()  # ids that left lately: observe makes them no row

    def bind(self, shape) -> None:
        super().bind(shape)
        self.cost_model = RowCostModel()
        self._forgotten = collections.deque(maxlen=8 * shape.max_requests)

    def observe(self, request_ids: np.ndarray, draft_lengths: np.ndarray, accepted_counts: np.ndarray) -> None:
        """As :meth:`GoodputPolicy.observe`, but a request's own counts start with its first outcome,
        not when a choice first sees it (a request that joined while a choice held verifies up to
        ``decide_every`` steps before that, in a life of a few tens of steps), except for requests
        that left lately (their last outcomes come after ``forget``: a row made then would be held for
        good)."""
        request_ids = np.asarray(request_ids, dtype=np.int64)
        known = np.isin(request_ids, np.fromiter(self._forgotten, dtype=np.int64, count=len(self._forgotten)))
        self._rows(np.unique(request_ids[~known]), create=True)
        super().observe(request_ids, draft_lengths, accepted_counts)

    def forget(self, request_id: int) -> None:
        super().forget(request_id)
        self._forgotten.append(request_id)

    def join_length(self) -> Optional[int]:
        return self._join_length

    def choose(self, query: DraftLengthQuery) -> np.ndarray:
        S, caps, n, G = query.num_speculative_tokens, query.caps, query.caps.shape[0], query.batch_size
        decay = self.decay ** query.steps  # per step since the last choice
        self._model *= decay
        self._counts *= decay
        rows = self._rows(query.request_ids, create=True)
        estimates = self._estimates(rows)  # [n, S]
        reach = np.cumprod(estimates, axis=1)  # [n, S]: expected tokens of draft k (it and those before land)
        # the candidates: the first m of the drafts sorted by expected tokens (draft k before k + 1),
        # then one depth for the batch (min(D, cap_r) each: GoodputPolicy's choices)
        request, depth = np.nonzero(np.arange(S)[None, :] < caps[:, None])  # [M] each
        gains = reach[request, depth]
        order = np.lexsort((depth, -gains))
        request, gains = request[order], gains[order]
        num_prefixes, max_depth = request.shape[0] + 1, int(caps.max()) if n else 0
        lengths = np.zeros((num_prefixes + max_depth + 1, n), dtype=np.int64)  # [C, n]
        np.cumsum(np.eye(n, dtype=np.int64)[request], axis=0, out=lengths[1:num_prefixes])
        lengths[num_prefixes:] = np.minimum(np.arange(max_depth + 1)[:, None], caps[None, :])
        depths = lengths.max(axis=1) if n else np.zeros(lengths.shape[0], dtype=np.int64)  # [C]
        seconds = self.cost_model.row_seconds(G, n + lengths.sum(axis=1), depths)  # [C]
        if self.drain_objective and query.num_waiting == 0 and query.tokens_left is not None and n:
            scored = np.concatenate([_drain_candidates(depths[:num_prefixes]),
                                     np.arange(num_prefixes, lengths.shape[0])])
            drain_reach = np.cumprod(self._drain_estimates(rows, estimates, query.request_ids), axis=1)
            steps = expected_drain_steps(query.tokens_left, drain_reach, caps, S, lengths=lengths[scored])  # [c]
            score = np.full(lengths.shape[0], -np.inf)
            score[scored] = 1.0 / (steps * seconds[scored])
        else:
            expected = np.zeros((n, S + 1))  # [n, S + 1]: expected tokens of request r past its first with s drafts
            np.cumsum(reach, axis=1, out=expected[:, 1:])
            score = (n + np.take_along_axis(expected, lengths.T, axis=1).sum(axis=0)) / seconds
        best = int(np.argmax(score))
        # GoodputPolicy's exploration runs every depth once at this grid (one length for the batch)
        by_depth = np.array([score[depths == d].max() for d in range(max_depth + 1)])
        self._steps_since_explore += query.steps
        explore = self._explore(G, by_depth, int(depths[best]))
        if explore != depths[best]:  # measure depth `explore`: the best candidate that runs it
            best = int(np.argmax(np.where(depths == explore, score, -np.inf)))
        chosen = lengths[best]
        # a joining request: the drafts whose expected tokens reach the last one taken, at the prior
        # (a choice of one depth: that depth)
        prior_reach = np.cumprod(self._estimates(np.array([-1]))[0])  # [S]
        if best < num_prefixes:
            self._join_length = int((prior_reach >= (gains[best - 1] if best > 0 else np.inf)).sum())
        else:
            self._join_length = int(depths[best])
        self.last_depth, self.last_lengths = int(depths[best]), chosen
        return chosen


def _drain_candidates(depths: np.ndarray) -> np.ndarray:
    """Prefix counts the drain objective scores: evenly spread, plus the first of each depth and the last."""
    spread = np.linspace(0, depths.shape[0] - 1, min(DRAIN_CANDIDATES, depths.shape[0])).round().astype(np.int64)
    firsts = np.searchsorted(depths, np.arange(int(depths[-1]) + 1))
    return np.unique(np.concatenate([spread, firsts, [depths.shape[0] - 1]]))
