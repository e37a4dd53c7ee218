"""TextGenerationController: lossless speculative decoding over a paged megatron-core GPT.

One step (see ``docs/design.md``)::

    step = context.build_step()                   # schedule, take KV blocks, one H2D copy
    context.prepare_inputs(step)                  # device: grow KV lengths, positions, slots, tokens
    logits, hidden = runner.forward(...)          # decoder over the packed rows
    tokens = sample(logits[step.logits_indices])  # the target's token at every row that needs one
    verify_and_commit(...)                        # one kernel: accept, next inputs, KV rewind
    mamba_state_selective_copy(...)               # hybrid models: keep the state after the last accepted row
    drafts = proposer.propose(...)                # next S drafts from verified state only
    stage [accepted, bonus, accepted drafts]      # copied to pinned host memory, no wait

The overlapped loop: ``step()`` builds and launches step N + 1 first, then waits for step N's
read-back and applies it on the host (stop rules, emitted tokens, KV lengths), so the host's
work hides behind the GPU's. The device is the source of truth for what the host learns late
(accepted counts, KV lengths, next tokens, drafts); step N + 1 reads them on the device. A
request that stopped in step N has run in step N + 1 too: that step's tokens for it are dropped,
so its output ends exactly at the stop. Only pausing, resuming and preemption wait for the step in
flight: a request keeps its table slot from admission to exit, so finishing and joining move
nothing, and a read-back is applied to the slots its step ran on (a request that left since is
skipped). Policy is ``context.scheduler``'s (``state/scheduler.py``).
``InferenceConfig(overlap_scheduling=False)`` applies every step before the next one is built.
With ``InferenceConfig(decode_steps_per_launch=k)`` a build of decode steps only may stage a
decode run: one launch (one CUDA graph) of up to k steps back to back, built and applied once.

Acceptance is exact match of the target's own sample, and sampling noise is a function of
(seed, position) only, so speculative output equals plain output token for token, greedy or
sampled, on every tensor-parallel rank. ``InferenceConfig(acceptance="rejection")`` rewrites the
draft rows' tokens first (speculative sampling, ``acceptance.py``): same distribution, more accepted.

Research hooks, each overridable in a subclass: :meth:`sample_rows` (how a token is drawn),
:meth:`accept_tokens` (what a request keeps of its verified tokens), and :meth:`on_step_end`
(after each step's host bookkeeping); drafting is the ``proposer``, which sees a
``DraftContext``, never the controller. For tests and tools: the debug hooks :meth:`on_launch`
and :meth:`on_apply`, and :meth:`debug_view`. The GPU part of a step is ``step_launch.py``; the
engine's sizes are ``self.shape`` (an ``EngineShape``).
"""

import time
from typing import Dict, Hashable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from megatron.core import parallel_state

from mtp_ctrl.controllers.acceptance import RejectionAcceptance, RequestSampling
from mtp_ctrl.controllers.config import InferenceConfig, SamplingParams
from mtp_ctrl.controllers.cuda_graphs import StepGraphs
from mtp_ctrl.controllers.draft_context import DraftContext
from mtp_ctrl.controllers.draft_lengths import DraftLengths, step_order_lengths
from mtp_ctrl.controllers.draft_policy import DraftLengthPolicy
from mtp_ctrl.controllers.graph_warmup import NO_DRAFT_PHASE, ROW_COST, STEP_COST, warmup_variants
from mtp_ctrl.controllers.metrics import GenerationMetrics
from mtp_ctrl.controllers.mtp_proposer import MTPProposer
from mtp_ctrl.controllers.output_rows import OutputRows
from mtp_ctrl.controllers.proposers import Proposer, notify_committed
from mtp_ctrl.controllers.readback import LaunchedStep, Readbacks
from mtp_ctrl.controllers.request_checks import check_prompts, check_sampling_params_list, checked_prompt
from mtp_ctrl.controllers.requests import ControllerDebugView, GenerationResult, Request, RequestBook, RequestStatus
from mtp_ctrl.controllers.slot_lifecycle import SlotLifecycle
from mtp_ctrl.controllers.step_launch import StepLauncher
from mtp_ctrl.controllers.stop_rules import FinishReason, accept_new_tokens
from mtp_ctrl.controllers.tp_lockstep import TPLockstep
from mtp_ctrl.models.runner import PagedGPTRunner
from mtp_ctrl.state import BatchDimensions, DynamicInferenceContext, KVCacheFullError, StepMetadata
from mtp_ctrl.triton_ops import sample_tokens

