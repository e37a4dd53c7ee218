"""Parallel drafting (PTD): all S drafts from ONE forward of an EAGLE head built with
``parallel_drafting=True`` (a learned ``mask_hidden`` feature and a ``mask_token_id``).

After a step verified the tokens up to the bonus token ``t_e`` (the last accepted row sits at
position ``e - 1``), the head runs once over (:func:`~mtp_ctrl.triton_ops.ptd_prepare_inputs`
lays the rows out):

- the step's verified rows, shifted by one token as in :class:`EagleProposer`'s draft step 1:
  row ``p`` has feature ``fc(aux_p)`` and token ``t_{p+1}`` (the next input row, the bonus token
  at the last accepted row, the next prompt token at the end of a chunk that does not end its
  prompt); the rows of rejected drafts are dropped;
- ``S - 1`` mask rows at positions ``e .. e + S - 2``: token ``mask_token_id``, feature
  ``mask_hidden``, slots from the head's block table.

Draft ``k`` is sampled from row ``e - 2 + k``'s logits (the last verified row, then the mask
rows), with the request's own parameters and the target's noise at the draft's position
``e + k``, like every proposer here. :mod:`mtp_ctrl.models.ptd_layout` trains the head on the
same layout (every position an anchor, mask rows seeing only the verified rows up to their anchor).

Worked example, S = 3, a decode step with base row at position 10 accepting 1 draft: rows at
10, 11 (accepted), 12, 13 (rejected). ``e = 12``. The drafting rows are 10 (token ``t_11``),
11 (``t_12``, the bonus), 12 and 13 (mask); ``d_1, d_2, d_3`` come from rows 11, 12, 13.

Why the mask rows' KV is never read as verified history: they write the head's cache at
positions ``>= e``, which are not verified yet. The head entry at position ``q`` becomes history
only once ``t_{q+1}`` is verified, and the step that verifies it has ``q`` among its own
verified rows (the windows of consecutive steps tile ``[0, e)``: each starts at the previous
``e``), so that step rewrites entry ``q`` with verified inputs before any row attends to it (a
forward writes its rows' KV before attending, and a row attends only to positions ``<=`` its
own). A mask write at ``q`` comes from a step whose ``e <= q``, an earlier step than the one
that verifies ``q``: the verified write is always the last. The same holds across chunked
prefill (a mid-prompt chunk's mask rows sit past its chunk), pausing (nothing runs) and
preemption (a re-prefill rewrites every position from 0). Draft positions past the blocks the
request holds go to the head's private tail blocks, as with :class:`EagleProposer`.

Shapes are fixed by the step's grid and token count (``T_in + G * (S - 1)`` rows: requests
with fewer verified rows leave padding rows at the end, which write nothing), there is no host
sync, and padding requests own no rows: any padded step, with or without prefill chunks, runs
inside its CUDA graph. Tensor parallelism: ``mask_hidden`` is replicated, the head shards like
:class:`EagleProposer`'s, and every rank samples the same drafts from the gathered logits.
"""

import dataclasses

import torch

from mtp_ctrl.controllers.draft_context import DraftContext
from mtp_ctrl.controllers.eagle_proposer import EagleProposer
from mtp_ctrl.controllers.proposers import DraftBatch
from mtp_ctrl.models.eagle_head import EagleHead
from mtp_ctrl.state.attention_metadata import AttentionMetadata
from mtp_ctrl.triton_ops import eagle_prepare_inputs_padded, ptd_prepare_inputs


