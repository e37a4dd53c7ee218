"""Requests into and out of table slots: admission, preemption, finishing and retirement; and a
live request's retirement from speculation (the draft-length policy gave up on its drafts).

A request takes a table slot when it is admitted (``state/scheduler.py`` decides who and when)
and keeps it until it leaves: finished, aborted, or preempted for KV space (then it waits again
and is recomputed from its prompt and output so far: sampling is positional, so its output does
not change). With a step in flight nothing moves: a request that finishes in the read-back of
step N is only marked (``finish``); its slot is freed by ``retire_finished`` once no launched
step still reads it as live, and a newly admitted request's device rows are reset stream-ordered
after the step in flight.
"""

from typing import Iterable, List, Optional, Tuple

import numpy as np

from mtp_ctrl.controllers.acceptance import RequestSampling
from mtp_ctrl.controllers.draft_lengths import DraftLengths
from mtp_ctrl.controllers.output_rows import OutputRows
from mtp_ctrl.controllers.proposers import Proposer
from mtp_ctrl.controllers.requests import RequestBook
from mtp_ctrl.controllers.stop_rules import FinishReason
from mtp_ctrl.state import DynamicInferenceContext, RowGroup


# the prefix-cache namespace of requests whose prompt blocks lack the proposer's state (they never
# draft: Proposer.prompt_state_complete): they share blocks among themselves, never with the others
NO_DRAFT_STATE = b"no-draft-state"
JOINING_SAMPLE = 16  # waiting requests whose token budgets give the policy the length of a joining request


