"""EAGLE drafting: one draft head (:func:`mtp_ctrl.models.build_eagle_head`) applied S times.

After a step verified tokens up to the bonus token ``t_e`` (the last accepted row sits at position
``e - 1``), the head entry at position ``p`` (its K/V in the head's own paged cache) is final
once ``t_{p+1}`` is verified: it reads the target's aux hidden states at ``p`` and the embedding
of ``t_{p+1}``. So every step:

1. Draft step 1 runs over this step's own packed rows, shifted by one token as the input kernel
   :func:`~mtp_ctrl.triton_ops.copy_and_expand_eagle_inputs` lays them out (shift mode, one
   slot per request): row ``p`` gets ``t_{p+1}`` (the next input row, the bonus token at the last
   accepted row, the next prompt token at the end of a chunk that does not end its prompt), and
   the rows of rejected drafts are masked (no KV write). Its features are ``fc`` of this step's
   aux hidden states, row for row. The last accepted row (found by
   :func:`~mtp_ctrl.triton_ops.eagle_prepare_inputs_padded`) drafts ``d_1``. These rows rewrite
   the head's entries at positions ``[first, e)``, which the previous step may have filled from
   drafts: nothing built from a rejected draft is ever read (the windows of consecutive steps
   tile ``[0, e)``).
2. Draft step ``k > 1``: one row per request at position ``e + k - 2``, with the head's own
   output hidden state of step ``k - 1`` and the token ``d_{k-1}``; slots and sequence lengths
   advance with :func:`~mtp_ctrl.triton_ops.eagle_step_update_slot_mapping_and_metadata`. These
   entries are drafts: the next step's window rewrites them.

Worked example, S = 3, a decode step with base row at position 10 accepting 1 draft: rows at
10, 11 (accepted), 12, 13 (rejected). ``e = 12``. Step 1 writes head entries 10 and 11 (tokens
``t_11``, ``t_12`` = the bonus), masks rows 12 and 13, and drafts ``d_1`` from row 11. Step 2
writes position 12 (token ``d_1``) and drafts ``d_2``; step 3 writes position 13 and drafts
``d_3``. The next step's rows start at 12 and rewrite from there.

KV room: a draft position past the blocks the request holds (the host reserves for the verify
rows, not for drafting) goes to a small private tail of the head's cache: the head's block table
is the request's, with every unused entry (-1) pointing at one of ``ceil((S - 1) / block_size)
+ 1`` tail blocks of the request's table row. Tail blocks only ever hold draft entries.

No host sync, and shapes fixed by the step's grid and token count, so any padded step, with or
without prefill chunks, runs inside its CUDA graph (padding requests write nothing). Drafts are sampled like the MTP proposer's (the request's own parameters and the
target's noise at the draft's position).
"""

import dataclasses

import torch

from mtp_ctrl.controllers.aux_draft_proposer import AuxDraftProposer
from mtp_ctrl.controllers.draft_context import DraftContext
from mtp_ctrl.controllers.proposers import DraftBatch
from mtp_ctrl.models.eagle_head import EagleHead
from mtp_ctrl.state.attention_metadata import AttentionMetadata
from mtp_ctrl.triton_ops import (
    copy_and_expand_eagle_inputs,
    eagle_prepare_inputs_padded,
    eagle_step_update_slot_mapping_and_metadata,
)


