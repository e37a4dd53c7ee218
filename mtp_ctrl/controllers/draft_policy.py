"""Draft-length policies: how many drafts each request verifies, chosen per step on the host.

Each step the controller asks its policy for ``s_r`` in ``[0, cap_r]`` for every request that
samples (decodes and final prompt chunks): ``cap_r = min(S, SamplingParams.num_speculative_tokens)``.
The step then drafts ``D = max_r s_r`` depths (a depth no request uses is not computed; ``D = 0``
runs no draft phase), and the next step verifies at most ``s_r`` of request r's drafts (its draft
rows past ``s_r`` are padding in the same graph shape, masked before acceptance). Exact-match
acceptance with position-keyed noise makes the output independent of every ``s_r``; rejection
acceptance stays lossless (a shorter chain of the same rule).

The policy is a hook: subclass :class:`DraftLengthPolicy` and pass it as
``TextGenerationController(..., draft_policy=...)``. Its inputs are host numbers every
tensor-parallel rank has alike (the step's requests, the read-back's accepted counts, a step-cost
profile made rank-identical at warm-up), so a deterministic policy makes the same choice on every
rank (the TP lockstep check includes the lengths).

- :class:`FixedDraftLength` (the default): ``s_r = cap_r``, the old fixed-S behaviour.
- :class:`GoodputPolicy`: per-request decayed per-depth acceptance and a step-cost model; picks
  the depth D that maximises expected tokens per second of the batch (``D = 0`` where drafting
  does not pay). Off by default: an estimate can be wrong (a step verifies ``1 + V`` rows per
  decode request, V the most any of them holds: docs/draft_lengths.md).
- :class:`RandomDraftLengths`: seeded random lengths, for tests (the output must not change).
"""

import dataclasses
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
# np.unique (the policies' row lookups, the queue's finish groups) imports numpy.ma on its first call:
# 10-50 ms of host time inside the first decision while serving, unless it is imported with the package
import numpy.ma  # noqa: F401

from mtp_ctrl.controllers.draft_estimates import at_depths, expected_drain_steps, prefix_products, queue_step_seconds
from mtp_ctrl.controllers.request_rows import RequestRows
from mtp_ctrl.controllers.step_costs import RowCostModel, StepCostModel
from mtp_ctrl.triton_ops._checks import check_int


@dataclasses.dataclass(frozen=True)
class DraftLengthQuery:
    """One step's question to the policy (host values only)."""

    request_ids: np.ndarray  # [n] int64, the requests that sample this step, in row order
    caps: np.ndarray  # [n] int64, each request's most drafts: min(S, its SamplingParams cap)
    num_speculative_tokens: int  # S, the engine's most drafts
    batch_size: int  # G, the step's grid (padded to its CUDA-graph batch when one covers it)
    # launches since the policy's last choice (it held for them: ``decide_every``); a decode run's
    # launch of k steps counts once (its lengths are chosen once), here and in every hold and decay
    steps: int = 1
    num_waiting: int = 0  # requests queued, not yet admitted (0: the batch drains: nobody takes a freed slot)
    tokens_left: Optional[np.ndarray] = None  # [n] int64, the most tokens each may still emit (None: unknown)
    # the tokens a waiting request may emit (max_new_tokens within max_model_len; the controller: the mean
    # of the next 16): how long a request that takes a freed slot stays (None: unknown, or nobody waits)
    joining_tokens: Optional[int] = None


