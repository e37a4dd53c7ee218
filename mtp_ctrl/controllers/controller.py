"""TextGenerationController: lossless speculative decoding over a paged megatron-core GPT.

One step (see ``shared/DESIGN.md``)::

    step = context.build_step()                   # schedule, take KV blocks, one H2D copy
    logits, hidden = runner.forward(...)          # decoder over the packed rows
    tokens = sample(logits[step.logits_indices])  # the target's token at every row that needs one
    verify_and_commit(...)                        # one kernel: accept, next inputs, KV rewind
    mamba_state_selective_copy(...)               # hybrid models: keep the state after the last accepted row
    drafts = proposer.propose(...)                # next S drafts from verified state only
    read back [accepted, bonus, accepted drafts]  # the step's one device-to-host copy
    context.commit_step(...); stop rules; finish  # host bookkeeping

Acceptance is exact match of the target's own sample, and sampling noise is a function of
(seed, position) only, so speculative output equals plain output token for token, greedy or
sampled, on every tensor-parallel rank.

Research hooks, each overridable in a subclass: :meth:`sample_rows` (how a token is drawn),
:meth:`accept_tokens` (what a request keeps of its verified tokens: stop rules), and
:meth:`on_step_end` (after each step's host bookkeeping); drafting is the ``proposer``.
"""

import collections
import dataclasses
import time
from typing import Deque, Dict, List, Optional, Sequence, Tuple, Union

import torch
from megatron.core import parallel_state

from mtp_ctrl.controllers.config import InferenceConfig, SamplingParams
from mtp_ctrl.controllers.cuda_graphs import StepGraphs
from mtp_ctrl.controllers.metrics import GenerationMetrics
from mtp_ctrl.controllers.mtp_proposer import MTPProposer
from mtp_ctrl.controllers.proposers import DraftBatch, Proposer
from mtp_ctrl.controllers.requests import GenerationResult, RequestRecord
from mtp_ctrl.controllers.sampling import sample_tokens
from mtp_ctrl.controllers.stop_rules import FinishReason, accept_new_tokens
from mtp_ctrl.models.forward_context import MambaForward
from mtp_ctrl.models.runner import PagedGPTRunner
from mtp_ctrl.state import DynamicInferenceContext, KVCacheFullError, KVCacheSpec, StepMetadata
from mtp_ctrl.triton_ops import StepCommit, mamba_state_selective_copy, max_released_blocks, verify_and_commit

StepOutput = Tuple[int, List[int], bool]  # (request_id, tokens emitted this step, finished)


