"""Drafting through the model's own MTP layers, serial over depths.

MTP depth k (0-based) at position i combines the hidden state ``h^k_i`` (the decoder's output
for k = 0, depth k - 1's output otherwise) with the embedding of token ``t_{i+k+1}`` and
predicts ``t_{i+k+2}``. After a step verified tokens up to the bonus token ``t_e`` (the last
accepted row sits at position ``e - 1``), depth k at position ``e - 1`` drafts ``d_{k+1}``,
the token at position ``e + k + 1``; its input token is ``t_e`` for k = 0 and the previous
draft for k > 0.

mtp_attention="paged" (as trained): each depth attends with full causal attention over its
own paged KV cache (cache ``L + k``, same block table as the decoder). A position's entry at
depth k is final once ``t_{i+k+1}`` is verified; entries built from drafts are recomputed the
next step. So every step each depth runs over a per-request window ``[w, e)``, where ``w`` is
the first position that was not final for the deepest depth, rewriting final entries with the
same values. Worked example, S = 2, a decode step with base row at position 10 (``w = 9``)
accepting 1 draft: ``e = 12``, the window is positions 9, 10, 11; position 9's decoder hidden
comes from a small per-request ring, 10 and 11 from this step's rows; depth 0 reads tokens
``t_10, t_11, t_12``, depth 1 ``t_11, t_12, d_1``; the next window starts at
``min(e, e + 1 - S) = 11``.

mtp_attention="single_position": each depth attends to its current row only (Megatron-LM's
inference today); no window, one row per request and depth.

Decode-only steps take every index from device tensors with shapes fixed by the batch bucket
(each request gets ``2S`` window rows, the most a decode window spans), so they can be captured
in a CUDA graph; steps with prefill chunks build their layout on the host.

Draft tokens are sampled with the request's own parameters and the target's noise for that
position (see ``sampling.py``), which couples draft and target samples: greedy requests draft
the MTP argmax, sampled requests draft what the target would most likely draw. With
``acceptance="rejection"`` each depth also records the distribution ``q`` it drew from (the same
filtered softmax, ``[R + 1, S, V]`` float32 rows that follow their request), which the next
step's rejection sampling reads (``controllers/acceptance.py``).
"""

from typing import Dict, NamedTuple, Optional, Sequence

import torch

from mtp_ctrl.controllers.acceptance import RequestSampling
from mtp_ctrl.controllers.proposers import DraftBatch, Proposer
from mtp_ctrl.state.attention_metadata import AttentionMetadata
from mtp_ctrl.state.step_metadata import StepMetadata


class _DraftLayout(NamedTuple):
    """Where a step's requests and their draft windows sit (device tensors; G requests, T rows)."""

    first: torch.Tensor  # [G] int64, position of each request's first row this step
    query_lengths: torch.Tensor  # [G] int64, its rows this step
    main_start: torch.Tensor  # [G] int64, its first packed row
    row_requests: torch.Tensor  # [T] int64, the request of each packed row
    window_query_start_loc: torch.Tensor  # [G + 1] int32, window rows per request (paged mode)
    window_rows: torch.Tensor  # [Tm] int64, the request of each window row
    window_from_end: torch.Tensor  # [Tm] int64, distance of each window row to the row at e - 1
    prefill_window_starts: Optional[torch.Tensor]  # [G] int64, the host's w (steps with prefill)
    max_window_rows: int


