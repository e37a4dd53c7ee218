"""Speculation and throughput metrics, accumulated on the host from each step's read-back."""

import collections
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np


class GenerationMetrics:
    """Acceptance per draft depth, mean accepted length, tokens/s and the host/GPU split of a step.

    ``step_seconds``: wall time of the controller's ``step`` calls (host work, launches, and any
    wait for the GPU). ``gpu_seconds``: GPU time of the steps, between CUDA events recorded
    around each launch's work (CUDA only). With overlap scheduling and a GPU-bound step the two
    are about equal; ``step_seconds`` well above ``gpu_seconds`` means the host is the bottleneck.
    A call that launches a decode run of k steps counts as k steps of a k-th of its time each,
    on both clocks.
    """

    def __init__(self, num_speculative_tokens: int):
        # [S + 1, S + 1] int64: verify request-steps by (drafts verified, drafts accepted); every
        # per-depth count is read from it (one bincount a step: the loop's host time)
        self._outcomes = np.zeros((num_speculative_tokens + 1,) * 2, dtype=np.int64)
        self._prefix_source: Optional[Callable[[], Tuple[int, ...]]] = None  # watch_prefix_cache
        self.reset()

    @property
    def num_speculative_tokens(self) -> int:
        """S: the draft depths counted."""
        return self._outcomes.shape[0] - 1

    def reset(self) -> None:
        """Start counting afresh (e.g. after a warm-up run)."""
        self._outcomes = np.zeros_like(self._outcomes)
        self.verify_steps = 0  # request-steps that verified drafts (decode rows)
        self.emitted_tokens = 0
        self.steps = 0
        self.step_seconds = 0.0
        self.gpu_steps = 0
        self.gpu_seconds = 0.0
        self.gpu_step_seconds: Deque[float] = collections.deque(maxlen=4096)  # the latest steps' GPU times
        self._prefix_base = self._prefix_totals()  # the prefix cache's counters at the reset
        self._started = time.perf_counter()

    def watch_prefix_cache(self, totals: Callable[[], Tuple[int, int, int, int]]) -> None:
        """The prefix cache's counters, read when asked (:meth:`as_dict`): prefill tokens looked
        up, found cached, blocks evicted (totals), and blocks cached now."""
        self._prefix_source = totals
        self._prefix_base = self._prefix_totals()

    def _prefix_totals(self) -> Tuple[int, int, int, int]:
        source = self._prefix_source
        return (0, 0, 0, 0) if source is None else tuple(int(value) for value in source())

    def record_acceptance(self, accepted_counts: Sequence[int], draft_lengths: Optional[Sequence[int]] = None) -> None:
        """One entry per decode request of a step: its accepted drafts (ints or an int array), and
        the drafts it verified (``draft_lengths``; None: S each). Depth k counts as drafted for the
        requests that verified at least k drafts."""
        counts = np.asarray(accepted_counts, dtype=np.int64)
        S = self.num_speculative_tokens
        self.verify_steps += int(counts.shape[0])
        if not S or not counts.shape[0]:
            return
        if draft_lengths is None:
            self._outcomes[S] += np.bincount(counts, minlength=S + 1)
        else:
            # lengths are in [0, S] (np.minimum: ndarray.clip's Python wrapper costs ~5x the ufunc)
            cells = np.minimum(np.asarray(draft_lengths, dtype=np.int64), S) * (S + 1) + counts
            self._outcomes += np.bincount(cells, minlength=(S + 1) ** 2).reshape(S + 1, S + 1)

    def record_no_drafts(self, count: int) -> None:
        """``count`` decode request-steps that verified no draft (a step where nobody held one):
        :meth:`record_acceptance` of ``count`` zeros with lengths 0, without the arrays."""
        self.verify_steps += count
        if self.num_speculative_tokens:
            self._outcomes[0, 0] += count

    @property
    def draft_length_counts(self) -> np.ndarray:
        """``[S + 1]`` int64: verify request-steps by how many drafts they verified (the draft-length
        policy's choices)."""
        return self._outcomes.sum(axis=1)

    @property
    def drafted_per_depth(self) -> List[int]:
        """``[S]``: drafts verified at depth k + 1 (request-steps that verified at least k + 1)."""
        at_least = self.draft_length_counts[::-1].cumsum()[::-1]  # [S + 1]: verified >= k
        return [int(count) for count in at_least[1:]]

    @property
    def accepted_per_depth(self) -> List[int]:
        """``[S]``: of :attr:`drafted_per_depth`, accepted (a request that accepted a drafts accepted
        depths 1..a)."""
        at_least = self._outcomes.sum(axis=0)[::-1].cumsum()[::-1]  # [S + 1]: accepted >= k
        return [int(count) for count in at_least[1:]]

    def record_step(self, seconds: float, steps: int = 1) -> None:
        """A ``step`` call that took ``seconds`` and launched ``steps`` steps (a decode run: several)."""
        self.steps += steps
        self.step_seconds += seconds

    def record_gpu(self, seconds: float, steps: int = 1) -> None:
        """The GPU time of a launch of ``steps`` steps."""
        self.gpu_steps += steps
        self.gpu_seconds += seconds
        self.gpu_step_seconds.extend([seconds / steps] * steps)

    @property
    def acceptance_per_depth(self) -> List[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_depth, self.drafted_per_depth)]

    @property
    def mean_accepted_length(self) -> float:
        """1 + mean accepted drafts per verify step."""
        return 1.0 + sum(self.accepted_per_depth) / self.verify_steps if self.verify_steps else 1.0

    def tokens_per_second(self) -> float:
        """Emitted tokens over the wall time of the controller's ``step`` calls (``step_seconds``):
        time between ``generate`` or ``step`` calls, when the controller has nothing to do, does
        not count. 0.0 before the first step."""
        return self.emitted_tokens / self.step_seconds if self.step_seconds > 0 else 0.0

    def summary(self) -> str:
        depths = ", ".join(f"{rate:.2f}" for rate in self.acceptance_per_depth) or "-"
        split = f"step {self.step_seconds / max(self.steps, 1) * 1e3:.3f} ms"
        if self.gpu_steps:
            split += f" (GPU {self.gpu_seconds / self.gpu_steps * 1e3:.3f} ms)"
        return (f"tokens {self.emitted_tokens}, {self.tokens_per_second():.1f} tok/s, mean accepted length "
                f"{self.mean_accepted_length:.2f}, acceptance per depth [{depths}]; {split} over {self.steps} steps")

    def as_dict(self) -> Dict[str, Any]:
        """Plain data (ints, floats, lists, dicts: ``json.dump`` takes it as is).

        Keys: ``tokens_per_second`` (:meth:`tokens_per_second`: idle time between calls not
        counted), ``emitted_tokens``, ``elapsed_seconds`` (wall time since the last reset, idle
        time included), ``num_speculative_tokens``, ``verify_steps``, ``mean_accepted_length``,
        ``acceptance_per_depth``, ``drafted_per_depth``, ``accepted_per_depth``,
        ``draft_length_counts`` (verify steps by drafts verified, ``[S + 1]``), and
        ``step_time``: ``{"steps", "step_seconds", "mean_step_ms", "gpu_steps", "gpu_seconds",
        "mean_gpu_ms"}`` (the GPU fields are 0 off CUDA; ``mean_gpu_ms`` is None then), and
        ``prefix_cache``: ``{"hit_rate"`` (prefill tokens found cached / looked up), ``"hit_tokens"``,
        ``"queried_tokens"``, ``"cached_blocks"`` (in the pool now),
        ``"evictions"}`` (all 0 with ``prefix_caching`` off).
        """
        elapsed = time.perf_counter() - self._started
        totals = self._prefix_totals()
        queried, hit, evictions = (total - base for total, base in zip(totals[:3], self._prefix_base[:3]))
        cached_blocks = totals[3]
        return {
            "tokens_per_second": self.tokens_per_second(),
            "emitted_tokens": int(self.emitted_tokens),
            "elapsed_seconds": elapsed,
            "num_speculative_tokens": int(self.num_speculative_tokens),
            "verify_steps": int(self.verify_steps),
            "mean_accepted_length": float(self.mean_accepted_length),
            "acceptance_per_depth": [float(rate) for rate in self.acceptance_per_depth],
            "drafted_per_depth": [int(count) for count in self.drafted_per_depth],
            "accepted_per_depth": [int(count) for count in self.accepted_per_depth],
            "draft_length_counts": [int(count) for count in self.draft_length_counts],
            "step_time": {
                "steps": int(self.steps),
                "step_seconds": float(self.step_seconds),
                "mean_step_ms": self.step_seconds / self.steps * 1e3 if self.steps else None,
                "gpu_steps": int(self.gpu_steps),
                "gpu_seconds": float(self.gpu_seconds),
                "mean_gpu_ms": self.gpu_seconds / self.gpu_steps * 1e3 if self.gpu_steps else None,
            },
            "prefix_cache": {
                "hit_rate": hit / queried if queried else 0.0,
                "hit_tokens": hit,
                "queried_tokens": queried,
                "cached_blocks": cached_blocks,
                "evictions": evictions,
            },
        }
