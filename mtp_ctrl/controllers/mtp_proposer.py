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

Skipped windows (``skip_idle_windows``, ``InferenceConfig(mtp_idle_windows="skip")``, the
default): a decode-only step that drafts D < S runs depths ``0..D-1`` only (none when D = 0); each
depth keeps its own window start ``w_k`` (device rows ``mtp_window_start_{k}``), the ring holds
``S + M`` positions (``catch_up_positions``), and the next step that runs a skipped depth widens its
decode windows by M rows so they cover ``[w_k, e)`` again (``mtp_catch_up.py``): the same entries,
the same drafts. A step that runs D' depths starts them all at ``w_{D'-1}`` and moves that start on
for all of them (``_window_start``).

mtp_attention="single_position": each depth attends to its current row only (Megatron-LM's
inference today); no window, one row per request and depth.

Prefix caching (``prefix_cache_lookahead``, paged mode only): the depths' caches live in the
target's blocks, and a depth's entry at position ``i`` embeds ``t_{i+k+1}``, so a cached block's
key covers ``S`` tokens past it. A request that starts from ``H`` cached positions starts its
window at ``w = H`` and never moves it below ``H`` (the entries there are final and shared).

Every index comes from device tensors with shapes fixed by the step's grid and token count (a
decode request gets ``S + V`` window rows, the most a decode window spans in a step that verifies
V drafts per request; a prefill chunk of ``q``
rows at most ``q + S``), so any padded step, with or without prefill chunks, can be captured in
a CUDA graph. Two kernels do the index work (``triton_ops/mtp_window.py``): ``mtp_draft_window``
records the step's tokens and lays the windows out before the depths run, ``mtp_advance_window``
moves each request's ``w`` and hidden ring on after them.

