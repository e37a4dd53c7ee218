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
  time of the ragged token count its rows pad to, plus the loop's measured wall-over-GPU time at
  ``(G, D)`` (host work, bubbles, steps with prefill chunks);
- while requests wait the policy takes the candidate with the most expected tokens per second
  (``(n + sum of its m) / cost``), when none waits (``drain_objective``) the one with the least
  expected time to finish the batch (``expected_drain_steps`` of its lengths x its cost), over 16
  candidates spread along the list (and the first of each depth).

Worked example (S = 3, three requests of acceptance 0.9 / 0.6 / 0.2 at every depth, a step
costing ``1 + 0.1 (rows - 3)``, depth costs left out): the drafts sorted by expected tokens are
0.9, 0.81, 0.729 (request 0), 0.6 (request 1), 0.36, 0.216, 0.2, ...; tokens per unit of cost
after the first m: 3.0, 3.55, 3.93, 4.18, **4.31** (m = 4), 4.27, ...; so s = (3, 1, 0): 6.04
tokens for 1.4, where fixed S = 1 / 2 / 3 get 3.62 / 3.69 / 3.61.
"""

from typing import Dict, Optional, Tuple

import numpy as np

from mtp_ctrl.controllers.draft_policy import DraftLengthQuery, GoodputPolicy, expected_drain_steps
from mtp_ctrl.controllers.step_costs import StepCostModel

DRAIN_CANDIDATES = 16  # prefixes the drain objective evaluates (evenly spread, and each depth's first)


class RowCostModel(StepCostModel):
    """:class:`StepCostModel` (the loop's wall time per (G, D)) and, for ragged rows, the GPU time
    of a decode-only step by its token count: ``row_gpu[(G, T, D)]``, the warm-up's replay times of
    the ragged token counts (``controller.warmup()``; ``set_row_costs``)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.row_gpu: Dict[Tuple[int, int, int], float] = {}  # (G, T, D) -> replay seconds
        self._row_tables: Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray]] = {}  # (G, D) -> ([k] T, [k] s)

    def set_row_costs(self, row_costs: Dict[Tuple[int, int, int], float]) -> None:
        self.row_gpu = {(int(g), int(t), int(d)): float(s) for (g, t, d), s in row_costs.items() if s > 0}
        tables: Dict[Tuple[int, int], list] = {}
        for (g, t, d), seconds in sorted(self.row_gpu.items()):
            tables.setdefault((g, d), []).append((t, seconds))
        self._row_tables = {key: (np.array([t for t, _ in rows], dtype=np.float64), np.array([s for _, s in rows]))
                            for key, rows in tables.items()}

    def row_seconds(self, batch_size: int, rows: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """``[c]`` seconds of decode-only steps at grid ``batch_size`` with ``rows[i]`` real rows and
        ``depths[i]`` draft depths: the replay time of the smallest measured token count that holds
        the rows, plus ``max(0, seconds(G, D) - gpu(G, D))`` (what the loop adds to the GPU time at
        that depth, measured; 0 before it is). A depth with no row costs (CPU, eager steps)
        interpolates ``seconds(G, D)`` linearly in rows from ``seconds(G, 0)`` at G rows."""
        rows, depths = np.asarray(rows, dtype=np.float64), np.asarray(depths, dtype=np.int64)
        out = np.empty(rows.shape[0])
        grid = min((g for g, _ in self._row_tables if g >= batch_size), default=None)
        base = self.seconds(batch_size, 0)
        for depth in range(int(depths.max()) + 1 if depths.shape[0] else 0):
            chosen = depths == depth
            wall = self.seconds(batch_size, depth)
            table = self._row_tables.get((grid, depth))
            if table is not None:
                tokens, seconds = table
                index = np.searchsorted(tokens, rows[chosen]).clip(max=tokens.shape[0] - 1)
                gpu = self._lookup(self.gpu, batch_size, depth)
                gap = max(0.0, wall - gpu) if gpu is not None and self.is_measured(batch_size, depth) else 0.0
                out[chosen] = seconds[index] + gap
            elif depth == 0:
                out[chosen] = base
            else:  # rows between G (a plain step's) and G (1 + D) (the tier's)
                share = (rows[chosen] - batch_size) / (batch_size * depth)
                out[chosen] = base + (wall - base) * share
        return out


class PerRequestGoodputPolicy(GoodputPolicy):
    """:class:`GoodputPolicy` with a draft length per request (module docstring): same arguments.
    Its lengths differ between requests (``per_request_lengths``): the controller runs ragged rows
    where the proposer and the model take them. A request that joins while a choice holds drafts
    what a request with the batch's average acceptance would get (``join_length``), capped."""

    per_request_lengths = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._join_length: Optional[int] = None
        self.last_lengths = np.zeros(0, dtype=np.int64)  # the last choice (for benchmarks)

    def bind(self, shape) -> None:
        super().bind(shape)
        self.cost_model = RowCostModel()

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
        # the candidates: the first m of the drafts sorted by expected tokens (draft k before k + 1)
        request, depth = np.nonzero(np.arange(S)[None, :] < caps[:, None])  # [M] each
        gains = reach[request, depth]
        order = np.lexsort((depth, -gains))
        request, depth, gains = request[order], depth[order] + 1, gains[order]
        tokens = n + np.concatenate([[0.0], np.cumsum(gains)])  # [M + 1]
        depths = np.concatenate([[0], np.maximum.accumulate(depth)]) if depth.shape[0] else np.zeros(1, np.int64)
        seconds = self.cost_model.row_seconds(G, n + np.arange(tokens.shape[0]), depths)  # [M + 1]
        if self.drain_objective and query.num_waiting == 0 and query.tokens_left is not None and n:
            candidates = _drain_candidates(depths)
            priors = self._population_priors(estimates, query.request_ids)
            drain_reach = reach if priors is None else np.cumprod(self._estimates(rows, priors), axis=1)
            lengths = np.stack([_lengths(request, m, n) for m in candidates.tolist()])  # [C, n]  # host-ok: numpy
            steps = expected_drain_steps(query.tokens_left, drain_reach, caps, S, lengths=lengths)  # [C]
            score = np.full(tokens.shape[0], -np.inf)
            score[candidates] = 1.0 / (steps * seconds[candidates])
        else:
            score = tokens / seconds
        best = int(np.argmax(score))
        # GoodputPolicy's exploration runs every depth once at this grid (one length for the batch)
        by_depth = np.array([score[depths == d].max() for d in range(int(depths[-1]) + 1)])
        self._steps_since_explore += query.steps
        explore = self._explore(G, by_depth, int(depths[best]))
        if explore != depths[best]:  # measure depth `explore`: the best candidate that runs it
            best = int(np.argmax(np.where(depths == explore, score, -np.inf)))
        lengths = _lengths(request, best, n)
        # a joining request: the drafts whose expected tokens reach the last one taken, at the prior
        prior_reach = np.cumprod(self._estimates(np.array([-1]))[0])  # [S]
        cutoff = gains[best - 1] if best > 0 else np.inf
        self._join_length = int((prior_reach >= cutoff).sum())
        self.last_depth, self.last_lengths = int(lengths.max()) if n else 0, lengths
        return lengths


def _lengths(request: np.ndarray, count: int, n: int) -> np.ndarray:
    """``[n]`` int64: the drafts each request gets from the first ``count`` sorted drafts."""
    return np.bincount(request[:count], minlength=n).astype(np.int64)


def _drain_candidates(depths: np.ndarray) -> np.ndarray:
    """Prefix counts the drain objective scores: evenly spread, plus the first of each depth and the last."""
    spread = np.linspace(0, depths.shape[0] - 1, min(DRAIN_CANDIDATES, depths.shape[0])).round().astype(np.int64)
    firsts = np.searchsorted(depths, np.arange(int(depths[-1]) + 1))
    return np.unique(np.concatenate([spread, firsts, [depths.shape[0] - 1]]))
