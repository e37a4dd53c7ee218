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

from typing import Optional

import torch

from mtp_ctrl.controllers.acceptance import draft_probabilities
from mtp_ctrl.controllers.proposers import DraftBatch, Proposer
from mtp_ctrl.models.eagle_head import EagleHead
from mtp_ctrl.models.runner import check_aux_layer_ids
from mtp_ctrl.state.attention_metadata import AttentionMetadata
from mtp_ctrl.triton_ops import (
    copy_and_expand_eagle_inputs,
    eagle_prepare_inputs_padded,
    eagle_step_update_slot_mapping_and_metadata,
)


def attach_draft_module(module, name: str, controller) -> None:
    """Check that an EAGLE-family draft ``module`` (``name`` in errors) fits the controller's target
    (hidden size, device, aux layers), then make the target's forward expose those aux layers."""
    runner = controller.runner
    if module.config.hidden_size != runner.model.config.hidden_size:
        raise ValueError(f"{name} hidden size {module.config.hidden_size} != the target's "
                         f"{runner.model.config.hidden_size}")
    parameter = next(module.parameters())
    if parameter.device != controller.device:
        raise ValueError(f"{name} lives on {parameter.device}, the target on {controller.device}")
    check_aux_layer_ids(module.aux_layer_ids, runner.num_decoder_layers)
    runner.set_aux_layers(module.aux_layer_ids)


