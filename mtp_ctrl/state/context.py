"""DynamicInferenceContext: the state a speculative-decoding controller drives.

It owns the KV block pool, the KV caches, the request table, the Mamba state slots and the
buffers of each step, and carries out what its :class:`~mtp_ctrl.state.scheduler.Scheduler`
decides (``self.scheduler``: which decodes pause or resume, the prefill chunks under the token
budget, the worst-case block reserve): table moves and staging; block reservation and pausing for
KV space through its :class:`~mtp_ctrl.state.block_reservations.BlockReservations`.

Life cycle of a request::

    add_request    -> PREFILL: a table slot (kept until it leaves), a Mamba slot, no blocks (with
                      prefix caching: the cached full blocks its prompt starts with, see
                      ``state/prefix_cache.py``)
    build_step     -> runs prefill chunks; after its final chunk the next build_step makes it DECODE
                      (1 + V rows a step, V <= S); too few free blocks -> PAUSED (state intact), resumed
                      by a later build_step once blocks are free
    pause_request / resume_request  -> PAUSED and back, on the caller's word
    finish_request(s) -> blocks and Mamba slot released, table slot freed

The overlapped loop (see ``controllers/controller.py``): the caller may build step N + 1 before
it has read step N's outcome back. The device knows each decode request's KV length; the host
(``table.host.known_lengths``) learns it from the read-back (:meth:`commit_readback`), one step
late. So a step is built for the worst case, every draft of the steps in flight accepted: each
decode request holds blocks for ``known_length + (1 + S) * (new_steps + steps_in_flight)`` tokens
(``scheduler.worst_case_blocks``, the one formula). A build may stage a decode run: ``new_steps``
decode steps that one launch runs back to back (``StepMetadata.num_steps``; the scheduler picks
it, :meth:`build_step`). Pausing and resuming need the host's lengths exact, so they wait until no
step is in flight: :meth:`needs_sync` tells the caller, and those calls raise ``RuntimeError``
while a built step has not been committed (a build with a step in flight neither pauses nor
resumes; short of blocks it raises ``KVCacheFullError``). Nothing else needs a wait, because slots never move: finishing
frees the slots (their device rows are reset after the steps in flight on the stream), admitting
takes a free slot (reset with the next build, in one batch), a prompt whose final chunk ran joins
the decode list. A step's read-back is committed to the slots it ran on, skipping a slot whose
request has left since (:meth:`commit_readback`).
"""

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from mtp_ctrl.state.batch_dimensions import (BatchDimensions, check_batch_sizes, ragged_token_counts, round_up_batch_size,
                                             token_buckets, check_token_counts)
from mtp_ctrl.state.block_reservations import BlockReservations
from mtp_ctrl.state.engine_shape import EngineShape
from mtp_ctrl.state.kv_block_allocator import KVBlockAllocator, KVCacheFullError
from mtp_ctrl.state.kv_cache import AnyKVCacheSpec, KVCacheSpec, LatentKVCacheSpec
from mtp_ctrl.state.mamba_slots import MambaSpec, MambaStateSlots
from mtp_ctrl.state.prefix_cache import PrefixCache, SnapshotDue
from mtp_ctrl.state.request_table import RequestTable, RowGroup
from mtp_ctrl.state.scheduler import Scheduler
from mtp_ctrl.state.state_snapshots import RecurrentStateSnapshots
from mtp_ctrl.state.step_metadata import StepBuffers, StepMetadata

Tokens = Union[torch.Tensor, np.ndarray, Sequence[int]]
DraftLengthsFn = Callable[[np.ndarray, int, int], np.ndarray]  # (request ids, num_sampling, batch size) -> lengths