Draft tokens are sampled with the request's own parameters and the target's noise for that
position (see ``sampling.py``), which couples draft and target samples: greedy requests draft
the MTP argmax, sampled requests draft what the target would most likely draw. With
``acceptance="rejection"`` each depth also records the logits it drew from (``[R + 1, S, V]``
float32 rows by slot, one copy a depth), which the next step's rejection sampling filters into
``q`` with the request's rule (``controllers/acceptance.py``).
"""

import dataclasses
from typing import Optional, Tuple

import torch

from mtp_ctrl.controllers.draft_context import DraftContext
from mtp_ctrl.controllers.mtp_catch_up import Entry, WindowCatchUp
from mtp_ctrl.controllers.proposers import DraftBatch, Proposer
from mtp_ctrl.state.attention_metadata import AttentionMetadata
from mtp_ctrl.state.step_metadata import StepMetadata
from mtp_ctrl.triton_ops import TokenRecord, mtp_advance_window, mtp_draft_window


class MTPProposer(Proposer):
    """``reuse_last_layer``: depths past the model's MTP layers run its last MTP layer again (a model
    that ships one MTP layer, like Qwen3-Next, then drafts S > 1 tokens), each such depth with a
    paged KV cache of its own (:meth:`bind`); how often those drafts are accepted depends on how the
    layer was trained (a layer trained only at depth 1 sees its own outputs as input)."""

    takes_ragged_rows = True  # windows read the step's rows by query_start_loc and positions
    sees_never_drafting_steps = False  # a request that never drafts needs no window, token record or ring

    def __init__(self, mode: str = "paged", reuse_last_layer: bool = False, skip_idle_windows: bool = False,
                 catch_up_positions: int = 16):
        if mode not in ("paged", "single_position"):
            raise ValueError(f"mode must be 'paged' or 'single_position', got {mode!r}")
        if not isinstance(reuse_last_layer, bool):
            raise TypeError(f"reuse_last_layer must be a bool, got {type(reuse_last_layer).__name__}")
        if not isinstance(skip_idle_windows, bool):
            raise TypeError(f"skip_idle_windows must be a bool, got {type(skip_idle_windows).__name__}")
        if isinstance(catch_up_positions, bool) or not isinstance(catch_up_positions, int) or catch_up_positions < 1:
            raise ValueError(f"catch_up_positions must be an int >= 1, got {catch_up_positions!r}")
        self.mode = mode
        self.skip_idle_windows = skip_idle_windows  # InferenceConfig.mtp_idle_windows == "skip"
        self.catch_up_positions = catch_up_positions  # M: the most positions a skipped window falls behind
        self._catch_up: Optional[WindowCatchUp] = None
        self._entry: Optional[Entry] = None  # the plan entry on_no_drafts took for the propose it calls
        self.reuse_last_layer = reuse_last_layer

    def bind(self, draft_context: DraftContext) -> None:
        super().bind(draft_context)
        runner, shape = draft_context.runner, draft_context.shape
        S = shape.num_speculative_tokens
        num_layers = runner.mtp_num_layers
        if S > num_layers and not (self.reuse_last_layer and num_layers > 0):
            raise ValueError(f"num_speculative_tokens ({S}) exceeds the model's MTP depth ({num_layers}); "
                             "reuse_last_layer=True (InferenceConfig.mtp_reuse_last_layer) runs its last MTP "
                             "layer for the deeper depths")
        # depth k runs MTP layer min(k, n - 1) through cache list k: the target's caches, where a reused
        # depth's own cache (zeroed, shaped like the last layer's, addressed by the same block ids)
        # replaces the last MTP layer's entry L + n - 1
        targets = draft_context.target_kv_caches
        self._depth_layers = [min(depth, num_layers - 1) for depth in range(S)]
        self._depth_kv_caches = [targets if depth < num_layers else
                                 list(targets[:-1]) + [_zeroed_like(targets[-1])] for depth in range(S)]
        self._history_len = shape.max_model_len + 2 * S + 2
        if self.mode == "paged" and self.skip_idle_windows:  # skipped windows, caught up later (mtp_catch_up.py)
            self._catch_up = WindowCatchUp(draft_context.scratch_row + 1, S, self.catch_up_positions)
        ring_slots = S + (self.catch_up_positions if self._catch_up is not None else 0)  # K
        # [R + 1, ...] each (last row: scratch): verified tokens by position, then the drafts;
        # decoder hidden of the last K accepted positions (position p at p % K); window start w
        self._token_history = draft_context.add_device_rows("mtp_token_history", (self._history_len,), torch.int64)
        self._hidden_ring = draft_context.add_device_rows("mtp_hidden_ring", (ring_slots, runner.hidden_size),
                                                          shape.kv_dtype)
        # [R + 1] int64 each: window starts, one per depth with skipped windows, else one (see _window_start)
        self._window_starts = [draft_context.add_device_rows(f"mtp_window_start_{depth}", (), torch.int64,
                                                             kv_start=True)
                               for depth in range(S if self._catch_up is not None else 1)]
        # [R + 1] int64: the start of a step that runs fewer than S depths (its rows' maximum), then its next start
        self._partial_window_start = torch.zeros_like(self._window_starts[0]) if self._catch_up is not None else None
        # [R + 1] int64: the first position the window may rewrite (a cached prefix's end, else 0)
        self._window_floor = draft_context.add_device_rows("mtp_window_floor", (), torch.int64, kv_start=True) \
            if draft_context.prefix_caching and self.mode == "paged" else None
        self._draft_logits = draft_context.draft_logits_rows("mtp_draft_logits")  # q (rejection acceptance only)

    def prefix_cache_lookahead(self) -> Optional[int]:
        """Paged depths: S tokens past a block (see the module docstring); single-position mode
        writes slot 0 of a request's first block, which may be shared: no reuse."""
        return self.draft_context.shape.num_speculative_tokens if self.mode == "paged" else None

    def draft_logits(self) -> Optional[torch.Tensor]:
        return None if self._draft_logits is None else self._draft_logits.rows

    # ----- skipped windows (mtp_catch_up.py) ---------------------------------------------------

    def on_admitted(self, slot: int, may_draft: bool) -> None:
        if self._catch_up is not None:
            self._catch_up.set_may_draft(slot, may_draft)

    def on_retired(self, slot: int) -> None:
        if self._catch_up is not None:  # its lags plan nothing from now on (its prompt was shared: not skipped)
            self._catch_up.set_may_draft(slot, False, admitted=False)

    def prompt_state_complete(self, may_draft: bool) -> bool:
        return may_draft or self._catch_up is None  # a step of such requests only runs no prompt window

    def plan_launch(self, step: StepMetadata) -> Optional[Tuple[Entry, ...]]:
        """With ``skip_idle_windows``: per step of the launch, the depths it runs and the extra rows
        of its decode windows (a catch-up); None otherwise."""
        return None if self._catch_up is None else self._catch_up.plan_launch(step)

    def warmup_plans(self, step: StepMetadata) -> Tuple[Optional[Tuple[Entry, ...]], ...]:
        return (None,) if self._catch_up is None else self._catch_up.warmup_plans(step)

    def use_plan(self, plan: Optional[Tuple[Entry, ...]]) -> None:
        if self._catch_up is not None:
            self._catch_up.use(plan or ())

    def _next_entry(self) -> Entry:
        S = self.draft_context.shape.num_speculative_tokens
        return (S, 0) if self._catch_up is None else self._catch_up.next_entry()

    # ----- drafting ------------------------------------------------------------------------

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        entry, self._entry = (self._next_entry() if self._entry is None else self._entry), None
        return self._propose(batch, *entry)

    def _propose(self, batch: DraftBatch, depths_run: int, catch_up_rows: int) -> torch.Tensor:
        """``depths_run`` D' (paged mode): the depths whose windows run, ``>= D``;
        ``catch_up_rows``: rows each decode window gets past ``S + V`` (windows skipped before)."""
        S, device, num_requests = self.draft_context.shape.num_speculative_tokens, batch.hidden.device, batch.num_requests
        ends = batch.bonus_positions  # [G] int64, e: the bonus token's position
        num_drafts = batch.depths(S)
        if self.mode == "paged":
            if depths_run < num_drafts:
                raise RuntimeError(f"MTPProposer: the plan runs {depths_run} depths, the step drafts {num_drafts}")
            hidden, positions, history_rows, metadata = self._paged_window(batch, depths_run, catch_up_rows)
        else:
            self._record_verified_tokens(batch)
            hidden, positions, history_rows, metadata = self._single_position_rows(batch, ends)
        last_rows = metadata.query_start_loc[1:].long() - 1  # [G] each request's row at e - 1
        sampling_rows = batch.write_rows  # [G] int64: each request's table row (padding: the scratch row)
        draft_write_rows = torch.where(batch.samples, batch.write_rows, self.draft_context.scratch_row)  # [G] int64
        drafts = torch.empty(num_requests, S, dtype=torch.int64, device=device)  # [G, S]
        runner = self.draft_context.runner
        row_positions = positions.clamp(min=0)
        rotary = runner.rotary_tables(row_positions)  # the same rows at every depth
        depth_offsets = torch.arange(1, S + 1, device=device)[:, None]  # [S, 1]
        # [S, Tm] position of t_{i+k+1} for depth k; [S, G] where draft k goes
        token_index = (positions[None, :] + depth_offsets).clamp(0, self._history_len - 1)
        draft_positions = (ends[None, :] + depth_offsets).clamp(0, self._history_len - 1)
        # depths from D on draft nothing this step; in paged mode those up to D' still run their windows
        # (no output layer) so that their caches stay final for the positions the window leaves behind
        depths_run = depths_run if self.mode == "paged" else num_drafts
        for depth in range(depths_run):
            tokens = self._token_history[history_rows, token_index[depth]]  # [Tm] int64
            drafting = depth < num_drafts
            logits, hidden = runner.mtp_forward(self._depth_layers[depth], hidden, tokens, row_positions, metadata,
                                                self._depth_kv_caches[depth],
                                                logits_rows=last_rows if drafting else last_rows[:0],
                                                rotary=rotary)  # [G, V] logits ([0, V] past D)
            if not drafting:
                continue
            drafts[:, depth] = self.draft_context.sample_rows(logits, sampling_rows, draft_positions[depth])
            if self._draft_logits is not None:  # q: what the draft was drawn from
                self._draft_logits.record(logits, draft_write_rows, depth)
            self._token_history[draft_write_rows, draft_positions[depth]] = drafts[:, depth]
        self._advance_window(batch, depths_run)
        return drafts

    def _window_start(self, depths_run: int) -> torch.Tensor:
        """``[R + 1]`` int64: where a step that runs ``depths_run`` D' depths starts, ``w_{D'-1}``.
        Row k holds the start the last step that ran exactly k + 1 depths left (a step of D' depths
        writes row ``D' - 1`` only: no copies), and a request's starts only move forward, so
        ``w_k = max(row_k, ..., row_{S-1})``: row ``S - 1`` itself for a step of every depth (the
        fixed-S steps: the same kernels as without skipping), else their maximum in a buffer of
        its own (``S - D'`` small kernels), which ``_advance_window`` then moves on and writes back."""
        rows = self._window_starts
        if depths_run >= len(rows) or depths_run == 0:
            return rows[-1]
        torch.maximum(rows[depths_run - 1], rows[depths_run], out=self._partial_window_start)
        for deeper in rows[depths_run + 1:]:
            torch.maximum(self._partial_window_start, deeper, out=self._partial_window_start)
        return self._partial_window_start

    def _advance_window(self, batch: DraftBatch, depths_run: int, move_window_start: bool = True,
                        record_tokens: bool = False) -> None:
        """The next window start of the depths that ran (the skipped ones keep theirs), and the
        decoder hidden of each request's last K positions; ``record_tokens``: the step's tokens too
        (a step that lays out no window: one launch instead of two)."""
        rows = self._window_starts
        window_start = rows[-1] if depths_run >= len(rows) or depths_run == 0 else self._partial_window_start
        record = None
        if record_tokens:
            step, num_rows = batch.step, batch.hidden.shape[0]
            record = TokenRecord(step.attention.positions[:num_rows], step.input_ids[:num_rows], batch.next_tokens,
                                 self._token_history, self.draft_context.scratch_row)
        mtp_advance_window(batch.first_positions, batch.bonus_positions, batch.write_rows, batch.samples,
                           batch.step.attention.query_start_loc[: batch.num_requests + 1], batch.hidden,
                           window_start, self._hidden_ring, self.draft_context.shape.num_speculative_tokens,
                           move_window_start=move_window_start, record=record)
        if not move_window_start:
            return
        if self._window_floor is not None:  # never below a cached prefix (stays in place: no allocation)
            torch.maximum(window_start, self._window_floor, out=window_start)
        if window_start is self._partial_window_start:  # depths 0..D'-1 start here now (row D' - 1)
            rows[depths_run - 1].copy_(window_start)

    def on_no_drafts(self, batch: DraftBatch) -> None:
        """No request drafts this step: record the step's tokens and move the window on. Paged mode
        also runs every depth over its window (no output layer), keeping every depth's cache final,
        unless ``skip_idle_windows`` and the step is decode-only: then the depths' entries at this
        step's positions are written later: the window starts stay, the ring keeps the decoder
        hidden, and the next step that runs a depth widens its window to cover ``[w_k, e)``
        (``mtp_catch_up.py``; a forced catch-up step when a request would fall more than
        ``catch_up_positions`` behind). A step with prefill chunks runs them, unless none of its
        requests ever drafts (``WindowCatchUp``: their prompt blocks are not shared): then the window
        starts move on as if the windows ran, so that a later chunk's window, run beside a request
        that drafts, spans only that chunk and ``S`` (the bound its layout is sized by)."""
        entry = self._next_entry()
        if self.mode == "paged" and entry[0] > 0:
            self._entry = entry  # propose follows this step's plan entry
            self.propose(dataclasses.replace(batch, num_drafts=0))
            return
        move = self.mode != "paged" or not batch.step.decode_only  # nothing reads those requests' entries
        self._advance_window(batch, 0, move_window_start=move, record_tokens=True)

    def _window_bounds(self, batch: DraftBatch, catch_up_rows: int) -> Tuple[int, int]:
        """(Tm, the longest window): bounds fixed by the step's shape and plan, so a padded step can
        be captured. A decode request's window has ``S + V`` rows (the most it spans: w is at most
        ``S - 1`` positions before its base row, e at most ``1 + V`` after it; ``2S`` at V = S),
        ``catch_up_rows`` more after skipped windows; a prefill chunk's covers ``[w, e)``, at most
        ``q + S`` rows."""
        step, S, num_requests = batch.step, self.draft_context.shape.num_speculative_tokens, batch.num_requests
        num_rows, extra = step.input_ids.shape[0], catch_up_rows
        if step.decode_only:
            return num_requests * (S + step.verify_width + extra), S + step.verify_width + extra
        # the bound below counts 1 + V step rows a decode request (the context keeps steps with
        # prefill chunks strided): fewer would let the windows run past it
        if int(step.host_query_start_loc[step.num_decode]) != step.num_decode * step.verify_stride:  # host-ok: CPU
            raise RuntimeError("MTPProposer: a step with prefill chunks must give each decode request 1 + V rows")
        if step.graph_padded:  # a bound that holds for every step the graph replays
            return num_rows + num_requests * (S + extra), num_rows + S + extra
        # eager: the host's longest chunk bounds the windows (the attention grid follows it)
        longest_chunk = int(step.host_query_lengths.max())  # host-ok: host tensor
        return num_rows + num_requests * (S + extra), max(2 * S + extra, longest_chunk + S)

    def _draft_window(self, batch: DraftBatch, num_window_rows: int, depths_run: int = 0, catch_up_rows: int = 0):
        """Record the step's verified tokens and lay out the windows (``mtp_draft_window``);
        returns its outputs: window query_start_loc [G + 1] int32, positions, slot mapping and
        table rows [Tm] int64, depth 0's hidden [Tm, H]."""
        step, device, num_requests = batch.step, batch.hidden.device, batch.num_requests
        attention, shape = step.attention, self.draft_context.shape
        window_query_start_loc = torch.empty(num_requests + 1, dtype=torch.int32, device=device)
        positions, slot_mapping, history_rows = torch.empty(3, num_window_rows, dtype=torch.int64, device=device)
        hidden = torch.empty(num_window_rows, batch.hidden.shape[1], dtype=batch.hidden.dtype, device=device)
        num_rows = batch.hidden.shape[0]
        mtp_draft_window(
            attention.query_start_loc[: num_requests + 1], batch.first_positions, batch.bonus_positions,
            batch.write_rows, batch.samples, step.device_num_decode, step.num_active,
            attention.positions[:num_rows], step.input_ids[:num_rows], batch.next_tokens, batch.hidden,
            attention.block_table[:num_requests], self._window_start(depths_run), self._token_history,
            self._hidden_ring,
            shape.num_speculative_tokens, shape.block_size_tokens, self.draft_context.scratch_row,
            window_query_start_loc, positions, slot_mapping, history_rows, hidden,
            decode_window_rows=shape.num_speculative_tokens + step.verify_width + catch_up_rows)
        return window_query_start_loc, positions, slot_mapping, history_rows, hidden

    def _record_verified_tokens(self, batch: DraftBatch) -> None:
        """The step's rows at their positions, then each bonus token at ``e`` (no window)."""
        self._draft_window(batch, num_window_rows=0)

    def _paged_window(self, batch: DraftBatch, depths_run: int, catch_up_rows: int):
        """Rows for positions ``[w, e)`` of every request, right-aligned in its window rows; rows
        before ``w`` and padding rows are masked (no KV write, output unused)."""
        step = batch.step
        num_window_rows, max_window_rows = self._window_bounds(batch, catch_up_rows)
        window_query_start_loc, positions, slot_mapping, history_rows, hidden = self._draft_window(
            batch, num_window_rows, depths_run, catch_up_rows)
        metadata = AttentionMetadata(
            query_start_loc=window_query_start_loc,
            seq_lens=batch.bonus_positions.clamp(min=0).to(torch.int32),
            slot_mapping=slot_mapping,
            block_table=step.attention.block_table[: batch.num_requests],
            positions=positions.clamp(min=0),
            num_actual_tokens=num_window_rows,
            max_query_len=max_window_rows,
            max_seq_len=step.attention.max_seq_len,
        )
        return hidden, positions, history_rows, metadata

    def _single_position_rows(self, batch: DraftBatch, ends):
        """One row per request at position ``e - 1``, attending to itself only (its K/V go to slot
        0 of its first block in the depth's cache, which nothing else reads); rows of requests
        that did not sample are masked."""
        step, device, num_requests = batch.step, batch.hidden.device, batch.num_requests
        block_size = self.draft_context.shape.block_size_tokens
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
        # a grid entry that samples nothing this step (padding, a prompt chunk that does not end its
        # prompt) keeps the row an earlier, larger step left it: read row 0 for it (its draft is masked)
        hidden = batch.hidden[torch.where(batch.samples, batch.last_accepted_rows, 0).clamp(min=0)]  # [G, H]
        history_rows = torch.where(batch.samples, batch.write_rows, self.draft_context.scratch_row)
        return hidden, ends - 1, history_rows, metadata


def _zeroed_like(layer_cache):
    """A zeroed cache of one attention layer's layout: a ``(key, value)`` pair or an MLA latent tensor."""
    if isinstance(layer_cache, torch.Tensor):
        return torch.zeros_like(layer_cache)
    return tuple(torch.zeros_like(part) for part in layer_cache)
