"""What one forward pass needs: :class:`StepMetadata`, staged by the host, completed on the device.

Letters: R = max_requests, T = query rows, G = requests of the step's grid, MB = max blocks.

Rows are packed request by request in step order: every decode request has ``1 + V`` rows
(its base token, then its drafts; V = ``verify_width``, the most drafts any of the step's decode
requests holds, at most S), then every prefill request its chunk. With ragged rows
(``DynamicInferenceContext.enable_ragged_rows``) a decode request has ``1 + s_r`` rows, the drafts
it holds (``host_verify_lengths``), and its logits rows stay ``1 + V`` (below). The host knows how
many rows each request has; the device knows where they are (a decode request's KV length is
the device's, see ``request_table``). So the work is split:

- the host stages ``query_start_loc``, the prefill chunks' tokens, ``logits_indices``, the real
  counts (requests, decode requests, sampling requests), each request's table slot
  (``slot_ids``; padding -> the scratch slot) and the new blocks (``(slot, column, id)``
  writes), in one host-to-device copy;
- :meth:`StepBuffers.prepare_inputs`, run on the device at the start of the step (inside its
  CUDA graph), writes the new blocks, grows each request's KV length (at its slot) by its
  rows, and derives ``positions``, ``slot_mapping``, ``seq_lens``, the step's block table (row r
  = the block row of request r's slot) and the decode rows' tokens (``next_tokens``,
  ``draft_tokens`` of their slots).

Example, ``S = 1``, ``block_size_tokens = 4``; request 0 decodes with 6 tokens cached in blocks
``[3, 5]``, request 1 prefills the final chunk ``t4 t5 t6`` of a 7-token prompt (block ``0``
holds ``t0..t3``, block ``1`` is new)::

    query_start_loc = [0, 2, 5]                  (host)
    input_ids       = [base0, draft0, t4, t5, t6] (decode tokens gathered on the device)
    positions       = [6, 7, 4, 5, 6]            (device: KV length + row in request)
    slot_mapping    = [5*4+2, 5*4+3, 1*4+0, 1*4+1, 1*4+2]
    seq_lens        = [8, 7]                     logits_indices = [0, 1, 4, 0]

``logits_indices`` has ``1 + V`` entries per request of the grid: the decode rows, then each
final chunk's last row, then zeros (rows computed and ignored), so the shapes of a step depend
only on its grid. With ragged rows decode request r's logits row j is its packed row
``qsl[r] + min(j, s_r)``: sampling, acceptance and the proposers keep the strided logits layout,
and a logits row past ``s_r`` repeats row ``s_r`` with a masked draft (never accepted). Example,
S = V = 2, requests holding 2, 0 and 1 drafts::

    query_start_loc = [0, 3, 4, 6]     positions = [p0, p0+1, p0+2, p1, p2, p2+1]
    logits_indices  = [0, 1, 2,  3, 3, 3,  4, 5, 5]

A step padded to a CUDA-graph shape (``B`` requests, ``T`` rows; a decode-only
step has ``T = B * (1 + V)``): padding requests have no query rows (``query_start_loc`` repeats,
``seq_lens == 0``), padding rows carry position 0 and slot ``-1`` (no KV write).

A decode run (``num_steps > 1``, decode-only steps) is one build launched several times in a row:
every launch's set-up reads the same staged sections (its block writes are absolute, so applying
them again changes nothing) and grows each request from the KV length and tokens the launch
before it left on the device.

All tensors are views of buffers allocated once; a StepMetadata is valid until the next step.
"""

import dataclasses
from typing import List, Optional, Tuple

import numpy as np
import torch

from mtp_ctrl.state.attention_metadata import AttentionMetadata
from mtp_ctrl.state.batch_dimensions import BatchDimensions
from mtp_ctrl.state.request_table import RequestTable
from mtp_ctrl.state.staging import StagingBuffers
from mtp_ctrl.triton_ops import prepare_step_inputs


