"""Multi-layer EAGLE drafting: S draft layers (:func:`mtp_ctrl.models.build_multi_layer_eagle_heads`),
layer k drafts ``d_k``; every layer runs once per step over a per-request window.

After a step verified tokens up to the bonus token ``t_e`` (the last known row sits at ``e - 1``),
each request's window is the ``W = min(e, max(q, S) + S - 1)`` positions ending at ``e - 1``
(``q``: its rows this step; the module docstring of ``mtp_ctrl.models.multi_layer_eagle`` says why
that reaches far enough back). Window row ``p`` carries ``t_{p+1}`` (the next token), ``p`` and
``h^0_p`` (``fc`` of the target's aux states). The step's own rows supply the window's positions
from the step's first one to ``e - 1``; the ``shift = W - (e - first)`` rows before come from a
per-request cache of the last ``2S - 1`` window rows (device rows by table slot, which the
request keeps while it lives), with :func:`~mtp_ctrl.triton_ops.shift_and_gather_cache` and
:func:`~mtp_ctrl.triton_ops.shift_and_gather_cache_hidden`, which also refresh the cache with the
window's last ``min(W, 2S - 1)`` rows. A request's cache holds positions
``[first - min(first, 2S - 1), first)`` whenever it runs (the previous window ended at
``first - 1`` and was long enough), and a new or recomputed request starts at position 0, where
nothing is read from it.

Layer k runs over the window with tokens shifted k - 1 rows left (row p reads ``t_{p+k}``), the
rows past ``e - 1`` filled by the drafts ``d_1 .. d_{k-1}``, and the previous layer's outputs as
features; its logits at the row of ``e - 1`` give ``d_k``. It rewrites its own paged KV entries at
every window position: entries built from drafts are rewritten, final entries with the same values.

Worked example, S = 2 (windows of 2S = 4 rows for a decode, cache of 3): a decode with base row at
position 10 accepting 1 draft, rows 10, 11 (accepted), 12 (rejected); ``e = 12``. The window is
positions 8..11: 8 and 9 from the cache (``shift = 2``), 10 and 11 from the step (next tokens
``t_11``, ``t_12``). Layer 1 reads ``t_9 .. t_12`` and drafts ``d_1`` from row 11; layer 2 reads
``t_10, t_11, t_12, d_1`` and drafts ``d_2``. The cache keeps positions 9..11.

No host sync, and shapes fixed by the step's grid and token count (``T + G (S - 1)`` window rows for
a decode-only step, ``T + G (2S - 2)`` with prefill chunks; rows past the windows are padding that
writes nothing), so any padded step, mixed prefill steps included, runs inside its CUDA graph.
Drafts are sampled like the other proposers' (the request's own parameters and the target's
noise at the draft's position).
"""


import dataclasses

import torch

from mtp_ctrl.controllers.aux_draft_proposer import AuxDraftProposer
from mtp_ctrl.controllers.draft_context import DraftContext
from mtp_ctrl.controllers.proposers import DraftBatch
from mtp_ctrl.models.multi_layer_eagle import MultiLayerEagleHeads
from mtp_ctrl.state.attention_metadata import AttentionMetadata
from mtp_ctrl.triton_ops import shift_and_gather_cache, shift_and_gather_cache_hidden


