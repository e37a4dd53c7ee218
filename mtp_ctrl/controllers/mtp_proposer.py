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

Every index comes from device tensors with shapes fixed by the step's grid and token count (a
decode request gets ``2S`` window rows, the most a decode window spans; a prefill chunk of ``q``
rows at most ``q + S``), so any padded step, with or without prefill chunks, can be captured in
a CUDA graph.

Draft tokens are sampled with the request's own parameters and the target's noise for that
position (see ``sampling.py``), which couples draft and target samples: greedy requests draft
the MTP argmax, sampled requests draft what the target would most likely draw. With
``acceptance="rejection"`` each depth also records the distribution ``q`` it drew from (the same
filtered softmax, ``[R + 1, S, V]`` float32 rows that follow their request), which the next
step's rejection sampling reads (``controllers/acceptance.py``).
"""

from typing import NamedTuple, Optional

import torch

from mtp_ctrl.controllers.acceptance import RequestSampling
from mtp_ctrl.controllers.proposers import DraftBatch, Proposer
from mtp_ctrl.state.attention_metadata import AttentionMetadata


class _DraftLayout(NamedTuple):
    """Where a step's requests and their draft windows sit (device tensors; G requests, T rows,
    Tm window rows: a bound fixed by the step's shape, rows past the real ones are padding)."""

    first: torch.Tensor  # [G] int64, position of each request's first row this step
    main_start: torch.Tensor  # [G] int64, its first packed row
    history_rows: torch.Tensor  # [T] int64, table row of each packed row (scratch for padding rows)
    window_start: torch.Tensor  # [G] int64, w: the first window position of each request
    window_query_start_loc: torch.Tensor  # [G + 1] int32, window rows per request (paged mode)
    window_rows: torch.Tensor  # [Tm] int64, the request of each window row (clamped for padding rows)
    in_window: torch.Tensor  # [Tm] bool, the row belongs to a request's window
    window_from_end: torch.Tensor  # [Tm] int64, distance of each window row to the row at e - 1
    max_window_rows: int  # a bound on any request's window rows


