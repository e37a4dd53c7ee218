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

Draft tokens are sampled with the request's own parameters and the target's noise for that
position (see ``sampling.py``), which couples draft and target samples: greedy requests draft
the MTP argmax, sampled requests draft what the target would most likely draw.
"""

from typing import Dict, Sequence

import torch

from mtp_ctrl.controllers.proposers import DraftBatch, Proposer
from mtp_ctrl.controllers.sampling import sample_tokens
from mtp_ctrl.state.attention_metadata import AttentionMetadata
from mtp_ctrl.state.step_metadata import StepMetadata


class MTPProposer(Proposer):
    def __init__(self, mode: str = "paged"):
        if mode not in ("paged", "single_position"):
            raise ValueError(f"mode must be 'paged' or 'single_position', got {mode!r}")
        self.mode = mode
        self._window_starts: Dict[int, int] = {}  # request id -> w (host)

    def bind(self, controller) -> None:
        super().bind(controller)
        runner, context = controller.runner, controller.context
        self.num_speculative_tokens = controller.config.num_speculative_tokens
        if self.num_speculative_tokens > runner.mtp_num_layers:
            raise ValueError(
                f"num_speculative_tokens ({self.num_speculative_tokens}) exceeds the model's MTP depth "
                f"({runner.mtp_num_layers})"
            )
        table, S = context.table, self.num_speculative_tokens
        self._ring_size = max(S, 1)
        hidden_size = runner.model.config.hidden_size
        dtype = context.kv_caches[0][0].dtype
        # [R, max_model_len + 2S + 2] int64: verified tokens by position, then this step's drafts
        self._token_history = table.add_device_rows("mtp_token_history", (context.max_model_len + 2 * S + 2,), torch.int64)
        # [R, ring, H]: decoder hidden of the last accepted positions (position p at p % ring)
        self._hidden_ring = table.add_device_rows("mtp_hidden_ring", (self._ring_size, hidden_size), dtype)

    # ----- host bookkeeping ----------------------------------------------------------------

    def on_step_committed(self, step: StepMetadata, accepted_counts: Sequence[int]) -> None:
        """Advance each request's window start: ``w = min(e, V - S)``, where ``V`` counts the
        tokens known on the device (prompt chunk, or verified tokens plus the bonus)."""
        S, num_sampling = self.num_speculative_tokens, step.num_sampling_requests
        query_lengths = (step.host_query_start_loc[1:] - step.host_query_start_loc[:-1]).tolist()
        first_positions = step.host_first_positions.tolist()
        for index, request_id in enumerate(step.request_ids):
            end = first_positions[index] + query_lengths[index]
            if index < step.num_decode:
                end -= S - accepted_counts[index]
            known_tokens = end + 1 if index < num_sampling else end
            self._window_starts[request_id] = max(0, min(end, known_tokens - S))

    def forget(self, request_id: int) -> None:
        self._window_starts.pop(request_id, None)

    # ----- drafting ------------------------------------------------------------------------

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        step, S = batch.step, self.num_speculative_tokens
        device = batch.hidden.device
        num_requests, num_sampling = step.num_requests, batch.num_sampling_requests
        first_positions = step.host_first_positions  # [n] int64 (CPU)
        query_lengths = step.host_query_start_loc[1:] - step.host_query_start_loc[:-1]  # [n] int64 (CPU)
        starts = torch.tensor([self._window_starts.get(rid, 0) for rid in step.request_ids], dtype=torch.int64)
        host_layout = torch.stack((first_positions, query_lengths, starts, step.host_query_start_loc[:-1]))
        first, qlen, window_start, main_start = host_layout.to(device, non_blocking=True)  # [n] int64 each

        # end of the verified span per request: decodes drop their rejected rows
        rewinds = torch.zeros(num_requests, dtype=torch.int64, device=device)  # [n]
        rewinds[: step.num_decode] = S - batch.accepted_counts[: step.num_decode]
        ends = first + qlen - rewinds  # [n] int64, e
        self._record_verified_tokens(batch, ends)
        if self.mode == "paged":
            window_sizes = first_positions + query_lengths - starts  # [n] int64 (CPU), e - w at most
            hidden, rows, positions, metadata = self._paged_window(
                batch, ends, first, window_start, main_start, window_sizes)
        else:
            hidden, rows, positions, metadata = self._single_position_rows(batch, ends)
        last_rows = metadata.query_start_loc[1 : num_sampling + 1].long() - 1  # [n_s] each request's row at e - 1
        drafts = torch.empty(num_sampling, S, dtype=torch.int64, device=device)  # [n_s, S]
        request_rows = torch.arange(num_sampling, device=device)
        runner, controller = self.controller.runner, self.controller
        for depth in range(S):
            history_index = (positions + depth + 1).clamp(min=0)  # [Tm] position of t_{i+k+1}
            tokens = self._token_history[rows, history_index]  # [Tm] int64
            logits, hidden = runner.mtp_forward(depth, hidden, tokens, positions.clamp(min=0), metadata,
                                                self.controller.context.kv_caches)
            draft_positions = ends[:num_sampling] + depth + 1  # [n_s] position each draft will occupy
            drafts[:, depth] = controller.sample_rows(logits[last_rows], request_rows, draft_positions)
            self._token_history[request_rows, draft_positions] = drafts[:, depth]
        if self.mode == "paged":
            self._update_hidden_ring(batch, ends, first, main_start)
        return drafts

    def _record_verified_tokens(self, batch: DraftBatch, ends: torch.Tensor) -> None:
        """Write this step's input rows at their positions, then each bonus token at ``e``.
        Rejected drafts land past ``e`` and are overwritten by the new drafts."""
        step = batch.step
        rows = step.attention.num_actual_tokens
        row_requests = torch.repeat_interleave(  # [t] int64 request of each real row
            torch.arange(step.num_requests), step.host_query_start_loc[1:] - step.host_query_start_loc[:-1]
        ).to(batch.hidden.device, non_blocking=True)
        self._token_history[row_requests, step.attention.positions[:rows]] = step.input_ids[:rows]
        num_sampling = batch.num_sampling_requests
        sampling_rows = torch.arange(num_sampling, device=ends.device)
        self._token_history[sampling_rows, ends[:num_sampling]] = batch.next_tokens[:num_sampling]

    def _paged_window(self, batch, ends, first, window_start, main_start, sizes):
        """Rows for positions ``[w, e)`` of every request, right-aligned in ``sizes`` rows (the
        host's bound ``first + query_length - w`` on ``e - w``; rows before ``w`` are masked)."""
        step, device = batch.step, batch.hidden.device
        block_size = self.controller.config.block_size_tokens
        query_start_loc = torch.zeros(step.num_requests + 1, dtype=torch.int32)  # [n + 1] int32 (CPU)
        torch.cumsum(sizes, 0, out=query_start_loc[1:])
        row_count = int(query_start_loc[-1])
        rows_host = torch.repeat_interleave(torch.arange(step.num_requests), sizes)  # [Tm] int64
        from_end_host = query_start_loc[1:].long()[rows_host] - 1 - torch.arange(row_count)  # [Tm] distance to e - 1
        rows, from_end, query_start_loc = (
            t.to(device, non_blocking=True) for t in (rows_host, from_end_host, query_start_loc))
        positions = ends[rows] - 1 - from_end  # [Tm] int64, may be < w (then masked) or < 0
        valid = positions >= window_start[rows]
        safe_positions = positions.clamp(min=0)
        block_table = step.attention.block_table
        block_ids = block_table[rows, safe_positions // block_size].long()
        slot_mapping = torch.where(valid, block_ids * block_size + safe_positions % block_size, -1)  # [Tm] int64
        # depth 0 input: this step's decoder rows for positions >= first, the ring before that
        from_step = positions >= first[rows]
        step_rows = (main_start[rows] + positions - first[rows]).clamp(0, batch.hidden.shape[0] - 1)
        ring_hidden = self._hidden_ring[rows, safe_positions % self._ring_size]  # [Tm, H]
        hidden = torch.where(from_step[:, None], batch.hidden[step_rows], ring_hidden)  # [Tm, H]
        metadata = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=ends.to(torch.int32),
            slot_mapping=slot_mapping,
            block_table=block_table[: step.num_requests],
            positions=safe_positions,
            num_actual_tokens=row_count,
            max_query_len=int(sizes.max()) if step.num_requests else 0,
            max_seq_len=step.attention.max_seq_len,
        )
        return hidden, rows, positions, metadata

    def _single_position_rows(self, batch, ends):
        """One row per sampling request at position ``e - 1``, attending to itself only (its K/V
        go to slot 0 of its first block in the depth's cache, which nothing else reads)."""
        step, device = batch.step, batch.hidden.device
        num_sampling = batch.num_sampling_requests
        block_size = self.controller.config.block_size_tokens
        rows = torch.arange(num_sampling, device=device)  # [n_s]
        block_table = step.attention.block_table[:num_sampling]
        metadata = AttentionMetadata(
            query_start_loc=torch.arange(num_sampling + 1, dtype=torch.int32, device=device),
            seq_lens=torch.ones(num_sampling, dtype=torch.int32, device=device),
            slot_mapping=block_table[:, 0].long() * block_size,
            block_table=block_table,
            positions=torch.zeros(num_sampling, dtype=torch.int64, device=device),
            num_actual_tokens=num_sampling,
            max_query_len=1,
            max_seq_len=1,
        )
        hidden = batch.hidden[batch.last_accepted_rows[:num_sampling]]  # [n_s, H]
        return hidden, rows, ends[:num_sampling] - 1, metadata

    def _update_hidden_ring(self, batch, ends, first, main_start):
        """Keep the decoder hidden of each request's last ``ring`` accepted positions."""
        ring, device = self._ring_size, batch.hidden.device
        num_requests = ends.shape[0]
        positions = ends[:, None] - ring + torch.arange(ring, device=device)[None, :]  # [n, ring]
        valid = positions >= first[:, None]
        step_rows = (main_start[:, None] + positions - first[:, None]).clamp(0, batch.hidden.shape[0] - 1)
        slots = positions.clamp(min=0) % ring
        request_rows = torch.arange(num_requests, device=device)[:, None].expand(-1, ring)
        old = self._hidden_ring[request_rows, slots]  # [n, ring, H]
        self._hidden_ring[request_rows, slots] = torch.where(valid[..., None], batch.hidden[step_rows], old)
