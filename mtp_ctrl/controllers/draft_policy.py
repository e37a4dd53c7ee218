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
  does not pay). Off by default: with today's step graphs (``1 + S`` verify rows per decode
  request whatever ``s_r``) it can only save draft depths, and an estimate can be wrong.
- :class:`RandomDraftLengths`: seeded random lengths, for tests (the output must not change).
"""

import dataclasses
from typing import Optional, Sequence, Tuple

import numpy as np

from mtp_ctrl.controllers.step_costs import StepCostModel
from mtp_ctrl.triton_ops._checks import check_int


@dataclasses.dataclass(frozen=True)
class DraftLengthQuery:
    """One step's question to the policy (host values only)."""

    request_ids: np.ndarray  # [n] int64, the requests that sample this step, in row order
    caps: np.ndarray  # [n] int64, each request's most drafts: min(S, its SamplingParams cap)
    num_speculative_tokens: int  # S, the engine's most drafts
    batch_size: int  # G, the step's grid (padded to its CUDA-graph batch when one covers it)
    steps: int = 1  # steps since the policy's last choice (it held for them: ``decide_every``)


class RequestRows:
    """Rows of per-request host arrays by request id, looked up for a whole batch at once (numpy,
    no per-request Python): the ids held, sorted, beside their rows; freed rows are reused."""

    def __init__(self):
        self._ids = np.zeros(0, dtype=np.int64)  # [m] int64, sorted
        self._rows = np.zeros(0, dtype=np.int64)  # [m] int64, the row of _ids[i]
        self._free = np.zeros(0, dtype=np.int64)  # rows no id holds (a stack)
        self.capacity = 0  # rows handed out so far (the arrays they index must be this long)
        self._last = (self._ids, self._rows)  # (ids, rows) of the last lookup whose ids were all held
        self._removed = []  # ids removed since the last lookup (applied together: a batch drains at once)

    def rows(self, request_ids: np.ndarray, create: bool = False) -> Tuple[np.ndarray, np.ndarray]:
        """``([n] rows of request_ids (-1: not held), [k] rows given to new ids)``; with ``create``
        every id gets a row (new ones take freed rows, then new rows past ``capacity``)."""
        if self._removed:
            self._apply_removals()
        request_ids = np.asarray(request_ids, dtype=np.int64)
        last_ids, last_rows = self._last
        if request_ids.shape == last_ids.shape and np.array_equal(request_ids, last_ids):
            return last_rows, last_rows[:0]  # the batch of the last lookup (steady decoding): every id held
        positions = np.searchsorted(self._ids, request_ids)  # [n]
        held = positions < self._ids.shape[0]
        held[held] = self._ids[positions[held]] == request_ids[held]
        rows = np.full(request_ids.shape, -1, dtype=np.int64)
        rows[held] = self._rows[positions[held]]
        if held.all():
            self._last = (request_ids.copy(), rows)
        if not create or held.all():
            return rows, rows[:0]
        new_ids = np.unique(request_ids[~held])  # [k]
        reused = min(new_ids.shape[0], self._free.shape[0])
        new_rows = np.concatenate([self._free[self._free.shape[0] - reused:],
                                   np.arange(self.capacity, self.capacity + new_ids.shape[0] - reused)])
        self._free = self._free[: self._free.shape[0] - reused]
        self.capacity += new_ids.shape[0] - reused
        ids, all_rows = np.concatenate([self._ids, new_ids]), np.concatenate([self._rows, new_rows])
        order = np.argsort(ids, kind="stable")
        self._ids, self._rows = ids[order], all_rows[order]
        return self.rows(request_ids)[0], new_rows

    def remove(self, request_id: int) -> None:
        """Free the row of ``request_id`` (nothing if it holds none); done at the next lookup."""
        self._removed.append(request_id)

    def _apply_removals(self) -> None:
        gone = np.isin(self._ids, np.array(self._removed, dtype=np.int64))  # [m] bool
        self._removed = []
        if gone.any():
            self._free = np.concatenate([self._free, self._rows[gone]])
            self._ids, self._rows = self._ids[~gone], self._rows[~gone]
            self._last = (self._ids, self._rows)

    def __len__(self) -> int:
        if self._removed:
            self._apply_removals()
        return self._ids.shape[0]