class EagleProposer(Proposer):
    """Serial EAGLE drafting with ``head``; pass it as ``TextGenerationController(model, config, proposer=...)``."""

    def __init__(self, head: EagleHead):
        if not isinstance(head, EagleHead):
            raise TypeError(f"head must be an EagleHead (mtp_ctrl.models.build_eagle_head), got {type(head).__name__}")
        self.head = head.eval()

    def bind(self, controller) -> None:
        runner, context = controller.runner, controller.context
        head = self.head
        attach_draft_module(head, "head", controller)
        super().bind(controller)
        S = self.num_speculative_tokens = controller.config.num_speculative_tokens
        block_size = self._block_size = context.block_size_tokens
        self._tail_blocks = 0 if S == 1 else -(-(S - 1) // block_size) + 1
        self._num_blocks = context.num_cache_blocks  # the pool and its scratch block; tails follow
        self._scratch_row = context.table.scratch_row
        self._max_positions = (context.max_blocks_per_request + self._tail_blocks) * block_size
        attention = head.transformer_layer.self_attention.core_attention
        rows = context.table.max_requests + 1  # every table row and the scratch row own a tail
        shape = (self._num_blocks + rows * self._tail_blocks, block_size, attention.num_kv_heads_local,
                 attention.head_dim)  # [num_blocks + (R + 1) * tail, block_size, Hkv_local, D]
        dtype = runner.model.embedding.word_embeddings.weight.dtype
        self._kv_caches = [(torch.zeros(shape, dtype=dtype, device=controller.device),
                            torch.zeros(shape, dtype=dtype, device=controller.device))]
        self._draft_probs = draft_probabilities(controller, "eagle_draft_probs")  # q (rejection acceptance only)

    def draft_probs(self) -> Optional[torch.Tensor]:
        return None if self._draft_probs is None else self._draft_probs.rows

    def _record_draft_probs(self, batch: DraftBatch, logits: torch.Tensor, sampling_rows: torch.Tensor,
                            depth: Optional[int] = None) -> None:
        """q of the drafts just sampled from ``logits`` (rejection acceptance only)."""
        if self._draft_probs is not None:
            write_rows = torch.where(batch.samples, batch.write_rows, self._scratch_row)  # [G] int64
            self._draft_probs.record(logits, sampling_rows, write_rows, depth)

    # ----- drafting ------------------------------------------------------------------------

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        if batch.aux_hidden is None:
            raise RuntimeError("EagleProposer: the step carries no aux hidden states (runner.set_aux_layers was undone)")
        S, step, runner = self.num_speculative_tokens, batch.step, self.controller.runner
        attention, device = step.attention, batch.hidden.device
        G = batch.num_requests  # every request of the grid drafts; rows of those not sampling are ignored
        block_table = self._head_block_table(attention.block_table, batch.write_rows)  # [G, MB + tail]
        query_start_loc = attention.query_start_loc[: G + 1]  # [G + 1]
        ends = batch.bonus_positions  # [G] int64, e

        # draft step 1: this step's rows, tokens shifted by one, rejected rows masked
        request_index = torch.arange(G, device=device)
        cu_num_drafts = S * torch.minimum(request_index + 1, step.device_num_decode)  # [G] int64, inclusive cumsum
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
        sampling_rows = torch.arange(G, device=device)
        drafts = torch.empty(G, S, dtype=torch.int64, device=device)  # [G, S]
        drafts[:, 0] = self.controller.sample_rows(logits, sampling_rows, ends + 1)
        self._record_draft_probs(batch, logits, sampling_rows, 0)
        if S == 1:
            return drafts

        # draft steps 2..S: one row per request, the head's own hidden state, one position further
        features = hidden[draft_rows]  # [G, H]
        real = batch.samples  # [G] bool: requests that did not sample (padding, a mid-prompt chunk) write nothing
        step_positions = ends - 1  # [G] int64, the previous row's position
        seq_lens = ends.clamp(min=0).to(torch.int32)  # [G] int32, grown in place each step
        one_row_each = torch.arange(G + 1, dtype=torch.int32, device=device)  # [G + 1]
        for depth in range(1, S):
            next_positions = torch.empty_like(step_positions)  # [G] int64
            slots = torch.empty_like(step_positions)  # [G] int64
            eagle_step_update_slot_mapping_and_metadata(step_positions, block_table, seq_lens, self._block_size,
                                                        self._max_positions, next_positions, slots)
            metadata = AttentionMetadata(
                query_start_loc=one_row_each, seq_lens=seq_lens, slot_mapping=torch.where(real, slots, -1),
                block_table=block_table, positions=next_positions, num_actual_tokens=G, max_query_len=1,
                max_seq_len=self._max_positions)
            logits, features = runner.eagle_forward(self.head, features, drafts[:, depth - 1], next_positions,
                                                    metadata, self._kv_caches)  # [G, V], [G, H]
            drafts[:, depth] = self.controller.sample_rows(logits, sampling_rows, ends + depth + 1)
            self._record_draft_probs(batch, logits, sampling_rows, depth)
            step_positions = next_positions
        return drafts

    def _next_tokens(self, batch: DraftBatch) -> torch.Tensor:
        """``[G]`` int64: the token after each request's last verified row: the bonus token, or for
        a chunk that does not end its prompt (the only real request that does not sample) the
        next prompt token, which the step staged on the device."""
        step = batch.step
        request_index = torch.arange(batch.num_requests, device=batch.next_tokens.device)
        mid_prompt = (request_index < step.num_active) & ~batch.samples
        return torch.where(mid_prompt, step.next_prompt_token, batch.next_tokens)

    def _head_block_table(self, block_table: torch.Tensor, write_rows: torch.Tensor) -> torch.Tensor:
        """``[G, MB + tail]``: the requests' block table with every unused entry (-1) and the extra
        columns pointing at the request row's tail blocks (column ``c`` at tail ``c % tail``: the
        at most ``tail`` columns one step's drafts span get distinct blocks)."""
        tail = self._tail_blocks
        if tail == 0:
            return block_table
        num_requests, width = block_table.shape[0], block_table.shape[1] + tail
        columns = torch.arange(width, device=block_table.device)
        tail_ids = self._num_blocks + write_rows[:, None] * tail + columns[None, :] % tail  # [G, MB + tail]
        extended = torch.cat([block_table, block_table.new_full((num_requests, tail), -1)], dim=1)
        return torch.where(extended >= 0, extended, tail_ids.to(extended.dtype))

