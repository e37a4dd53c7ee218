"""Skipped MTP windows and their exact catch-up (``InferenceConfig(mtp_idle_windows="skip")``), per depth.

Paged MTP drafting keeps every depth's cache final by running each depth over a window ``[w, e)``
every step (``controllers/mtp_proposer.py``). A decode-only step need not run the depths it does
not draft from: a step where nobody drafts (D = 0) runs none, a step that drafts D < S runs depths
``0..D-1`` only. A skipped depth's window start ``w_k`` stays where its cache stopped being final
and the decoder hidden of the skipped positions stays in the request's ring (``S + M`` slots instead
of ``S``). A later step that runs depth k widens each decode request's window by ``M`` rows so it
covers ``[w_k, e)`` again: every depth's entry at every position is computed from the same hidden
states and tokens as if no window had been skipped (the drafts are the same).

Lags are monotone in depth (a depth is skipped only with every deeper one), so a step that runs
``D'`` depths starts all of them at ``w_{D'-1}`` (the largest start among them; the shallower ones
rewrite final entries with the same values) and depth k's input hidden over those rows is depth
``k - 1``'s output over the same rows. Afterwards ``w_{D'-1}`` moves on for depths ``0..D'-1``;
deeper starts stay (``MTPProposer._window_start``: one device row per depth, written by the steps
that run exactly that many depths, so a step of every depth costs what it did without skipping).

The host bounds how far each ``w_k`` fell behind: a step of verify width V that skips depth k moves
``e`` on by at most ``1 + V`` positions. This module keeps that bound per table slot and depth
(``[R + 1, S]``) and plans each launch, one entry ``(depths run, extra rows)`` a step:
``(0, 0)`` (SKIP: a decode-only step where nobody drafts), ``(D, 0)`` / ``(D, M)`` (a decode-only
step that drafts D < S: depths ``D..S-1`` skipped; M extra rows when depth ``D - 1`` has fallen
behind), ``(S, 0)`` / ``(S, M)`` (every depth: a step that drafts S, a step with prefill chunks, or a
*forced catch-up* when the deepest skipped depth would fall more than M behind). A slot whose
request never drafts (``set_may_draft``: its cap is 0, or the policy retired it) is left out: its
lags plan nothing (a launch that drafts nothing and holds only such slots runs no window,
whatever its verify width; one with prefill chunks only if each was admitted so, its prompt blocks
then not shared through the prefix cache: a request retired mid-way may have shared blocks whose
windows must run), and its windows, where a step runs them for others, cover what their rows
reach (its cache keeps gaps that no draft of its reads; prefix caching shares only blocks of
prefill tokens, written whole). The fixed-S policy only ever plans ``(S, 0)``. The plan joins the
CUDA graph key, so a replay needs no host value: a few variants per shape, captured at warm-up
(:meth:`WindowCatchUp.warmup_plans`). A request that joins, or returns after a preemption, starts
with a step that has prefill chunks (all its windows run, from its first position): nothing stale
is read. A paused request keeps its slot and its
lags: the first step it returns to catches it up.

Choosing M: in steady D = 1 at S = 2 (V = 1) a forced catch-up comes every ``M / 2 + 1`` steps, a
step of every depth with ``S + V + M`` window rows; a larger M makes them rarer (each a little
wider), at the ring's cost of ``[R + 1, S + M, H]`` in the KV dtype.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mtp_ctrl.state.step_metadata import StepMetadata

Entry = Tuple[int, int]  # (depths run, rows each decode window gets past S + V)
SKIP: Entry = (0, 0)  # the step runs no window


class WindowCatchUp:
    """``num_slots``: table slots (the scratch slot included); ``num_depths``: S; ``capacity`` M: the
    most positions a request's window start may fall behind (its ring holds ``S + M`` positions)."""

    def __init__(self, num_slots: int, num_depths: int, capacity: int):
        self.num_depths, self.capacity = num_depths, capacity
        # [R + 1, S] per slot and depth: positions w_k may have fallen behind (non-decreasing in k)
        self._lags = np.zeros((num_slots, num_depths), np.int64)
        # [R + 1] bool: the slot's request may draft; a request that never does (its cap is 0) is
        # left out of every plan: its windows are never caught up, its lags never force a step
        self._may_draft = np.ones(num_slots, bool)
        self._all_may_draft = True  # no slot is left out (the plan needs no mask)
        # [R + 1] bool: the slot's request was admitted never to draft (not retired later), so its
        # prompt blocks are not shared (Proposer.prompt_state_complete): its prompt windows may be skipped
        self._unshared_prompt = np.zeros(num_slots, bool)
        # (slots' bytes, [n] int64 slots, [S] lags): every slot of the last launch has exactly these
        # lags and ``_lags`` is stale for them (written back when another set of slots launches).
        # Steady decoding launches the same slots step after step, all at the same lags (a step with
        # prefill chunks resets them all): its plan then costs no per-slot array work.
        self._uniform: Optional[Tuple[bytes, np.ndarray, Tuple[int, ...]]] = None
        # (lags [S], V, D, steps, decode only) -> (plan, lags after): the uniform path's plans, which
        # repeat (a held depth walks the same few lags over and over; at most M + 1 lags a depth)
        self._plans: Dict[tuple, Tuple[Tuple[Entry, ...], Tuple[int, ...]]] = {}
        self._plan: Tuple[Entry, ...] = ()
        self._calls = 0  # propose / on_no_drafts calls since the plan was set (a capture runs a launch twice)

    def set_may_draft(self, slot: int, may_draft: bool, admitted: bool = True) -> None:
        """Slot ``slot`` now holds a request that may draft, or one that never does (``admitted``:
        it was admitted so, its prompt blocks unshared; False: a live request retired)."""
        if admitted:
            self._unshared_prompt[slot] = not may_draft
        if bool(self._may_draft[slot]) != may_draft:
            self._write_back()
            self._may_draft[slot] = may_draft
            self._lags[slot] = 0  # a slot's lags start over with its request (its prefill runs every window)
            self._all_may_draft = bool(self._may_draft.all())

    def lags(self, slot: int) -> Tuple[int, ...]:
        """How far each depth's window start of table slot ``slot`` may have fallen behind."""
        self._write_back()
        return tuple(int(lag) for lag in self._lags[slot])  # host-ok: numpy

    def _write_back(self) -> None:
        if self._uniform is not None:
            _, slots, lags = self._uniform
            self._lags[slots] = lags
            self._uniform = None

    def _depths_run(self, step: StepMetadata, deepest_lag: int) -> int:
        """D' for one step: D on a decode-only step that drafts D < S while the deepest skipped
        depth stays within M, else S."""
        S = self.num_depths
        drafts = S if step.num_drafts < 0 else step.num_drafts
        if step.decode_only and drafts < S and deepest_lag + 1 + step.verify_width <= self.capacity:
            return drafts
        return S

    def plan(self, step: StepMetadata, lags: Sequence[int]) -> Tuple[Entry, ...]:
        """Each step of the launch (a decode run has several): (depths run, extra rows), from the
        batch's largest lag per depth ``lags`` ``[S]`` (non-decreasing)."""
        return self._plan_and_lags(step, lags)[0]

    def _plan_and_lags(self, step: StepMetadata, lags: Sequence[int]) -> Tuple[Tuple[Entry, ...], Tuple[int, ...]]:
        """:meth:`plan`, and the lags per depth a request at ``lags`` has after the launch."""
        lags, entries, advance = list(lags), [], 1 + step.verify_width  # the most positions a step moves e on
        for _ in range(step.num_steps):
            run = self._depths_run(step, lags[-1])
            entries.append((run, self.capacity if run and lags[run - 1] > 0 else 0))
            lags = [0] * run + [lag + advance for lag in lags[run:]]
        return tuple(entries), tuple(lags)

    def _uniform_plan(self, step: StepMetadata, lags: Tuple[int, ...]) -> Tuple[Tuple[Entry, ...], Tuple[int, ...]]:
        """:meth:`_plan_and_lags` of a launch whose requests all stand at ``lags``, remembered: it
        depends on nothing else of the step."""
        key = (lags, step.verify_width, step.num_drafts, step.num_steps, step.decode_only)
        known = self._plans.get(key)
        if known is None:
            if len(self._plans) >= 4096:  # a bound for odd workloads; steady ones use a few dozen
                self._plans.clear()
            known = self._plans[key] = self._plan_and_lags(step, lags)
        return known

    def plan_launch(self, step: StepMetadata) -> Tuple[Entry, ...]:
        """The launch's plan from the step's decode requests' lags, which it then moves on."""
        S, slots, num_decode = self.num_depths, step.host_slot_ids, step.num_decode  # slots: [n] int64
        if not self._all_may_draft and step.num_drafts == 0 and not self._may_draft[slots].any() and \
                (step.decode_only or self._unshared_prompt[slots].all()):  # nobody here drafts, or ever will
            self.use((SKIP,) * step.num_steps)
            return self._plan
        key, uniform = slots.tobytes(), self._uniform
        if uniform is not None and uniform[0] == key:  # the same slots as the last launch, at one lag each
            drafting = num_decode and (self._all_may_draft or bool(self._may_draft[slots[:num_decode]].any()))
            plan, lags = self._uniform_plan(step, uniform[2] if drafting else (0,) * S)
            self._uniform = (key, uniform[1], lags if drafting else (0,) * S)
            self._plan, self._calls = plan, 0  # use(plan)
            return plan
        self._write_back()
        decode_slots = slots[:num_decode]  # [n_d] int64
        if not self._all_may_draft:  # requests that never draft: their lags plan nothing
            decode_slots = decode_slots[self._may_draft[decode_slots]]
        decode_lags = self._lags[decode_slots]  # [n_d', S]
        lags = decode_lags.max(axis=0).tolist() if decode_slots.shape[0] else [0] * S  # host-ok: numpy
        plan, moved = self._plan_and_lags(step, lags)
        # the launch leaves its slots at one lag each when one of its steps ran every depth (a reset:
        # prefill chunks, drafts of S, a forced catch-up) or its slots all decode at one lag already
        # (a slot left out of the plans may take any lag: nothing reads it)
        every_depth_ran = max(run for run, _ in plan) == S
        at_one_lag = num_decode == slots.shape[0] and bool((decode_lags == decode_lags[:1]).all())
        if every_depth_ran or at_one_lag:
            self._uniform = (key, slots.copy(), moved)
        elif step.num_steps == 1:  # its depths run reset, the rest fall behind
            run = plan[0][0]
            self._lags[slots] = np.where(np.arange(S) < run, 0, self._lags[slots] + 1 + step.verify_width)
        else:  # every request of the step moves the same way: per depth, reset (then behind) or behind more
            advance, behind, reset = 1 + step.verify_width, [0] * S, [False] * S
            for run, _ in plan:
                for depth in range(S):
                    reset[depth], behind[depth] = (True, 0) if depth < run else (reset[depth], behind[depth] + advance)
            self._lags[slots] = np.where(reset, behind, self._lags[slots] + behind)
        self.use(plan)
        return plan

    def warmup_plans(self, step: StepMetadata) -> Tuple[Tuple[Entry, ...], ...]:
        """Every plan the step's shape may take (a few distinct ones), the caught-up one first: only
        the deepest lag's value and whether the step's deepest drafting depth lags matter."""
        S, drafts = self.num_depths, (self.num_depths if step.num_drafts < 0 else step.num_drafts)
        candidates = [[min(shallow, deep)] * drafts + [deep] * (S - drafts)
                      for deep in range(self.capacity + 1) for shallow in (0, 1)]
        plans = [self.plan(step, lags) for lags in candidates]
        if drafts == 0:  # slots that never draft (plan_launch): no window
            plans.append((SKIP,) * step.num_steps)
        return tuple(dict.fromkeys(plans))

    def use(self, plan: Tuple[Entry, ...]) -> None:
        self._plan, self._calls = plan, 0

    def next_entry(self) -> Entry:
        """The plan's entry for the step being built (every depth, S + V rows, without a plan)."""
        if not self._plan:
            return self.num_depths, 0
        entry = self._plan[self._calls % len(self._plan)]
        self._calls += 1
        return entry