@dataclasses.dataclass(frozen=True)
class StepMetadata:
    attention: AttentionMetadata  # B = dimensions.request_count, T = dimensions.token_count
    input_ids: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [K] int64, packed rows whose logits are computed, in order
    request_ids: Tuple[int, ...]  # the real requests, in step order (decode requests first)
    num_decode: int  # real decode requests (the step's first requests)
    num_prefill: int  # prefill requests after them
    num_final_prefill_chunks: int  # the first this many prefill requests finish their prompt
    dimensions: BatchDimensions  # the grid, padded to a CUDA-graph shape when one covers the step
    graph_padded: bool  # padded to a CUDA-graph shape (else exact, and the step runs eagerly)
    counts: torch.Tensor  # [3] int64 on the device: real requests, decode requests, sampling requests
    next_prompt_token: torch.Tensor  # [1] int64 on the device: the prompt token after a chunk that
    # stops mid-prompt (only ever the last request's), 0 when there is none
    device_request_ids: torch.Tensor  # [G] int64 on the device: each request's id, -1 for padding
    slot_ids: torch.Tensor  # [G] int64 on the device: each request's table slot, the scratch slot for padding
    host_slot_ids: np.ndarray  # [num_requests] int64: the real requests' table slots, in step order
    host_request_ids: np.ndarray  # [num_requests] int64: ``request_ids`` as an array
    mamba_slot_ids: torch.Tensor  # [G] int64 on the device: each request's Mamba slot (set by prepare_inputs;
    # -1 without Mamba layers)
    prefill_status: torch.Tensor  # [G] int64 on the device: 1 for a prefill request (set by prepare_inputs
    # with Mamba layers)
    host_query_start_loc: torch.Tensor  # [num_requests + 1] int64 (CPU): real requests' rows
    host_first_positions: torch.Tensor  # [num_requests] int64 (CPU): first row's position; -1 for
    # decode requests, whose position only the device knows
    verify_width: int  # V (host), at most S: drafts each decode request verifies this step (its rows: 1 + V)
    num_steps: int = 1  # a decode run: the launch runs this many decode steps of this layout back to
    # back, each deriving its inputs from the one before on the device (1 for any step with prefill)
    draft_lengths: Optional[torch.Tensor] = None  # [G] int64 on the device: drafts each sampling request
    # makes this step (verified by its next step); 0 for the others. None: S for every request
    num_drafts: int = -1  # D = max of draft_lengths (host): draft depths the step runs; -1: S
    host_draft_lengths: Tuple[int, ...] = ()  # the real requests' draft_lengths (host), in row order
    host_verify_lengths: Tuple[int, ...] = ()  # drafts each decode request holds, what the step's
    # first step verifies (host; at most verify_width), in row order

    @property
    def verify_stride(self) -> int:
        """Rows of each decode request this step: ``1 + V``."""
        return self.verify_width + 1

    @property
    def host_query_lengths(self) -> torch.Tensor:
        """``[num_requests]`` int64 (CPU): query rows of each real request."""
        return self.host_query_start_loc[1:] - self.host_query_start_loc[:-1]

    @property
    def num_requests(self) -> int:
        return self.num_decode + self.num_prefill

    @property
    def num_sampling_requests(self) -> int:
        """Requests that sample a token: the decodes and the final prefill chunks. A prefill
        chunk that does not end its prompt can only be the last request of the step."""
        return self.num_decode + self.num_final_prefill_chunks

    @property
    def decode_only(self) -> bool:
        """Every request of the grid has ``1 + V`` rows (the layout a graph of this shape uses)."""
        return not self.dimensions.has_prefill

    @property
    def num_active(self) -> torch.Tensor:
        """``[1]`` int64 on the device: the real requests (the rest of the grid pads)."""
        return self.counts[0:1]

    @property
    def device_num_decode(self) -> torch.Tensor:
        """``[1]`` int64 on the device: the decode requests (the grid's first requests)."""
        return self.counts[1:2]

    @property
    def device_num_sampling(self) -> torch.Tensor:
        """``[1]`` int64 on the device: the requests that sample (decodes, then final chunks)."""
        return self.counts[2:3]