class MTPProposer(Proposer):
    def __init__(self, mode: str = "paged"):
        if mode not in ("paged", "single_position"):
            raise ValueError(f"mode must be 'paged' or 'single_position', got {mode!r}")
        self.mode = mode
        self._prefill_window_starts: Dict[int, int] = {}  # request id -> w, for requests still in prefill

    def bind(self, controller) -> None:
        super().bind(controller)
        runner, context = controller.runner, controller.context
        S = self.num_speculative_tokens = controller.config.num_speculative_tokens
        if S > runner.mtp_num_layers:
            raise ValueError(f"num_speculative_tokens ({S}) exceeds the model's MTP depth ({runner.mtp_num_layers})")
        table = context.table
        self._ring_size = S
        self._history_len = context.max_model_len + 2 * S + 2
        hidden_size = runner.model.config.hidden_size
        table.add_device_rows("mtp_token_history", (self._history_len,), torch.int64)
        table.add_device_rows("mtp_hidden_ring", (S, hidden_size), context.kv_caches[0][0].dtype)
        table.add_device_rows("mtp_window_start", (), torch.int64)
        # [R + 1, ...] each (last row: scratch): verified tokens by position, then the drafts;
        # decoder hidden of the last S accepted positions (position p at p % S); window start w
        self._token_history = table.device_rows_with_scratch("mtp_token_history")
        self._hidden_ring = table.device_rows_with_scratch("mtp_hidden_ring")
        self._window_start = table.device_rows_with_scratch("mtp_window_start")
        self._draft_probs = None  # [R + 1, S, V] float32: q of each draft (rejection acceptance only)
        if controller.config.acceptance == "rejection":
            table.add_device_rows("mtp_draft_probs", (S, controller.vocab_size), torch.float32)
            self._draft_probs = table.device_rows_with_scratch("mtp_draft_probs")
            self._sampling = RequestSampling(table)

    def draft_probs(self) -> Optional[torch.Tensor]:
        return self._draft_probs

    # ----- host bookkeeping ----------------------------------------------------------------

    def on_step_scheduled(self, step: StepMetadata) -> None:
        """The host keeps the window start of requests still in prefill (it sizes their rows):
        after a chunk ending at ``e`` that did not sample, ``w = max(0, e - S)``. Only prefill
        requests change it (host values), so decode-only steps cost nothing here."""
        if step.num_prefill == 0:
            return
        ends = (step.host_first_positions + step.host_query_lengths).tolist()  # host-ok: host tensors
        for index in range(step.num_decode, step.num_requests):
            request_id = step.request_ids[index]
            if index < step.num_sampling_requests:
                self._prefill_window_starts.pop(request_id, None)
            else:
                self._prefill_window_starts[request_id] = max(0, ends[index] - self.num_speculative_tokens)

    def forget(self, request_id: int) -> None:
        self._prefill_window_starts.pop(request_id, None)

    # ----- drafting ------------------------------------------------------------------------

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        S, step = self.num_speculative_tokens, batch.step
        device, num_requests, num_sampling = batch.hidden.device, batch.num_requests, batch.num_sampling_requests
        if num_sampling == 0 and self.mode == "single_position":  # a lone mid-prompt chunk: no row to draft from
            return torch.empty(0, S, dtype=torch.int64, device=device)
        layout = self._layout(batch)
        first, main_start = layout.first, layout.main_start  # [G] int64 each
        ends = batch.bonus_positions  # [G] int64, e: the bonus token's position
        self._record_verified_tokens(batch, ends, layout.row_requests)
        if self.mode == "paged":
            hidden, rows, positions, metadata = self._paged_window(batch, ends, layout)
        else:
            hidden, rows, positions, metadata = self._single_position_rows(batch, ends)
        history_rows = batch.write_rows[rows]  # [Tm] table row (scratch for padding) of each row
        last_rows = metadata.query_start_loc[1 : num_sampling + 1].long() - 1  # [n_s] each request's row at e - 1
        sampling_rows = torch.arange(num_sampling, device=device)
        drafts = torch.empty(num_sampling, S, dtype=torch.int64, device=device)  # [n_s, S]
        kv_caches = self.controller.context.kv_caches
        for depth in range(S):
            token_index = (positions + depth + 1).clamp(0, self._history_len - 1)  # [Tm] position of t_{i+k+1}
            tokens = self._token_history[history_rows, token_index]  # [Tm] int64
            logits, hidden = self.controller.runner.mtp_forward(depth, hidden, tokens, positions.clamp(min=0),
                                                                metadata, kv_caches, logits_rows=last_rows)
            draft_positions = (ends[:num_sampling] + depth + 1).clamp(0, self._history_len - 1)  # [n_s]
            drafts[:, depth] = self.controller.sample_rows(logits, sampling_rows, draft_positions)  # [n_s, V] logits
            if self._draft_probs is not None:  # q: the same filtered softmax the draft was drawn from
                self._draft_probs[batch.write_rows[:num_sampling], depth] = self._sampling.probs(logits, sampling_rows)
            self._token_history[batch.write_rows[:num_sampling], draft_positions] = drafts[:, depth]
        self._advance_windows(batch, ends)
        if self.mode == "paged":
            self._update_hidden_ring(batch, ends, first, main_start)
        return drafts

    def _layout(self, batch: DraftBatch) -> _DraftLayout:
        """Decode-only steps derive the layout on the device (fixed shapes per bucket, so the step
        can be captured); steps with prefill build it on the host and copy it once."""
        step, device, S = batch.step, batch.hidden.device, self.num_speculative_tokens
        stride, window_size = S + 1, 2 * S  # a decode window spans at most 2S positions
        num_requests = batch.num_requests
        first = batch.first_positions  # [G] int64 (padding requests: their row's stale length, unused)
        if batch.decode_only:
            request_index = torch.arange(num_requests, device=device)
            window_index = torch.arange(num_requests * window_size, device=device)
            return _DraftLayout(
                first, torch.full_like(first, stride), request_index * stride,
                torch.arange(step.input_ids.shape[0], device=device) // stride,
                torch.arange(0, (num_requests + 1) * window_size, window_size, dtype=torch.int32, device=device),
                window_index // window_size, window_size - 1 - window_index % window_size, None, window_size)
        query_lengths = step.host_query_lengths  # [n] int64 (CPU), like every host tensor below
        starts = torch.tensor([self._prefill_window_starts.get(rid, 0) for rid in step.request_ids], dtype=torch.int64)
        sizes = torch.where(torch.arange(num_requests) < step.num_decode, window_size,
                            step.host_first_positions + query_lengths - starts)  # [n] window rows
        window_query_start_loc = torch.zeros(num_requests + 1, dtype=torch.int64)
        torch.cumsum(sizes, 0, out=window_query_start_loc[1:])
        window_rows = torch.repeat_interleave(torch.arange(num_requests), sizes)  # [Tm]
        from_end = window_query_start_loc[1:][window_rows] - 1 - torch.arange(window_rows.shape[0])  # [Tm]
        host_parts = (query_lengths, step.host_query_start_loc[:-1],
                      torch.repeat_interleave(torch.arange(num_requests), query_lengths),
                      window_query_start_loc, window_rows, from_end, starts)
        device_parts = torch.cat(host_parts).to(device, non_blocking=True).split([p.shape[0] for p in host_parts])
        lengths, main_start, row_requests, window_qsl, rows, from_end, starts = device_parts
        return _DraftLayout(first, lengths, main_start, row_requests, window_qsl.to(torch.int32), rows, from_end,
                            starts, int(sizes.max()))

    def _record_verified_tokens(self, batch: DraftBatch, ends: torch.Tensor, row_requests: torch.Tensor) -> None:
        """Write this step's input rows at their positions, then each bonus token at ``e``.
        Rejected drafts land past ``e`` and are overwritten by the new drafts."""
        step, num_sampling = batch.step, batch.num_sampling_requests
        rows = row_requests.shape[0]
        self._token_history[batch.write_rows[row_requests], step.attention.positions[:rows]] = step.input_ids[:rows]
        bonus_positions = ends[:num_sampling].clamp(0, self._history_len - 1)
        self._token_history[batch.write_rows[:num_sampling], bonus_positions] = batch.next_tokens[:num_sampling]

    def _paged_window(self, batch: DraftBatch, ends, layout: _DraftLayout):
        """Rows for positions ``[w, e)`` of every request, right-aligned in its window rows (a
        decode gets 2S rows, a prefill chunk ``first + q - w``); rows before ``w`` are masked."""
        step = batch.step
        block_size = self.controller.config.block_size_tokens
        first, main_start, rows = layout.first, layout.main_start, layout.window_rows
        window_start = self._window_start[batch.write_rows]  # [G] int64, the device's w (decodes)
        if layout.prefill_window_starts is not None:
            is_decode = torch.arange(batch.num_requests, device=ends.device) < step.num_decode
            window_start = torch.where(is_decode, window_start, layout.prefill_window_starts)
        positions = ends[rows] - 1 - layout.window_from_end  # [Tm] int64, may be < w (then masked) or < 0
        valid = positions >= window_start[rows]
        safe_positions = positions.clamp(min=0)
        block_table = step.attention.block_table[: batch.num_requests]
        block_ids = block_table[rows, safe_positions // block_size].long()
        slot_mapping = torch.where(valid, block_ids * block_size + safe_positions % block_size, -1)  # [Tm] int64
        # depth 0 input: this step's decoder rows for positions >= first, the ring before that
        from_step = positions >= first[rows]
        step_rows = (main_start[rows] + positions - first[rows]).clamp(0, batch.hidden.shape[0] - 1)
        ring_hidden = self._hidden_ring[batch.write_rows[rows], safe_positions % self._ring_size]  # [Tm, H]
        hidden = torch.where(from_step[:, None], batch.hidden[step_rows], ring_hidden)  # [Tm, H]
        metadata = AttentionMetadata(
            query_start_loc=layout.window_query_start_loc,
            seq_lens=ends.clamp(min=0).to(torch.int32),
            slot_mapping=slot_mapping,
            block_table=block_table,
            positions=safe_positions,
            num_actual_tokens=rows.shape[0],
            max_query_len=layout.max_window_rows,
            max_seq_len=step.attention.max_seq_len,
        )
        return hidden, rows, positions, metadata

    def _single_position_rows(self, batch: DraftBatch, ends):
        """One row per sampling request at position ``e - 1``, attending to itself only (its K/V
        go to slot 0 of its first block in the depth's cache, which nothing else reads)."""
        step, device, num_sampling = batch.step, batch.hidden.device, batch.num_sampling_requests
        block_size = self.controller.config.block_size_tokens
        real = ends[:num_sampling] > 0  # [n_s] bool: False for padding requests of a graph batch
        block_table = step.attention.block_table[:num_sampling]
        metadata = AttentionMetadata(
            query_start_loc=torch.arange(num_sampling + 1, dtype=torch.int32, device=device),
            seq_lens=real.to(torch.int32),
            slot_mapping=torch.where(real, block_table[:, 0].long() * block_size, -1),
            block_table=block_table,
            positions=torch.zeros(num_sampling, dtype=torch.int64, device=device),
            num_actual_tokens=num_sampling,
            max_query_len=1,
            max_seq_len=1,
        )
        hidden = batch.hidden[batch.last_accepted_rows[:num_sampling].clamp(min=0)]  # [n_s, H]
        return hidden, torch.arange(num_sampling, device=device), ends[:num_sampling] - 1, metadata

    def _advance_windows(self, batch: DraftBatch, ends: torch.Tensor) -> None:
        """Next window start on the device: ``w = max(0, min(e, V - S))``, where ``V`` counts the
        tokens known there (the prompt chunk, or the verified tokens and the bonus)."""
        samples = torch.arange(batch.num_requests, device=ends.device) < batch.num_sampling_requests
        known_tokens = ends + samples.long()  # [G] int64, V
        self._window_start[batch.write_rows] = torch.minimum(ends, known_tokens - self.num_speculative_tokens).clamp(min=0)

    def _update_hidden_ring(self, batch: DraftBatch, ends, first, main_start) -> None:
        """Keep the decoder hidden of each request's last ``S`` accepted positions."""
        ring, device = self._ring_size, batch.hidden.device
        positions = ends[:, None] - ring + torch.arange(ring, device=device)[None, :]  # [G, ring]
        valid = positions >= first[:, None]
        step_rows = (main_start[:, None] + positions - first[:, None]).clamp(0, batch.hidden.shape[0] - 1)
        slots = positions.clamp(min=0) % ring
        table_rows = batch.write_rows[:, None].expand(-1, ring)
        old = self._hidden_ring[table_rows, slots]  # [G, ring, H]
        self._hidden_ring[table_rows, slots] = torch.where(valid[..., None], batch.hidden[step_rows], old)