class MultiLayerEagleProposer(AuxDraftProposer):
    """Drafts with ``heads`` (one layer per draft); pass it as the ``proposer`` argument of the
    controller, with ``num_speculative_tokens == heads.num_layers``."""

    module_name = "heads"
    logits_name = "multi_layer_eagle_draft_logits"

    def __init__(self, heads: MultiLayerEagleHeads):
        if not isinstance(heads, MultiLayerEagleHeads):
            raise TypeError("heads must be MultiLayerEagleHeads (mtp_ctrl.models.build_multi_layer_eagle_heads), "
                            f"got {type(heads).__name__}")
        super().__init__(heads)
        self.heads = self.module

    def bind(self, draft_context: DraftContext) -> None:
        shape, heads = draft_context.shape, self.heads
        S = shape.num_speculative_tokens
        if S != heads.num_layers:
            raise ValueError(f"num_speculative_tokens ({S}) must equal the number of draft layers of the heads "
                             f"({heads.num_layers}): layer k drafts token k")
        super().bind(draft_context)  # checks the heads against the target, exposes their aux layers
        self._cache_rows = 2 * S - 1  # MAX_SHIFT: the most window rows a step takes from the cache
        # [R + 1, 2S - 1] int64 / [R + 1, 2S - 1, H]: the last window rows of each request (oldest first)
        self._cached_tokens, self._cached_positions, self._cached_features = (
            draft_context.add_device_rows(f"multi_layer_eagle_{name}", (self._cache_rows, *row_shape), dtype)
            for name, row_shape, dtype in (("tokens", (), torch.int64), ("positions", (), torch.int64),
                                           ("features", (draft_context.runner.hidden_size,), shape.kv_dtype)))
        attention = heads.layers[0].transformer_layer.self_attention.core_attention
        # a [blocks, bs, Hkv_local, D] pair per layer
        self._kv_caches = [draft_context.allocate_kv_cache(attention.num_kv_heads_local, attention.head_dim)
                           for _ in range(S)]

    # ----- drafting ------------------------------------------------------------------------

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        self._check_aux_hidden(batch)
        S, step, runner = self.draft_context.shape.num_speculative_tokens, batch.step, self.draft_context.runner
        G, device = batch.num_requests, batch.hidden.device
        window = self._window(batch)
        tokens, positions, features = self._shift_in_cache(batch, window)  # [Tw], [Tw], [Tw, H]
        attention = step.attention
        metadata = AttentionMetadata(
            query_start_loc=window["query_start_loc"].to(torch.int32), seq_lens=window["seq_lens"],
            slot_mapping=self._slots(attention.block_table, window, positions), block_table=attention.block_table,
            positions=positions, num_actual_tokens=tokens.shape[0], max_query_len=window["max_rows"],
            max_seq_len=attention.max_seq_len)
        draft_rows, is_draft_row, owners = window["draft_rows"], window["is_draft_row"], window["owners"]
        sampling_rows = batch.write_rows  # [G] int64: each request's table row (padding: the scratch row)
        ends = batch.bonus_positions  # [G] int64, e
        drafts = torch.empty(G, S, dtype=torch.int64, device=device)  # [G, S]
        # layers from D on draft nothing this step: they still run over their window (each keeps its own
        # cache final for the positions the window leaves behind) but skip the output layer and sampling;
        # their rows at e - 1 read a stand-in token (that entry is rewritten next step)
        num_drafts = batch.depths(S)
        for depth, layer in enumerate(self.heads.layers):
            drafting = depth < num_drafts
            logits, features = runner.eagle_forward(  # [G, V] ([0, V] past D), [Tw, H]
                layer, features, tokens, positions, metadata, self._kv_caches[depth],
                logits_rows=draft_rows if drafting else draft_rows[:0])
            if drafting:
                drafts[:, depth] = self.draft_context.sample_rows(logits, sampling_rows, ends + depth + 1)
                self._record_draft_logits(batch, logits, depth)
            if depth + 1 < S:  # the next layer reads one token further: shift left, d_{depth+1} at e - 1
                shifted = torch.cat([tokens[1:], tokens[-1:]])  # [Tw] int64
                tokens = torch.where(is_draft_row, drafts[owners, depth], shifted) if drafting else shifted
        return drafts

    def on_no_drafts(self, batch: DraftBatch) -> None:
        """No request drafts: every layer still runs over its window (its cache), none samples."""
        self.propose(dataclasses.replace(batch, num_drafts=0))

    def _window(self, batch: DraftBatch) -> dict:
        """Each request's window (device tensors; ``Tw`` rows, a bound fixed by the step's shape)."""
        S, step = self.draft_context.shape.num_speculative_tokens, batch.step
        attention, device = step.attention, batch.hidden.device
        G, T = batch.num_requests, step.input_ids.shape[0]
        query_start_loc = attention.query_start_loc[: G + 1].long()  # [G + 1]
        lengths = query_start_loc[1:] - query_start_loc[:-1]  # [G] int64, 0 for padding requests
        real = lengths > 0  # [G] bool
        first, ends = batch.first_positions, batch.bonus_positions  # [G] int64 each
        known = torch.where(real, ends - first, 0)  # [G] int64: rows whose next token is known (to e - 1)
        rows = torch.where(real, torch.minimum(ends, lengths.clamp(min=S) + S - 1), 0)  # [G] int64, W
        window_start_loc = torch.zeros(G + 1, dtype=torch.int64, device=device)  # [G + 1]
        window_start_loc[1:] = torch.cumsum(rows, 0)
        # a bound on the window rows: max(q, S) + S - 1 per request, q = 1 + V for a decode
        if step.decode_only:
            max_rows = max(step.verify_stride, S) + S - 1
            num_rows = G * max_rows  # Tw
        else:
            num_rows = T + 2 * G * (S - 1)  # Tw (max(q, S) <= q + S - 1 for q >= 1)
            max_rows = max(attention.max_query_len, S) + S - 1
        row_index = torch.arange(num_rows, device=device)  # [Tw]
        owners = torch.searchsorted(window_start_loc[1:], row_index, right=True).clamp(max=max(G - 1, 0))  # [Tw]
        in_window = row_index < window_start_loc[-1]  # [Tw] bool
        draft_rows = (window_start_loc[1:] - 1).clamp(0, max(num_rows - 1, 0))  # [G] int64: the row of e - 1
        return dict(query_start_loc=window_start_loc, rows=rows, known=known, shifts=rows - known,
                    cached_lens=torch.where(real, first.clamp(0, self._cache_rows), 0),
                    seq_lens=torch.where(real, ends, 0).to(torch.int32), first=first, step_starts=query_start_loc[:-1],
                    owners=owners, in_window=in_window, draft_rows=draft_rows,
                    is_draft_row=in_window & (row_index == window_start_loc[1:][owners] - 1),
                    max_rows=min(max_rows, num_rows), num_rows=num_rows)

    def _shift_in_cache(self, batch: DraftBatch, window: dict):
        """The windows' next tokens, positions and ``h^0`` ``([Tw], [Tw], [Tw, H])``; refreshes the caches."""
        step, G = batch.step, batch.num_requests
        device, num_rows = batch.hidden.device, window["num_rows"]
        owners, in_window, known = window["owners"], window["in_window"], window["known"]
        window_start_loc = window["query_start_loc"]
        # src layout: a window's first `known` rows are the step's rows (the kernel shifts them right)
        local = torch.arange(num_rows, device=device) - window_start_loc[:-1][owners]  # [Tw] int64
        step_rows = (window["step_starts"][owners] + local).clamp(0, step.input_ids.shape[0] - 1)  # [Tw] int64
        next_in_step = (step_rows + 1).clamp(max=step.input_ids.shape[0] - 1)
        is_last_known = local == known[owners] - 1
        src_tokens = torch.where(is_last_known, self._next_tokens(batch)[owners], step.input_ids[next_in_step])
        src_tokens = torch.where(in_window, src_tokens, 0)  # [Tw] int64
        src_positions = torch.where(in_window, window["first"][owners] + local, 0)  # [Tw] int64
        features = self.heads.project_aux(batch.aux_hidden)  # [T, H]
        src_features = torch.where(in_window[:, None], features[step_rows], 0).contiguous()  # [Tw, H]

        rows, write_rows = window["rows"], batch.write_rows
        store_lens = rows.clamp(max=self._cache_rows)  # [G] int64: the window's last rows are kept
        store_starts = window_start_loc[1:] - store_lens
        args = (window_start_loc, window["shifts"], window["cached_lens"], store_starts, store_lens)
        tokens, new_tokens = shift_and_gather_cache(src_tokens, self._cached_tokens[write_rows], *args)
        positions, new_positions = shift_and_gather_cache(src_positions, self._cached_positions[write_rows], *args)
        features, new_features = shift_and_gather_cache_hidden(src_features, self._cached_features[write_rows], *args)
        self._cached_tokens[write_rows] = new_tokens  # padding requests write the scratch row
        self._cached_positions[write_rows] = new_positions
        self._cached_features[write_rows] = new_features
        return tokens, positions, features

    def _slots(self, block_table: torch.Tensor, window: dict, positions: torch.Tensor) -> torch.Tensor:
        """``[Tw]`` int64 KV slots of the window rows (their positions are in the request's blocks), -1 past them."""
        blocks = block_table[window["owners"], (positions // self.draft_context.shape.block_size_tokens).clamp(0, block_table.shape[1] - 1)]
        slots = blocks.long() * self.draft_context.shape.block_size_tokens + positions % self.draft_context.shape.block_size_tokens
        return torch.where(window["in_window"] & (blocks >= 0), slots, -1)
