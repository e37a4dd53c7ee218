"""Scheduler: the policy of the step loop (who joins, who runs, who waits, who gives way).

Sizes in, decisions out: it reads host numbers (KV lengths, held block counts, free blocks, free
rows) and returns decisions. The context applies them (table moves, block reservation, staging);
the controller keeps each request's record. What it decides, and nothing else does:

- **The KV reserve.** :func:`worst_case_blocks` is the one block-count formula of the
  overlapped loop: a decode request whose host-known KV length is ``known`` holds blocks for
  ``known + (1 + S) * (new_steps + steps_in_flight)`` tokens (every draft of the steps the host
  has not heard back from accepted, and of the ``new_steps`` being built). Every other block
  count derives from it.
- **Decode runs.** When every running request decodes, one launch may run several decode steps
  back to back (``decode_steps_per_launch``; the host builds and applies once for all of them):
  :meth:`Scheduler.decode_run_steps` picks how many: never so many that a request could reach
  max_model_len before the run's last step (so its KV stays inside the blocks ``worst_case_blocks``
  caps), nor more than some request may still use. A request that stops mid-run (eos, stop
  sequence, max_new_tokens) has the rest of the run discarded.
- **Admission.** Waiting requests join in arrival order (FIFO); an evicted request goes back to
  the front of the queue, and joins only once it can be recomputed without evicting again
  (:meth:`Scheduler.can_admit`). None joins while the prompt tokens the prefilling requests have
  left fill a step's token budget: it would get no chunk in the next step (the chunks go in row
  order and stop at the first partial one), so its admission (prefix lookup, staging) would only
  delay that step's launch; it joins a step later, overlapped with the GPU work.
- **Holding joins** (``join_hold_steps`` > 0): while requests wait, rows that free one by one
  stay empty until enough are free to take the waiting requests, or a quarter of the table
  (``join_group_rows``; so a table of fewer than 8 rows never holds), or ``join_hold_steps``
  steps have been built since the hold began (:meth:`Scheduler.joins_held`). A step that admits
  requests costs far more than a decode step whatever it admits (their prompt chunks, and the
  host's work on a join), so one join of many costs less than many of one. Speculation spreads
  the finishes of requests that plain decoding keeps in lockstep. The rule never holds a row while
  nothing else runs, while a request is paused for KV, nor for a request that was evicted; rows
  it let go are not held again.
- **Pausing for KV.** Decode rows get their blocks in row order; the first that does not fit and
  every later one that needs a block pause (:meth:`Scheduler.decodes_to_pause`). Paused requests
  resume oldest first, a younger one never overtakes (:meth:`Scheduler.num_to_resume`), and no
  prefill chunk runs while one waits.
- **Preemption.** When a step cannot be built at all, the newest live request is evicted
  (:meth:`Scheduler.preemption_victim`), only with no step in flight and while another request
  stays (:meth:`Scheduler.should_preempt`).
- **Chunking.** Prefill requests, in row order, share the token budget the decodes leave and the
  free blocks less those the running decodes take next step; only the last may stop mid-prompt
  (:meth:`Scheduler.prefill_chunk_lengths`).

Example, ``S = 2``, blocks of 4 tokens, a decode request known at 5 tokens holding 2 blocks, with
one step in flight: ``worst_case_blocks(5, 1, 2, 4) = ceil((5 + 3 * 2) / 4) = 3``, so building the
next step takes one more block for it (``blocks_needed`` gives 1). A run of 4 steps instead:
``worst_case_blocks(5, 1, 2, 4, new_steps=4) = ceil((5 + 3 * 5) / 4) = 5``.
"""

import collections
import itertools
from typing import TYPE_CHECKING, Deque, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np

if TYPE_CHECKING:  # engine_shape imports this module's formula
    from mtp_ctrl.state.engine_shape import EngineShape

Lengths = Union[int, np.ndarray]


