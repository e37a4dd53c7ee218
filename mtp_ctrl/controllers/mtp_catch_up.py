"""Skipped MTP windows and their exact catch-up (``InferenceConfig(mtp_idle_windows="skip")``).

Paged MTP drafting keeps every depth's cache final by running each depth over a window ``[w, e)``
every step (``controllers/mtp_proposer.py``). A decode-only step where nobody drafts (D = 0) need
not: it records its tokens, keeps the decoder hidden of its positions in the request's ring (``S +
M`` slots instead of ``S``) and leaves ``w`` where the caches stopped being final. The next step that
runs the windows (one that drafts, one with prefill chunks, or a forced catch-up) widens each decode
request's window by ``M`` rows, so it covers ``[w, e)`` again: every depth's entry at every position
is computed from the same hidden states and tokens as if no window had been skipped (the drafts
are the same).

The host bounds how far ``w`` fell behind: a skipped step of verify width V moves ``e`` on by at most
``1 + V`` positions. This module keeps that bound per table slot (``m``) and plans each launch: a
step skips its windows when it is decode-only, drafts nothing and every request's ``m`` stays
within ``M`` after it; otherwise it runs them, ``M`` rows wider when some request has ``m > 0``
(a *forced catch-up* when it drafts nothing). The plan (one entry a step of the launch) joins the
CUDA graph key, so a replay needs no host value: a few variants per shape (windows or catch-up;
skip or forced catch-up; a decode run's steps in their orders), captured at warm-up. A request
that joins, or returns after a preemption, starts with a step that has prefill chunks (its windows
run, from its first position): nothing stale is read. A paused request keeps its slot and its
``m``: the first step it returns to catches it up.
"""

from typing import Tuple

import numpy as np

from mtp_ctrl.state.step_metadata import StepMetadata

SKIP = -1  # a plan entry: the step runs no window; otherwise the rows a decode window gets past S + V


class WindowCatchUp:
    """``num_slots``: table slots (the scratch slot included); ``capacity`` M: the most positions a
    request's window start may fall behind (its ring holds ``S + M`` positions)."""

    def __init__(self, num_slots: int, capacity: int):
        self.capacity = capacity
        self._lags = np.zeros(num_slots, np.int64)  # [R + 1] per slot: m, positions w may have fallen behind
        self._plan: Tuple[int, ...] = ()
        self._calls = 0  # propose / on_no_drafts calls since the plan was set (a capture runs a launch twice)

    def plan(self, step: StepMetadata, lag: int) -> Tuple[int, ...]:
        """Each step of the launch (a decode run has several): SKIP, or the extra rows of its decode
        windows (0, or M while some request has fallen behind), from the batch's largest ``lag``."""
        entries, advance = [], 1 + step.verify_width  # the most positions a step moves e on
        for _ in range(step.num_steps):
            if step.num_drafts == 0 and step.decode_only and lag + advance <= self.capacity:
                entries.append(SKIP)
                lag += advance
            else:
                entries.append(self.capacity if lag > 0 else 0)
                lag = 0
        return tuple(entries)

    def plan_launch(self, step: StepMetadata) -> Tuple[int, ...]:
        """The launch's plan from the step's decode requests' lags, which it then moves on."""
        slots = step.host_slot_ids  # [num_requests] int64
        decode_lags = self._lags[slots[: step.num_decode]]
        plan = self.plan(step, int(decode_lags.max()) if decode_lags.size else 0)
        behind, windowed = 0, False
        for entry in plan:
            windowed, behind = (windowed, behind + 1 + step.verify_width) if entry == SKIP else (True, 0)
        if windowed:
            self._lags[slots] = behind
        else:
            self._lags[slots] += behind
        self.use(plan)
        return plan

    def warmup_plans(self, step: StepMetadata) -> Tuple[Tuple[int, ...], ...]:
        """Every plan the step's shape may take (lags 0..M; a few distinct ones), the caught-up one first."""
        return tuple(dict.fromkeys(self.plan(step, lag) for lag in range(self.capacity + 1)))

    def use(self, plan: Tuple[int, ...]) -> None:
        self._plan, self._calls = plan, 0

    def next_entry(self) -> int:
        """The plan's entry for the step being built (0 without a plan: windows of S + V rows)."""
        if not self._plan:
            return 0
        entry = self._plan[self._calls % len(self._plan)]
        self._calls += 1
        return entry
