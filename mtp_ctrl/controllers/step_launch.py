"""The GPU part of one step: inputs, forward, sample, verify + commit, draft, stage the read-back.

:class:`StepLauncher` owns the step's preallocated device buffers (nothing is allocated per
step) and runs the device work of one step of a launch; the controller decides what runs and
applies the read-back. No host sync and no value-dependent Python: the grid is the step's
(padded) request count, every request has ``1 + V`` logits rows (V = ``step.verify_width``, the
step's verify tier: the most drafts any of its decode requests holds), and the real counts
(requests, decode requests, sampling requests) are read on the device, so a padded step can be
captured in a CUDA graph (one per tier). A step with ``V = 0`` is a plain decode step. With ragged
rows (``context.ragged_rows``) decode request r ran only ``1 + s_r`` of its ``1 + V`` logits rows'
packed rows (``StepMetadata``'s docstring); its logits rows keep the ``1 + V`` layout.
"""

from typing import Callable, Optional

import torch

from mtp_ctrl.controllers.acceptance import RejectionAcceptance
from mtp_ctrl.controllers.proposers import DraftBatch, Proposer, check_drafts
from mtp_ctrl.models.forward_context import MambaForward
from mtp_ctrl.models.runner import PagedGPTRunner
from mtp_ctrl.state import DynamicInferenceContext, StepMetadata
from mtp_ctrl.triton_ops import StepCommit, draft_batch_rows, logits_row_requests, max_released_blocks, verify_and_commit