def worst_case_blocks(known_lengths: Lengths, steps_in_flight: int, num_speculative_tokens: int,
                      block_size_tokens: int, new_steps: int = 1) -> Lengths:
    """The one block-count formula: blocks a request with ``known_lengths`` host-known KV tokens
    (int, or ``[n]`` int64 array) must hold before ``new_steps`` decode steps are launched while
    ``steps_in_flight`` steps have not been read back: room for
    ``known + (1 + S) * (new_steps + steps_in_flight)`` tokens."""
    tokens = known_lengths + (num_speculative_tokens + 1) * (new_steps + steps_in_flight)
    return -(-tokens // block_size_tokens)


def decode_run_lengths(decode_steps_per_launch: int) -> Tuple[int, ...]:
    """The step counts a decode run may have (each has its own CUDA graph): the powers of two below
    ``decode_steps_per_launch``, and it. Example: 6 -> (1, 2, 4, 6)."""
    lengths = {decode_steps_per_launch}
    power = 1
    while power < decode_steps_per_launch:
        lengths.add(power)
        power *= 2
    return tuple(sorted(lengths))


class Scheduler:
    """The step loop's policy for a context of these sizes (see the module docstring).

    It owns the request queues its decisions read, and only it changes them (callers read them
    and tell it what happened through the methods below):

    - waiting: request ids waiting for a row, next first (:meth:`enqueue`, :meth:`requeue_first`,
      :meth:`next_waiting`, :meth:`take_next_waiting`, :meth:`drop_waiting`);
    - :attr:`admission_order`: live requests, oldest first (:meth:`admitted`, :meth:`released`);
    - :attr:`paused_for_kv`: requests it paused for KV, oldest first (:meth:`paused_for_kv_space`,
      :meth:`resumed`);
    - retiring: finished requests whose rows are not freed yet (:meth:`finished`,
      :meth:`take_retiring`).
    """

    def __init__(self, shape: "EngineShape"):
        self.shape = shape
        self.run_lengths = decode_run_lengths(shape.decode_steps_per_launch)  # step counts of a launch, 1 first
        # block writes one launch can stage: each decode's worst case from zero (+1 when its KV does
        # not start on a block boundary), then the prefill chunks' tokens (+1 for a partial block)
        longest = self.run_lengths[-1]
        from_zero = worst_case_blocks(0, longest, shape.num_speculative_tokens, shape.block_size_tokens,
                                      new_steps=longest)
        self.max_block_writes_per_step = \
            shape.max_requests * (from_zero + 1) + self.blocks_for(shape.max_tokens_per_step) + 1
        self._waiting: Deque[int] = collections.deque()  # request ids waiting for a row, next first
        self.admission_order: Dict[int, None] = {}  # live requests (ordered set), oldest first
        self.paused_for_kv: Dict[int, None] = {}  # ordered set: paused by the scheduler, oldest first
        self._retiring: Dict[int, None] = {}  # ordered set: finished, rows not freed yet
        self.join_group_rows = max(1, shape.max_requests // 4)  # free rows that end a hold (joins_held)
        self._steps_built = 0  # steps built so far (a decode run counts each of its steps): the holds' clock
        self._held_since: Optional[int] = None  # _steps_built when the rows now held first went free
        self._hold_ended = False  # the rows free now were held, or let go: not held again (joins_held)

    # ----- the queues ------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_retiring(self) -> int:
        return len(self._retiring)

    def enqueue(self, request_id: int) -> None:
        """A new request waits for a row, behind every waiting one."""
        self._waiting.append(request_id)

    def requeue_first(self, request_id: int) -> None:
        """An evicted request waits at the front of the queue (it joins next, see :meth:`can_admit`)."""
        self._waiting.appendleft(request_id)

    def next_waiting(self) -> Optional[int]:
        """The request that joins next, or None."""
        return self._waiting[0] if self._waiting else None

    def waiting_ids(self, limit: int) -> List[int]:
        """The first ``limit`` waiting requests, the one that joins next first."""
        return list(itertools.islice(self._waiting, limit))

    def take_next_waiting(self) -> int:
        """Remove the request that joins next from the queue (it took a row) and return it."""
        return self._waiting.popleft()

    def drop_waiting(self, request_ids: Iterable[int]) -> None:
        """Remove ``request_ids`` from the queue (those not in it are ignored); the rest keep their order."""
        dropped = set(request_ids)
        kept = [request_id for request_id in self._waiting if request_id not in dropped]
        self._waiting.clear()
        self._waiting.extend(kept)

    def finished(self, request_id: int) -> None:
        """A live request finished: its row is freed at the next :meth:`take_retiring`."""
        self._retiring[request_id] = None

    def is_retiring(self, request_id: int) -> bool:
        return request_id in self._retiring

    def take_retiring(self) -> List[int]:
        """The finished requests whose rows are to be freed now, oldest first; the queue empties."""
        request_ids = list(self._retiring)
        self._retiring.clear()
        return request_ids

    # ----- block counts ----------------------------------------------------------------------

    def blocks_for(self, token_count: Lengths) -> Lengths:
        """Blocks that hold ``token_count`` tokens (int or array): ``ceil(tokens / block size)``."""
        return -(-token_count // self.shape.block_size_tokens)

    def worst_case_blocks(self, known_lengths: Lengths, steps_in_flight: int, new_steps: int = 1) -> Lengths:
        """:func:`worst_case_blocks` for this context, capped at ``max_blocks_per_request`` (a request
        at max_model_len stops; the cap already holds the step it runs past its stop)."""
        shape = self.shape
        blocks = worst_case_blocks(known_lengths, steps_in_flight, shape.num_speculative_tokens, shape.block_size_tokens,
                                   new_steps)
        return np.minimum(blocks, shape.max_blocks_per_request)

    def blocks_needed(self, known_lengths: np.ndarray, block_counts: np.ndarray, steps_in_flight: int,
                      new_steps: int = 1) -> np.ndarray:
        """``[n]`` int64: blocks each of ``n`` decode requests must still take before ``new_steps``
        more steps are launched."""
        return np.maximum(self.worst_case_blocks(known_lengths, steps_in_flight, new_steps) - block_counts, 0)

    def decode_run_steps(self, tokens_to_model_len: int, most_tokens_left: int, steps_in_flight: int,
                         tokens_per_step: float = 1.0) -> int:
        """How many decode steps the next launch runs, when every running request decodes: the
        longest run length such that

        - no request can reach max_model_len before the run's last step: each step adds at most
          ``1 + S`` tokens, so ``(1 + S) * (steps_in_flight + steps - 1) < tokens_to_model_len``
          (the fewest tokens any running request may still emit before max_model_len, as the
          host knows now). Then a request runs past max_model_len as far as with single steps,
          and ``max_blocks_per_request`` holds it;
        - the run's last step is expected to be of use: ``(steps_in_flight + steps - 1) *
          tokens_per_step < most_tokens_left`` (the most tokens any running request may still emit
          before max_new_tokens or max_model_len; ``tokens_per_step``: the mean accepted length
          so far, 1 without drafts). Only throughput rests on it: a run that outlasts every
          request is discarded, a short one costs host time.

        Example, ``S = 0``, run lengths (1, 2, 4), one run of 4 in flight, no max_model_len near:
        8 tokens left -> 4 (4 + 4 - 1 < 8); 6 left -> 2; 4 left -> 1."""
        for steps in reversed(self.run_lengths):
            last = steps_in_flight + steps - 1  # steps before the run's last one
            if steps == 1 or (self.shape.stride * last < tokens_to_model_len and last * tokens_per_step < most_tokens_left):
                return steps
        return 1

    # ----- admission and preemption ----------------------------------------------------------

    def can_admit(self, token_count: int, preempted: bool, free_rows: int, free_blocks: int,
                  prefill_backlog: int = 0) -> bool:
        """Whether the next waiting request (``token_count`` tokens to prefill; ``preempted``: it
        was evicted before) may take a row now. An evicted request waits until its whole KV, with
        a step in flight, fits the free blocks, so that it is not evicted again at once.
        ``prefill_backlog``: prompt tokens the live prefilling requests have left; at a step's
        token budget or more, the request would get no chunk next step, so it waits."""
        if free_rows <= 0 or prefill_backlog >= self.shape.max_tokens_per_step:
            return False
        return not preempted or int(self.worst_case_blocks(token_count, steps_in_flight=1)) <= free_blocks

    def joins_held(self, free_rows: int, num_running: int, next_preempted: bool) -> bool:
        """Whether the waiting requests stay out of the ``free_rows`` free rows for now (see the
        module docstring, "Holding joins"): ``num_running``, the live requests that run next step
        (none paused for KV); ``next_preempted``, the next waiting request was evicted. Ask it
        before every admission, also when nobody waits. A hold lasts until the first call
        ``join_hold_steps`` built steps after it began (a decode run's steps all count, so a row may
        stay empty up to ``join_hold_steps + decode_steps_per_launch - 1`` steps); once it ends, or
        is not taken, the rows free now are not held again (every request :meth:`can_admit` lets in
        joins) until no row is free or enough are."""
        wanted = min(self.num_waiting, self.join_group_rows)
        if free_rows <= 0 or wanted == 0 or free_rows >= wanted:  # nothing to hold: a later hold starts afresh
            self._held_since, self._hold_ended = None, False
            return False
        if self._hold_ended:
            return False
        if num_running == 0 or self.paused_for_kv or next_preempted or self.shape.join_hold_steps == 0:
            self._hold_ended = True
            return False
        if self._held_since is None:
            self._held_since = self._steps_built
        if self._steps_built - self._held_since >= self.shape.join_hold_steps:
            self._held_since, self._hold_ended = None, True
            return False
        return True

    def built(self, num_steps: int) -> None:
        """The context built a launch of ``num_steps`` steps (the clock of :meth:`joins_held`)."""
        self._steps_built += num_steps

    def admitted(self, request_id: int) -> None:
        """The request took a row."""
        self.admission_order[request_id] = None

    def released(self, request_id: int) -> None:
        """The request left its row (finished or evicted)."""
        self.admission_order.pop(request_id, None)
        self.paused_for_kv.pop(request_id, None)

    def paused_for_kv_space(self, request_id: int) -> None:
        """The context paused a decode the free blocks could not hold (it resumes oldest first)."""
        self.paused_for_kv[request_id] = None

    def resumed(self, request_id: int) -> None:
        """A paused request runs again."""
        self.paused_for_kv.pop(request_id, None)

    def should_preempt(self, num_live: int, steps_in_flight: int) -> bool:
        """A step found no request able to get a block: evict one, if that can help (another
        request stays) and the host knows every length (no step in flight)."""
        return num_live > 1 and steps_in_flight == 0

    def preemption_victim(self) -> int:
        """The request to evict for KV space: the newest live one (it has the least work to redo)."""
        if not self.admission_order:
            raise ValueError("preemption_victim: no live request")
        return next(reversed(self.admission_order))

    # ----- pausing for KV --------------------------------------------------------------------

    def decodes_to_pause(self, needs: np.ndarray, free_blocks: int) -> np.ndarray:
        """``[n]`` bool: which decode rows pause, given each one's ``needs`` (``[n]`` int64, row
        order) and the free blocks: rows take blocks in order; the first that does not fit and
        every later one that needs a block pause."""
        fits = (needs == 0) | (np.cumsum(needs) <= free_blocks)
        return ~fits

    def oldest_paused(self) -> Optional[int]:
        """The request paused for KV the longest (the next to resume), or None."""
        return next(iter(self.paused_for_kv), None)

    def num_to_resume(self, needs: Iterable[int], spare_blocks: int) -> int:
        """How many of the requests paused for KV resume: ``needs`` are their blocks for one
        decode step, oldest first; they resume in that order while the spare blocks last."""
        count = 0
        for need in needs:
            if need > spare_blocks:
                break  # oldest first: a younger request does not overtake
            spare_blocks -= need
            count += 1
        return count

    # ----- chunking --------------------------------------------------------------------------

    def prefill_budget(self, num_decode: int) -> int:
        """Query rows left for prefill chunks once ``num_decode`` decode requests took theirs."""
        return self.shape.max_tokens_per_step - num_decode * self.shape.stride

    def decode_reserve(self, num_decode: int) -> int:
        """Free blocks a prefill chunk must leave: those the running decodes may take next step."""
        return num_decode * int(self.worst_case_blocks(0, steps_in_flight=0))

    def prefill_chunk_lengths(self, remaining: np.ndarray, known_lengths: np.ndarray, block_counts: np.ndarray,
                              free_blocks: int, num_decode: int, chunk_caps: Optional[np.ndarray] = None) -> List[int]:
        """Chunk lengths of the prefill requests, in row order (``remaining``, ``known_lengths``,
        ``block_counts``: ``[p]`` int64 each): each takes what is left of its prompt, the token
        budget and the blocks (free less the decodes' reserve), and at most its ``chunk_caps``
        entry (``[p]`` int64: a chunk ends at a recurrent-state snapshot boundary, see
        ``state/prefix_cache.py``; None: no caps); the list stops at the first request that gets
        nothing or stops mid-prompt."""
        budget = self.prefill_budget(num_decode)
        spare_blocks = max(free_blocks - self.decode_reserve(num_decode), 0)
        lengths: List[int] = []
        caps = remaining if chunk_caps is None else np.minimum(remaining, chunk_caps)  # [p] int64
        rows = zip(remaining.tolist(), known_lengths.tolist(), block_counts.tolist(), caps.tolist())  # host-ok: numpy
        for left, known, held, cap in rows:
            capacity = (held + spare_blocks) * self.shape.block_size_tokens - known
            length = min(cap, budget, capacity)
            if length <= 0:
                break
            spare_blocks -= max(int(self.blocks_for(known + length)) - held, 0)
            lengths.append(length)
            budget -= length
            if length < left:
                break  # a partial chunk is the last one of the step
        return lengths