class DraftLengthPolicy:
    """Base class of draft-length policies (module docstring). Override :meth:`choose`; the rest
    have working defaults.

    When ``choose`` is called: on a step whose sampling requests (decodes and final prompt
    chunks) need lengths and no choice holds. A choice holds for ``decide_every`` steps (longer
    while it repeats: ``longest_hold``) while the step's sampling requests stay the same, lose
    some (they keep their lengths), or gain some: a request that joins while a choice holds
    drafts ``min(D, cap_r)`` with D the most drafts of that choice (``joins_take_held_depth``;
    False: a join ends the hold and asks ``choose`` at once). What it sees: the step's sampling
    requests in row order with their caps, the step's grid, the steps the last choice served
    (``query.steps``), the queue (``num_waiting``, ``tokens_left``). Its outcomes (``observe``)
    include the steps of joined requests, which ``choose`` has not seen yet."""

    # a choice holds for up to this many steps while the step's sampling requests stay the same
    # (or some of them leave or join); the outcomes of those steps come to `observe` in one call.
    # 1: choose and observe every step.
    decide_every = 1
    # each time the policy returns the same lengths for the same requests, the hold doubles, up to
    # this many steps (None: decide_every, no doubling); the held steps' outcomes come to `observe`
    # when the hold ends (at most this many steps late) and always before the next `choose`
    longest_hold = None
    # a request that joins while a choice holds takes its depth (capped) until the hold ends: in a
    # queued workload a request joins almost every step, and asking `choose` on each join is a
    # decision every step (or the policy's `join_length()` when it gives one). False: a join asks
    # `choose` at once
    joins_take_held_depth = True
    # the policy's lengths differ between requests of a step (not one depth for the batch): the
    # controller then runs each decode request's own 1 + s_r rows (ragged rows) where the proposer
    # and the model take them (Proposer.takes_ragged_rows; no Mamba / GDN layers), and warmup()
    # captures the ragged token counts too
    per_request_lengths = False

    def __init__(self):
        self.cost_model: Optional[StepCostModel] = None
        # [D + 1] float64 or None: a request's expected tokens a step at each depth, at the last choice
        # (the cost model's realised samples keep them beside the tokens that came: its token_calibration)
        self.expected_tokens: Optional[np.ndarray] = None

    def bind(self, shape) -> None:
        """Called once by the controller (S > 0 only) with its ``EngineShape`` (S is
        ``shape.num_speculative_tokens``; each query carries it too)."""
        self.shape = shape
        self.cost_model = StepCostModel()

    def warmup_depths(self, num_speculative_tokens: int) -> Sequence[int]:
        """The draft depths D whose step graphs ``warmup()`` captures (others are captured on first use)."""
        return range(num_speculative_tokens + 1)

    def choose(self, query: DraftLengthQuery) -> np.ndarray:
        """``[n]`` int64 draft lengths in ``[0, query.caps]`` (clipped by the caller)."""
        raise NotImplementedError

    def join_length(self) -> Optional[int]:
        """With ``joins_take_held_depth``: the drafts (capped) a request that joins while the last
        choice holds makes; None (the default): that choice's most drafts. Asked once per choice."""
        return None

    def admits_drafts(self) -> bool:
        """Whether a request admitted now may draft (asked at each admission, a preempted request's
        return included). False: it is retired from speculation on admission (see :meth:`retiring`).
        Default: True."""
        return True

    def retiring(self) -> Sequence[int]:
        """Request ids retired from speculation, asked after each :meth:`choose` (ids of that
        choice's requests, else a ValueError): from the next
        step on each verifies no draft, for good (its cap is 0, also after a preemption), and the
        proposer stops keeping what only its drafts would read (``Proposer.on_retired``: the MTP
        proposer never catches up its skipped windows again, so a batch held at D = 0 costs plain
        decoding's steps, not plain's plus a catch-up every M positions). It cannot be undone for
        that request. Default: none."""
        return ()

    def observe(self, request_ids: np.ndarray, draft_lengths: np.ndarray, accepted_counts: np.ndarray) -> None:
        """A step's outcome (``[m]`` each, host ints): request ``request_ids[i]`` verified
        ``draft_lengths[i]`` drafts and accepted ``accepted_counts[i]``. Default: nothing."""

    def forget(self, request_id: int) -> None:
        """The request is gone for good (finished or aborted), called once. A request preempted for
        KV space is not forgotten: it returns with the same text, so its outcomes so far stay
        evidence about it. Default: nothing."""


class FixedDraftLength(DraftLengthPolicy):
    """Every request verifies its cap (S unless its SamplingParams says fewer): the old behaviour."""

    def warmup_depths(self, num_speculative_tokens: int) -> Sequence[int]:
        return (num_speculative_tokens,)

    def choose(self, query: DraftLengthQuery) -> np.ndarray:
        return query.caps.copy()


class RandomDraftLengths(DraftLengthPolicy):
    """Uniform random lengths in ``[0, cap]`` from a seeded generator (deterministic for equal
    call sequences, so every TP rank agrees), with probability ``all_zero`` of a step with no
    drafts at all. For tests: output must not depend on the lengths."""

    per_request_lengths = True

    def __init__(self, seed: int = 0, all_zero: float = 0.2):
        super().__init__()
        self._rng = np.random.default_rng(seed)
        self.all_zero = all_zero
        self.chosen = []  # every choice made, for tests

    def choose(self, query: DraftLengthQuery) -> np.ndarray:
        if self._rng.random() < self.all_zero:
            lengths = np.zeros_like(query.caps)
        else:
            lengths = np.floor(self._rng.random(query.caps.shape[0]) * (query.caps + 1)).astype(np.int64)
        self.chosen.append(lengths.copy())
        return lengths