class DynamicInferenceContext:
    """The engine's state for a :class:`EngineShape` (sizes, S, device: read from ``shape``).

    kv_cache: the cache layout (standard K/V per local kv head, or the MLA latent) of every layer
        (decoder + MTP depths) and its dtype.
    num_blocks / kv_cache_bytes: the KV pool, as a block count or a byte budget.
    cuda_graph_batch_sizes: batch sizes with a CUDA graph (steps are padded to them; a step with
        prefill chunks also pads its tokens to ``cuda_graph_token_counts``; None: ``token_buckets``).
    mamba: Mamba layer count and state shapes, or None for a model without Mamba layers.
    state_snapshots: recurrent-state snapshot slots for prefix caching on a hybrid model (``mamba``
        given; 0: none, a hybrid then takes no prefix-cache hit); with ``kv_cache_bytes`` they are
        paid from that budget.

    Sizing rules (checked here and in :class:`EngineShape`): ``max_tokens_per_step >= R * (1 + S)``
    so every decode request runs every step; a request holds at most ``MB = ceil((max_model_len +
    2 (1 + S)) / block_size_tokens)`` blocks (room for a step run past its stop before the host saw
    it), and the pool holds at least that many; give ``num_blocks`` or ``kv_cache_bytes``, not both.
    """

    def __init__(
        self,
        shape: EngineShape,
        *,
        kv_cache: AnyKVCacheSpec,
        num_blocks: Optional[int] = None,
        kv_cache_bytes: Optional[int] = None,
        cuda_graph_batch_sizes: Sequence[int] = (),
        cuda_graph_token_counts: Optional[Sequence[int]] = None,
        mamba: Optional[MambaSpec] = None,
        state_snapshots: int = 0,
    ):
        if not isinstance(shape, EngineShape):
            raise TypeError(f"shape must be an EngineShape, got {type(shape).__name__}")
        if not isinstance(kv_cache, (KVCacheSpec, LatentKVCacheSpec)):
            raise TypeError(f"kv_cache must be a KVCacheSpec or LatentKVCacheSpec, got {type(kv_cache).__name__}")
        if (num_blocks is None) == (kv_cache_bytes is None):
            raise ValueError("give exactly one of num_blocks and kv_cache_bytes")
        if isinstance(state_snapshots, bool) or not isinstance(state_snapshots, int) or state_snapshots < 0:
            raise ValueError(f"state_snapshots must be an int >= 0, got {state_snapshots!r}")
        state_snapshots = state_snapshots if mamba is not None else 0
        self.shape = shape
        max_requests, block_size_tokens, device = shape.max_requests, shape.block_size_tokens, shape.device
        self.cuda_graph_batch_sizes = check_batch_sizes(cuda_graph_batch_sizes, max_requests)
        # token counts of the graphs of steps with prefill chunks (none without batch buckets)
        token_counts = token_buckets(shape.max_tokens_per_step) if cuda_graph_token_counts is None else \
            check_token_counts(cuda_graph_token_counts, shape.max_tokens_per_step)
        self.cuda_graph_token_counts = token_counts if self.cuda_graph_batch_sizes else ()
        # decode requests run 1 + s_r rows each (the drafts they hold), not 1 + V (enable_ragged_rows)
        self.ragged_rows = False
        self.scheduler = Scheduler(shape)
        if num_blocks is not None:
            self.allocator = KVBlockAllocator(num_blocks, block_size_tokens)
        else:
            bytes_per_block = kv_cache.bytes_per_block(block_size_tokens)
            if state_snapshots:  # the snapshots are paid from the KV budget
                kv_cache_bytes -= state_snapshots * RecurrentStateSnapshots.bytes_per_snapshot(mamba)
            if kv_cache_bytes < 2 * bytes_per_block:  # the budget holds the scratch block too (see below)
                raise ValueError(f"kv_cache_bytes ({kv_cache_bytes}) must hold two KV blocks ({bytes_per_block} "
                                 "bytes each): one for requests, one scratch block")
            self.allocator = KVBlockAllocator.from_memory_budget(kv_cache_bytes - bytes_per_block, bytes_per_block,
                                                                 block_size_tokens)
        if self.allocator.num_blocks < shape.max_blocks_per_request:
            raise ValueError(
                f"the KV pool ({self.allocator.num_blocks} blocks) cannot hold one request of max_model_len "
                f"{shape.max_model_len} + 2 x {shape.stride} rows in flight ({shape.max_blocks_per_request} blocks)"
            )
        # one block past the pool is never handed out: released and padding rows point at it, so a
        # replay of any captured graph reads and writes inside the caches (RequestTable.reset_free_rows)
        self.scratch_block = self.allocator.num_blocks
        self.num_cache_blocks = self.allocator.num_blocks + 1  # [num_cache_blocks, bs, Hkv, D] caches
        self.kv_caches = kv_cache.allocate(self.num_cache_blocks, block_size_tokens, device)
        self.mamba = None if mamba is None else MambaStateSlots(mamba, max_requests, shape.num_speculative_tokens, device)
        self._state_snapshots = RecurrentStateSnapshots(mamba, state_snapshots, device) if state_snapshots else None
        # the last built step and the requests whose chunk in it ends at a snapshot boundary
        self._snapshots_due: Tuple[Optional[StepMetadata], List[SnapshotDue]] = (None, [])
        self.table = RequestTable(shape)
        self.table.set_free_row_targets(self.scratch_block, -1 if self.mamba is None else self.mamba.scratch_slot)
        # [R + 1] int64: tokens the request's prefill computes (its prompt, plus the output so far
        # after a preemption; the controller's OutputRows.prompt_lengths is the original prompt's)
        self._prefill_token_counts = self.table.add_host_rows("prefill_token_counts", ())
        # [R + 1] int64: drafts the request holds (chosen by its last sampling step): its next decode
        # verifies that many, and a step's verify width V is the most any of its decodes holds
        self._drafts_held = self.table.add_host_rows("drafts_held", (), fill=shape.num_speculative_tokens)
        self._step_buffers = StepBuffers(self.table, shape.max_tokens_per_step, self.scheduler.max_block_writes_per_step)
        self._step_buffers.gathers_mamba_rows = self.mamba is not None
        # the blocks each request holds: reserved before each build, pausing decodes short of them
        self._reservations = BlockReservations(self.table, self.scheduler, self.allocator)
        # request id -> [P] int64: the tokens its prefill computes (the prompt, plus the output so far
        # for a preempted request); the controller's RequestRecord keeps the prompt and the output
        self._prefill_tokens: Dict[int, np.ndarray] = {}
        self._prompts_done: Dict[int, None] = {}  # ran their final chunk; become DECODE at the next build
        self._steps_in_flight: List[StepMetadata] = []  # built, not yet committed (oldest first); runs count num_steps
        self.prefix_cache = PrefixCache(self.allocator, lookahead=None)  # off until enable_prefix_caching

    def enable_prefix_caching(self, lookahead: int, salt: bytes = b"") -> bool:
        """Reuse full KV blocks of prompts (see ``state/prefix_cache.py``): ``lookahead`` tokens past
        a block its content depends on (0 for the decoder alone; the proposer's, e.g. S for paged
        MTP depths). Hybrid models (Mamba-2 or Gated DeltaNet: state slots) reuse a prefix with a
        snapshot of the recurrent state after it (``state_snapshots`` slots; without them they
        take no hit). Returns whether caching is on. Only before the first request."""
        if self.table.num_live or self.prefix_cache.queried_tokens:
            raise RuntimeError("enable_prefix_caching: requests have joined already")
        reusable = self.mamba is None or self._state_snapshots is not None
        self.prefix_cache = PrefixCache(self.allocator, lookahead if reusable else None, salt, self._state_snapshots)
        if self.prefix_cache.enabled:
            self.table.enable_cached_prefixes()
        return self.prefix_cache.enabled

    def blocks_for(self, token_count) -> int:
        """Blocks that hold ``token_count`` tokens (int or array); the worst-case reserve of a
        decode request is ``scheduler.worst_case_blocks``."""
        return self.scheduler.blocks_for(token_count)

    # ----- requests ----------------------------------------------------------------------

    @property
    def num_prefills_held(self) -> int:
        """Requests whose prefill tokens the context keeps (one per live request; a debug count)."""
        return len(self._prefill_tokens)

    @property
    def num_free_rows(self) -> int:
        """How many more requests ``add_request`` accepts now."""
        return self.table.shape.max_requests - self.table.num_live

    def __contains__(self, request_id: int) -> bool:
        return request_id in self.table

    def add_request(self, request_id: int, prompt_tokens: Tokens, row_values: Optional[Dict[str, float]] = None,
                    use_prefix_cache: bool = True, prefix_namespace: bytes = b"") -> None:
        """Admit a request with its prompt (``[P]`` int tokens: CPU tensor, numpy array or sequence).
        ``row_values``: the first values of the table's ``set_on_insert`` rows (``table.insert``).
        With prefix caching on (and ``use_prefix_cache``), it starts with the cached blocks its
        prompt begins with and prefills only the rest; ``prefix_namespace``: it shares blocks only
        with requests of the same namespace (their content differs: a proposer that skips the
        prompt windows of a request that never drafts).

        Allowed while a step is in flight (see the module docstring): the request takes a free
        slot, at the end of the prefill list, and its device rows are reset with the next step's
        set-up, stream-ordered after the step in flight, in one batch with every other request
        admitted until then."""
        if isinstance(request_id, bool) or not isinstance(request_id, int) or request_id < 0:
            raise ValueError(f"request_id must be an int >= 0, got {request_id!r}")
        if request_id in self.table:
            raise ValueError(f"request_id {request_id} is already live")
        prompt = _as_prompt(prompt_tokens, self.shape.max_model_len)
        if self.num_free_rows == 0:
            raise RuntimeError(f"max_requests ({self.table.shape.max_requests}) requests are live; finish one first")
        if not isinstance(use_prefix_cache, bool):
            raise TypeError(f"use_prefix_cache must be a bool, got {type(use_prefix_cache).__name__}")
        if not isinstance(prefix_namespace, bytes):
            raise TypeError(f"prefix_namespace must be bytes, got {type(prefix_namespace).__name__}")
        slot = -1 if self.mamba is None else self.mamba.allocate_slot()
        cached_block_ids = self.prefix_cache.attach(request_id, prompt, use_prefix_cache, self.mamba, slot,
                                                    prefix_namespace)
        table_slot = self.table.insert(request_id, RowGroup.PREFILL, slot, row_values, cached_block_ids)
        self._prefill_token_counts[table_slot] = prompt.shape[0]
        self._prefill_tokens[request_id] = prompt
        self.scheduler.admitted(request_id)

    def prefill_backlog(self) -> int:
        """Prompt tokens the live prefilling requests have left to prefill (the host's lengths:
        chunks of steps in flight count as done)."""
        slots = self.table.slots_in(RowGroup.PREFILL)  # [p] int64
        return int((self._prefill_token_counts[slots] - self.table.host.known_lengths[slots]).sum())

    def finish_request(self, request_id: int) -> None:
        """:meth:`finish_requests` of one request."""
        self.finish_requests([request_id])

    def finish_requests(self, request_ids: Sequence[int]) -> None:
        """Release the requests' KV blocks and Mamba slots and free their table slots. Allowed with
        steps in flight: their blocks and slots may still be written by them, and the next
        owner's writes come after them on the stream (so does the reset of the freed slots)."""
        rows = [self._live_slot(request_id) for request_id in request_ids]  # every one is checked first
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"request_ids has repeats: {list(request_ids)}")
        host = self.table.host
        for request_id, row in zip(request_ids, rows):
            self.allocator.release(host.block_ids[row, : host.block_counts[row]].tolist())  # host-ok: numpy
            if self.mamba is not None:
                self.mamba.release_slot(int(host.mamba_slot_ids[row]))
            del self._prefill_tokens[request_id]
            self.prefix_cache.forget(request_id)
            self.scheduler.released(request_id)
            self._prompts_done.pop(request_id, None)
        self.table.remove(request_ids)

    def pause_request(self, request_id: int) -> None:
        """Stop running the request (its blocks and state stay) until ``resume_request``."""
        self._live_slot(request_id)
        self._require_no_step_in_flight("pause_request")
        if self.table.group_of(request_id) == RowGroup.PAUSED:
            raise ValueError(f"request {request_id} is already paused")
        self._become_decode_if_prompt_done(request_id)
        self.table.move(request_id, RowGroup.PAUSED)

    def resume_request(self, request_id: int) -> None:
        """Run a paused request again from the next step (decode, or the rest of its prompt)."""
        row = self._live_slot(request_id)
        self._require_no_step_in_flight("resume_request")
        if self.table.group_of(request_id) != RowGroup.PAUSED:
            raise ValueError(f"request {request_id} is not paused")
        prompt_done = int(self.table.host.known_lengths[row]) >= self._prefill_tokens[request_id].shape[0]
        self.table.move(request_id, RowGroup.DECODE if prompt_done else RowGroup.PREFILL)
        self.scheduler.resumed(request_id)

    # ----- steps -------------------------------------------------------------------------

    def needs_sync(self) -> bool:
        """Whether the next :meth:`build_step` would pause or resume requests, which it may only
        do once the host knows every decode request's length (no step in flight)."""
        steps = max(self.steps_in_flight, 1)  # the next step is built with the launch in flight
        if not self.scheduler.paused_for_kv:
            # a request holds the blocks of its known tokens, so it needs at most the blocks of the
            # (1 + S) tokens a step of the launch in flight and the next one add: when the free
            # blocks hold that for every live request, no decode can pause (O(1), most steps)
            most_per_request = self.scheduler.blocks_for((1 + self.shape.num_speculative_tokens) * (steps + 1))
            if self.table.num_live * most_per_request <= self.allocator.num_free_blocks:
                return False
        decode_slots = self.table.slots_in(RowGroup.DECODE)  # the next step's decodes: these and the prompts done
        if self._prompts_done:
            decode_slots = np.concatenate([decode_slots, [self.table.slot_of(rid) for rid in self._prompts_done]])
        needs = self._reservations.decode_needs(steps_in_flight=steps, slots=decode_slots)
        spare_blocks = self.allocator.num_free_blocks - int(needs.sum())
        if spare_blocks < 0:
            return True  # a decode must pause
        oldest = self.scheduler.oldest_paused()
        if oldest is not None:  # only worth a sync when the oldest paused request could resume
            return self._reservations.blocks_to_resume(self.table.slot_of(oldest)) <= spare_blocks
        return False

    @property
    def steps_in_flight(self) -> int:
        """Steps built whose outcome :meth:`commit_readback` has not taken yet (a decode run counts
        each of its steps)."""
        return sum(step.num_steps for step in self._steps_in_flight)

    def build_step(self, *, length_budgets: Tuple[int, int, float] = (0, 0, 1.0),
                   draft_lengths: Optional[DraftLengthsFn] = None) -> Optional[StepMetadata]:
        """Schedule the next forward pass, take its blocks and stage it; None if no request runs.

        With a step in flight (built, not committed) the step is built for the worst case of the
        one in flight, and nothing pauses or resumes (:meth:`needs_sync` says when the caller
        should commit first); decodes short of blocks then raise ``KVCacheFullError``. Every
        decode request runs ``1 + V`` rows (V, the step's verify width: the most drafts any of its
        decode requests holds, chosen by ``draft_lengths`` when it last sampled, with or without
        prefill chunks; S without a policy; blocks are still reserved for ``1 + S``); prefill
        requests then take the rest of
        ``max_tokens_per_step`` in list order (only the last one may stop mid-prompt). Decode
        requests that cannot get their blocks are paused; paused ones are resumed (oldest first)
        when blocks are free again, and no prefill starts while one still waits. Raises
        ``KVCacheFullError`` when requests are live but none can get a block (nothing changed).

        Decode runs: when every running request decodes (no prefill row, none paused for KV) and
        the blocks are free, the step is staged as a run of ``step.num_steps`` decode steps
        (``scheduler.decode_run_steps``; at most ``decode_steps_per_launch``), reserving blocks
        for all of them. ``length_budgets``: the fewest tokens any running request may still emit
        before max_model_len, the most any may emit before max_new_tokens or max_model_len (the
        caller's output rows know them), and the tokens a step is expected to add
        (``scheduler.decode_run_steps``); ``(0, 0, 1.0)`` (the default) builds single steps.
        ``draft_lengths(request_ids, num_sampling, batch_size)``: the caller's draft-length policy,
        asked once the step's requests are known: ``[num_sampling]`` int64 drafts for the step's
        first ``num_sampling`` requests (row order; the rest sample nothing and draft 0). None:
        S each.
        """
        steps_in_flight = self.steps_in_flight
        self._snapshots_due = (None, [])
        self.table.write_inserted_rows()  # the slots admitted since the last step, in one batch
        for request_id in list(self._prompts_done):  # in the order their prompts ended
            self._become_decode_if_prompt_done(request_id)
        if not steps_in_flight:
            self._reservations.pause_decodes_short_of_blocks()
            self._reservations.resume_requests_paused_for_kv()
        host = self.table.host
        decode_slots = self.table.slots_in(RowGroup.DECODE)  # [nd] int64
        num_decode = decode_slots.shape[0]
        num_steps = self._decode_run_steps(num_decode, length_budgets)
        self._reservations.reserve(decode_slots,
                      self.scheduler.worst_case_blocks(host.known_lengths[decode_slots], steps_in_flight, num_steps))
        chunks, prefill_slots = ([], decode_slots[:0]) if self.scheduler.paused_for_kv else \
            self._schedule_prefill_chunks(num_decode)
        slot_ids = np.concatenate([decode_slots, prefill_slots])  # [n] int64, the step's requests in order
        num_requests = slot_ids.shape[0]
        if num_requests == 0:
            if self.table.group_size(RowGroup.PREFILL) or self.scheduler.paused_for_kv:
                raise KVCacheFullError(
                    f"no live request can get a KV block ({self.allocator.num_free_blocks} free); "
                    "finish or pause requests to make room"
                )
            return None
        final_chunk_count, next_prompt_token = 0, 0
        for slot in prefill_slots.tolist():  # prefill requests: a handful, host values  # host-ok: numpy
            request_id = int(host.request_ids[slot])
            prompt, known_length = self._prefill_tokens[request_id], int(host.known_lengths[slot])
            if known_length == prompt.shape[0]:
                final_chunk_count += 1
                self._prompts_done[request_id] = None
            else:  # only the step's last request can stop mid-prompt
                next_prompt_token = int(prompt[known_length])
        lengths = None
        num_sampling = num_decode + final_chunk_count
        if draft_lengths is not None:
            lengths = np.zeros(num_requests, dtype=np.int64)  # [n] int64
            batch_size = round_up_batch_size(num_requests, self.cuda_graph_batch_sizes) or num_requests
            lengths[:num_sampling] = draft_lengths(host.request_ids[slot_ids[:num_sampling]], num_sampling, batch_size)
        verify_width = self._verify_width(decode_slots, None if lengths is None else lengths[:num_decode], num_steps)
        held = self._drafts_held[decode_slots]  # [nd] int64: drafts each decode request verifies this step
        # decode-only single steps: a step with prefill chunks keeps 1 + V rows a decode request, as
        # its MTP windows' bound counts them (MTPProposer._window_bounds: S + V + catch-up a decode window)
        ragged = self.ragged_rows and num_steps == 1 and not chunks
        query_lengths = np.full(num_requests, 1 + verify_width, dtype=np.int64)  # [n] int64
        if ragged:  # 1 + s_r rows each (logits rows stay 1 + V a request: StepBuffers.build)
            query_lengths[:num_decode] = 1 + held
        query_lengths[num_decode:] = [chunk.shape[0] for chunk in chunks]
        padded = self._graph_shape(num_requests, int(query_lengths.sum()), bool(chunks), verify_width, ragged)
        if padded is not None or not chunks:  # one fixed bound, so a graph and the eager step split attention alike
            max_seq_len = self.shape.max_blocks_per_request * self.shape.block_size_tokens
        else:
            max_seq_len = int(host.block_counts[slot_ids].max()) * self.shape.block_size_tokens
        block_writes = self._reservations.take_writes()
        step = self._step_buffers.build(slot_ids, query_lengths, num_decode, chunks, final_chunk_count, padded,
                                        block_writes, max_seq_len, next_prompt_token, num_steps, lengths, verify_width,
                                        held)
        self._drafts_held[slot_ids[:num_sampling]] = \
            self.shape.num_speculative_tokens if lengths is None else lengths[:num_sampling]
        self._steps_in_flight.append(step)
        self.scheduler.built(num_steps)
        self._snapshots_due = (step, self._snapshots_due[1])
        return step

    def _verify_width(self, decode_slots: np.ndarray, chosen: Optional[np.ndarray], num_steps: int) -> int:
        """V of a step: the most drafts any of its decode requests (slots ``decode_slots``)
        verifies, with or without prefill chunks. Its first step verifies the drafts each holds; a
        decode run's later steps verify the lengths ``chosen`` for this build (``[nd]``, None: S).
        A step with no decode request keeps S (its logits rows: one per final chunk either way)."""
        if decode_slots.shape[0] == 0:
            return self.shape.num_speculative_tokens
        width = int(self._drafts_held[decode_slots].max())  # host-ok: numpy
        if num_steps > 1:
            run_width = self.shape.num_speculative_tokens if chosen is None else int(chosen.max())  # host-ok: numpy
            width = max(width, run_width)
        return width

    def _decode_run_steps(self, num_decode: int, length_budgets: Tuple[int, int, float]) -> int:
        """Decode steps the build stages (see :meth:`build_step`): 1 unless every running request
        decodes and the free blocks hold the run's worst case."""
        scheduler = self.scheduler
        if len(scheduler.run_lengths) == 1 or num_decode == 0 or self.table.group_size(RowGroup.PREFILL) or \
                scheduler.paused_for_kv:
            return 1
        to_model_len, most_left, tokens_per_step = length_budgets
        num_steps = scheduler.decode_run_steps(to_model_len, most_left, self.steps_in_flight, tokens_per_step)
        if num_steps > 1 and int(self._reservations.decode_needs(self.steps_in_flight, new_steps=num_steps).sum()) > \
                self.allocator.num_free_blocks:
            return 1  # short of blocks: single steps (which pause or preempt as usual)
        return num_steps

    def take_state_snapshots(self, step: StepMetadata) -> None:
        """Hybrid models with prefix caching: call right after launching ``step`` (the last one
        built), before anything else reaches the stream. Copies the recurrent state of each
        request whose chunk in it ended at a snapshot boundary (device copies, no sync)."""
        built, due = self._snapshots_due
        if step is built and due:
            self.prefix_cache.take_snapshots(due, self.mamba)
        self._snapshots_due = (None, [])

    def prepare_inputs(self, step: StepMetadata) -> None:
        """The device half of the step's set-up; run it first in the step (see StepBuffers)."""
        self._step_buffers.prepare_inputs(step)

    def commit_readback(self, step: StepMetadata, accepted_counts: np.ndarray) -> None:
        """Learn a decode step's outcome: ``accepted_counts`` ``[num_decode]`` int64 host values
        (or ``[num_steps, num_decode]``, one row per step of a decode run), in the step's order.

        Each decode request's known length grows by ``1 + accepted`` per step, in its slot; a
        request that has left since (its slot free, or another request's) is skipped."""
        if not self._steps_in_flight or step is not self._steps_in_flight[0]:
            raise ValueError("commit_readback: step is not the oldest step in flight")
        num_decode = step.num_decode
        if accepted_counts.ndim == 1:
            accepted_counts = accepted_counts[None]  # [1, num_decode]: one step
        if accepted_counts.shape != (step.num_steps, num_decode):
            raise ValueError(f"accepted_counts has shape {accepted_counts.shape}, the step has {step.num_steps} "
                             f"step(s) of {num_decode} decode requests")
        grown = (1 + accepted_counts).sum(0)  # [num_decode] int64
        slots = step.host_slot_ids[:num_decode]  # [num_decode] int64
        host = self.table.host
        kept = host.request_ids[slots] == step.host_request_ids[:num_decode]  # [num_decode] bool: still there
        host.known_lengths[slots[kept]] += grown[kept]
        self._steps_in_flight.pop(0)

    def abandon_steps_in_flight(self) -> None:
        """Forget the steps in flight without their outcome (their work failed): the caller then
        finishes every request they held. Block writes not yet sent are dropped too."""
        self._steps_in_flight.clear()
        self._reservations.drop_writes()
        self._snapshots_due = (None, [])
        self.allocator.drop_cached()  # blocks they were writing may be registered: trust none

    # ----- scheduling helpers ------------------------------------------------------------

    def enable_ragged_rows(self) -> None:
        """From now on a single decode-only step (not a decode run, nor a step with prefill chunks)
        gives decode request r ``1 + s_r`` rows, the drafts it holds, instead of ``1 + V`` (its
        logits rows stay ``1 + V``, the rows past ``s_r`` repeating row ``s_r``: see
        ``StepBuffers.build``), and pads its rows to one of ``batch_dimensions.ragged_token_counts``.
        Not for models with Mamba layers (their intermediate states are laid out ``1 + V`` a request)."""
        if self.mamba is not None:
            raise ValueError("ragged decode rows: a model with Mamba / GDN layers keeps 1 + V rows a request")
        self.ragged_rows = True

    def _graph_shape(self, num_requests: int, token_count: int, has_prefill: bool,
                     verify_width: int, ragged: bool = False) -> Optional[BatchDimensions]:
        """The CUDA-graph shape a step pads to, or None (exact, eager): the request count rounds
        up to a batch bucket (decode-only: ``1 + verify_width`` rows each, or with ``ragged`` rows
        the token count rounds up to one of ``ragged_token_counts``); a step with prefill rounds its
        tokens up to a token bucket."""
        batch_size = round_up_batch_size(num_requests, self.cuda_graph_batch_sizes)
        if batch_size is None:
            return None
        if not has_prefill:
            if ragged:
                tokens = round_up_batch_size(token_count, ragged_token_counts(batch_size, verify_width))
                return BatchDimensions(tokens, batch_size, False)
            return BatchDimensions.decode_only(batch_size, verify_width)
        tokens = round_up_batch_size(token_count, self.cuda_graph_token_counts)
        return None if tokens is None else BatchDimensions(tokens, batch_size, True)

    def graph_shapes(self, verify_width: Optional[int] = None) -> List[BatchDimensions]:
        """Every CUDA-graph shape a step of verify width V (``verify_width``; default S) can be
        padded to (see :meth:`_graph_shape`): the decode-only ones (``1 + V`` rows a request; with
        ragged rows also the token counts below that), and
        the mixed ones (their token buckets do not depend on V; the graph key carries it)."""
        S = self.shape.num_speculative_tokens
        V = S if verify_width is None else verify_width
        shapes = [BatchDimensions.decode_only(size, V) for size in self.cuda_graph_batch_sizes]
        if self.ragged_rows:  # the tier's ragged token counts below G (1 + V)
            shapes += [BatchDimensions(tokens, size, False) for size in self.cuda_graph_batch_sizes
                       for tokens in ragged_token_counts(size, V)[:-1]]
        shapes += [BatchDimensions(tokens, size, True)
                   for size in self.cuda_graph_batch_sizes for tokens in self.cuda_graph_token_counts]
        return shapes

    def build_padding_step(self, shape: BatchDimensions, num_steps: int = 1, num_drafts: Optional[int] = None,
                           verify_width: Optional[int] = None) -> StepMetadata:
        """A step of ``shape`` (a decode run of ``num_steps``) that holds no request (every row is
        padding): running it changes no request, and capturing it records the graph every real
        step of that shape replays (with ``num_drafts`` draft depths and ``verify_width`` drafts
        verified per decode request; default S each; ``shape`` is one of ``graph_shapes(verify_width)``)."""
        if shape not in self.graph_shapes(verify_width):
            raise ValueError(f"{shape} is not a CUDA-graph shape of this context")
        if num_steps not in self.scheduler.run_lengths or (num_steps > 1 and shape.has_prefill):
            raise ValueError(f"num_steps {num_steps}: decode runs have {self.scheduler.run_lengths} steps, and only "
                             "decode-only shapes run several")
        step = self._step_buffers.build(np.zeros(0, np.int64), np.zeros(0, np.int64), 0, [], 0, shape, np.zeros((3, 0), np.int64),
                                        self.shape.max_blocks_per_request * self.shape.block_size_tokens, num_steps=num_steps,
                                        verify_width=verify_width)
        return step if num_drafts is None else dataclasses.replace(step, num_drafts=num_drafts)

    def _become_decode_if_prompt_done(self, request_id: int) -> None:
        """A request whose final chunk ran joins the end of the decode list (its slot stays; the
        prefill-status write is stream-ordered after the step in flight)."""
        if request_id not in self._prompts_done:
            return
        del self._prompts_done[request_id]
        self.table.set_prefill_status(self.table.slot_of(request_id), 0)
        self.table.move(request_id, RowGroup.DECODE)

    def _schedule_prefill_chunks(self, num_decode: int) -> Tuple[list, np.ndarray]:
        """Run the scheduler's chunks for the prefill requests and take their blocks. Returns each
        chunk's prompt tokens (``[q]`` int64) and the slots of the requests that run one (``[p']``
        int64: the first ``p'`` prefill requests)."""
        host = self.table.host
        prefill_slots = self.table.slots_in(RowGroup.PREFILL)  # [p] int64
        if prefill_slots.shape[0] == 0:  # a decode-only step: nothing to schedule (~30-70 us of numpy otherwise)
            return [], prefill_slots
        known_lengths = host.known_lengths[prefill_slots]
        # [p] int64: where each chunk must end for a recurrent-state snapshot (hybrids; -1: anywhere)
        boundaries = self.prefix_cache.snapshot_boundaries(host.request_ids[prefill_slots], known_lengths)
        remaining = self._prefill_token_counts[prefill_slots] - known_lengths  # [p] int64
        lengths = self.scheduler.prefill_chunk_lengths(
            remaining, known_lengths, host.block_counts[prefill_slots], self.allocator.num_free_blocks, num_decode,
            np.where(boundaries >= 0, boundaries - known_lengths, remaining))
        chunk_lengths = np.array(lengths, dtype=np.int64)  # [p'] int64
        slots = prefill_slots[: chunk_lengths.shape[0]]
        known = known_lengths[: chunk_lengths.shape[0]]
        self._reservations.reserve(slots, self.blocks_for(known + chunk_lengths))  # one allocation for every chunk
        host.known_lengths[slots] = known + chunk_lengths  # exact: a prefill keeps every row
        at_boundary = slots[boundaries[: slots.shape[0]] == known + chunk_lengths]  # [k] int64: snapshot these
        if at_boundary.shape[0]:  # after the step's launch (take_state_snapshots)
            self._snapshots_due = (None, list(zip(
                host.request_ids[at_boundary].tolist(),  # host-ok: numpy
                (host.known_lengths[at_boundary] // self.shape.block_size_tokens).tolist(),  # host-ok: numpy
                host.mamba_slot_ids[at_boundary].tolist())))  # host-ok: numpy
        if self.prefix_cache.enabled:  # blocks this step completes: cached for requests joining after it
            for table_slot in slots.tolist():  # host-ok: numpy
                self.prefix_cache.register_written(int(host.request_ids[table_slot]), host.block_ids[table_slot],
                                                   int(host.known_lengths[table_slot]))
        return [self._prefill_tokens[request_id][length : length + chunk_length]
                for request_id, length, chunk_length in zip(host.request_ids[slots].tolist(), known.tolist(),  # host-ok: numpy
                                                            lengths)], slots

    def _require_no_step_in_flight(self, what: str) -> None:
        if self._steps_in_flight:
            raise RuntimeError(f"{what}: a step is in flight (the host's lengths are not exact); commit it with "
                               "commit_readback first (the controller's pause_request/resume_request do)")

    def _live_slot(self, request_id: int) -> int:
        if request_id not in self.table:
            raise ValueError(f"request_id {request_id!r} is not a live request (unknown or finished)")
        return self.table.slot_of(request_id)


def _as_prompt(prompt_tokens: Tokens, max_model_len: int) -> np.ndarray:
    if isinstance(prompt_tokens, torch.Tensor):
        if prompt_tokens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"prompt_tokens must be int32 or int64, got {prompt_tokens.dtype}")
        if prompt_tokens.device.type != "cpu":
            raise ValueError(f"prompt_tokens must be a CPU tensor (the host schedules prefill), got {prompt_tokens.device}")
        if prompt_tokens.dim() != 1:
            raise ValueError(f"prompt_tokens must be 1-D, got shape {tuple(prompt_tokens.shape)}")
        prompt = prompt_tokens.numpy().astype(np.int64)
    elif isinstance(prompt_tokens, np.ndarray):
        if prompt_tokens.dtype.kind not in "iu" or prompt_tokens.ndim != 1:
            raise TypeError(f"prompt_tokens must be a 1-D int array, got {prompt_tokens.dtype} {prompt_tokens.shape}")
        prompt = prompt_tokens.astype(np.int64)
    else:
        tokens = list(prompt_tokens)
        if any(isinstance(token, bool) or not isinstance(token, int) for token in tokens):
            raise TypeError("prompt_tokens must hold ints")
        prompt = np.array(tokens, dtype=np.int64)
    if prompt.shape[0] == 0:
        raise ValueError("prompt_tokens is empty")
    if prompt.shape[0] > max_model_len:
        raise ValueError(f"prompt_tokens has {prompt.shape[0]} tokens, more than max_model_len ({max_model_len})")
    if int(prompt.min()) < 0:
        raise ValueError("prompt_tokens must be non-negative token ids")
    return prompt
