"""What a choice of draft lengths is worth, for the goodput policies (``draft_policy.py``,
``per_request_policy.py``): the expected steps until a batch that nobody joins is done
(:func:`expected_drain_steps`), a queued step's price with the prompt chunks its finishes bring
(:func:`queue_step_seconds`), and the per-request prefix products both read. Host numpy only: a
fixed number of numpy calls whatever the batch (a Python loop over the S depths at most)."""

import functools
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:
    from mtp_ctrl.controllers.draft_policy import DraftLengthQuery

def queue_step_seconds(cost_model, query: "DraftLengthQuery", rows: np.ndarray, depths: np.ndarray,
                       drafting: np.ndarray, tokens: np.ndarray,
                       mixed_rows: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
    """``[c]`` seconds a step of each candidate costs while requests wait, its prompt chunks
    included (``RowCostModel.queue_seconds``): a candidate whose requests emit ``tokens`` ``[c]`` a
    step finishes ``tokens / joining_tokens`` requests a step (each freed slot takes a waiting
    request that stays ``joining_tokens``); one that drafts for nobody (``drafting`` ``[c]`` 0)
    finishes them in the groups of equal ``tokens_left`` they are in now (as many as wait). The
    policies pass ``drafting`` 1 for a candidate that drafts for anyone: a request that drafts
    leaves its finish group, and its next request joins apart, so a group once broken does not
    form again (in the CPU simulation of a lockstep queue at batch 256, pricing a few drafting
    requests as only their share of the spread let the per-request policy draft for a few and ran
    0.84x plain, against 0.99x). Nor is the spread capped at the requests waiting: when fewer wait
    than a period brings, the batch is about to drain, and drafting then spreads the last wave's
    finishes, which the drain pays for (capped, the simulation's queue of 4 x 256 ran 0.93x plain,
    uncapped 0.96x). None where the query or the cost model cannot tell (no ``joining_tokens`` > 0
    or ``tokens_left``, no prompt chunk measured, no mixed buckets' times): the caller prices by
    the recent chunks. ``mixed_rows``: the decode rows of a step with prompt chunks (None: ``rows``)."""
    queue_seconds = getattr(cost_model, "queue_seconds", None)
    joining = query.joining_tokens
    if queue_seconds is None or not joining or joining <= 0 or query.tokens_left is None or \
            not query.tokens_left.shape[0]:
        return None
    left = np.maximum(np.asarray(query.tokens_left, dtype=np.int64), 1)
    _, sizes = np.unique(left, return_counts=True)  # [g] requests finishing together, earliest first
    taken = np.minimum(np.cumsum(sizes), query.num_waiting)  # only as many as wait take a freed slot
    groups = np.diff(taken, prepend=0)
    return queue_seconds(query.batch_size, rows, depths, drafting, np.asarray(tokens, dtype=np.float64) / joining,
                         groups[groups > 0], float(joining), mixed_rows=mixed_rows)


def prefix_products(values: np.ndarray) -> np.ndarray:
    """``[n, S]``: ``np.cumprod(values, axis=1)`` (the same products in the same order), a column at a
    time: S is a handful of depths, and cumprod along a short axis loops per row (~3x slower at S = 2)."""
    products = values.copy()
    for k in range(1, values.shape[1]):
        products[:, k] *= products[:, k - 1]
    return products


def at_depths(per_length: np.ndarray, caps: np.ndarray, max_depth: int) -> np.ndarray:
    """``per_length`` ``[n, ..., S + 1]`` (values per draft length s) read at ``min(D, cap_r)`` for
    D = 0..max_depth: ``[n, ..., max_depth + 1]``."""
    if bool((caps >= max_depth).all()):
        return per_length[..., : max_depth + 1]
    at = np.minimum(np.arange(max_depth + 1)[None, :], caps[:, None])  # [n, D + 1]
    at = at.reshape((at.shape[0],) + (1,) * (per_length.ndim - 2) + at.shape[1:])  # [n, 1..., D + 1]
    return np.take_along_axis(per_length, at, axis=-1)


def expected_drain_steps(tokens_left: np.ndarray, reach: np.ndarray, caps: np.ndarray, max_depth: int,
                         grid_points: int = 16, lengths: Optional[np.ndarray] = None) -> np.ndarray:
    """``[max_depth + 1]``: the expected steps until every request is done, if the batch drafts D
    depths from now on (request r: ``min(D, cap_r)`` drafts).

    ``tokens_left`` ``[n]``: tokens each may still emit; ``reach`` ``[n, S]``: P(a step accepts
    draft k or more) per request. A step emits ``X = 1 + A`` tokens, ``A`` the accepted drafts
    (``E[A] = sum_k P(A >= k)``, ``E[A^2] = sum_k (2k - 1) P(A >= k)``); a request with ``R`` tokens
    left needs about ``R / E[X]`` steps with variance ``R Var[X] / E[X]^3`` (renewal theory),
    taken as normal; the batch's expected maximum is integrated from the product of their CDFs
    (``grid_points`` points). At 0.2 acceptance and 48 tokens, the slowest of 64 requests needs
    ~46 steps at D = 1 though the mean one needs 40: the tail that makes a closed batch slow.

    ``lengths`` ``[C, n]`` (``PerRequestGoodputPolicy``): the columns are C candidates instead of
    depths, request r drafting ``lengths[c, r]`` in candidate c (``caps``, ``max_depth`` unused): ``[C]``."""
    n, S = reach.shape
    # [n, 2, S + 1]: E[A], E[A^2] with s = 0..S drafts; both prefix sums a column at a time (as in
    # prefix_products: np.cumsum's adds in its order, ~4x cheaper than two cumsums over rows of S)
    moments = np.zeros((n, 2, S + 1))
    moments[:, 0, 1:] = reach
    np.multiply(reach, 2 * np.arange(1, S + 1) - 1, out=moments[:, 1, 1:])
    for s in range(2, S + 1):
        moments[:, :, s] += moments[:, :, s - 1]
    if lengths is None:  # [n, 2, D + 1]: request r drafts min(D, cap_r)
        moments = at_depths(moments, caps, max_depth)
    else:  # [n, 2, C]: each candidate's own lengths
        moments = np.take_along_axis(moments, np.asarray(lengths).T[:, None, :], axis=2)
    mean_a, square_a = moments[:, 0], moments[:, 1]
    tokens = 1.0 + mean_a
    variance = np.maximum(square_a - mean_a ** 2, 0.0)
    left = np.maximum(np.asarray(tokens_left, dtype=np.float64), 1.0)[:, None]  # [n, 1]
    mean = left / tokens  # [n, D + 1] steps
    spread = np.maximum(np.sqrt(left * variance / tokens ** 3), 0.02)  # D = 0: exact (a narrow step)
    low = (mean - 5 * spread).max(axis=0)  # [D + 1]: below it every request is (almost surely) still running
    high = (mean + 5 * spread).max(axis=0)
    t = low[:, None] + (high - low)[:, None] * _unit_grid(grid_points).T  # [D + 1, K]
    # [n, D + 1, K], in place where it can: the grid last, so the broadcasts read contiguous rows (not
    # transposed operands: ~3x) and the product over requests multiplies whole blocks (~2x the last axis)
    z = t[None] - mean[:, :, None]
    z *= (1.0 / spread)[:, :, None]
    # the normal CDF (tanh form): 0.5 (1 + tanh(0.79788 (z + 0.044715 z^3))); z is not clipped to
    # +-8: the tanh there (of +-24.7) is +-1.0 in float64 already, and z^3 stays far from overflow
    cdf = z * z
    cdf *= 0.044715
    cdf += 1.0
    cdf *= z
    cdf *= 0.7978845608
    np.tanh(cdf, out=cdf)
    cdf += 1.0
    cdf *= 0.5
    running = 1.0 - cdf.prod(axis=0)  # [D + 1, K]: P(some request still running at t)
    # the trapezoid rule on the uniform grid (np.trapz is gone from numpy 2.4)
    return low + (running[:, 1:] + running[:, :-1]).sum(axis=1) * 0.5 * (high - low) / (grid_points - 1)


@functools.lru_cache(maxsize=8)
def _unit_grid(points: int) -> np.ndarray:
    """``[points, 1]`` float64, evenly spaced over [0, 1] (read-only, made once: np.linspace costs
    more than the rest of a small drain estimate)."""
    grid = np.linspace(0.0, 1.0, points)[:, None]
    grid.setflags(write=False)
    return grid