class ParallelDraftingProposer(EagleProposer):
    """Parallel drafting with ``head`` (``build_eagle_head(target, ..., parallel_drafting=True)``);
    pass it as the ``proposer`` argument of the controller."""

    def __init__(self, head: EagleHead):
        super().__init__(head)  # TypeError unless an EagleHead
        if getattr(head, "mask_token_id", None) is None or getattr(head, "mask_hidden", None) is None:
            raise ValueError("head has no mask_token_id / mask_hidden: parallel drafting needs a head built with "
                             "build_eagle_head(..., parallel_drafting=True) (a checkpoint of examples/train_eagle.py "
                             "--mode ptd)")

    logits_name = "ptd_draft_logits"

    def bind(self, draft_context: DraftContext) -> None:
        vocab_size = draft_context.shape.vocab_size
        if not 0 <= self.head.mask_token_id < vocab_size:
            raise ValueError(f"head.mask_token_id {self.head.mask_token_id} is outside the target's vocabulary "
                             f"[0, {vocab_size})")
        super().bind(draft_context)  # the head's KV cache (with tail blocks for the mask rows), aux layers

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        self._check_aux_hidden(batch)
        S, runner, head = self.draft_context.shape.num_speculative_tokens, self.draft_context.runner, self.head
        # D depths (at least 1: the verified rows always run, the head's cache must stay whole); the
        # mask rows of depths nobody uses this step are left out
        D = max(batch.depths(S), 1)
        step = batch.step
        attention, device = step.attention, batch.hidden.device
        G = batch.num_requests  # every request of the grid drafts; rows of those not sampling are ignored
        num_input_rows = step.input_ids.shape[0]  # T_in (padded)
        num_rows = num_input_rows + G * (D - 1)  # T_out: every request's verified rows + D - 1 mask rows
        block_table = self._head_block_table(attention.block_table, batch.write_rows)  # [G, MB + tail]
        query_start_loc = attention.query_start_loc[: G + 1]  # [G + 1]
        ends = batch.bonus_positions  # [G] int64, e

        request_index = torch.arange(G, device=device)  # [G]
        # [G] int64, inclusive cumsum: V drafts per decode request (the step's verify width)
        cu_num_drafts = step.verify_width * torch.minimum(request_index + 1, step.device_num_decode)
        last_rows, _ = eagle_prepare_inputs_padded(cu_num_drafts, batch.accepted_counts + 1, query_start_loc)  # [G]
        real = request_index < step.num_active  # [G] bool; padding requests own no rows
        verified_counts = (last_rows - query_start_loc[:-1] + 1).clamp(min=0)  # [G] int64
        row_counts = torch.where(real, verified_counts + (D - 1), 0)  # [G] int64
        out_query_start_loc = torch.zeros(G + 1, dtype=torch.int32, device=device)  # [G + 1] int32
        out_query_start_loc[1:] = torch.cumsum(row_counts, 0).to(torch.int32)
        features = head.project_aux(batch.aux_hidden)  # [T_in, H]
        input_ids, positions, hidden, slots = ptd_prepare_inputs(
            step.input_ids, attention.positions, features, attention.slot_mapping, self._next_tokens(batch),
            last_rows, query_start_loc, out_query_start_loc, block_table, self.draft_context.shape.block_size_tokens, self._max_positions,
            head.mask_token_id, head.mask_hidden.detach(), num_rows)  # [T_out] x3 (+ hidden [T_out, H])
        # a request's rows sit at consecutive positions from its first row's: e + D - 1 for a sampling
        # request, and right for a chunk that stops mid-prompt too (whose bonus position is not e)
        last_ends = (batch.first_positions + row_counts).clamp(0, self._max_positions)  # [G] int64
        seq_lens = torch.where(real, last_ends, 0).to(torch.int32)  # [G] int32
        metadata = AttentionMetadata(
            query_start_loc=out_query_start_loc, seq_lens=seq_lens, slot_mapping=slots, block_table=block_table,
            positions=positions, num_actual_tokens=num_rows, max_query_len=attention.max_query_len + D - 1,
            max_seq_len=min(attention.max_seq_len + D - 1, self._max_positions))
        # draft k of request r: row out_start + verified_count - 1 + (k - 1)
        draft_rows = (out_query_start_loc[1:].to(torch.int64) - D)[:, None] + torch.arange(D, device=device)  # [G, D]
        draft_rows = draft_rows.clamp(0, num_rows - 1).flatten()  # [G * D] (padding requests: any valid row)
        logits, _ = runner.eagle_forward(head, hidden, input_ids, positions, metadata, self._kv_caches,
                                         logits_rows=draft_rows)  # [G * D, V]
        sampling_rows = batch.write_rows[:, None].expand(G, D).flatten()  # [G * D] table row of each draft
        draft_positions = (ends[:, None] + torch.arange(1, D + 1, device=device)).flatten()  # [G * D] int64
        drafts = self.draft_context.sample_rows(logits, sampling_rows, draft_positions).view(G, D)
        self._record_draft_logits(batch, logits)  # the first D depths at once
        if D < S:  # [G, S]: the columns past D are never verified
            drafts = torch.cat([drafts, drafts.new_zeros(G, S - D)], dim=1)
        return drafts

    def on_no_drafts(self, batch: DraftBatch) -> None:
        """No request drafts: the verified rows still run through the head (its cache of verified
        positions must stay whole), with no mask rows."""
        self.propose(dataclasses.replace(batch, num_drafts=1))