StepOutput = Tuple[int, List[int], bool]  # (request_id, tokens emitted by the launch applied, finished)


class TextGenerationController:
    def __init__(self, model, config: InferenceConfig, proposer: Optional[Proposer] = None, seed: int = 0,
                 draft_policy: Optional[DraftLengthPolicy] = None):
        if not isinstance(config, InferenceConfig):
            raise TypeError(f"config must be an InferenceConfig, got {type(config).__name__}")
        self.config = config
        self.runner = PagedGPTRunner(model, fused_rope=config.fused_rope, fused_glue=config.fused_glue,
                                     mamba_kernels=config.mamba_kernels, moe_backend=config.moe_backend)
        # what K/V will be computed in: the embedding's dtype
        self.shape = config.engine_shape(model.vocab_size, next(model.parameters()).device,
                                         self.runner.model.embedding.word_embeddings.weight.dtype)
        S = self.shape.num_speculative_tokens
        reuse = config.mtp_reuse_last_layer and self.runner.mtp_num_layers > 0  # deeper depths rerun the last layer
        if proposer is None and S > self.runner.mtp_num_layers and not reuse:
            raise ValueError(f"num_speculative_tokens ({S}) exceeds the model's MTP depth ({self.runner.mtp_num_layers})")
        max_sequence_length = getattr(model, "max_sequence_length", None)
        if max_sequence_length is not None and config.max_model_len + S > max_sequence_length:
            raise ValueError(f"max_model_len + num_speculative_tokens ({config.max_model_len} + {S}) exceeds the "
                             f"model's max_sequence_length ({max_sequence_length})")
        if proposer is not None and not isinstance(proposer, Proposer):
            raise TypeError(f"proposer must be a Proposer, got {type(proposer).__name__}")
        self.context = self._build_context(model.config)
        self._scheduler = self.context.scheduler  # admission, pausing, preemption, chunking
        self._allocate_step_buffers()
        self._outputs = OutputRows(self.context.table)
        self.proposer = proposer if proposer is not None else MTPProposer(
            config.mtp_attention, config.mtp_reuse_last_layer, skip_idle_windows=config.mtp_idle_windows == "skip",
            catch_up_positions=config.mtp_catch_up_positions)
        rejection = config.acceptance == "rejection" and S > 0
        if S > 0:
            self.proposer.bind(DraftContext(self.shape, self.runner, self.sample_rows, self.context.table,
                                            self.context.kv_caches, self.context.num_cache_blocks, rejection,
                                            finish_steps=self._sync, request_result=self.result,
                                            prefix_caching=config.prefix_caching))
        if config.prefix_caching:  # the proposer says how its state depends on a prefix (None: no reuse)
            lookahead = self.proposer.prefix_cache_lookahead() if S > 0 else 0
            if lookahead is not None:
                salt = f"{type(self.proposer).__qualname__ if S else ''}:S={S}:{config.mtp_attention}".encode()
                self.context.enable_prefix_caching(lookahead, salt)
        self._launcher = StepLauncher(self.context, self.runner, self.proposer, self.sample_rows,
                                      RejectionAcceptance(self.context.table, self.proposer) if rejection else None)
        # with moe_backend='megatron' an MoE model's steps run eagerly: megatron's expert dispatch syncs
        use_graphs = self.shape.device.type == "cuda" and bool(config.cuda_graph_batch_sizes) and \
            self.runner.cuda_graph_capturable
        self._graphs = StepGraphs() if use_graphs else None  # TP collectives are captured too
        self.metrics = GenerationMetrics(S)
        pool = self.context.allocator
        self.metrics.watch_prefix_cache(lambda: (self.context.prefix_cache.queried_tokens,
                                                 self.context.prefix_cache.hit_tokens, pool.num_evictions,
                                                 pool.num_cached_blocks))
        # how many drafts each request makes per step (controllers/draft_policy.py; default: S each)
        self._draft_lengths = DraftLengths(draft_policy, self.shape)
        if S > 0 and self._draft_lengths.policy.per_request_lengths and self.proposer.takes_ragged_rows and \
                self.context.mamba is None and self.config.ragged_rows:
            self.context.enable_ragged_rows()  # each decode request runs 1 + s_r rows (docs/draft_lengths.md)
        self._requests = RequestBook(seed, config.finished_results_kept)  # every request not forgotten
        self._lifecycle = SlotLifecycle(self.context, self._requests, self._outputs, self.proposer, self._draft_lengths)
        self._draft_lengths.queue_view = self._lifecycle.queue_view
        self._all_greedy = False  # set per step from the running requests' SamplingParams
        self._idle_steps = 0  # step() calls that found nothing able to run
        self._pending_outputs: List[StepOutput] = []  # applied outside step() (close, pause): the next step() returns them
        self._in_flight: Optional[LaunchedStep] = None
        self._steps_launched = 0  # by the current step() call (its wall time is shared among them)
        self._last_return: Optional[float] = None  # perf_counter() when the last step() call returned
        self._applied: List[Tuple[StepMetadata, Optional[float]]] = []  # launches it applied, their GPU seconds
        self._timing = None  # the last call's StepTiming for the draft-length cost model (sent at the next check)
        self._lockstep = TPLockstep(parallel_state.get_tensor_model_parallel_group(check_initialized=False),
                                    config.tp_check_timeout_s)  # ranks agree on every step

    # ----- set-up ------------------------------------------------------------------------

    def _build_context(self, model_config) -> DynamicInferenceContext:
        config, shape = self.config, self.shape
        kv_cache = self.runner.kv_cache_spec(shape.kv_dtype)  # the model's layout (standard K/V or MLA latent)
        num_blocks = config.num_kv_blocks
        if num_blocks is None and config.kv_cache_bytes is None:
            num_blocks = shape.max_requests * shape.max_blocks_per_request
        return DynamicInferenceContext(shape, kv_cache=kv_cache, num_blocks=num_blocks,
                                       kv_cache_bytes=config.kv_cache_bytes,
                                       cuda_graph_batch_sizes=config.cuda_graph_batch_sizes,
                                       cuda_graph_token_counts=config.cuda_graph_token_counts or None,
                                       mamba=self.runner.mamba_spec,  # None without Mamba layers
                                       state_snapshots=self._state_snapshot_count())

    def _state_snapshot_count(self) -> int:
        """Recurrent-state snapshot slots of a hybrid model with prefix caching (config's doc)."""
        if not self.config.prefix_caching:
            return 0
        count = self.config.prefix_state_snapshots
        return max(2 * self.shape.max_requests, 8) if count is None else count

    def _allocate_step_buffers(self) -> None:
        table, R, S = self.context.table, self.shape.max_requests, self.shape.num_speculative_tokens
        RequestSampling.add_rows(table)  # the requests' sampling parameters, by table row
        self._sampling = RequestSampling(table)  # read here and by rejection acceptance
        device, T = self.shape.device, self.shape.max_tokens_per_step
        self._greedy_params = (torch.zeros(T, device=device), torch.zeros(T, dtype=torch.int64, device=device),
                               torch.ones(T, device=device), torch.zeros(T, dtype=torch.int64, device=device))
        self._readbacks = Readbacks(self._scheduler.run_lengths[-1], R, S, device)  # K: the longest decode run

    def warmup(self) -> int:
        """Capture the CUDA graph of every padded step shape now (and of every decode run length
        of the decode-only shapes, for both sampling paths), so that serving never stops to capture
        (a shape not warmed up is captured on first use). Each graph is recorded from a step that
        holds no request. Call it before adding requests (on every rank under tensor parallelism);
        returns the number of graphs held."""
        if self._graphs is None:
            return 0
        if self.context.table.num_live or self._scheduler.num_waiting or self._in_flight is not None:
            raise RuntimeError("warmup: call it before adding requests")
        costs, row_costs = self._replay_every_shape()  # a replay also uploads a new graph now, not mid-serving
        torch.cuda.current_stream(self.shape.device).synchronize()  # host-ok: start-up
        self._draft_lengths.set_step_costs(costs, self._lockstep.group, row_costs)  # rank 0's, on every rank
        return len(self._graphs)

    def _replay_every_shape(self) -> Tuple[Dict[Tuple[int, int], float], Dict[Tuple[int, int, int, bool], float]]:
        """Replay the graph of every variant ``graph_warmup.warmup_variants`` lists (capture it first
        if new), from steps that hold no request. Returns the replay seconds of the steady decode-only
        steps by (batch size, D) (the policy's step costs), and by (batch size, token count, D, has
        prefill) of those and of the ragged counts and token buckets (the row costs a queue's steps
        are priced by: ``RowCostModel``)."""
        costs, row_costs = {}, {}
        for variant in warmup_variants(self.context, self._scheduler.run_lengths, self._draft_lengths, self.proposer):
            step, masked = variant.step, variant.masked
            self._all_greedy = variant.all_greedy
            key = self._graph_key(step, masked, variant.plan)
            if key not in self._graphs:
                if variant.plan != NO_DRAFT_PHASE:
                    self.proposer.use_plan(variant.plan)
                self._graphs.run(key, lambda: self._launch_run(step, masked, variant.plan))
            shape = step.dimensions
            if variant.use == STEP_COST:
                cost_key = (shape.request_count, step.num_drafts)
                costs[cost_key] = max(costs.get(cost_key, 0.0), self._graphs.timed_replay(key))
                row_costs[(shape.request_count, shape.token_count, step.num_drafts, False)] = costs[cost_key]
            elif variant.use == ROW_COST:
                row_key = (shape.request_count, shape.token_count, step.num_drafts, shape.has_prefill)
                row_costs[row_key] = self._graphs.timed_replay(key)
            else:  # uploaded now, not mid-serving (StepGraphs.replay); no profile needed
                self._graphs.replay(key)
        return costs, row_costs

    def replay_graphs(self) -> int:
        """A check for tests and debugging, with no request queued or live: replay the last step's
        graph over the inputs it was given (its requests' rows are free now), then every graph
        from a step that holds no request. Free rows point only at the scratch KV block and Mamba
        slot, so no replay reaches outside the pools; they are reset afterwards. Returns the number
        of graphs replayed."""
        self._sync()
        if self.context.table.num_live or self._scheduler.num_waiting:
            raise RuntimeError("replay_graphs: call it with no request queued or live")
        if self._graphs is None:
            return 0
        self.context.table.write_inserted_rows()  # the slots freed since the last step point at the scratch block
        self._graphs.replay_last()
        self._replay_every_shape()
        self.context.table.reset_free_rows()
        return len(self._graphs)

    def close(self) -> None:
        """Finish the step in flight and free the captured CUDA graphs. Call it before
        ``torch.distributed.destroy_process_group`` when running tensor-parallel: a process group
        otherwise waits forever for the collectives captured in the graphs (pytorch/pytorch#115388).
        The controller stays usable."""
        self._sync()
        if self._graphs is not None:
            self._graphs.reset()

    def _sync(self) -> None:
        """Apply the step in flight (its outputs wait for the next ``step()``) and free the rows
        of finished requests: afterwards the host knows everything and rows may move."""
        if self._in_flight is not None:
            self._pending_outputs += self._apply_in_flight(collect=True)
        self._lifecycle.retire_finished()

    def pause_request(self, request_id: int) -> None:
        """Stop running a live request (its KV blocks and state stay) until :meth:`resume_request`."""
        self._sync()
        self.context.pause_request(request_id)

    def resume_request(self, request_id: int) -> None:
        """Run a request paused by :meth:`pause_request` again from the next step."""
        self._sync()
        self.context.resume_request(request_id)

    # ----- requests ------------------------------------------------------------------------

    def add_request(self, prompt_tokens: Union[Sequence[int], torch.Tensor],
                    sampling_params: Optional[SamplingParams] = None, *, prefix_caching: bool = True) -> int:
        """Queue a request; it joins the running batch as soon as a row is free. Returns its id.
        ``prefix_caching=False``: it neither reuses nor shares cached prompt blocks (it has no
        effect unless ``InferenceConfig(prefix_caching=True)``)."""
        if not isinstance(prefix_caching, bool):
            raise TypeError(f"prefix_caching must be a bool, got {type(prefix_caching).__name__}")
        request_id = self._queue_request(*self._check_request(prompt_tokens, sampling_params))
        self._requests[request_id].use_prefix_cache = prefix_caching
        return request_id

    def _check_request(self, prompt_tokens, sampling_params) -> Tuple[List[int], np.ndarray, SamplingParams]:
        """Validate one request without touching any state; returns (prompt, its [P] int64 array, params)."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        prompt, prompt_array = checked_prompt(prompt_tokens, self.shape.vocab_size, self.shape.max_model_len)
        params.check_vocab(self.shape.vocab_size)
        return prompt, prompt_array, params

    def _queue_request(self, prompt: List[int], prompt_array: np.ndarray, params: SamplingParams) -> int:
        request_id = self._requests.new(prompt, params, prompt_array).request_id
        self._draft_lengths.add(request_id, params)
        self._scheduler.enqueue(request_id)
        return request_id

    def abort_request(self, request_id: int) -> None:
        """End a queued, running or paused request now with reason ABORTED (its output so far is
        kept; :meth:`pop_result` takes it): its row, KV blocks and state are free for the next step.
        A finished request is left as it is. Applies the step in flight first (a host sync)."""
        record = self._requests[request_id]
        self._sync()  # the step in flight may finish it; afterwards its row may be freed
        if record.finish_reason is None:
            self._lifecycle.abort([request_id])
            self._lifecycle.retire_finished()

    def has_unfinished_requests(self) -> bool:
        return self._scheduler.num_waiting > 0 or self.context.table.num_live > self._scheduler.num_retiring

    def result(self, request_id: int) -> GenerationResult:
        """The result of a finished request (it stays until :meth:`pop_result` takes it, or until
        ``InferenceConfig.finished_results_kept`` newer results push it out)."""
        record = self._requests[request_id]
        if record.finish_reason is None:
            raise ValueError(f"request {request_id} has not finished")
        return GenerationResult.from_record(record, self.shape.num_speculative_tokens)

    def pop_result(self, request_id: int) -> GenerationResult:
        """Take a finished request's result: the controller forgets the request."""
        result = self.result(request_id)
        self._requests.forget(request_id)
        return result

    def request_status(self, request_id: int) -> RequestStatus:
        """Where a request is in its life: waiting, prefilling, decoding, paused or finished."""
        return self._requests[request_id].status

    def finished_request_ids(self) -> List[int]:
        """Finished step-API requests whose result :meth:`pop_result` has not taken, oldest first."""
        return self._requests.unclaimed_ids

    # ----- hooks -------------------------------------------------------------------------

    def sample_rows(self, logits: torch.Tensor, table_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Draw one token per logits row ``[K, V]`` with the parameters of the request at
        ``table_rows`` ``[K]``, for the token that will sit at ``positions`` ``[K]``."""
        if self._all_greedy:  # every row is greedy: constant parameters, no per-row gathers
            params = [tensor[: logits.shape[0]] for tensor in self._greedy_params]
        else:
            sampling = self._sampling
            params = [tensor[table_rows] for tensor in (sampling.temperature, sampling.top_k, sampling.top_p,
                                                        sampling.seeds)]
        return sample_tokens(logits, *params, positions, all_greedy=self._all_greedy)

    def accept_tokens(self, record: Request, new_tokens: List[int]) -> Tuple[List[int], Optional[FinishReason]]:
        """What a request keeps of a step's verified tokens: a prefix of ``new_tokens``, and a
        finish reason when it keeps fewer than all of them (the device has already moved on
        with every verified token, so a request can only drop tokens by finishing). Default:
        the stop rules (eos ids, stop sequences, max_new_tokens, max_model_len), applied to the
        whole batch at once unless a subclass overrides this hook."""
        output = list(record.output_tokens)
        return accept_new_tokens(output, new_tokens, record.params, len(record.prompt_tokens), self.shape.max_model_len)

    def on_step_end(self, outputs: List[StepOutput]) -> None:
        """Called after every step with what it emitted. Default: nothing."""

    # ----- debug hooks and view (for tests and tools; they change nothing) ---------------------

    def on_launch(self, step: StepMetadata,
                  graph_key: Optional[Tuple[BatchDimensions, bool, int, int, int, bool, Hashable]]) -> None:
        """Debug hook: ``step`` (every step of a decode run) was just launched, replayed from the
        CUDA graph ``graph_key`` ``(padded dimensions, all greedy, steps, verify width, draft depths,
        draft rows masked by length, the proposer's plan)``, or eagerly (None).
        On the CPU the device work is done by now. Default: nothing."""

    def on_apply(self, step: StepMetadata, readbacks: np.ndarray, overlapped: bool) -> None:
        """Debug hook: the read-back of ``step`` arrived and is about to be applied. ``readbacks``:
        ``[k, n, S + 2]`` int64 ``[accepted count, bonus token, accepted drafts]`` per step of the
        launch and request, in the step's order (do not modify it). ``overlapped``: the next
        step was launched first (False: the host waited, e.g. to pause or for the last step).
        Default: nothing."""

    def debug_view(self) -> ControllerDebugView:
        """A snapshot of the controller's bookkeeping (see :class:`ControllerDebugView`)."""
        return ControllerDebugView(
            num_cuda_graphs=0 if self._graphs is None else len(self._graphs),
            cuda_graphs_enabled=self._graphs is not None, num_waiting=self._scheduler.num_waiting,
            num_live=self.context.table.num_live,
            num_records=len(self._requests), num_unclaimed_results=len(self._requests.unclaimed_ids),
            num_retiring=self._scheduler.num_retiring, step_in_flight=self._in_flight is not None,
            num_prefills_held=self.context.num_prefills_held, next_request_id=self._requests.next_request_id,
            last_accepted_counts=self._launcher.accepted_counts)

    # ----- the step ------------------------------------------------------------------------

    def step(self) -> List[StepOutput]:
        """Run one step; returns what each request emitted. With overlap scheduling the tokens
        come one call late: a call launches step N + 1 and returns step N's tokens."""
        return self._step(collect=True)

    def _step(self, collect: bool) -> List[StepOutput]:
        started = time.perf_counter()
        self._steps_launched, self._applied, self._decode_tokens = 0, [], 0  # _decode_tokens: by _apply
        try:
            outputs = self._step_once(collect)
            if self._pending_outputs:
                outputs, self._pending_outputs = self._pending_outputs + outputs, []
            if self._hook_overridden("on_step_end"):
                self.on_step_end(outputs)
        except BaseException as error:
            self._lockstep.announce_failure(error)  # the other ranks' next check raises with this cause
            self._abort_running()
            raise
        now = time.perf_counter()
        self.metrics.record_step(now - started, max(self._steps_launched, 1))
        # the cost model's sample: the loop's wall since the last return, decode tokens applied, work left
        since, self._last_return = (None if self._last_return is None else now - self._last_return), now
        self._timing = self._draft_lengths.step_timing(self._applied, since, self._steps_launched, self._decode_tokens,
                                                       self._in_flight is not None or self.has_unfinished_requests())
        return outputs

    def _step_once(self, collect: bool) -> List[StepOutput]:
        outputs: List[StepOutput] = []
        applied = self._in_flight is not None  # this call applies a step, whatever it builds
        self._lifecycle.retire_finished()  # also with a step in flight: slots do not move (see _apply)
        # the step in flight is applied first when a decode must pause or a paused one can resume
        # (context.needs_sync); finishing and admitting need not
        if self._in_flight is not None and (not self.config.overlap_scheduling or self.context.needs_sync()):
            outputs += self._apply_in_flight(collect)
            self._lifecycle.retire_finished()
        self._lifecycle.admit_waiting()
        step = self._build_step()
        # every TP rank builds this step, before its first collective; the cost model takes rank 0's timing
        self._draft_lengths.record_timing(self._lockstep.check(step, self._timing))
        self._timing = None
        if step is None:
            if self._in_flight is not None:
                outputs += self._apply_in_flight(collect)
                self._lifecycle.retire_finished()
            elif not applied:
                self._idle_steps += 1
            return outputs
        previous, self._in_flight = self._in_flight, self._launch_step(step)
        self._lockstep.in_collectives = False
        if previous is not None:
            outputs += self._apply(previous, collect, overlapped=True)
        if not self.config.overlap_scheduling or not self.has_unfinished_requests():
            outputs += self._apply_in_flight(collect)  # nothing to overlap with: finish now
            self._lifecycle.retire_finished()
        return outputs

    def _build_step(self) -> Optional[StepMetadata]:
        # how long a decode run may be (scheduler.decode_run_steps): the requests' length budgets and
        # the tokens a step adds on average so far
        length_budgets = (0, 0, 1.0) if len(self._scheduler.run_lengths) == 1 else \
            (*self._outputs.length_budgets(self.context.table.live_slots()), self.metrics.mean_accepted_length)
        while True:
            try:
                return self.context.build_step(length_budgets=length_budgets,
                                               draft_lengths=self._draft_lengths.choose)
            except KVCacheFullError:
                if self._in_flight is not None:  # learn the step in flight's outcome, then decide
                    self._sync()
                    continue
                if not self._scheduler.should_preempt(self.context.table.num_live, self.context.steps_in_flight):
                    raise
                self._lifecycle.preempt_newest()

    def _launch_step(self, step: StepMetadata) -> LaunchedStep:
        """Launch the step's GPU work (every step of a decode run) and the copy of its read-back;
        returns without waiting. A graph of a step with prefill chunks always takes the general
        sampling path (greedy rows are argmax there too): one graph a token count, not two."""
        self._all_greedy = bool(self._outputs.greedy[step.host_slot_ids].all()) and \
            not (step.graph_padded and step.dimensions.has_prefill)
        masked = self._draft_lengths.needs_mask(step)
        self._readbacks.begin()
        plan = self._launch_plan(step)
        key = self._graph_key(step, masked, plan)
        if self._graphs is not None and key is not None:
            self._graphs.run(key, lambda: self._launch_run(step, masked, plan))
        else:
            self._launch_run(step, masked, plan)
        self.context.take_state_snapshots(step)  # hybrids: recurrent state at prompt-block boundaries
        launched = self._readbacks.end(step)
        self._draft_lengths.launched(step)
        if self.shape.num_speculative_tokens > 0:
            for _ in range(step.num_steps):
                self.proposer.on_step_scheduled(step)
        self._steps_launched += step.num_steps
        self.on_launch(step, key)
        return launched

    def _graph_key(self, step: StepMetadata, masked: bool,
                   plan: Hashable = None) -> Optional[Tuple[BatchDimensions, bool, int, int, int, bool, Hashable]]:
        """The CUDA graph a step replays: its padded dimensions, whether every request is greedy
        (the sampling path differs), its decode steps, its verify tier (``step.verify_width``: 1 + V
        rows per decode request), its draft depths (``step.num_drafts``), whether its draft rows
        are masked by length (``masked``: ``DraftLengths.needs_mask``) and the proposer's plan
        (``Proposer.plan_launch``: the MTP proposer's skipped or caught-up windows); None for a
        step no graph covers (it runs eagerly)."""
        return (step.dimensions, self._all_greedy, step.num_steps, step.verify_width, step.num_drafts,
                masked, plan) if step.graph_padded else None

    def _launch_plan(self, step: StepMetadata) -> Hashable:
        """The launch's plan, which joins its graph key: ``NO_DRAFT_PHASE`` for a decode-only step
        that verifies and drafts nothing and whose requests never draft, of a proposer that need not
        see it (``Proposer.sees_never_drafting_steps``: no proposer work, a plain engine's step),
        else the proposer's plan of host-chosen work (``Proposer.plan_launch``:
        skipped MTP windows); None without drafting."""
        if self.shape.num_speculative_tokens == 0:
            return None
        if step.decode_only and step.verify_width == 0 and step.num_drafts == 0 and \
                not self.proposer.sees_never_drafting_steps and self._lifecycle.none_drafts(step.host_slot_ids):
            return NO_DRAFT_PHASE
        return self.proposer.plan_launch(step)

    def _launch_run(self, step: StepMetadata, masked: bool, plan: Hashable = None) -> None:
        """Every step of the launch (one, or a decode run): each derives its inputs on the device
        from the one before and stages its read-back in its own slot."""
        draft_phase = plan != NO_DRAFT_PHASE
        for index in range(step.num_steps):
            self._launcher.launch(step, self._readbacks.slot(index), self._all_greedy, masked, draft_phase)

    def _apply_in_flight(self, collect: bool = False) -> List[StepOutput]:
        """Apply the step in flight with nothing launched after it (the host waits for the GPU)."""
        launched, self._in_flight = self._in_flight, None
        return self._apply(launched, collect, overlapped=False)

    def _apply(self, launched: LaunchedStep, collect: bool, overlapped: bool) -> List[StepOutput]:
        """Wait for a launch's read-back and apply it on the host (every step of a decode run:
        a request that stopped in one of them emits nothing after it)."""
        step = launched.step
        readbacks, gpu_seconds = self._readbacks.wait(launched)  # [k, n_s, S + 2], the step's order
        self._applied.append((step, gpu_seconds))
        verified = self._draft_lengths.applied(step, readbacks[:, : step.num_decode, 0])  # [k, n_d] drafts verified
        self.on_apply(step, readbacks, overlapped)
        if gpu_seconds is not None:
            self.metrics.record_gpu(gpu_seconds, step.num_steps)
        num_decode, num_launched = step.num_decode, readbacks.shape[1]
        self.context.commit_readback(step, readbacks[:, :num_decode, 0])
        slots = step.host_slot_ids[:num_launched]  # [n] int64: where the step's requests were
        request_ids = step.host_request_ids[:num_launched]  # [n] int64
        present = self.context.table.host.request_ids[slots] == request_ids  # [n] bool: not left since
        present = None if present.all() else present
        decode = np.arange(num_launched) < num_decode
        counts_before = self._outputs.counts[slots]  # [n] int64 (a copy)
        if self._hook_overridden("accept_tokens"):
            records = [self._requests.get(int(request_id)) if present is None or present[index] else None
                       for index, request_id in enumerate(request_ids)]
            emitted, finished = self._outputs.apply_with_hook(readbacks, decode, slots, records, self.accept_tokens,
                                                              type(self).__name__)
        else:
            emitted, finished = self._outputs.apply(
                readbacks, decode, slots, lambda index: self._requests[int(request_ids[index])].params, present)  # [k, n]
        if self.shape.num_speculative_tokens > 0:
            notify_committed(self.proposer, step, readbacks, emitted)
        counted = decode[None, :] & (emitted > 0)  # [k, n]
        if verified.any():
            self.metrics.record_acceptance(readbacks[:, :, 0][counted], step_order_lengths(verified, num_launched)[counted])
        else:  # nobody verified a draft (a D = 0 step after one): counts only
            self.metrics.record_no_drafts(int(counted.sum()))
        self.metrics.emitted_tokens += int(emitted.sum())
        self._decode_tokens += int(emitted[:, :num_decode].sum())  # the draft-length cost model's realised tokens
        for index, reason in finished:
            self._lifecycle.finish(int(request_ids[index]), reason)
        return self._outputs.emitted_since(slots, request_ids, counts_before, finished) if collect else []

    def _hook_overridden(self, name: str) -> bool:
        return getattr(type(self), name) is not getattr(TextGenerationController, name)

    def _drop_requests(self, request_ids: List[int]) -> None:
        """End the unfinished ones of ``request_ids`` (waiting, running or paused) as ABORTED and free their slots."""
        self._sync()
        ours = set(request_ids)
        self._pending_outputs = [output for output in self._pending_outputs if output[0] not in ours]
        self._lifecycle.abort(request_ids)
        self._lifecycle.retire_finished()

    def _abort_running(self) -> None:
        """A step raised: end every request in the batch with reason ABORTED (output so far kept)
        and release its state, so the controller stays usable. Waiting requests stay queued."""
        self._in_flight = None
        self._draft_lengths.abandon()
        if self.shape.device.type == "cuda":
            torch.cuda.current_stream(self.shape.device).synchronize()  # host-ok: error path
        self._lifecycle.abort_running()

    # ----- batch API -----------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None) -> List[GenerationResult]:
        """Generate for every prompt (queued beyond max_requests); results in prompt order. The
        controller keeps nothing of these requests afterwards."""
        prompts = check_prompts(prompts)
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            sampling_params = [sampling_params] * len(prompts)
        check_sampling_params_list(sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
        checked = [self._check_request(prompt, params) for prompt, params in zip(prompts, sampling_params)]
        request_ids = [self._queue_request(*request) for request in checked]  # all valid: queue
        self._requests.hold(request_ids)
        try:
            while any(self._requests[rid].finish_reason is None for rid in request_ids):
                idle_steps = self._idle_steps
                self._step(collect=self._hook_overridden("on_step_end"))
                if self._idle_steps != idle_steps:
                    raise RuntimeError("generate: no request can run (all running requests are paused); "
                                       "resume them or use the step API")
            return [self.result(rid) for rid in request_ids]
        except BaseException:
            self._drop_requests(request_ids)  # the caller never gets their ids: none may run later
            raise
        finally:  # the caller has the results (or the exception): forget the finished requests
            self._requests.release(request_ids)