class MTPProposer(Proposer):
    def __init__(self, mode: str = "paged"):
        if mode not in ("paged", "single_position"):
            raise ValueError(f"mode must be 'paged' or 'single_position', got {mode!r}")
        self.mode = mode

    def bind(self, controller) -> None:
        super().bind(controller)
        runner, context = controller.runner, controller.context
        S = self.num_speculative_tokens = controller.config.num_speculative_tokens
        if S > runner.mtp_num_layers:
            raise ValueError(f"num_speculative_tokens ({S}) exceeds the model's MTP depth ({runner.mtp_num_layers})")
        table = context.table
        self._ring_size = S
        self._history_len = context.max_model_len + 2 * S + 2
        self._scratch_row = table.scratch_row
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

    # ----- drafting ------------------------------------------------------------------------

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        S, device, num_requests = self.num_speculative_tokens, batch.hidden.device, batch.num_requests
        layout = self._layout(batch)
        ends = batch.bonus_positions  # [G] int64, e: the bonus token's position
        self._record_verified_tokens(batch, ends, layout)
        if self.mode == "paged":
            hidden, positions, history_rows, metadata = self._paged_window(batch, ends, layout)
        else:
            hidden, positions, history_rows, metadata = self._single_position_rows(batch, ends)
        last_rows = metadata.query_start_loc[1:].long() - 1  # [G] each request's row at e - 1
        sampling_rows = torch.arange(num_requests, device=device)
        draft_write_rows = torch.where(batch.samples, batch.write_rows, self._scratch_row)  # [G] int64
        drafts = torch.empty(num_requests, S, dtype=torch.int64, device=device)  # [G, S]
        kv_caches, row_positions = self.controller.context.kv_caches, positions.clamp(min=0)
        for depth in range(S):
            token_index = (positions + depth + 1).clamp(0, self._history_len - 1)  # [Tm] position of t_{i+k+1}
            tokens = self._token_history[history_rows, token_index]  # [Tm] int64
            logits, hidden = self.controller.runner.mtp_forward(depth, hidden, tokens, row_positions,
                                                                metadata, kv_caches, logits_rows=last_rows)
            draft_positions = (ends + depth + 1).clamp(0, self._history_len - 1)  # [G]
            drafts[:, depth] = self.controller.sample_rows(logits, sampling_rows, draft_positions)  # [G, V] logits
            if self._draft_probs is not None:  # q: the same filtered softmax the draft was drawn from
                self._draft_probs[draft_write_rows, depth] = self._sampling.probs(logits, sampling_rows)
            self._token_history[draft_write_rows, draft_positions] = drafts[:, depth]
        self._advance_windows(batch, ends)
        if self.mode == "paged":
            self._update_hidden_ring(batch, ends, layout)
        return drafts

    def _layout(self, batch: DraftBatch) -> _DraftLayout:
        """Derived on the device from the step's staged rows, with shapes fixed by the step's grid
        and token count, so a padded step can be captured. A decode request's window has ``2S``
        rows (the most it spans); a prefill chunk's covers ``[w, e)``, at most ``q + S`` rows."""
        step, device, S = batch.step, batch.hidden.device, self.num_speculative_tokens
        num_requests, num_rows = batch.num_requests, step.input_ids.shape[0]  # G, T
        request_index = torch.arange(num_requests, device=device)
        query_start_loc = step.attention.query_start_loc.long()  # [G + 1]
        main_start, query_lengths = query_start_loc[:-1], query_start_loc[1:] - query_start_loc[:-1]
        first = batch.first_positions  # [G] int64 (padding requests: their row's stale length, unused)
        is_decode = request_index < step.device_num_decode
        # w: the device's, kept by _advance_windows; a prompt's first chunk starts at 0 (the row may
        # hold a previous request's value)
        window_start = torch.where(first == 0, 0, self._window_start[batch.write_rows])
        is_real = request_index < step.num_active
        sizes = torch.where(is_decode, 2 * S, torch.where(is_real, first + query_lengths - window_start, 0))
        window_query_start_loc = torch.zeros(num_requests + 1, dtype=torch.int64, device=device)
        torch.cumsum(sizes, 0, out=window_query_start_loc[1:])
        if step.decode_only:
            num_window_rows, max_window_rows = num_requests * 2 * S, 2 * S
        elif step.graph_padded:  # a bound that holds for every step the graph replays
            num_window_rows, max_window_rows = num_rows + num_requests * S, num_rows + S
        else:  # eager: the host's longest chunk bounds the windows (the attention grid follows it)
            longest_chunk = int(step.host_query_lengths.max())  # host-ok: host tensor
            num_window_rows, max_window_rows = num_rows + num_requests * S, max(2 * S, longest_chunk + S)
        window_index = torch.arange(num_window_rows, device=device)
        window_rows = torch.searchsorted(window_query_start_loc[1:], window_index, right=True).clamp(max=num_requests - 1)
        row_index = torch.arange(num_rows, device=device)
        row_requests = torch.searchsorted(query_start_loc[1:], row_index, right=True).clamp(max=num_requests - 1)
        history_rows = torch.where(row_index < query_start_loc[-1], batch.write_rows[row_requests], self._scratch_row)
        return _DraftLayout(
            first, main_start, history_rows, window_start, window_query_start_loc.to(torch.int32), window_rows,
            window_index < window_query_start_loc[-1], window_query_start_loc[1:][window_rows] - 1 - window_index,
            max_window_rows)

    def _record_verified_tokens(self, batch: DraftBatch, ends: torch.Tensor, layout: _DraftLayout) -> None:
        """Write this step's input rows at their positions, then each bonus token at ``e``.
        Rejected drafts land past ``e`` and are overwritten by the new drafts."""
        step, num_rows = batch.step, layout.history_rows.shape[0]
        self._token_history[layout.history_rows, step.attention.positions[:num_rows]] = step.input_ids[:num_rows]
        bonus_rows = torch.where(batch.samples, batch.write_rows, self._scratch_row)
        self._token_history[bonus_rows, ends.clamp(0, self._history_len - 1)] = batch.next_tokens

    def _paged_window(self, batch: DraftBatch, ends, layout: _DraftLayout):
        """Rows for positions ``[w, e)`` of every request, right-aligned in its window rows; rows
        before ``w`` and padding rows are masked (no KV write, output unused)."""
        step = batch.step
        block_size = self.controller.config.block_size_tokens
        first, main_start, rows = layout.first, layout.main_start, layout.window_rows
        # [Tm] int64, may be < w (then masked) or < 0; -1 for padding rows
        positions = torch.where(layout.in_window, ends[rows] - 1 - layout.window_from_end, -1)
        valid = positions >= layout.window_start[rows]
        safe_positions = positions.clamp(min=0)
        block_table = step.attention.block_table[: batch.num_requests]
        block_ids = block_table[rows, safe_positions // block_size].long()
        slot_mapping = torch.where(valid, block_ids * block_size + safe_positions % block_size, -1)  # [Tm] int64
        history_rows = torch.where(layout.in_window, batch.write_rows[rows], self._scratch_row)  # [Tm] int64
        # depth 0 input: this step's decoder rows for positions >= first, the ring before that
        from_step = positions >= first[rows]
        step_rows = (main_start[rows] + positions - first[rows]).clamp(0, batch.hidden.shape[0] - 1)
        ring_hidden = self._hidden_ring[history_rows, safe_positions % self._ring_size]  # [Tm, H]
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
        return hidden, positions, history_rows, metadata

    def _single_position_rows(self, batch: DraftBatch, ends):
        """One row per request at position ``e - 1``, attending to itself only (its K/V go to slot
        0 of its first block in the depth's cache, which nothing else reads); rows of requests
        that did not sample are masked."""
        step, device, num_requests = batch.step, batch.hidden.device, batch.num_requests
        block_size = self.controller.config.block_size_tokens
        block_table = step.attention.block_table[:num_requests]
        metadata = AttentionMetadata(
            query_start_loc=torch.arange(num_requests + 1, dtype=torch.int32, device=device),
            seq_lens=batch.samples.to(torch.int32),
            slot_mapping=torch.where(batch.samples, block_table[:, 0].long() * block_size, -1),
            block_table=block_table,
            positions=torch.zeros(num_requests, dtype=torch.int64, device=device),
            num_actual_tokens=num_requests,
            max_query_len=1,
            max_seq_len=1,
        )
        hidden = batch.hidden[batch.last_accepted_rows.clamp(min=0)]  # [G, H]
        history_rows = torch.where(batch.samples, batch.write_rows, self._scratch_row)
        return hidden, ends - 1, history_rows, metadata

    def _advance_windows(self, batch: DraftBatch, ends: torch.Tensor) -> None:
        """Next window start on the device: ``w = max(0, min(e, V - S))``, where ``V`` counts the
        tokens known there (the prompt chunk, or the verified tokens and the bonus)."""
        known_tokens = ends + batch.samples.long()  # [G] int64, V
        self._window_start[batch.write_rows] = torch.minimum(ends, known_tokens - self.num_speculative_tokens).clamp(min=0)

    def _update_hidden_ring(self, batch: DraftBatch, ends, layout: _DraftLayout) -> None:
        """Keep the decoder hidden of each request's last ``S`` accepted positions."""
        ring, device, first, main_start = self._ring_size, batch.hidden.device, layout.first, layout.main_start
        positions = ends[:, None] - ring + torch.arange(ring, device=device)[None, :]  # [G, ring]
        valid = positions >= first[:, None]
        step_rows = (main_start[:, None] + positions - first[:, None]).clamp(0, batch.hidden.shape[0] - 1)
        slots = positions.clamp(min=0) % ring
        table_rows = batch.write_rows[:, None].expand(-1, ring)
        old = self._hidden_ring[table_rows, slots]  # [G, ring, H]
        self._hidden_ring[table_rows, slots] = torch.where(valid[..., None], batch.hidden[step_rows], old)