class EagleProposer(AuxDraftProposer):
    """Serial EAGLE drafting with ``head``; pass it as the ``proposer`` argument of the controller."""

    logits_name = "eagle_draft_logits"

    def __init__(self, head: EagleHead):
        if not isinstance(head, EagleHead):
            raise TypeError(f"head must be an EagleHead (mtp_ctrl.models.build_eagle_head), got {type(head).__name__}")
        super().__init__(head)
        self.head = self.module

    def bind(self, draft_context: DraftContext) -> None:
        super().bind(draft_context)  # checks the head against the target, exposes its aux layers
        shape = draft_context.shape
        S, block_size = shape.num_speculative_tokens, shape.block_size_tokens
        self._tail_blocks = 0 if S == 1 else -(-(S - 1) // block_size) + 1
        self._max_positions = (shape.max_blocks_per_request + self._tail_blocks) * block_size
        attention = self.head.transformer_layer.self_attention.core_attention
        # every table row and the scratch row own a tail: [num_blocks + (R + 1) * tail, bs, Hkv_local, D];
        # one pair per attention layer of the head (a deeper EAGLE-3 head has several, alike)
        self._kv_caches = [pair for _ in range(self.head.num_kv_layers)
                           for pair in draft_context.allocate_kv_cache(
                               attention.num_kv_heads_local, attention.head_dim,
                               extra_blocks=(shape.max_requests + 1) * self._tail_blocks)]

    # ----- drafting ------------------------------------------------------------------------

    def prefix_cache_lookahead(self) -> int:
        """The head's entry at ``p`` (its cache lives in the target's blocks) reads ``t_{p+1}``:
        one token past a block; a request's draft rows never rewrite positions before its first
        row, so a cached prefix's entries stay as written."""
        return 1

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        self._check_aux_hidden(batch)
        S, step, runner = self.draft_context.shape.num_speculative_tokens, batch.step, self.draft_context.runner
        attention, device = step.attention, batch.hidden.device
        G = batch.num_requests  # every request of the grid drafts; rows of those not sampling are ignored
        block_table = self._head_block_table(attention.block_table, batch.write_rows)  # [G, MB + tail]
        query_start_loc = attention.query_start_loc[: G + 1]  # [G + 1]
        ends = batch.bonus_positions  # [G] int64, e

        # draft step 1: this step's rows, tokens shifted by one, rejected rows masked
        request_index = torch.arange(G, device=device)
        # [G] int64, inclusive cumsum: V drafts per decode request (the step's verify width)
        cu_num_drafts = step.verify_width * torch.minimum(request_index + 1, step.device_num_decode)
        last_rows, _ = eagle_prepare_inputs_padded(cu_num_drafts, batch.accepted_counts + 1, query_start_loc)  # [G]
        input_ids, positions, is_rejected, _, new_token_rows, _ = copy_and_expand_eagle_inputs(
            step.input_ids, attention.positions, self._next_tokens(batch), query_start_loc, last_rows,
            0, 0, 1, True)  # [T] each; new_token_rows [G]: the last accepted row of each request
        # rows past the real ones (a padded step) are left unset by the kernel: make them inert
        padding_rows = torch.arange(input_ids.shape[0], device=device) >= query_start_loc[-1]  # [T] bool
        input_ids = torch.where(padding_rows, 0, input_ids)
        positions = torch.where(padding_rows, 0, positions)
        is_rejected = is_rejected | padding_rows
        metadata = AttentionMetadata(
            query_start_loc=attention.query_start_loc, seq_lens=attention.seq_lens,
            slot_mapping=torch.where(is_rejected, -1, attention.slot_mapping), block_table=block_table,
            positions=positions, num_actual_tokens=attention.num_actual_tokens,
            max_query_len=attention.max_query_len, max_seq_len=attention.max_seq_len)
        draft_rows = new_token_rows.clamp(0, step.input_ids.shape[0] - 1)  # [G] int64 (padding requests: unset)
        features = self.head.project_aux(batch.aux_hidden)  # [T, H]
        logits, hidden = runner.eagle_forward(self.head, features, input_ids, positions, metadata, self._kv_caches,
                                              logits_rows=draft_rows)  # [G, V], [T, H]
        sampling_rows = batch.write_rows  # [G] int64: each request's table row (padding: the scratch row)
        drafts = torch.empty(G, S, dtype=torch.int64, device=device)  # [G, S]
        drafts[:, 0] = self.draft_context.sample_rows(logits, sampling_rows, ends + 1)
        self._record_draft_logits(batch, logits, 0)
        num_drafts = batch.depths(S)  # depths past D draft nothing this step (their rows are recomputed later)
        if num_drafts <= 1:
            return drafts

        # draft steps 2..S: one row per request, the head's own hidden state, one position further
        features = hidden[draft_rows]  # [G, H]
        real = batch.samples  # [G] bool: requests that did not sample (padding, a mid-prompt chunk) write nothing
        step_positions = ends - 1  # [G] int64, the previous row's position
        seq_lens = ends.clamp(min=0).to(torch.int32)  # [G] int32, grown in place each step
        one_row_each = torch.arange(G + 1, dtype=torch.int32, device=device)  # [G + 1]
        for depth in range(1, num_drafts):
            next_positions = torch.empty_like(step_positions)  # [G] int64
            slots = torch.empty_like(step_positions)  # [G] int64
            eagle_step_update_slot_mapping_and_metadata(step_positions, block_table, seq_lens, self.draft_context.shape.block_size_tokens,
                                                        self._max_positions, next_positions, slots)
            metadata = AttentionMetadata(
                query_start_loc=one_row_each, seq_lens=seq_lens, slot_mapping=torch.where(real, slots, -1),
                block_table=block_table, positions=next_positions, num_actual_tokens=G, max_query_len=1,
                max_seq_len=self._max_positions)
            logits, features = runner.eagle_forward(self.head, features, drafts[:, depth - 1], next_positions,
                                                    metadata, self._kv_caches)  # [G, V], [G, H]
            drafts[:, depth] = self.draft_context.sample_rows(logits, sampling_rows, ends + depth + 1)
            self._record_draft_logits(batch, logits, depth)
            step_positions = next_positions
        return drafts

    def on_no_drafts(self, batch: DraftBatch) -> None:
        """No request drafts: the first draft step still runs over this step's rows (the head's
        cache of verified positions must stay whole); the later ones do not."""
        self.propose(dataclasses.replace(batch, num_drafts=1))

    def _head_block_table(self, block_table: torch.Tensor, write_rows: torch.Tensor) -> torch.Tensor:
        """``[G, MB + tail]``: the requests' block table with every unused entry (-1) and the extra
        columns pointing at the request row's tail blocks (column ``c`` at tail ``c % tail``: the
        at most ``tail`` columns one step's drafts span get distinct blocks)."""
        tail = self._tail_blocks
        if tail == 0:
            return block_table
        num_requests, width = block_table.shape[0], block_table.shape[1] + tail
        columns = torch.arange(width, device=block_table.device)
        tail_ids = self.draft_context.num_kv_blocks + write_rows[:, None] * tail + columns[None, :] % tail  # [G, MB + tail]
        extended = torch.cat([block_table, block_table.new_full((num_requests, tail), -1)], dim=1)
        return torch.where(extended >= 0, extended, tail_ids.to(extended.dtype))