class GoodputPolicy(DraftLengthPolicy):
    """Maximise expected tokens per second of the batch.

    Acceptance: for each request and depth k (1-based), the decayed counts of steps that reached
    draft k (drafts 1..k-1 accepted, k verified) and that accepted it; the estimate shrinks
    toward the model's recent average (the same counts over all requests) with weight
    ``prior_weight``, and that average toward ``optimistic_prior`` with weight 1. Counts decay by
    ``decay`` per step (``query.steps``), so estimates that no step refreshes (nobody drafts) drift back to the
    prior and the policy tries again. Expected tokens of request r with ``s`` drafts:
    ``1 + sum_{k <= s} prod_{j <= k} a_{r,j}``.

    Cost: :class:`StepCostModel` of the step's grid and depth D (the loop's wall time per steady
    step). While requests wait to be admitted (or the queue is unknown) the policy picks
    ``D = argmax_D sum_r tokens_r(min(D, cap_r)) / cost(G, D)``, the live batch's tokens per
    second: a freed slot is refilled at once, so that is what the server delivers. When nobody
    waits (``query.num_waiting == 0`` with ``tokens_left`` known; ``drain_objective``) the batch
    only drains: it is done when its slowest request is, and every step until then costs a full
    step. Then it picks ``D = argmin_D E[max_r steps_r(D)] * cost(G, D)``, the expected time to
    finish every live request (:func:`expected_drain_steps`: a request's steps to emit its tokens
    left, normal with the mean and variance of its tokens per step; the expected maximum over the
    batch). Each request gets ``min(D, cap_r)`` (within one graph shape a request drafting less
    than D saves nothing). Population: a new request's estimate is the batch's average, but a
    batch of new requests is not n copies of the average: their slowest set the end. So the
    drain objective takes each request's prior (weight ``prior_weight``) from the estimates of
    recent requests that left with evidence (``population_evidence`` first drafts verified,
    decayed; a ring of 2 x max_requests), at evenly spread quantiles matched to the batch's own
    ranking: a closed batch after a mixed one expects a third of its requests at 0.2 from the
    first step, before they have shown it.

    Switching: another depth must score ``switch_gain`` above the depth of the last choice made on
    the scores (not to explore) to replace it: a switch costs what no step price shows (the MTP
    catch-up of the windows D = 0 skipped, the first steps at a new depth), and at a near tie
    flipping between depths cost more than either held (a D = 0 kept only by this margin does not
    count toward retirement, which is for good). A batch that drains is priced by its
    decode-only steps (nobody joins it: ``StepCostModel.policy_decode_seconds``).

    Exploration: the cost of a depth is known only once the loop ran it. A depth the batch may
    take (``D <= max cap_r``) that is not measured at the step's grid is run first (the one that
    scores best on its optimistic seed; at most ``explore_tries`` holds per grid and depth, for
    a loop that never reaches a steady step). After that, the first choice a wait after the last
    exploration runs the runner-up depth for one hold if it scores within ``explore_within`` of
    the best, measured afresh (``StepCostModel.remeasure``): a measurement that was unlucky, or a
    cost that changed, is corrected. The wait starts
    at ``4 x decide_every`` steps and doubles with each such hold up to ``explore_every``: the first
    measurements are taken while serving starts (a cold host, the first steps after capture) and a
    depth measured dear then is never run again to correct it unless the runner-up comes back soon;
    later a runner-up costs at most ``1 - explore_within`` of one hold in ``explore_every`` steps.
    With ``retime_explored`` the first such waits time every depth but the best once more, whatever
    it scores (one hold each, once per grid): a depth far behind the best otherwise keeps its cold
    first measurement for good (:meth:`settled`: done at a grid).
    Vectorised over the batch (numpy: no per-request Python in ``choose`` or ``observe``, a fixed
    number of numpy calls whatever the batch), and run once per ``decide_every`` steps while the
    batch stays the same (the controller reuses the choice meanwhile and hands the outcomes over in
    one ``observe``); a depth it chooses again holds twice as long (whoever joined or left), up to
    ``longest_hold`` steps (steady decoding then asks it once in 64 steps): its host work per step
    is then a small fraction of a host-bound step's.

    Retirement: a batch held at D = 0 still keeps every MTP cache exact for when drafting resumes
    (a forced catch-up every M positions: 12-13 % of a plain step's GPU time on the demo). So once
    the policy has chosen D = 0 at a settled grid (:meth:`settled`) while requests wait, on its
    own scores and not to explore, for ``retire_after`` steps in a row (launches:
    ``DraftLengthQuery.steps``), it retires the live requests from speculation (:meth:`retiring`):
    their decode steps then run no draft phase at all, plain decoding's kernels. It admits new
    ones retired (:meth:`admits_drafts`), and admits drafting requests again when nobody waits (the
    queue's workload is over) or ``explore_every`` steps after retiring; estimates that nothing
    refreshed meanwhile have drifted to the prior, so the new requests are tried.
    ``retire_after=None``: never retire. Only in a queue: a closed batch that drains may want
    drafts for its last requests, which a retired request could not make (retiring draining
    batches too was measured and not kept: the 1B's queued mix at batch 64 retired its drain and
    ran 0.95x the best fixed S, against 0.98x).
    """

    SMALLEST_POPULATION = 8  # estimates of requests that left, before the drain objective uses them as priors

    def __init__(self, decay: float = 0.95, prior_weight: float = 4.0, optimistic_prior: float = 0.8,
                 min_gain: float = 1.02, decide_every: int = 8, longest_hold: Optional[int] = None,
                 drain_objective: bool = True, explore_tries: int = 3, explore_every: int = 512,
                 explore_within: float = 0.8, population_evidence: float = 2.0, retime_explored: bool = True,
                 retire_after: Optional[int] = 32, switch_gain: float = 1.05):
        super().__init__()
        # another depth must score this factor above the one the last choice (on the scores) took to replace it
        self.switch_gain = _check_number("switch_gain", switch_gain, low=1.0)
        self._held_depth: Optional[int] = None
        self.retire_after = None if retire_after is None else check_int("retire_after", retire_after, low=1)
        self.speculation_retired = False  # requests admitted now are retired (admits_drafts); reports read it
        self.retired = 0  # requests retired so far (reports)
        self._zero_steps = 0  # steps in a row served by settled D = 0 choices while requests waited
        self._last_zero = False  # the last choice was such a choice
        self._retired_steps = 0  # steps since the policy last retired a batch
        self._retiring: list = []  # ids retired by the last choice, not yet asked for (retiring)
        self.population_evidence = _check_number("population_evidence", population_evidence, low=0.0)
        if not isinstance(drain_objective, bool):
            raise TypeError(f"drain_objective must be a bool, got {drain_objective!r}")
        self.drain_objective = drain_objective
        self.explore_tries = check_int("explore_tries", explore_tries, low=0)
        self.explore_every = check_int("explore_every", explore_every, low=1)
        self.explore_within = _check_number("explore_within", explore_within, low=0.0, high=1.0)
        self._tries: Dict[Tuple[int, int], int] = {}  # (grid, D) -> holds run to measure it
        if not isinstance(retime_explored, bool):
            raise TypeError(f"retime_explored must be a bool, got {retime_explored!r}")
        self.retime_explored = retime_explored
        self._retimed: set = set()  # (grid, D) timed again after the first exploration (retime_explored)
        self._steps_since_explore = 0
        self.explored = 0  # choices made to measure a depth (not yet measured, or the runner-up)
        self.decide_every = check_int("decide_every", decide_every, low=1)
        # steps to wait before the next runner-up hold: doubles from 4 x decide_every up to explore_every
        self._explore_wait = min(4 * self.decide_every, self.explore_every)
        # None: 64 steps (or decide_every, if longer); a given hold cannot be shorter than decide_every
        self.longest_hold = (max(64, self.decide_every) if longest_hold is None
                             else check_int("longest_hold", longest_hold, low=self.decide_every))
        _check_number("decay", decay, low=0.0, high=1.0)
        if decay == 0.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        _check_number("prior_weight", prior_weight, low=0.0)
        _check_number("optimistic_prior", optimistic_prior, low=0.0, high=1.0)
        _check_number("min_gain", min_gain, low=0.0)
        self.decay, self.prior_weight, self.optimistic_prior = decay, prior_weight, optimistic_prior
        # a deeper D must beat the best shallower one by this factor (1.0: any gain): a near tie, within the
        # loop's run-to-run spread, keeps the fewer drafts (they cost less if the estimate is wrong)
        self.min_gain = min_gain
        self.last_depth = None  # the D of the last choice (for benchmarks)
        # [D + 1] at the last choice: each depth's priced seconds a step and its score (higher is better:
        # tokens a second, or one over the expected drain time); None before the first (reports)
        self.last_seconds = self.last_scores = None
        self._index = RequestRows()  # request id -> its row of _counts
        self._leaving = []  # ids forgotten since the last lookup: their estimates join the population first
        # the expected tokens a step of the last choice, and their moving average over the steps the
        # choices served (per step the weight of mixed_share's: the window of the recent prefill rows)
        self._last_tokens: Optional[float] = None
        self.tokens_per_step: Optional[float] = None

    def bind(self, shape) -> None:
        super().bind(shape)
        self.cost_model = RowCostModel()  # a queue's steps are priced by their rows (choose)
        S = shape.num_speculative_tokens
        self._model = np.zeros((2, S))  # [2, S] (reached, accepted) over every request
        # [rows + 1, 2, S] (reached, accepted) per request, decayed every step; the last row stays zero,
        # so row -1 (a request with no counts yet) reads zeros
        self._counts = np.zeros((1, 2, S))
        # [P, S] the estimates of recent requests that left with evidence (a ring of 2 x max_requests):
        # the drain objective's prior of a new request (module docstring: "population")
        self._population = np.zeros((max(32, 2 * shape.max_requests), S))
        self._population_size, self._population_next = 0, 0
        self._ranked_population = None  # [P, S] the population ranked (_population_priors); None: stale
        # [(S + 1)^2, 2S]: what outcome code s * (S + 1) + a (s drafts verified, a accepted) adds to
        # (reached draft k: drafts 1..k-1 accepted and k verified; accepted draft k), k = 1..S
        lengths, accepted = np.divmod(np.arange((S + 1) ** 2), S + 1)  # [(S + 1)^2] each
        depths = np.arange(S)[None, :]  # [1, S]: k - 1
        self._code_outcomes = np.concatenate([(depths < lengths[:, None]) & (depths <= accepted[:, None]),
                                              depths < accepted[:, None]], axis=1).astype(np.float64)

    def _rows(self, request_ids: np.ndarray, create: bool) -> np.ndarray:
        """``[n]`` rows of the requests' counts (-1: none yet, unless ``create``: new rows start at zero)."""
        if self._leaving:
            self._retire_leaving()
        rows, new_rows = self._index.rows(request_ids, create)
        if new_rows.shape[0]:
            grow = self._index.capacity + 1 - self._counts.shape[0]
            if grow > 0:
                self._counts = np.concatenate([self._counts, np.zeros((grow,) + self._counts.shape[1:])])
            self._counts[new_rows] = 0
        return rows

    def _retire_leaving(self) -> None:
        """The requests forgotten since the last lookup: the estimate of each that verified at least
        ``population_evidence`` first drafts (decayed) joins the population; then their rows are freed."""
        ids, self._leaving = np.unique(np.array(self._leaving, dtype=np.int64)), []
        rows, _ = self._index.rows(ids)
        rows = rows[rows >= 0]
        rows = rows[self._counts[rows, 0, 0] >= self.population_evidence]
        if rows.shape[0]:
            estimates = self._estimates(rows)[-self._population.shape[0]:]  # [m, S]
            slots = (self._population_next + np.arange(estimates.shape[0])) % self._population.shape[0]
            self._population[slots] = estimates
            self._population_next = int(slots[-1] + 1) % self._population.shape[0]
            self._population_size = min(self._population_size + estimates.shape[0], self._population.shape[0])
            self._ranked_population = None  # the population changed: rank it again when next asked
        for request_id in ids.tolist():  # host-ok: numpy
            self._index.remove(request_id)

    def _estimates(self, rows: np.ndarray, priors: Optional[np.ndarray] = None) -> np.ndarray:
        """``[n, S]`` estimated acceptance of each depth given the ones before it; ``priors`` ``[n, S]``
        (None: the model's recent average for every request) weigh ``prior_weight``."""
        reached, accepted = self._model
        if priors is None:
            priors = (accepted + self.optimistic_prior) / (reached + 1.0)  # [S]
        counts = self._counts.take(rows, axis=0)  # [n, 2, S] (take: ~1.5x cheaper than counts[rows])
        return (counts[:, 1] + self.prior_weight * priors) / (counts[:, 0] + self.prior_weight)

    def _population_priors(self, estimates: np.ndarray, request_ids: np.ndarray) -> Optional[np.ndarray]:
        """``[n, S]`` priors for the drain objective: the batch's requests, ranked by their estimate
        (ties by id), take the population's estimates at evenly spread quantiles in the same order,
        so a batch of new requests is expected to hold the spread of recent ones (its slowest set
        the end), not n copies of their average; None with fewer than 8 in the population."""
        if self._population_size < self.SMALLEST_POPULATION:
            return None
        ranked = self._ranked_population  # [P, S]: changes only when requests leave (_retire_leaving)
        if ranked is None:
            population = self._population[: self._population_size]
            ranked = population[np.argsort(prefix_products(population).sum(axis=1), kind="stable")]
            self._ranked_population = ranked
        n = estimates.shape[0]
        order = np.lexsort((request_ids, prefix_products(estimates).sum(axis=1)))  # [n] slowest first
        priors = np.empty_like(estimates)
        priors[order] = ranked[((np.arange(n) + 0.5) * ranked.shape[0] / n).astype(np.int64)]
        return priors

    def _drain_estimates(self, rows: np.ndarray, estimates: np.ndarray, request_ids: np.ndarray) -> np.ndarray:
        """``[n, S]`` the drain objective's estimates: ``estimates`` with the population's quantile
        priors (:meth:`_population_priors`) for the requests without evidence of their own (fewer
        than ``population_evidence`` first drafts verified, decayed): the population's spread stands
        in for a spread not seen yet; once a request has shown some, a quantile prior matched to its
        rank counts its spread twice (the demo at batch 128, a closed batch after one like it: 8
        steps in, its slowest expected 32 more steps at D = 2 where they took 22, and it switched to
        D = 0: 43 steps for the batch against 30)."""
        if self._population_size < self.SMALLEST_POPULATION:  # no population priors
            return estimates
        new = self._counts[rows, 0, 0] < self.population_evidence  # [n]; rows -1: zeros
        if not new.any():  # every request has its own evidence: no ranking needed
            return estimates
        priors = self._population_priors(estimates, request_ids)
        estimates = estimates.copy()
        estimates[new] = self._estimates(rows[new], priors[new])
        return estimates

    def acceptance(self, request_id: int) -> np.ndarray:
        """``[S]`` float64: the estimated acceptance of each depth given the ones before it."""
        return self._estimates(self._rows(np.array([request_id]), create=False))[0]

    def choose(self, query: DraftLengthQuery) -> np.ndarray:
        S, caps, n = query.num_speculative_tokens, query.caps, query.caps.shape[0]
        decay = self.decay ** query.steps  # per step since the last choice
        self._model *= decay
        self._counts *= decay
        # rows are made here, for the live requests a choice is for (observe() makes none: see there)
        rows = self._rows(query.request_ids, create=True)
        if self.speculation_retired and self._still_retired(query):
            self._update_tokens_per_step(query.steps)
            self.last_depth, self._last_tokens = 0, float(n)  # a token a request a step
            return np.zeros_like(caps)
        estimates = self._estimates(rows)  # [n, S]
        max_depth = int(caps.max()) if n else 0  # a deeper D drafts no more for anyone
        self._update_tokens_per_step(query.steps)
        drain = bool(self.drain_objective and query.num_waiting == 0 and query.tokens_left is not None and n)
        reach = prefix_products(estimates)  # [n, S]: P(a step accepts draft k or more)
        gain = np.zeros((n, S + 1))  # [n, S + 1]: expected accepted drafts with s drafts
        gain[:, 1:] = reach
        for k in range(2, S + 1):  # prefix sums by column (S columns, whatever the batch: see prefix_products)
            gain[:, k] += gain[:, k - 1]
        tokens = n + at_depths(gain, caps, max_depth).sum(axis=0)  # [max_depth + 1]: a request drafts min(D, cap_r)
        self.expected_tokens = tokens / max(n, 1)  # a request's tokens a step at each D (the realised ones' yardstick)
        depths = np.arange(max_depth + 1)
        # what the loop emitted at each depth over what was expected of it (step_costs.py: last steps cut,
        # estimates that run high): the tokens a step the throughput objective counts on (the drain's
        # steps come from the tokens left, where a cut last step adds no step)
        token_calibration = np.array([self.cost_model.token_calibration(query.batch_size, depth) for depth in depths])
        tokens = tokens * token_calibration
        if query.num_waiting > 0 and self.cost_model.prices_rows(query.batch_size):
            rows_at_depth = n * (1 + depths)  # [D + 1] decode rows: 1 + V each (one depth: no ragged rows)
            drafting = ((depths > 0) & bool((caps > 0).any())).astype(np.float64)  # [D + 1]: drafts for anyone
            seconds = queue_step_seconds(self.cost_model, query, rows_at_depth, depths, drafting, tokens)
            if seconds is None:
                # the recent prompt chunks: a step's chunks come with the requests that finish, as many as
                # its tokens finish, so a depth's chunk rows are the recent ones times its tokens over the
                # recent steps' (priced at the chunks as they came, drafts looked to share a fixed prefill
                # cost: the 1B at batch 128 held D = 2 at 0.92x plain); each step priced by its rows
                scale = tokens / self.tokens_per_step if self.tokens_per_step else None
                seconds = self.cost_model.row_seconds(query.batch_size, rows_at_depth, depths, prefill_scale=scale)
        elif drain:  # decode-only steps (nobody joins a draining batch), as the loop realised them (step_costs.py)
            seconds = np.array([self.cost_model.policy_decode_seconds(query.batch_size, depth) for depth in depths])
        else:  # the model's cost of each depth times what the loop realised around its steady steps (step_costs.py)
            seconds = np.array([self.cost_model.policy_seconds(query.batch_size, depth) for depth in depths])
        if drain:
            drain_estimates = self._drain_estimates(rows, estimates, query.request_ids)
            if drain_estimates is not estimates:  # some requests took population priors
                reach = prefix_products(drain_estimates)
            steps = expected_drain_steps(query.tokens_left, reach, caps, max_depth)
            score = 1.0 / (steps * seconds)
        else:
            score = tokens / seconds  # expected tokens per second of the batch at each D
        self.last_seconds, self.last_scores = seconds, score
        best_depth = 0
        for depth in range(1, max_depth + 1):
            if score[depth] > score[best_depth] * self.min_gain:
                best_depth = depth
        scores_zero = best_depth == 0  # retirement (for good) needs D = 0 best on the scores, not only held
        held = self._held_depth  # the depth of the last choice made on the scores (not to explore)
        if held is not None and held != best_depth and held <= max_depth \
                and score[held] * self.switch_gain >= score[best_depth]:
            best_depth = held  # a switch costs what no price shows: keep the depth within switch_gain of the best
        self._steps_since_explore += query.steps
        depth = self._explore(query.batch_size, score, best_depth)
        if depth == best_depth:
            self._held_depth = depth
        self.last_depth, self._last_tokens = depth, float(tokens[depth])
        self._retire_if_held_at_zero(query, depth == best_depth == 0 and scores_zero and max_depth > 0)
        return np.minimum(depth, caps).astype(np.int64)

    def _still_retired(self, query: DraftLengthQuery) -> bool:
        """Retirement (class docstring), while the policy admits requests retired: whether that
        goes on (then the query's requests that may draft, admitted before it began, are retired
        too); else new requests draft again, and are tried."""
        self._retired_steps += query.steps
        if query.num_waiting == 0 or self._retired_steps >= self.explore_every:
            self.speculation_retired, self._last_zero = False, False
            return False
        self._retire(query.request_ids[query.caps > 0])
        return True

    def _retire_if_held_at_zero(self, query: DraftLengthQuery, chose_zero: bool) -> None:
        """Retirement (class docstring): ``chose_zero``, this choice is D = 0 on the scores for
        requests that may draft."""
        held_zero = chose_zero and query.num_waiting > 0 and self.settled(query.batch_size)
        self._zero_steps = self._zero_steps + query.steps if self._last_zero and held_zero else 0
        self._last_zero = held_zero
        if held_zero and self.retire_after is not None and self._zero_steps >= self.retire_after:
            self._retire(query.request_ids[query.caps > 0])
            self.speculation_retired, self._retired_steps, self._zero_steps = True, 0, 0

    def _retire(self, request_ids: np.ndarray) -> None:
        self._retiring.extend(request_ids.tolist())  # host-ok: numpy
        self.retired += request_ids.shape[0]

    def admits_drafts(self) -> bool:
        if self.speculation_retired:
            self.retired += 1
            return False
        return True

    def retiring(self) -> Sequence[int]:
        retiring, self._retiring = self._retiring, []
        return retiring

    def _update_tokens_per_step(self, steps: int) -> None:
        """Fold the last choice's expected tokens a step into ``tokens_per_step`` over the ``steps`` it served."""
        if self._last_tokens is not None:
            keep = (1.0 - self.cost_model.share_smoothing) ** steps
            last, old = self._last_tokens, self.tokens_per_step
            self.tokens_per_step = last if old is None else last + keep * (old - last)

    def settled(self, batch_size: int) -> bool:
        """Whether the one-time exploration at the grid of ``batch_size`` is over: every depth up to
        S measured, and (``retime_explored``) every depth but one timed a second time."""
        S = self.shape.num_speculative_tokens
        if not all(self.cost_model.is_measured(batch_size, d) for d in range(S + 1)):
            return False
        return not self.retime_explored or sum(grid == batch_size for grid, _ in self._retimed) >= S

    def _explore(self, batch_size: int, score: np.ndarray, best_depth: int) -> int:
        """The depth to run: one the cost model has not measured at this grid (the best-scoring,
        within ``explore_tries``), a wait (doubling up to ``explore_every``) after the last
        exploration the runner-up (if within ``explore_within`` of the best), else ``best_depth``."""
        unmeasured = [depth for depth in range(score.shape[0])
                      if not self.cost_model.is_measured(batch_size, depth)
                      and self._tries.get((batch_size, depth), 0) < self.explore_tries]
        if unmeasured:
            depth = max(unmeasured, key=lambda d: score[d])
            self._tries[(batch_size, depth)] = self._tries.get((batch_size, depth), 0) + 1
            self.explored += 1
            self._steps_since_explore = 0
            return depth
        if self._steps_since_explore < self._explore_wait or score.shape[0] < 2:
            return best_depth
        self._steps_since_explore = 0
        self._explore_wait = min(2 * self._explore_wait, self.explore_every)
        others = [d for d in range(score.shape[0]) if d != best_depth]
        # a depth measured only while serving started (its exploration hold: a cold host, the first
        # steps after capture) is timed again once, whatever it scores: a dear first measurement of a
        # depth far behind the best would never be corrected by the runner-up holds
        first_timed = [d for d in others if (batch_size, d) not in self._retimed] if self.retime_explored else []
        if first_timed:
            depth = max(first_timed, key=lambda d: score[d])
            self._retimed.add((batch_size, depth))
        else:
            depth = max(others, key=lambda d: score[d])  # the runner-up
            if score[depth] < self.explore_within * score[best_depth]:
                return best_depth
        self.explored += 1
        self.cost_model.remeasure(batch_size, depth)  # its next hold's samples replace the old estimate
        return depth

    def observe(self, request_ids: np.ndarray, draft_lengths: np.ndarray, accepted_counts: np.ndarray) -> None:
        # No new rows: with overlap, a request's last step is applied after it finished and was
        # forgotten, and a row made then would be held (and decayed every choice) for good. Its
        # outcome still counts in the batch model.
        self._count_outcomes(self._rows(request_ids, create=False), draft_lengths, accepted_counts)

    def _count_outcomes(self, rows: np.ndarray, draft_lengths: np.ndarray, accepted_counts: np.ndarray) -> None:
        """Add ``observe``'s outcomes (``[m]`` each) to the batch model and to the requests' rows
        ``rows`` ``[m]`` (-1: a request without a row: the batch model only)."""
        # Each outcome is a code (s, a) of (S + 1)^2; bincount the codes per request row, then one
        # product with the table of what each code adds to (reached, accepted) at each depth:
        # a few numpy calls whatever the outcomes (np.add.at over [m, 2, S] was ~10x slower). Rows
        # are shifted by one, so -1 (not held) bins in row 0 without an int64 modulo (~5x an add).
        base = self._model.shape[1] + 1  # S + 1
        lengths = np.asarray(draft_lengths, dtype=np.int64)
        keys = (rows + 1) * (base * base) + lengths * base + np.minimum(accepted_counts, lengths)  # [m]
        num_rows = self._counts.shape[0]
        histogram = np.bincount(keys, minlength=num_rows * base * base)
        histogram = histogram.reshape(num_rows, base * base)  # [rows + 1, (S + 1)^2]: row 0 not held, r + 1 row r
        self._model += (histogram.sum(axis=0) @ self._code_outcomes).reshape(self._model.shape)
        # the last row of _counts stays zero (rows not held read it)
        self._counts[:-1] += (histogram[1:] @ self._code_outcomes).reshape(self._counts[:-1].shape)

    def forget(self, request_id: int) -> None:
        self._leaving.append(request_id)  # its estimate may join the population at the next lookup


def _check_number(name: str, value, *, low: Optional[float] = None, high: Optional[float] = None) -> float:
    """A real number (not a bool) in ``[low, high]``, else a TypeError / ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return float(value)