class StepBuffers:
    """The step's staged host sections and the device buffers :meth:`prepare_inputs` fills."""

    def __init__(self, table: RequestTable, max_tokens_per_step: int, max_block_writes: int):
        self.table = table
        device = table.next_tokens.device
        R = table.shape.max_requests
        self.max_block_writes = max_block_writes
        self.staging = StagingBuffers({
            "input_ids": ((max_tokens_per_step,), torch.int64),
            "logits_indices": ((max_tokens_per_step,), torch.int64),
            "query_start_loc": ((R + 1,), torch.int32),
            "counts": ((3,), torch.int64),  # real requests, decode requests, sampling requests
            "next_prompt_token": ((1,), torch.int64),
            "request_ids": ((R,), torch.int64),
            "slot_ids": ((R,), torch.int64),  # each request's table slot, the scratch slot for padding
            "draft_lengths": ((R,), torch.int64),  # drafts per sampling request (draft-length policy)
            "block_writes": ((3, max_block_writes), torch.int64),  # rows: table slot, column, block id
        }, device)
        # A steady decode step (the same graph shape, requests and slots as the step before) stages
        # the same sections as that step but its block writes: it reuses that step's metadata and
        # rewrites only the block writes. Per host buffer: the steady key its sections were written for.
        self._buffer_keys: List[Optional[tuple]] = [None] * self.staging.num_host_buffers
        self._steady: Optional[Tuple[tuple, StepMetadata]] = None  # the last steady step: key, metadata
        self.positions = torch.zeros(max_tokens_per_step, dtype=torch.int64, device=device)  # [T] int64
        self.slot_mapping = torch.full((max_tokens_per_step,), -1, dtype=torch.int64, device=device)  # [T] int64
        self.seq_lens = torch.zeros(R, dtype=torch.int32, device=device)  # [R] int32
        # the step's block table, row r = the block row of request r's slot (prepare_step_inputs)
        self.block_table = torch.full((R, table.shape.max_blocks_per_request), -1, dtype=torch.int64,
                                      device=device)  # [R, MB] int64
        # with Mamba layers: each request's Mamba slot and prefill status, gathered by slot
        self.mamba_slot_ids = torch.full((R,), -1, dtype=torch.int64, device=device)  # [R] int64
        self.prefill_status = torch.zeros(R, dtype=torch.int64, device=device)  # [R] int64
        self.gathers_mamba_rows = False  # the context sets it when the model has Mamba layers

    def build(self, slot_ids: np.ndarray, query_lengths: np.ndarray, num_decode: int, prefill_chunks: List[np.ndarray],
              num_final_prefill_chunks: int, padded: Optional[BatchDimensions], block_writes: np.ndarray,
              max_seq_len: int, next_prompt_token: int = 0, num_steps: int = 1,
              draft_lengths: Optional[np.ndarray] = None, verify_width: Optional[int] = None,
              verify_lengths: Optional[np.ndarray] = None) -> StepMetadata:
        """Stage the step of the requests at table slots ``slot_ids`` (``[n]`` int64, decode requests
        first) and send it to the device.

        ``query_lengths``: ``[n]`` int64 rows per request. ``prefill_chunks``: each prefill
        request's chunk tokens (``[q]`` int64), in row order. ``padded``: the CUDA-graph shape the
        step is padded to, or None (exact shape, eager). With no request at all, the step is
        all padding: it changes no request (a graph captured from it serves every real step of
        its shape).
        ``block_writes``: ``[3, k]`` int64 (table slot, column, block id) of the blocks given since
        the last step. ``max_seq_len``: a bound on every request's KV length after this step.
        ``next_prompt_token``: the prompt token after the last request's chunk when that chunk
        does not end its prompt (drafters that feed each row the token after it need it).
        ``num_steps``: decode steps the launch runs (a decode run; decode-only steps only).
        ``draft_lengths``: ``[n]`` int64 drafts each request makes this step (0 for a chunk that
        does not end its prompt), or None: S each (``StepMetadata.draft_lengths``).
        ``verify_width``: V, the drafts each decode request verifies (``1 + V`` rows); None: S.
        ``verify_lengths``: ``[num_decode]`` int64 drafts each decode request holds (None: S each).
        """
        self.staging.wait_until_host_writable()
        num_requests = query_lengths.shape[0]
        if num_steps > 1 and num_decode != num_requests:
            raise ValueError(f"a decode run ({num_steps} steps) holds decode requests only")
        request_ids = self.table.host.request_ids[slot_ids]  # [n] int64
        S = self.table.shape.num_speculative_tokens
        if draft_lengths is None:
            draft_lengths = np.full(num_requests, S, dtype=np.int64)  # [n] int64
        num_sampling = num_decode + num_final_prefill_chunks
        # D: the depths the step drafts; a step where nobody samples keeps S (the fixed-S graph)
        num_drafts = int(draft_lengths[:num_sampling].max()) if num_sampling else S  # host-ok: numpy
        V = S if verify_width is None else verify_width
        if not 0 <= V <= S:
            raise ValueError(f"verify_width must be in [0, {S}], got {V}")
        if verify_lengths is None:
            verify_lengths = np.full(num_decode, S, dtype=np.int64)  # [nd] int64
        steady_key = None
        if padded is not None and not prefill_chunks and num_final_prefill_chunks == 0:
            # the same requests in the same slots, so every section but the block writes is the same
            steady_key = (num_requests, num_decode, padded, max_seq_len, num_steps, slot_ids.tobytes(),
                          request_ids.tobytes(), draft_lengths.tobytes(), V, verify_lengths.tobytes())
            step = self._steady_step(steady_key, block_writes)
            if step is not None:
                return step
        stride = V + 1  # logits rows of each decode request
        query_start_loc = np.zeros(num_requests + 1, dtype=np.int64)  # [n + 1] int64
        np.cumsum(query_lengths, out=query_start_loc[1:])
        token_count = int(query_start_loc[-1])
        decode_rows = int(query_start_loc[num_decode])  # num_decode * (1 + V) unless ragged
        num_prefill = num_requests - num_decode
        dimensions = BatchDimensions(token_count, num_requests, num_prefill > 0) if padded is None else padded
        batch_size, padded_tokens = dimensions.request_count, dimensions.token_count
        if block_writes.shape[1] > self.max_block_writes:
            raise RuntimeError(f"{block_writes.shape[1]} block writes in one step, the buffer holds "
                               f"{self.max_block_writes}")

        host = self.staging.host_arrays
        if prefill_chunks:
            np.concatenate(prefill_chunks, out=host["input_ids"][decode_rows:token_count])
        host["query_start_loc"][: num_requests + 1] = query_start_loc
        host["query_start_loc"][num_requests + 1 : batch_size + 1] = token_count
        # logits rows: every decode row, then each final chunk's last row; 1 + V per grid request in
        # all (the rest point at row 0 and are ignored), so a graph's shapes do not depend on the split
        logits_indices = host["logits_indices"][: batch_size * stride]  # [G * (1 + V)] int64
        final_chunk_ends = query_start_loc[num_decode + 1 :][:num_final_prefill_chunks] - 1
        decode_logits = num_decode * stride
        if decode_rows == decode_logits:  # every decode request has 1 + V rows
            logits_indices[:decode_logits] = np.arange(decode_logits)
        else:  # ragged: request r's logits row j is its row min(j, s_r) (rows past s_r: never accepted)
            drafts_run = query_lengths[:num_decode, None] - 1  # [nd, 1] int64
            logits_indices[:decode_logits] = (query_start_loc[:num_decode, None] +
                                              np.minimum(np.arange(stride)[None, :], drafts_run)).ravel()
        logits_indices[decode_logits : decode_logits + num_final_prefill_chunks] = final_chunk_ends
        logits_indices[decode_logits + num_final_prefill_chunks :] = 0
        host["counts"][:] = (num_requests, num_decode, num_sampling)
        host["next_prompt_token"][0] = next_prompt_token
        host["request_ids"][:num_requests] = request_ids
        host["request_ids"][num_requests:batch_size] = -1
        host["slot_ids"][:num_requests] = slot_ids
        host["slot_ids"][num_requests:batch_size] = self.table.scratch_row
        host["draft_lengths"][:num_requests] = draft_lengths
        host["draft_lengths"][num_requests:batch_size] = 0
        self._stage_block_writes(block_writes)
        self._buffer_keys[self.staging.current_buffer] = steady_key
        self.staging.copy_to_device()

        device = self.staging.device
        host_first_positions = np.full(num_requests, -1, dtype=np.int64)  # [n] int64
        host_first_positions[num_decode:] = self.table.host.known_lengths[slot_ids[num_decode:]] - \
            query_lengths[num_decode:]
        if not dimensions.has_prefill:
            max_query_len = stride
        else:  # a graph's bound must hold for every step it replays
            max_query_len = padded_tokens if padded is not None else int(query_lengths.max())
        attention = AttentionMetadata(
            query_start_loc=device["query_start_loc"][: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            slot_mapping=self.slot_mapping[:padded_tokens],
            block_table=self.block_table[:batch_size],
            positions=self.positions[:padded_tokens],
            num_actual_tokens=token_count,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )
        step = StepMetadata(
            attention=attention,
            input_ids=device["input_ids"][:padded_tokens],
            logits_indices=device["logits_indices"][: batch_size * stride],
            request_ids=tuple(request_ids.tolist()),  # host-ok: numpy
            num_decode=num_decode,
            num_prefill=num_prefill,
            num_final_prefill_chunks=num_final_prefill_chunks,
            dimensions=dimensions,
            graph_padded=padded is not None,
            counts=device["counts"],
            next_prompt_token=device["next_prompt_token"],
            device_request_ids=device["request_ids"][:batch_size],
            slot_ids=device["slot_ids"][:batch_size],
            host_slot_ids=slot_ids.copy(),
            host_request_ids=request_ids,
            mamba_slot_ids=self.mamba_slot_ids[:batch_size],
            prefill_status=self.prefill_status[:batch_size],
            host_query_start_loc=torch.from_numpy(query_start_loc),
            host_first_positions=torch.from_numpy(host_first_positions),
            num_steps=num_steps,
            draft_lengths=device["draft_lengths"][:batch_size],
            num_drafts=num_drafts,
            verify_width=V,
            host_draft_lengths=tuple(draft_lengths.tolist()),  # host-ok: numpy
            host_verify_lengths=tuple(verify_lengths.tolist()),  # host-ok: numpy
        )
        self._steady = None if steady_key is None else (steady_key, step)
        return step

    def _steady_step(self, key: tuple, block_writes: np.ndarray) -> Optional[StepMetadata]:
        """The last step's metadata when this step is the same decode step (``key`` equal: shape,
        slots and their requests) and the current host buffer was staged for that key too: only
        the block writes are staged and sent. None otherwise."""
        if self._steady is None or self._steady[0] != key or self._buffer_keys[self.staging.current_buffer] != key:
            return None
        step = self._steady[1]
        self._stage_block_writes(block_writes)
        self.staging.copy_to_device()
        return step

    def _stage_block_writes(self, block_writes: np.ndarray) -> None:
        writes = self.staging.host_arrays["block_writes"]  # [3, max_block_writes] int64
        writes[:, : block_writes.shape[1]] = block_writes
        # the unused entries write the scratch block into column 0 of the scratch slot (what it holds)
        writes[:, block_writes.shape[1] :] = ((self.table.scratch_row,), (0,), (self.table.scratch_block,))

    def prepare_inputs(self, step: StepMetadata) -> None:
        """The device half of the step's set-up (no host sync, fixed shapes per bucket, so it is
        captured with the decode step): take the host's new blocks, grow every request's KV by
        its rows, and derive positions, slots, sequence lengths and the decode rows' tokens."""
        table, attention, rows = self.table, step.attention, self.table.device
        batch_size = attention.batch_size
        prepare_step_inputs(
            self.staging.device["block_writes"],  # [3, k]: the unused tail writes -1 into the scratch slot
            rows.kv_block_ids, attention.query_start_loc[: batch_size + 1], step.slot_ids,
            rows.kv_length_offsets, rows.kv_block_counts, rows.last_kv_block_offset, rows.last_kv_block_id,
            table.device_rows_with_scratch("next_tokens"),
            table.device_rows_with_scratch("draft_tokens")[:, : step.verify_width],  # V drafts: 1 + V rows each
            step.device_num_decode, table.shape.block_size_tokens, attention.seq_lens, attention.positions,
            attention.slot_mapping, step.input_ids, attention.block_table)
        if self.gathers_mamba_rows:  # the step's Mamba slots and prefill flags (hybrid models)
            torch.index_select(rows.mamba_slot_ids, 0, step.slot_ids, out=step.mamba_slot_ids)
            torch.index_select(rows.prefill_status, 0, step.slot_ids, out=step.prefill_status)