class TextGenerationController:
    def __init__(self, model, config: InferenceConfig, proposer: Optional[Proposer] = None, seed: int = 0):
        if not isinstance(config, InferenceConfig):
            raise TypeError(f"config must be an InferenceConfig, got {type(config).__name__}")
        self.config = config
        self.runner = PagedGPTRunner(model)  # TypeError for a model without the paged spec
        self.vocab_size = model.vocab_size
        self.device = next(model.parameters()).device
        S = config.num_speculative_tokens
        if proposer is None and S > self.runner.mtp_num_layers:
            raise ValueError(f"num_speculative_tokens ({S}) exceeds the model's MTP depth ({self.runner.mtp_num_layers})")
        self.context = self._build_context(model.config)
        self._allocate_step_buffers()
        self.proposer = proposer if proposer is not None else MTPProposer(config.mtp_attention)
        if S > 0:
            self.proposer.bind(self)
        use_graphs = self.device.type == "cuda" and bool(config.cuda_graph_batch_sizes)
        self._graphs = StepGraphs() if use_graphs else None  # TP collectives are captured too
        self.metrics = GenerationMetrics(S)
        self._all_greedy = False  # set per step from the running requests' SamplingParams
        self._idle_steps = 0  # step() calls that found nothing able to run
        self._seed_generator = torch.Generator().manual_seed(seed)
        self._records: Dict[int, RequestRecord] = {}
        self._waiting: Deque[int] = collections.deque()  # admitted to the controller, not yet to the context
        self._admission_order: List[int] = []  # live requests, oldest first (preemption takes the newest)
        self._next_request_id = 0

    # ----- set-up ------------------------------------------------------------------------

    def _build_context(self, model_config) -> DynamicInferenceContext:
        config, S = self.config, self.config.num_speculative_tokens
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        num_kv_heads = model_config.num_query_groups or model_config.num_attention_heads
        kv_cache = KVCacheSpec(
            num_layers=self.runner.num_kv_layers,
            num_kv_heads=num_kv_heads // tp_size,
            head_dim=model_config.kv_channels,
            dtype=self.runner.model.embedding.word_embeddings.weight.dtype,  # what K/V will be computed in
        )
        num_blocks = config.num_kv_blocks
        if num_blocks is None and config.kv_cache_bytes is None:
            blocks_per_request = -(-(config.max_model_len + S) // config.block_size_tokens)
            num_blocks = config.max_requests * blocks_per_request
        return DynamicInferenceContext(
            max_requests=config.max_requests,
            max_model_len=config.max_model_len,
            block_size_tokens=config.block_size_tokens,
            num_speculative_tokens=S,
            max_tokens_per_step=config.max_tokens_per_step,
            kv_cache=kv_cache,
            device=self.device,
            num_blocks=num_blocks,
            kv_cache_bytes=config.kv_cache_bytes,
            cuda_graph_batch_sizes=config.cuda_graph_batch_sizes,
            mamba=self.runner.mamba_spec,  # None without Mamba layers
        )

    def _allocate_step_buffers(self) -> None:
        table, R, S = self.context.table, self.config.max_requests, self.config.num_speculative_tokens
        self._temperature = table.add_device_rows("temperature", (), torch.float32)  # [R] float32
        self._top_k = table.add_device_rows("top_k", (), torch.int64)  # [R] int64
        self._top_p = table.add_device_rows("top_p", (), torch.float32, fill=1.0)  # [R] float32
        self._seeds = table.add_device_rows("seed", (), torch.int64)  # [R] int64
        device = self.device
        self._last_accepted_rows = torch.zeros(R, dtype=torch.int64, device=device)  # [R] int64
        self._accepted_tokens = torch.full((R, S), -1, dtype=torch.int64, device=device)  # [R, S] int64
        self._accepted_counts = torch.zeros(R, dtype=torch.int64, device=device)  # [R] int64
        # the step's read-back: [accepted count, bonus token, accepted drafts...] per request
        self._readback = torch.zeros(R, S + 2, dtype=torch.int64, pin_memory=device.type == "cuda")  # [R, S + 2]
        self._readback_device = torch.zeros(R, S + 2, dtype=torch.int64, device=device)
        self._draft_rows = table.device_rows_with_scratch("draft_tokens")  # [R + 1, S] int64
        # verify_and_commit's outputs (the KV release is redone on the host mirror by commit_step)
        release_shape = (R,) if max_released_blocks(S, self.config.block_size_tokens) == 1 else (
            R, max_released_blocks(S, self.config.block_size_tokens))
        self._commit_out = StepCommit(
            last_one_indices=torch.empty(R, dtype=torch.int64, device=device),  # [R] int64
            accepted_tokens_mask=torch.empty(self.config.max_tokens_per_step, dtype=torch.bool, device=device),  # [T]
            blocks_to_release=torch.empty(release_shape, dtype=torch.int64, device=device),  # [R] or [R, W]
            remove_mask=torch.empty(release_shape, dtype=torch.bool, device=device),
        )

    def close(self) -> None:
        """Free the captured CUDA graphs. Call it before ``torch.distributed.destroy_process_group``
        when running tensor-parallel: a process group otherwise waits forever for the collectives
        captured in the graphs (pytorch/pytorch#115388). The controller stays usable."""
        if self._graphs is not None:
            self._graphs.reset()

    # ----- requests ------------------------------------------------------------------------

    def add_request(self, prompt_tokens: Union[Sequence[int], torch.Tensor],
                    sampling_params: Optional[SamplingParams] = None) -> int:
        """Queue a request; it joins the running batch as soon as a row is free. Returns its id."""
        prompt, params = self._check_request(prompt_tokens, sampling_params)
        return self._queue_request(prompt, params)

    def _check_request(self, prompt_tokens, sampling_params) -> Tuple[List[int], SamplingParams]:
        """Validate one request without touching any state; returns (prompt, params)."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        prompt = self._check_prompt(prompt_tokens)
        params.check_vocab(self.vocab_size)
        return prompt, params

    def _queue_request(self, prompt: List[int], params: SamplingParams) -> int:
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_generator))
        request_id = self._next_request_id
        self._next_request_id += 1
        self._records[request_id] = RequestRecord(request_id, prompt, params, seed)
        self._waiting.append(request_id)
        return request_id

    def _check_prompt(self, prompt_tokens) -> List[int]:
        if isinstance(prompt_tokens, torch.Tensor):
            if prompt_tokens.dim() != 1 or prompt_tokens.dtype not in (torch.int32, torch.int64):
                raise TypeError("prompt_tokens must be a 1-D int tensor or a sequence of ints")
            prompt = prompt_tokens.tolist()  # host-ok: user input, outside the step
        else:
            prompt = list(prompt_tokens)
            if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
                raise TypeError("prompt_tokens must be a 1-D int tensor or a sequence of ints")
        if not prompt:
            raise ValueError("prompt_tokens is empty")
        if len(prompt) >= self.config.max_model_len:
            raise ValueError(f"prompt_tokens has {len(prompt)} tokens; max_model_len ({self.config.max_model_len}) "
                             "leaves no room to generate")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt_tokens must lie in [0, {self.vocab_size}) (the vocabulary)")
        return prompt

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting) or bool(self._admission_order)

    def result(self, request_id: int) -> GenerationResult:
        record = self._records.get(request_id)
        if record is None:
            raise ValueError(f"unknown request_id {request_id}")
        if record.finish_reason is None:
            raise ValueError(f"request {request_id} has not finished")
        return GenerationResult.from_record(record, self.config.num_speculative_tokens)

    def _admit_waiting(self) -> None:
        while self._waiting and self.context.num_free_rows > 0:
            request_id = self._waiting[0]
            record = self._records[request_id]
            tokens = record.prompt_tokens + record.output_tokens
            if record.preemptions and not self._fits_in_free_blocks(len(tokens)):
                break  # an evicted request waits until it can be recomputed without evicting again
            self.context.add_request(request_id, tokens)
            self._waiting.popleft()  # only once the context holds it
            row = self.context.table.row_of(request_id)
            params = record.params
            self._temperature[row] = params.temperature
            self._top_k[row] = params.top_k
            self._top_p[row] = params.top_p
            self._seeds[row] = record.seed
            self._admission_order.append(request_id)

    def _fits_in_free_blocks(self, token_count: int) -> bool:
        block_size = self.config.block_size_tokens
        needed = -(-(token_count + self.config.num_speculative_tokens + 1) // block_size)
        return needed <= self.context.allocator.num_free_blocks

    def _preempt_newest(self) -> None:
        """Evict the newest live request to free its KV blocks; it is recomputed from its prompt
        and output so far when it comes back, with unchanged output (sampling is positional)."""
        request_id = self._admission_order.pop()
        self._release(request_id)
        self._records[request_id].preemptions += 1
        self._waiting.appendleft(request_id)

    def _release(self, request_id: int) -> None:
        self.context.finish_request(request_id)
        self.proposer.forget(request_id)

    # ----- hooks -------------------------------------------------------------------------

    def sample_rows(self, logits: torch.Tensor, table_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Draw one token per logits row ``[K, V]`` with the parameters of the request at
        ``table_rows`` ``[K]``, for the token that will sit at ``positions`` ``[K]``."""
        return sample_tokens(logits, self._temperature[table_rows], self._top_k[table_rows], self._top_p[table_rows],
                             self._seeds[table_rows], positions, all_greedy=self._all_greedy)

    def accept_tokens(self, record: RequestRecord, new_tokens: List[int]) -> Tuple[List[int], Optional[FinishReason]]:
        """Append a request's verified tokens up to its first stop; returns (emitted, reason)."""
        return accept_new_tokens(record.output_tokens, new_tokens, record.params, len(record.prompt_tokens),
                                 self.config.max_model_len)

    def on_step_end(self, outputs: List[StepOutput]) -> None:
        """Called after every step with what it emitted. Default: nothing."""

    # ----- the step ------------------------------------------------------------------------

    def step(self) -> List[StepOutput]:
        """Run one forward pass over the running batch; returns what each request emitted."""
        phase_start = time.perf_counter()
        self._admit_waiting()
        step = self._build_step()
        if step is None:
            self._idle_steps += 1
            return []
        self._all_greedy = all(self._records[rid].params.greedy for rid in step.request_ids)
        launch_step = self._with_length_bounds(step) if step.num_prefill == 0 else step
        phase_start = self._phase("schedule", phase_start)

        graph_batch = launch_step.attention.batch_size
        if self._graphs is not None and step.num_prefill == 0 and graph_batch in self.config.cuda_graph_batch_sizes:
            self._graphs.run((graph_batch, self._all_greedy), lambda: self._launch(launch_step))
        else:
            self._launch(launch_step)
        phase_start = self._phase("launch", phase_start)

        readback = self._read_back(step.num_sampling_requests)  # the step's one device-to-host copy
        phase_start = self._phase("wait", phase_start)
        accepted = readback[:, 0].tolist()  # host-ok: values already on the host
        self.context.commit_step(step, accepted[: step.num_decode])
        if self.config.num_speculative_tokens > 0:
            self.proposer.on_step_committed(step, accepted)
        outputs = self._emit(step, readback)
        self._phase("commit", phase_start)
        self.on_step_end(outputs)
        return outputs

    def _with_length_bounds(self, step: StepMetadata) -> StepMetadata:
        """A decode-only step with the attention's length bounds fixed per configuration, so its
        kernels' grids do not depend on this batch's lengths (one CUDA graph fits every batch)."""
        stride = self.config.num_speculative_tokens + 1
        attention = dataclasses.replace(step.attention, max_query_len=stride,
                                        max_seq_len=self.config.max_model_len + stride)
        return dataclasses.replace(step, attention=attention)

    def _launch(self, step: StepMetadata) -> None:
        """The GPU part of a step: forward, sample, verify + commit, draft, stage the read-back.

        No host sync. A decode-only step also has no value-dependent Python: its grid is the
        (padded) batch, and the real request count is read on the device, so it can be captured.
        """
        S, context, attention = self.config.num_speculative_tokens, self.context, step.attention
        decode_only = step.num_prefill == 0
        grid = attention.batch_size if decode_only else step.num_requests  # G
        num_decode = grid if decode_only else step.num_decode
        num_sampling = grid if decode_only else step.num_sampling_requests
        stride = S + 1
        num_rows = num_decode * stride + step.num_final_prefill_chunks
        rows = step.logits_indices[:num_rows]  # [K] int64 packed rows that sample
        num_active = (attention.seq_lens > 0).sum() if decode_only else None  # [] int64, real requests
        mamba = None if context.mamba is None else self._mamba_forward(step, num_decode, num_active)
        logits, hidden = self.runner.forward(step.input_ids, attention.positions, attention, context.kv_caches,
                                             logits_rows=rows, mamba=mamba)  # [K, V], [T, H]

        row_index = torch.arange(num_rows, device=self.device)
        row_requests = torch.where(row_index < num_decode * stride, row_index // stride,
                                   row_index - num_decode * stride + num_decode)  # [K] table row of each
        output_tokens = self.sample_rows(logits, row_requests, attention.positions[rows] + 1)
        self._accepted_tokens.fill_(-1)
        self._accepted_counts.zero_()
        table = context.table.device
        verify_and_commit(
            step.input_ids[rows], output_tokens, rows,
            context.table.next_tokens, self._last_accepted_rows, self._accepted_tokens, self._accepted_counts,
            table.last_kv_block_offset[:num_sampling], table.kv_length_offsets[:num_sampling],
            table.kv_block_counts[:num_sampling], table.last_kv_block_id[:num_sampling],
            table.kv_block_ids[:num_sampling],
            num_decode, step.num_final_prefill_chunks, S, self.config.block_size_tokens,
            num_active_requests=num_active, out=self._commit_buffers(num_sampling, num_rows),
        )
        if mamba is not None and num_decode > 0:
            self._commit_mamba(mamba.decode_slot_ids, num_decode)
        if S > 0:
            request_index = torch.arange(grid, device=self.device)
            write_rows = request_index if num_active is None else torch.where(
                request_index < num_active, request_index, context.table.scratch_row)  # [G] int64
            drafts = self.proposer.propose(DraftBatch(
                step=step, hidden=hidden, num_requests=grid, num_sampling_requests=num_sampling,
                next_tokens=context.table.next_tokens[:grid], last_accepted_rows=self._last_accepted_rows[:grid],
                accepted_counts=self._accepted_counts[:grid], write_rows=write_rows))
            self._check_drafts(drafts, num_sampling)
            # a draft outside the vocabulary would reach the next step's embedding: clamp on the device
            self._draft_rows[write_rows[:num_sampling]] = drafts.clamp(0, self.vocab_size - 1)
        staged = self._readback_device[:num_sampling]
        staged[:, 0] = self._accepted_counts[:num_sampling]
        staged[:, 1] = context.table.next_tokens[:num_sampling]
        staged[:, 2:] = self._accepted_tokens[:num_sampling]

    def _mamba_forward(self, step: StepMetadata, num_decode: int, num_active: Optional[torch.Tensor]) -> MambaForward:
        """Where this step's requests keep their Mamba state: decode slots on the device (requests
        padding a graph batch, at or past ``num_active``, use the scratch slot), prefill slots
        and packed row ranges as host ints."""
        slots, table = self.context.mamba, self.context.table
        decode_slot_ids = table.device.mamba_slot_ids[:num_decode]  # [nd] int64
        if num_active is not None:
            request_index = torch.arange(num_decode, device=self.device)
            decode_slot_ids = torch.where(request_index < num_active, decode_slot_ids, slots.scratch_slot)
        starts = step.host_query_start_loc.tolist()  # host-ok: host tensor
        prefill_rows = range(step.num_decode, step.num_requests)
        return MambaForward(
            conv_states=slots.conv_states, ssm_states=slots.ssm_states,
            intermediate_conv_states=slots.intermediate_conv_states,
            intermediate_ssm_states=slots.intermediate_ssm_states,
            decode_slot_ids=decode_slot_ids,
            prefill_row_ranges=tuple((starts[row], starts[row + 1]) for row in prefill_rows),
            prefill_slot_ids=tuple(int(table.host.mamba_slot_ids[row]) for row in prefill_rows),
        )

    def _commit_mamba(self, decode_slot_ids: torch.Tensor, num_decode: int) -> None:
        """Each decode request keeps the Mamba state after its last accepted row (conv and SSM)."""
        slots, table = self.context.mamba, self.context.table.device
        for intermediate, current in ((slots.intermediate_conv_states, slots.conv_states),
                                      (slots.intermediate_ssm_states, slots.ssm_states)):
            mamba_state_selective_copy(intermediate, current, table.prefill_status[:num_decode], decode_slot_ids,
                                       self._accepted_counts[:num_decode], slots.num_layers)

    def _build_step(self):
        while True:
            try:
                return self.context.build_step()
            except KVCacheFullError:
                if len(self._admission_order) <= 1:
                    raise
                self._preempt_newest()

    def _check_drafts(self, drafts, num_sampling: int) -> None:
        """A proposer's output must be ``[n, S]`` int64 on the step's device (metadata only)."""
        want = (num_sampling, self.config.num_speculative_tokens)
        if not isinstance(drafts, torch.Tensor) or drafts.dtype != torch.int64 or tuple(drafts.shape) != want:
            raise TypeError(f"{type(self.proposer).__name__}.propose must return a {list(want)} int64 tensor, got "
                            f"{getattr(drafts, 'dtype', type(drafts).__name__)} {tuple(getattr(drafts, 'shape', ()))}")
        if drafts.device != self.device:
            raise ValueError(f"{type(self.proposer).__name__}.propose returned drafts on {drafts.device}, "
                             f"expected {self.device}")

    def _commit_buffers(self, num_requests: int, num_rows: int) -> StepCommit:
        """Views of the preallocated outputs of ``verify_and_commit`` for this step's grid."""
        buffers = self._commit_out
        return StepCommit(buffers.last_one_indices[:num_requests], buffers.accepted_tokens_mask[:num_rows],
                          buffers.blocks_to_release[:num_requests], buffers.remove_mask[:num_requests])

    def _read_back(self, num_sampling: int) -> torch.Tensor:
        """Copy the staged ``[accepted, bonus, accepted drafts]`` rows of the real sampling
        requests to pinned host memory and wait for them: the step's one synchronisation."""
        host = self._readback[:num_sampling]
        host.copy_(self._readback_device[:num_sampling], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # host-ok: the step's single read-back
        return host

    def _emit(self, step, readback: torch.Tensor) -> List[StepOutput]:
        outputs: List[StepOutput] = []
        values = readback.tolist()  # host-ok: pinned host copy
        for index, request_id in enumerate(step.request_ids[: step.num_sampling_requests]):
            record = self._records[request_id]
            accepted, bonus, drafts = values[index][0], values[index][1], values[index][2:]
            if index < step.num_decode:
                record.decode_steps += 1
                record.accepted_drafts += accepted
                self.metrics.record_acceptance([accepted])
            emitted, reason = self.accept_tokens(record, drafts[:accepted] + [bonus])
            self.metrics.emitted_tokens += len(emitted)
            if reason is not None:
                record.finish_reason = reason
                self._admission_order.remove(request_id)
                self._release(request_id)
            outputs.append((request_id, emitted, reason is not None))
        return outputs

    def _phase(self, name: str, started: float) -> float:
        now = time.perf_counter()
        self.metrics.record_phase(name, now - started)
        return now

    # ----- batch API -----------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None) -> List[GenerationResult]:
        """Generate for every prompt (queued beyond max_requests); results in prompt order."""
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
        checked = [self._check_request(prompt, params) for prompt, params in zip(prompts, sampling_params)]
        request_ids = [self._queue_request(prompt, params) for prompt, params in checked]  # all valid: queue
        while any(self._records[rid].finish_reason is None for rid in request_ids):
            idle_steps = self._idle_steps
            self.step()
            if self._idle_steps != idle_steps:
                raise RuntimeError("generate: no request can run (all running requests are paused); "
                                   "resume them or use the step API")
        return [self.result(rid) for rid in request_ids]