class StepLauncher:
    """``sample_rows(logits, table_rows, positions)``: the controller's sampler hook;
    ``rejection``: rejection acceptance, or None for exact match."""

    def __init__(self, context: DynamicInferenceContext, runner: PagedGPTRunner, proposer: Proposer,
                 sample_rows: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                 rejection: Optional[RejectionAcceptance]):
        self.context, self.runner, self.proposer = context, runner, proposer
        self._sample_rows, self._rejection = sample_rows, rejection
        shape = context.shape
        R, S, T, device = shape.max_requests, shape.num_speculative_tokens, shape.max_tokens_per_step, shape.device
        self.last_accepted_rows = torch.zeros(R, dtype=torch.int64, device=device)  # [R] int64
        self.next_tokens = torch.zeros(R, dtype=torch.int64, device=device)  # [R] int64, by request: the last step's
        self.accepted_tokens = torch.full((R, S), -1, dtype=torch.int64, device=device)  # [R, S] int64
        self.accepted_counts = torch.zeros(R, dtype=torch.int64, device=device)  # [R] int64, the last step's
        self._row_requests = torch.zeros(2, R * (S + 1), dtype=torch.int64, device=device)  # [2, >= K] logits_row_requests
        self._draft_positions = torch.zeros(3, R, dtype=torch.int64, device=device)  # [3, R]: draft_batch_rows
        self._draft_samples = torch.zeros(R, dtype=torch.bool, device=device)  # [R] bool
        self._draft_rows = context.table.device_rows_with_scratch("draft_tokens")  # [R + 1, S] int64, by slot
        self._next_token_rows = context.table.device_rows_with_scratch("next_tokens")  # [R + 1] int64, by slot
        # drafts each request holds (made by its last sampling step, verified by its next): rows past it are masked
        context.table.add_device_rows("draft_lengths", (), torch.int64, fill=S)
        self._draft_length_rows = context.table.device_rows_with_scratch("draft_lengths")  # [R + 1] int64
        self._row_index = torch.arange(R * (S + 1), device=device)  # [R * (1 + S)] int64, a logits row's index
        # per verify width V: each logits row's depth k (row % (1 + V)), and verify_and_commit's outputs
        # (with keep_released_blocks nothing is released, see state/context.py; W depends on V)
        self._row_depths, self._commit_out = [], []
        for width in range(S + 1):
            self._row_depths.append(self._row_index % (width + 1))  # [R * (1 + S)] int64
            release_width = max_released_blocks(width, shape.block_size_tokens)
            release_shape = (R,) if release_width == 1 else (R, release_width)
            self._commit_out.append(StepCommit(
                last_one_indices=torch.empty(R, dtype=torch.int64, device=device),  # [R] int64
                accepted_tokens_mask=torch.empty(T, dtype=torch.bool, device=device),  # [T] bool
                blocks_to_release=torch.empty(release_shape, dtype=torch.int64, device=device),  # [R] or [R, W]
                remove_mask=torch.empty(release_shape, dtype=torch.bool, device=device),
            ))

    def launch(self, step: StepMetadata, readback: torch.Tensor, all_greedy: bool, mask_drafts: bool = True,
               draft_phase: bool = True) -> None:
        """One step's device work; stages ``[accepted count, bonus token, accepted drafts]`` of each
        request of the grid into ``readback`` (``[R, S + 2]`` int64 on the device). ``all_greedy``:
        every request samples greedily (a host flag from the requests' parameters). ``mask_drafts``:
        some request may hold fewer than S drafts (False skips the masking kernels: every request
        drafted S). ``draft_phase`` False (``graph_warmup.NO_DRAFT_PHASE``: a decode-only step of V = D = 0 whose
        requests never draft): neither the proposer nor its per-request rows run; each request's
        draft length row stays 0, what it held to verify none."""
        context, attention, shape = self.context, step.attention, self.context.shape
        S, V = shape.num_speculative_tokens, step.verify_width
        context.prepare_inputs(step)
        grid = attention.batch_size  # G
        rows = step.logits_indices  # [G * (1 + V)] int64: decode rows, final chunk ends, then ignored
        num_decode = step.device_num_decode  # [1] int64
        mamba = None
        if context.mamba is not None:  # a padded grid: every request may decode, those past the real ones as scratch
            padded = step.graph_padded or step.decode_only
            mamba = MambaForward.for_step(context.mamba, step.mamba_slot_ids, step,
                                          grid if padded else step.num_decode, step.device_num_decode if padded else None)
        logits, hidden = self.runner.forward(step.input_ids, attention.positions, attention, context.kv_caches,
                                             logits_rows=rows, mamba=mamba)  # [G * (1 + V), vocab], [T, H]

        # [K] int64 each: the table slot of each logits row's request, where its token goes
        row_requests, positions = self._row_requests[:, : rows.shape[0]]
        logits_row_requests(rows, attention.positions, num_decode, V, grid, step.slot_ids, row_requests, positions)
        output_tokens = self._sample_rows(logits, row_requests, positions)
        input_tokens = step.input_ids[rows]  # [K] int64
        if V > 0 and mask_drafts:  # drafts past a request's draft length were not made for it: no row may accept them
            input_tokens = self._mask_undrafted(input_tokens, row_requests, num_decode, V)
        if self._rejection is not None and not all_greedy and V > 0:  # draft rows: accept min(1, p/q) or resample
            output_tokens = self._rejection.resample(logits, output_tokens, input_tokens, row_requests,
                                                     positions, num_decode, V)
        if V > 0:  # (a step that verifies no draft stages -1 columns directly: one launch, not two)
            self.accepted_tokens.fill_(-1)
        self.accepted_counts.zero_()
        table = context.table.device
        verify_and_commit(  # the KV state by slot; next tokens, accepted rows and counts by request (V drafts each)
            input_tokens, output_tokens, rows,
            self.next_tokens, self.last_accepted_rows, self.accepted_tokens[:, :V], self.accepted_counts,
            table.last_kv_block_offset, table.kv_length_offsets, table.kv_block_counts, table.last_kv_block_id,
            table.kv_block_ids, grid, 0, V, shape.block_size_tokens, num_active_requests=step.device_num_sampling,
            out=self._commit_buffers(V, grid, rows.shape[0]), keep_released_blocks=True, decode_count=num_decode,
            request_slots=step.slot_ids,  # ragged rows: each decode request rewinds the rows it ran
            query_start_loc=attention.query_start_loc[: grid + 1] if context.ragged_rows else None,
        )
        # each request's next input token to its slot (a request that sampled nothing this step, or
        # padding, writes a stale value that nothing reads: its next decode follows a step that samples)
        self._next_token_rows.index_copy_(0, step.slot_ids, self.next_tokens[:grid])
        num_mamba_decode = 0 if mamba is None else mamba.decode_slot_ids.shape[0]
        if num_mamba_decode > 0:  # keep each decode's state after its last accepted row
            context.mamba.commit_accepted(step.prefill_status[:num_mamba_decode], mamba.decode_slot_ids,
                                          self.accepted_counts[:num_mamba_decode], step.verify_stride)
        if S > 0 and draft_phase:
            self._draft(step, hidden, grid)
        staged = readback[:grid]  # [G, S + 2]; columns past 2 + V stay -1 (accepted_tokens' fill)
        staged[:, 0] = self.accepted_counts[:grid]
        staged[:, 1] = self.next_tokens[:grid]
        if V > 0:
            staged[:, 2:] = self.accepted_tokens[:grid]
        elif S > 0:
            staged[:, 2:].fill_(-1)

    def _mask_undrafted(self, input_tokens: torch.Tensor, row_requests: torch.Tensor,
                        num_decode: torch.Tensor, verify_width: int) -> torch.Tensor:
        """``input_tokens`` ``[K]`` with -1 at decode draft rows ``b + k``, ``k > s_r`` (the request's
        draft length; ``b`` steps by ``1 + verify_width``): -1 equals no sampled token, so exact match
        stops at ``s_r`` and rejection acceptance treats the row as having no draft (row ``b + s_r``
        keeps its sample from ``p``)."""
        num_rows = input_tokens.shape[0]
        depth = self._row_depths[verify_width][:num_rows]  # [K] int64
        lengths = self._draft_length_rows[row_requests]  # [K] int64, the row's request's s_r
        undrafted = (self._row_index[:num_rows] < num_decode * (verify_width + 1)) & (depth > lengths)  # [K] bool
        return torch.where(undrafted, -1, input_tokens)

    def _draft(self, step: StepMetadata, hidden: torch.Tensor, grid: int) -> None:
        """The proposer's drafts (``step.num_drafts`` depths; none when that is 0) of every request
        of the grid, into the table's draft rows, and each request's draft length beside them."""
        context, attention, shape = self.context, step.attention, self.context.shape
        scratch_row = context.table.scratch_row
        write_rows, first_positions, bonus_positions = self._draft_positions[:, :grid]  # [G] int64 each
        samples = self._draft_samples[:grid]  # [G] bool
        lengths = step.draft_lengths  # [>= G] int64 or None: each sampling request's s_r, to its table row
        draft_batch_rows(attention.query_start_loc[: grid + 1], attention.seq_lens[:grid], self.accepted_counts,
                         step.counts, step.slot_ids, step.verify_width, scratch_row, write_rows, samples,
                         first_positions, bonus_positions, draft_lengths=lengths,
                         out_draft_length_rows=None if lengths is None else self._draft_length_rows)
        S = shape.num_speculative_tokens
        num_drafts = S if step.num_drafts < 0 else step.num_drafts
        batch = DraftBatch(
            step=step, hidden=hidden, num_requests=grid, samples=samples,
            next_tokens=self.next_tokens[:grid], last_accepted_rows=self.last_accepted_rows[:grid],
            accepted_counts=self.accepted_counts[:grid], write_rows=write_rows, first_positions=first_positions,
            bonus_positions=bonus_positions, aux_hidden=self.runner.aux_hidden, num_drafts=num_drafts)
        if num_drafts == 0:  # nobody drafts: no draft phase (the proposer only keeps its own state)
            self.proposer.on_no_drafts(batch)
            return
        drafts = self.proposer.propose(batch)
        check_drafts(self.proposer, drafts, (grid, shape.num_speculative_tokens), shape.device)
        # a draft outside the vocabulary would reach the next step's embedding: clamp on the device
        self._draft_rows[torch.where(samples, write_rows, scratch_row)] = drafts.clamp(0, shape.vocab_size - 1)

    def _commit_buffers(self, verify_width: int, num_requests: int, num_rows: int) -> StepCommit:
        """Views of the preallocated outputs of ``verify_and_commit`` for this step's tier and grid."""
        buffers = self._commit_out[verify_width]
        return StepCommit(buffers.last_one_indices[:num_requests], buffers.accepted_tokens_mask[:num_rows],
                          buffers.blocks_to_release[:num_requests], buffers.remove_mask[:num_requests])