class DraftLengthPolicy:
    """Base class of draft-length policies (module docstring). Override :meth:`choose`; the rest
    have working defaults."""

    # a choice holds for up to this many steps while the step's sampling requests stay the same
    # (or some of them leave); the outcomes of those steps come to `observe` in one call. 1: choose
    # and observe every step.
    decide_every = 1
    # each time the policy returns the same lengths for the same requests, the hold doubles, up to
    # this many steps (None: decide_every, no doubling); the held steps' outcomes come to `observe`
    # when the hold ends (at most this many steps late) and always before the next `choose`
    longest_hold = None

    def __init__(self):
        self.cost_model: Optional[StepCostModel] = None

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

    def observe(self, request_ids: np.ndarray, draft_lengths: np.ndarray, accepted_counts: np.ndarray) -> None:
        """A step's outcome (``[m]`` each, host ints): request ``request_ids[i]`` verified
        ``draft_lengths[i]`` drafts and accepted ``accepted_counts[i]``. Default: nothing."""

    def forget(self, request_id: int) -> None:
        """The request left the batch (finished or evicted). Default: nothing."""


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

    Cost: :class:`StepCostModel` of the step's grid and depth D. The policy picks
    ``D = argmax_D sum_r tokens_r(min(D, cap_r)) / cost(G, D)`` and gives each request
    ``min(D, cap_r)`` (within one graph shape a request drafting less than D saves nothing).
    Vectorised over the batch (numpy: no per-request Python in ``choose`` or ``observe``, a fixed
    number of numpy calls whatever the batch), and run once per ``decide_every`` steps while the
    batch stays the same (the controller reuses the choice meanwhile and hands the outcomes over in
    one ``observe``); a choice it repeats for the same batch holds twice as long, up to
    ``longest_hold`` steps (steady decoding then asks it once in 64 steps): its host work per step
    is then a small fraction of a host-bound step's.
    """

    def __init__(self, decay: float = 0.95, prior_weight: float = 4.0, optimistic_prior: float = 0.8,
                 min_gain: float = 1.0, decide_every: int = 8, longest_hold: Optional[int] = None):
        super().__init__()
        self.decide_every = check_int("decide_every", decide_every, low=1)
        # None: 64 steps (or decide_every, if longer); a given hold cannot be shorter than decide_every
        self.longest_hold = (max(64, self.decide_every) if longest_hold is None
                             else check_int("longest_hold", longest_hold, low=self.decide_every))
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {prior_weight}")
        if not 0.0 <= optimistic_prior <= 1.0:
            raise ValueError(f"optimistic_prior must be in [0, 1], got {optimistic_prior}")
        self.decay, self.prior_weight, self.optimistic_prior = decay, prior_weight, optimistic_prior
        self.min_gain = min_gain  # a deeper D must beat the shallower one by this factor (1.0: any gain)
        self.last_depth = None  # the D of the last choice (for benchmarks)
        self._index = RequestRows()  # request id -> its row of _counts

    def bind(self, shape) -> None:
        super().bind(shape)
        S = shape.num_speculative_tokens
        self._model = np.zeros((2, S))  # [2, S] (reached, accepted) over every request
        # [rows + 1, 2, S] (reached, accepted) per request, decayed every step; the last row stays zero,
        # so row -1 (a request with no counts yet) reads zeros
        self._counts = np.zeros((1, 2, S))
        # [(S + 1)^2, 2S]: what outcome code s * (S + 1) + a (s drafts verified, a accepted) adds to
        # (reached draft k: drafts 1..k-1 accepted and k verified; accepted draft k), k = 1..S
        lengths, accepted = np.divmod(np.arange((S + 1) ** 2), S + 1)  # [(S + 1)^2] each
        depths = np.arange(S)[None, :]  # [1, S]: k - 1
        self._code_outcomes = np.concatenate([(depths < lengths[:, None]) & (depths <= accepted[:, None]),
                                              depths < accepted[:, None]], axis=1).astype(np.float64)

    def _rows(self, request_ids: np.ndarray, create: bool) -> np.ndarray:
        """``[n]`` rows of the requests' counts (-1: none yet, unless ``create``: new rows start at zero)."""
        rows, new_rows = self._index.rows(request_ids, create)
        if new_rows.shape[0]:
            grow = self._index.capacity + 1 - self._counts.shape[0]
            if grow > 0:
                self._counts = np.concatenate([self._counts, np.zeros((grow,) + self._counts.shape[1:])])
            self._counts[new_rows] = 0
        return rows

    def _estimates(self, rows: np.ndarray) -> np.ndarray:
        """``[n, S]`` estimated acceptance of each depth given the ones before it."""
        reached, accepted = self._model
        model = self.prior_weight * (accepted + self.optimistic_prior) / (reached + 1.0)  # [S]
        counts = self._counts[rows]  # [n, 2, S]
        return (counts[:, 1] + model) / (counts[:, 0] + self.prior_weight)

    def acceptance(self, request_id: int) -> np.ndarray:
        """``[S]`` float64: the estimated acceptance of each depth given the ones before it."""
        return self._estimates(self._rows(np.array([request_id]), create=False))[0]

    def choose(self, query: DraftLengthQuery) -> np.ndarray:
        S, caps, n = query.num_speculative_tokens, query.caps, query.caps.shape[0]
        decay = self.decay ** query.steps  # per step since the last choice
        self._model *= decay
        self._counts *= decay
        gain = np.zeros((n, S + 1))  # [n, S + 1]: expected accepted drafts with s drafts
        # rows are made here, for the live requests a choice is for (observe() makes none: see there)
        np.cumsum(np.cumprod(self._estimates(self._rows(query.request_ids, create=True)), axis=1), axis=1,
                  out=gain[:, 1:])
        depths = np.arange(S + 1)  # [S + 1]
        if (caps < S).any():  # a request drafts min(D, cap_r)
            gain = np.take_along_axis(gain, np.minimum(depths[None, :], caps[:, None]), axis=1)
        tokens = n + gain.sum(axis=0)  # [S + 1]: expected tokens of the batch at each D
        best_depth, best_rate = 0, None
        for depth in range(S + 1):
            rate = tokens[depth] / self.cost_model.seconds(query.batch_size, depth)
            if best_rate is None or rate > best_rate * self.min_gain:
                best_depth, best_rate = depth, rate
        self.last_depth = best_depth
        return np.minimum(best_depth, caps).astype(np.int64)

    def observe(self, request_ids: np.ndarray, draft_lengths: np.ndarray, accepted_counts: np.ndarray) -> None:
        # Each outcome is a code (s, a) of (S + 1)^2; bincount the codes per request row, then one
        # product with the table of what each code adds to (reached, accepted) at each depth:
        # a few numpy calls whatever the outcomes (np.add.at over [m, 2, S] was ~10x slower).
        base = self._model.shape[1] + 1  # S + 1
        codes = np.asarray(draft_lengths, dtype=np.int64) * base + np.minimum(accepted_counts, draft_lengths)  # [m]
        # No new rows: with overlap, a request's last step is applied after it finished and was
        # forgotten, and a row made then would be held (and decayed every choice) for good. Its
        # outcome still counts in the batch model.
        num_rows = self._counts.shape[0]
        rows = self._rows(request_ids, create=False) % num_rows  # [m]; not held (-1): the last row
        histogram = np.bincount(rows * base * base + codes, minlength=num_rows * base * base)
        histogram = histogram.reshape(num_rows, base * base)  # [rows + 1, (S + 1)^2] outcomes by row and code
        self._model += (histogram.sum(axis=0) @ self._code_outcomes).reshape(self._model.shape)
        histogram[-1] = 0  # the last row stays zero (rows not held read it)
        self._counts += (histogram @ self._code_outcomes).reshape(self._counts.shape)

    def forget(self, request_id: int) -> None:
        self._index.remove(request_id)
