"""Speculation and throughput metrics, accumulated on the host from each step's read-back."""

import collections
import time
from typing import Dict, List, Sequence


class GenerationMetrics:
    """Acceptance per draft depth, mean accepted length, tokens/s and a split of step time.

    Step phases are host wall time between the controller's phase boundaries; on a GPU the
    phases before the read-back measure launch time, and ``wait`` holds the GPU time left.
    """

    def __init__(self, num_speculative_tokens: int):
        self.num_speculative_tokens = num_speculative_tokens
        self.reset()

    def reset(self) -> None:
        """Start counting afresh (e.g. after a warm-up run)."""
        self.drafted_per_depth = [0] * self.num_speculative_tokens  # drafts proposed at depth k + 1
        self.accepted_per_depth = [0] * self.num_speculative_tokens  # of those, accepted
        self.verify_steps = 0  # request-steps that verified drafts (decode rows)
        self.emitted_tokens = 0
        self.phase_seconds: Dict[str, float] = collections.defaultdict(float)
        self._started = time.perf_counter()

    def record_acceptance(self, accepted_counts: Sequence[int]) -> None:
        for accepted in accepted_counts:
            self.verify_steps += 1
            for depth in range(self.num_speculative_tokens):
                self.drafted_per_depth[depth] += 1
                self.accepted_per_depth[depth] += int(depth < accepted)

    def record_phase(self, name: str, seconds: float) -> None:
        self.phase_seconds[name] += seconds

    @property
    def acceptance_per_depth(self) -> List[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_depth, self.drafted_per_depth)]

    @property
    def mean_accepted_length(self) -> float:
        """1 + mean accepted drafts per verify step."""
        return 1.0 + sum(self.accepted_per_depth) / self.verify_steps if self.verify_steps else 1.0

    def tokens_per_second(self) -> float:
        return self.emitted_tokens / max(time.perf_counter() - self._started, 1e-9)

    def summary(self) -> str:
        depths = ", ".join(f"{rate:.2f}" for rate in self.acceptance_per_depth) or "-"
        phases = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in self.phase_seconds.items())
        return (f"tokens {self.emitted_tokens}, {self.tokens_per_second():.1f} tok/s, mean accepted length "
                f"{self.mean_accepted_length:.2f}, acceptance per depth [{depths}]; {phases}")