class SlotLifecycle:
    """Moves requests between the waiting queue, the table's slots and the finished results."""

    def __init__(self, context: DynamicInferenceContext, requests: RequestBook, outputs: OutputRows,
                 proposer: Proposer, draft_lengths: DraftLengths):
        self.context, self.scheduler = context, context.scheduler
        self.requests, self.outputs, self.proposer, self.draft_lengths = requests, outputs, proposer, draft_lengths
        draft_lengths.on_retired = self.retire_from_speculation
        # [R + 1] bool by table slot: its request never drafts (capped at 0, or retired); read per launch
        self._never_drafts = np.zeros(context.shape.max_requests + 1, dtype=bool)
        self._holds_joins = context.shape.join_hold_steps > 0

    def can_admit(self) -> bool:
        request_id = self.scheduler.next_waiting()
        if request_id is None:
            return False
        request = self.requests[request_id]
        return self.scheduler.can_admit(len(request.prompt_tokens) + len(request.output_tokens), request.preemptions > 0,
                                        self.context.num_free_rows, self.context.allocator.num_free_blocks,
                                        self.context.prefill_backlog())

    def admit_waiting(self) -> None:
        """Slots for waiting requests, also with a step in flight (the slot's device rows are
        reset stream-ordered after it), until the prefilling requests' backlog fills a step
        (``Scheduler.can_admit``); none while the scheduler holds joins (``Scheduler.joins_held``)."""
        if self._holds_joins and self._joins_held():
            return
        while self.can_admit():
            request = self.requests[self.scheduler.next_waiting()]
            may_draft = self.draft_lengths.admitted(request.request_id)
            # the prompt was checked by check_prompt: as an int64 array the context checks only its dtype
            self.context.add_request(request.request_id, request.prefill_tokens(),
                                     RequestSampling.row_values(request.params, request.seed), request.use_prefix_cache,
                                     prefix_namespace=b"" if self.proposer.prompt_state_complete(may_draft)
                                     else NO_DRAFT_STATE)
            self.scheduler.take_next_waiting()  # only once the context holds it
            request.attach(self.outputs, self.context.table)  # the slot's rows own output and counters now
            slot = self.context.table.slot_of(request.request_id)
            self._never_drafts[slot] = not may_draft
            self.proposer.on_admitted(slot, may_draft)

    def _joins_held(self) -> bool:
        table, scheduler = self.context.table, self.scheduler
        # requests the next step runs: a paused one (by the user or for KV) advances no hold's clock
        num_running = table.group_size(RowGroup.DECODE) + table.group_size(RowGroup.PREFILL) - scheduler.num_retiring
        next_id = scheduler.next_waiting()
        next_preempted = next_id is not None and self.requests[next_id].preemptions > 0
        return scheduler.joins_held(self.context.num_free_rows, max(num_running, 0), next_preempted)

    def none_drafts(self, slots: np.ndarray) -> bool:
        """Whether no request in table ``slots`` (``[n]`` int64) drafts, now or later."""
        return bool(self._never_drafts[slots].all())

    def queue_view(self, request_ids: np.ndarray) -> Tuple[int, np.ndarray, Optional[int]]:
        """For the draft-length policy (when it is asked): how many requests wait for the batch
        (to be admitted, or paused for KV space: either takes the blocks finishing requests free),
        ``[n]`` the tokens each of the live ``request_ids`` may still emit, and the mean of the most
        the next ``JOINING_SAMPLE`` waiting requests may (None: none waits, or only paused ones)."""
        slots = np.fromiter(map(self.context.table.slot_of, request_ids.tolist()),  # host-ok: numpy ids
                            np.int64, request_ids.shape[0])
        # a preempted request waits first with its output so far: its budget is what it has left
        max_model_len = self.context.shape.max_model_len
        budgets = [min(record.params.max_new_tokens, max_model_len - len(record.prompt_tokens))
                   - len(record.output_tokens)
                   for record in map(self.requests.__getitem__, self.scheduler.waiting_ids(JOINING_SAMPLE))]
        joining = round(sum(budgets) / len(budgets)) if budgets else None
        return (self.scheduler.num_waiting + len(self.scheduler.paused_for_kv), self.outputs.tokens_left(slots),
                joining)

    def retire_from_speculation(self, request_id: int) -> None:
        """The live request never drafts again (the policy retired it): the proposer may stop
        keeping what only its drafts would read (``Proposer.on_retired``)."""
        slot = self.context.table.slot_of(request_id)
        self._never_drafts[slot] = True
        self.proposer.on_retired(slot)

    def preempt_newest(self) -> None:
        """Evict the newest live request to free its KV blocks; it waits first in the queue."""
        request_id = self.scheduler.preemption_victim()
        self.release([request_id])
        self.requests[request_id].preemptions += 1
        self.scheduler.requeue_first(request_id)

    def release(self, request_ids: List[int]) -> None:
        """The requests leave their slots (finished, preempted or aborted): each ``Request`` keeps
        what its slot held. The context frees the slots in one batch."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                request.detach()
        self.context.finish_requests(request_ids)
        for request_id in request_ids:
            self.proposer.forget(request_id)
            request = self.requests.get(request_id)
            if request is None or request.finish_reason is not None:  # gone for good (an evicted one returns)
                self.draft_lengths.drop(request_id)

    def finish(self, request_id: int, reason: FinishReason) -> None:
        """Mark a live request finished; its slot is freed by the next :meth:`retire_finished`."""
        self.requests[request_id].finish_reason = reason
        self.scheduler.finished(request_id)

    def retire_finished(self) -> None:
        """Free the slots of requests that finished (call it when no launched step reads them)."""
        retiring = self.scheduler.take_retiring()
        if retiring:
            self.release(retiring)
            self.requests.finished(retiring)

    def abort(self, request_ids: Iterable[int]) -> None:
        """End these unfinished requests (waiting, live or paused) as ABORTED, output so far kept;
        the live ones' slots go at the next :meth:`retire_finished`. Call it with no step in flight."""
        request_ids = [rid for rid in request_ids if self.requests[rid].finish_reason is None]
        self.scheduler.drop_waiting(request_ids)
        for request_id in request_ids:
            self.requests[request_id].finish_reason = FinishReason.ABORTED
            if request_id in self.context:
                self.scheduler.finished(request_id)
            else:  # it held no slot: its result is claimable now
                self.draft_lengths.drop(request_id)
                self.requests.finished([request_id])

    def abort_running(self) -> None:
        """A step raised: every request in the batch ends as ABORTED (waiting ones stay queued)."""
        self.context.abandon_steps_in_flight()
        for request_id in list(self.scheduler.admission_order):
            request = self.requests.get(request_id)
            if request is not None and request.finish_reason is None:
                request.finish_reason = FinishReason.ABORTED
            self.scheduler.finished(request_id)
        self.retire_finished()
