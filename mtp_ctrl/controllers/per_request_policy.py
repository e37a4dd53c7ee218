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
  chunks with the token bucket that ``n (1 + D)`` rows (such a step is not ragged) and the recent
  chunk rows pad to, plus the loop's
  measured wall-over-GPU time at ``(G, D)`` (host work, bubbles);
- while requests wait (a freed slot takes the next one) a step's prompt chunks come with the
  requests that finish, as many as its tokens finish: a candidate's chunk rows are the recent mixed
  steps' times its expected tokens a step over the recent steps' (``tokens_per_step``). Priced at
  the recent chunks as they came, a draft's tokens looked to share a fixed prefill cost, so drafting
  looked cheap where a step is mostly chunks (the 1B at batch 256 on an H200: 0.72x plain);
- a draft's expected tokens are its estimate times ``draft_yield()``, what the drafts verified so
  far realised over what their estimates expected (the drafts taken are those estimated high: with
  shrunk priors and the winner's curse those run high), and a request drafts at most its tokens
  left - 1;
- one depth for the whole batch (``min(D, cap_r)`` each, ``GoodputPolicy``'s candidates) joins them;
- while requests wait the policy takes the candidate with the most expected tokens per second
  (``n`` plus its drafts' expected tokens, over its cost), when none waits (``drain_objective``)
  the one with the least expected time to finish the batch (``expected_drain_steps`` of its
  lengths x its cost), over 16 prefixes spread along the list (and the first of each depth) and
  the one-depth candidates: the batch ends with its slowest requests, so drafts of a request that
  finishes early save nothing there.

The search runs once in ``search_every`` choices (8); between, a choice re-cuts today's estimates
at the last search's price of a draft (the expected tokens of the last draft it took): a few numpy
calls. A request's prior at depths past the first follows its own first-depth estimate
(``_estimates``), with a light weight (``prior_weight=1``): in a queue a request lives ~20 steps.
Choices come every ``decide_every`` steps (8, as ``GoodputPolicy``'s): at 2 a GPU-bound batch of
64 on an H200 became host-bound (bench/RESULTS.md, "Adaptive", ragged2).

Worked example (S = 3, three requests of acceptance 0.9 / 0.6 / 0.2 at every depth, a step
costing ``1 + 0.1 (rows - 3)``, depth costs left out): the drafts sorted by expected tokens are
0.9, 0.81, 0.729 (request 0), 0.6 (request 1), 0.36, 0.216, 0.2, ...; tokens per unit of cost
after the first m: 3.0, 3.55, 3.93, 4.18, **4.31** (m = 4), 4.27, ...; so s = (3, 1, 0): 6.04
tokens for 1.4, where fixed S = 1 / 2 / 3 get 3.62 / 3.69 / 3.61.
"""

from typing import Dict, Optional, Tuple

import numpy as np

from mtp_ctrl.controllers.draft_estimates import expected_drain_steps, queue_step_seconds
from mtp_ctrl.controllers.draft_policy import DraftLengthQuery, GoodputPolicy
from mtp_ctrl.controllers.step_costs import RowCostModel  # noqa: F401 (the policies' cost model; imported from here before)
from mtp_ctrl.triton_ops._checks import check_int

DRAIN_CANDIDATES = 16  # prefixes the drain objective evaluates (evenly spread, and each depth's first)


class PerRequestGoodputPolicy(GoodputPolicy):
    """:class:`GoodputPolicy` with a draft length per request (module docstring): same arguments
    (default ``prior_weight=1``; ``min_gain``, ``switch_gain``, ``retire_after`` and the realised calibration are not
    used: candidates are costed by the warm-up's replay times per token count and the best score is
    taken, and no request is retired from speculation), and
    ``search_every``: the choices that run the candidate search (one in this many; the others keep
    its price). Its lengths differ between
    requests (``per_request_lengths``): the controller runs ragged rows where the proposer and the
    model take them. A request that joins while a choice holds drafts
    what a request with the batch's average acceptance would get (``join_length``), capped; its
    own acceptance counts start with its first outcome (``observe``)."""

    per_request_lengths = True
    YIELD_PRIOR = 8.0  # expected drafts of weight at a yield of 1 (draft_yield)

    def __init__(self, *args, search_every: int = 8, **kwargs):
        # a request's own outcomes must tell within a few steps of a ~20-step life: a light prior
        kwargs.setdefault("prior_weight", 1.0)
        super().__init__(*args, **kwargs)
        self.search_every = check_int("search_every", search_every, low=1)
        self._join_length: Optional[int] = None
        # the last search's price of a draft, reused by the next search_every - 1 choices (None: search
        # next time): (grid, drain objective?, requests waiting?, the row costs' version, the expected
        # tokens a draft must reach or None with a one-depth choice, that depth)
        self._price: Optional[Tuple[int, bool, bool, int, Optional[float], int]] = None
        self._choices_since_search = 0
        self.searches = 0  # choices that ran the candidate search (for tests and benchmarks)
        self.last_priced: Optional[Tuple[float, float]] = None  # the last search's choice: (seconds, tokens) a step
        self.last_lengths = np.zeros(0, dtype=np.int64)  # the last choice (for benchmarks)
        # decayed sums over the outcomes (as the counts): [drafts accepted, the estimates' expected accepted
        # drafts of the same verified drafts, taken before their outcome counts]: the drafts the policy takes
        # are those whose estimates are high, so their estimates run high (shrunk priors, the winner's curse)
        self._draft_yield = np.zeros(2)
        self._forgotten = np.full(8, -1, dtype=np.int64)  # ids that left lately (a ring): observe makes them no row
        self._forgotten_next = 0

    def bind(self, shape) -> None:
        super().bind(shape)
        self._forgotten = np.full(8 * shape.max_requests, -1, dtype=np.int64)

    def observe(self, request_ids: np.ndarray, draft_lengths: np.ndarray, accepted_counts: np.ndarray) -> None:
        """As :meth:`GoodputPolicy.observe`, but a request's own counts start with its first outcome,
        not when a choice first sees it (a request that joined while a choice held verifies up to
        ``decide_every`` steps before that, in a life of a few tens of steps), except for requests
        forgotten lately (finished or aborted: their last outcomes come after ``forget``, and a row
        made then would be held for good; a preempted request is not forgotten: its row stays)."""
        request_ids = np.asarray(request_ids, dtype=np.int64)
        rows = self._rows(request_ids, create=False)  # [m]
        missing = rows < 0  # requests not seen yet (joined since the last choice) or that left lately
        if missing.any():
            missing[missing] = ~np.isin(request_ids[missing], self._forgotten)
            if missing.any():  # rows for the joined ones (only they are looked up again)
                rows[missing] = self._rows(request_ids[missing], create=True)
        lengths = np.asarray(draft_lengths, dtype=np.int64)  # [m]
        S = self._model.shape[1]
        verified = np.arange(S)[None, :] < lengths[:, None]  # [m, S]
        if verified.any():  # what the estimates expected of these drafts, before they count
            with np.errstate(invalid="ignore"):  # prior_weight 0 and no counts: no estimate (NaN), left out
                reach = np.cumprod(self._estimates(rows), axis=1)  # [m, S]; rows -1 read the zero row: the prior
            known = np.isfinite(reach[:, -1])  # [m]
            self._draft_yield += (float(np.minimum(accepted_counts, lengths)[known].sum()),
                                  float(reach[verified & known[:, None]].sum()))
        self._count_outcomes(rows, lengths, accepted_counts)  # GoodputPolicy.observe with the rows looked up

    def draft_yield(self) -> float:
        """Drafts accepted over what the estimates expected of them (decayed sums of the verified
        drafts' outcomes; 8 expected drafts of prior weight at 1): what the search multiplies a
        candidate's expected drafts by."""
        accepted, expected = self._draft_yield
        return (accepted + self.YIELD_PRIOR) / (expected + self.YIELD_PRIOR)

    def forget(self, request_id: int) -> None:
        super().forget(request_id)
        self._forgotten[self._forgotten_next] = request_id
        self._forgotten_next = (self._forgotten_next + 1) % self._forgotten.shape[0]

    def _estimates(self, rows: np.ndarray, priors: Optional[np.ndarray] = None) -> np.ndarray:
        """As :meth:`GoodputPolicy._estimates`, but with ``priors`` None a request's deeper depths
        shrink toward the batch's average scaled by the request's own first-depth estimate (``a_{r,k}``
        prior ``a_k a_{r,1} / a_1``, at most 1): a request reaches depth k only when the ones before
        land, so a request whose first drafts seldom land has few counts past them, and its deeper
        estimates would otherwise stay at the batch's."""
        if priors is not None:
            return super()._estimates(rows, priors)
        reached, accepted = self._model
        average = (accepted + self.optimistic_prior) / (reached + 1.0)  # [S]
        counts = self._counts[rows]  # [n, 2, S]
        first = (counts[:, 1, 0] + self.prior_weight * average[0]) / (counts[:, 0, 0] + self.prior_weight)  # [n]
        # the request's first-depth estimate over the batch's (1 while the batch's is 0: optimistic_prior=0)
        scale = np.divide(first, average[0], out=np.ones_like(first), where=average[0] > 0)  # [n]
        priors = np.minimum(average[None, :] * scale[:, None], 1.0)  # [n, S]
        priors[:, 0] = average[0]
        return (counts[:, 1] + self.prior_weight * priors) / (counts[:, 0] + self.prior_weight)

    def join_length(self) -> Optional[int]:
        return self._join_length

    def choose(self, query: DraftLengthQuery) -> np.ndarray:
        S, caps, n, G = query.num_speculative_tokens, query.caps, query.caps.shape[0], query.batch_size
        decay = self.decay ** query.steps  # per step since the last choice
        self._model *= decay
        self._counts *= decay
        self._draft_yield *= decay
        if query.tokens_left is not None:  # a draft past a request's last token emits nothing
            caps = np.minimum(caps, np.maximum(np.asarray(query.tokens_left, dtype=np.int64) - 1, 0))
        rows = self._rows(query.request_ids, create=True)
        estimates = self._estimates(rows)  # [n, S]
        # [n, S]: expected tokens of draft k (it and those before land), times what such drafts realised
        draft_yield = self.draft_yield()
        reach = np.minimum(np.cumprod(estimates, axis=1) * draft_yield, 1.0)
        drain = bool(self.drain_objective and query.num_waiting == 0 and query.tokens_left is not None and n)
        self._update_tokens_per_step(query.steps)  # the steps the last choice served
        self._choices_since_search += 1
        price = self._price
        queued = query.num_waiting > 0  # chunks scale with a candidate's tokens (below)
        if price is not None and price[:4] == (G, drain, queued, self.cost_model.version) and \
                self._choices_since_search < self.search_every:
            # between searches: the last search's price on today's estimates (a joined request's own
            # outcomes count at once), a few numpy calls
            self._steps_since_explore += query.steps
            if price[4] is None:
                chosen = np.minimum(price[5], caps)
            else:
                chosen = ((reach >= price[4]) & (np.arange(S)[None, :] < caps[:, None])).sum(axis=1)
            self.last_depth, self.last_lengths = int(chosen.max()) if n else 0, chosen
            self._last_tokens = n + float(np.where(np.arange(S)[None, :] < chosen[:, None], reach, 0.0).sum())
            return chosen
        self._choices_since_search, self.searches = 0, self.searches + 1
        # the candidates: the first m of the drafts sorted by expected tokens (a stable sort of the
        # row-major [n, S]: draft k before k + 1 of a request, reach falls with k), then one depth for
        # the batch (min(D, cap_r) each: GoodputPolicy's choices); each scored from its prefix sums
        # alone (no [candidates, n] lengths: a decision is a fixed number of numpy calls on n S values)
        allowed = np.arange(S)[None, :] < caps[:, None]  # [n, S] bool
        num_drafts = int(allowed.sum())
        order = np.argsort(-np.where(allowed, reach, -1.0).ravel(), kind="stable")[:num_drafts]  # [M]
        gains = reach.ravel()[order]  # [M], falling
        max_depth = int(caps.max()) if n else 0
        one_depth = np.minimum(np.arange(max_depth + 1)[None, :], caps[:, None])  # [n, D + 1]
        expected = np.zeros((n, S + 1))  # [n, S + 1]: expected tokens of request r past its first with s drafts
        np.cumsum(np.where(allowed, reach, 0.0), axis=1, out=expected[:, 1:])
        drafts = np.concatenate([np.arange(num_drafts + 1), one_depth.sum(axis=0)])  # [C]
        depths = np.concatenate([[0], np.maximum.accumulate(order % S + 1), np.arange(max_depth + 1)])  # [C]
        tokens = n + np.concatenate([[0.0], np.cumsum(gains),
                                     np.take_along_axis(expected, one_depth, axis=1).sum(axis=0)])  # [C]
        # while requests wait, a freed slot takes the next one: a step's prefill chunks come with the
        # requests that finish, as many as its tokens finish (queue_step_seconds: without drafts in the
        # finish groups they are in, with drafts spread); without joining_tokens, the recent
        # steps' chunks scaled by its tokens over theirs (priced at the recent chunks alone, drafting
        # looked to share a fixed prefill cost among more tokens: the 1B at batch 256, 0.72x plain).
        drafting = (drafts > 0).astype(np.float64)  # [C] drafts for anyone: the batch's finishes spread
        mixed_rows = n * (1 + depths)  # [C] a step with prompt chunks is not ragged: 1 + V rows a decode request
        seconds = queue_step_seconds(self.cost_model, query, n + drafts, depths, drafting, tokens,
                                     mixed_rows=mixed_rows) if queued else None
        if seconds is None:
            scale = tokens / self.tokens_per_step if queued and self.tokens_per_step else None
            seconds = self.cost_model.row_seconds(G, n + drafts, depths, prefill_scale=scale, mixed_rows=mixed_rows)
        num_prefixes = num_drafts + 1
        if drain:
            scored = np.concatenate([_drain_candidates(depths[:num_prefixes]), np.arange(num_prefixes, drafts.shape[0])])
            drain_reach = np.cumprod(self._drain_estimates(rows, estimates, query.request_ids), axis=1)
            lengths = self._lengths_of(scored, num_prefixes, order, one_depth, n, S)  # [c, n]
            steps = expected_drain_steps(query.tokens_left, drain_reach, caps, S, lengths=lengths)  # [c]
            score = np.full(drafts.shape[0], -np.inf)
            score[scored] = 1.0 / (steps * seconds[scored])
        else:
            score = tokens / seconds
        best = int(np.argmax(score))
        # GoodputPolicy's exploration runs every depth once at this grid (one length for the batch)
        by_depth = np.full(max_depth + 1, -np.inf)
        np.maximum.at(by_depth, depths, np.nan_to_num(score, nan=-np.inf))
        self._steps_since_explore += query.steps
        explore = self._explore(G, by_depth, int(depths[best]))
        exploring = explore != depths[best]
        if exploring:  # measure depth `explore`: the best candidate that runs it
            best = int(np.argmax(np.where(depths == explore, score, -np.inf)))
        chosen = self._lengths_of(np.array([best]), num_prefixes, order, one_depth, n, S)[0]
        # a joining request: the drafts whose expected tokens reach the last one taken, at the prior
        # (a choice of one depth: that depth)
        prior_reach = np.cumprod(self._estimates(np.array([-1]))[0]) * draft_yield  # [S]
        threshold = (gains[best - 1] if best > 0 else np.inf) if best < num_prefixes else None
        self._join_length = int(depths[best]) if threshold is None else int((prior_reach >= threshold).sum())
        # an exploring choice is not a price to keep
        self._price = None if exploring else (G, drain, queued, self.cost_model.version, threshold, int(depths[best]))
        self.last_depth, self.last_lengths, self._last_tokens = int(depths[best]), chosen, float(tokens[best])
        self.last_priced = (float(seconds[best]), float(tokens[best]))  # the search's choice (benchmarks)
        return chosen

    @staticmethod
    def _lengths_of(candidates: np.ndarray, num_prefixes: int, order: np.ndarray, one_depth: np.ndarray,
                    n: int, S: int) -> np.ndarray:
        """``[c, n]`` the lengths of candidates ``[c]``: the first ``m`` sorted drafts (``m <
        num_prefixes``; ``order`` ``[M]`` their flat ``r S + k`` indices), else one depth
        (``one_depth`` ``[n, D + 1]``)."""
        taken = np.full(n * S, order.shape[0], dtype=np.int64)  # [n S]: each draft's place in the order
        taken[order] = np.arange(order.shape[0])
        prefix = np.minimum(candidates, num_prefixes - 1)  # [c]
        lengths = (taken.reshape(1, n, S) < prefix[:, None, None]).sum(axis=2)  # [c, n]
        is_depth = candidates >= num_prefixes
        if is_depth.any():
            lengths[is_depth] = one_depth[:, candidates[is_depth] - num_prefixes].T
        return lengths


def _drain_candidates(depths: np.ndarray) -> np.ndarray:
    """Prefix counts the drain objective scores: evenly spread, plus the first of each depth and the last."""
    spread = np.linspace(0, depths.shape[0] - 1, min(DRAIN_CANDIDATES, depths.shape[0])).round().astype(np.int64)
    firsts = np.searchsorted(depths, np.arange(int(depths[-1]) + 1))
    return np.unique(np.concatenate([spread, firsts, [depths.shape[0] - 1]]))
