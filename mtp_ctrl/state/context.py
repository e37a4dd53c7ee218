"""DynamicInferenceContext: the state a speculative-decoding controller drives.

It owns the KV block pool, the KV caches, the request table, the Mamba state slots and the
buffers of each step's metadata. The host is the source of truth for scheduling; the device
receives one host-to-device copy per step.

Life cycle of a request::

    add_request   -> PREFILL: a table row (end of the prefill group), a Mamba slot, no blocks
    build_step    -> runs a prefill chunk (blocks taken for its rows); the final chunk samples
    commit_step   -> after the final chunk: DECODE (rows move to the decode group)
    build_step    -> runs 1 + S rows; no free block -> PAUSED (state intact), resumed by a
                     later build_step once blocks are free
    pause_request / resume_request  -> PAUSED and back, on the caller's word
    finish_request -> blocks and slot released, row freed (any time no step is in flight)

One step::

    step = ctx.build_step()          # schedule, take blocks, stage host rows + step rows,
                                     # ONE copy to the device, gather decode tokens there
    ... forward(step); sample; verify_and_commit (verify, prepare_next_forward_pass into
        ctx.table.next_tokens[:n], rewind_kv_cache on ctx.table.device.*[:n]); a proposer
        writes ctx.table.draft_tokens[:n]; a hybrid model would commit its Mamba slots with
        mamba_state_selective_copy here ...
    ctx.commit_step(step, accepted_counts)   # host mirror catches up with the device rewind,
                                             # frees rewound blocks, flips finished prefills
"""

from typing import Dict, Optional, Sequence, Union

import torch

from mtp_ctrl.state.batch_dimensions import check_batch_sizes, round_up_batch_size
from mtp_ctrl.state.kv_block_allocator import KVBlockAllocator, KVCacheFullError
from mtp_ctrl.state.kv_cache import KVCacheSpec
from mtp_ctrl.state.kv_rows import blocks_to_add, resize_kv_rows
from mtp_ctrl.state.mamba_slots import MambaSpec, MambaStateSlots
from mtp_ctrl.state.request_table import RequestTable, RowGroup
from mtp_ctrl.state.staging import StagingBuffers
from mtp_ctrl.state.step_metadata import StepBuffers, StepMetadata

Tokens = Union[torch.Tensor, Sequence[int]]


class DynamicInferenceContext:
    """Letters: R = max_requests, S = num_speculative_tokens, MB = max_blocks_per_request.

    max_requests: live requests (running or paused); rows of the request table and Mamba slots.
    max_model_len: prompt + generated tokens of one request.
    block_size_tokens: tokens per KV block. num_speculative_tokens: S drafts per decode step.
    max_tokens_per_step: query rows of one forward pass (decode rows first, prefill chunks after).
    kv_cache: layers (decoder + MTP depths), local KV heads, head dim and dtype of the caches.
    num_blocks / kv_cache_bytes: the KV pool, as a block count or a byte budget.
    cuda_graph_batch_sizes: decode batch sizes with a CUDA graph (decode-only steps are padded).
    mamba: Mamba layer count and state shapes, or None for a model without Mamba layers.

    Sizing rules (checked here): ``max_tokens_per_step >= R * (1 + S)`` so every decode request
    runs every step; the pool holds at least one full-length request
    (``MB = ceil((max_model_len + S) / block_size_tokens)`` blocks); give ``num_blocks`` or a
    ``kv_cache_bytes`` budget, not both.
    """

    def __init__(
        self,
        *,
        max_requests: int,
        max_model_len: int,
        block_size_tokens: int,
        num_speculative_tokens: int,
        max_tokens_per_step: int,
        kv_cache: KVCacheSpec,
        device: Union[str, torch.device],
        num_blocks: Optional[int] = None,
        kv_cache_bytes: Optional[int] = None,
        cuda_graph_batch_sizes: Sequence[int] = (),
        mamba: Optional[MambaSpec] = None,
    ):
        for name, value, low in (
            ("max_requests", max_requests, 1),
            ("max_model_len", max_model_len, 1),
            ("block_size_tokens", block_size_tokens, 1),
            ("num_speculative_tokens", num_speculative_tokens, 0),
            ("max_tokens_per_step", max_tokens_per_step, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(kv_cache, KVCacheSpec):
            raise TypeError(f"kv_cache must be a KVCacheSpec, got {type(kv_cache).__name__}")
        stride = num_speculative_tokens + 1
        if max_tokens_per_step < max_requests * stride:
            raise ValueError(
                f"max_tokens_per_step ({max_tokens_per_step}) must hold every decode request's 1 + S rows: "
                f"max_requests * (1 + num_speculative_tokens) = {max_requests * stride}"
            )
        if (num_blocks is None) == (kv_cache_bytes is None):
            raise ValueError("give exactly one of num_blocks and kv_cache_bytes")
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tokens_per_step = max_tokens_per_step
        self.cuda_graph_batch_sizes = check_batch_sizes(cuda_graph_batch_sizes, max_requests)
        self.max_blocks_per_request = -(-(max_model_len + num_speculative_tokens) // block_size_tokens)
        if num_blocks is not None:
            self.allocator = KVBlockAllocator(num_blocks, block_size_tokens)
        else:
            bytes_per_block = kv_cache.bytes_per_block(block_size_tokens)
            self.allocator = KVBlockAllocator.from_memory_budget(kv_cache_bytes, bytes_per_block, block_size_tokens)
        if self.allocator.num_blocks < self.max_blocks_per_request:
            raise ValueError(
                f"the KV pool ({self.allocator.num_blocks} blocks) cannot hold one request of max_model_len "
                f"{max_model_len} + {num_speculative_tokens} drafts ({self.max_blocks_per_request} blocks)"
            )
        self.kv_caches = kv_cache.allocate(self.allocator.num_blocks, block_size_tokens, self.device)
        self.mamba = None if mamba is None else MambaStateSlots(mamba, max_requests, num_speculative_tokens, self.device)
        staging = StagingBuffers(
            {
                **RequestTable.sections(max_requests, self.max_blocks_per_request),
                **StepBuffers.sections(max_requests, max_tokens_per_step),
            },
            self.device,
        )
        self._staging = staging
        self.table = RequestTable(
            max_requests, self.max_blocks_per_request, num_speculative_tokens, block_size_tokens, self.device, staging
        )
        self._step_buffers = StepBuffers(staging, self.table, max_tokens_per_step)
        self._prompts: Dict[int, torch.Tensor] = {}  # request id -> [P] int64 prompt tokens (CPU)
        self._paused_for_kv: Dict[int, None] = {}  # ordered set: oldest first
        self._step_in_flight: Optional[StepMetadata] = None

    # ----- requests ----------------------------------------------------------------------

    @property
    def num_free_rows(self) -> int:
        """How many more requests ``add_request`` accepts now."""
        return self.table.max_requests - self.table.num_live

    def __contains__(self, request_id: int) -> bool:
        return request_id in self.table

    def add_request(self, request_id: int, prompt_tokens: Tokens) -> None:
        """Admit a request with its prompt (``[P]`` int tokens, CPU tensor or sequence).

        Allowed while a step is in flight (the new row lies past the step's rows).
        """
        if isinstance(request_id, bool) or not isinstance(request_id, int) or request_id < 0:
            raise ValueError(f"request_id must be an int >= 0, got {request_id!r}")
        if request_id in self.table:
            raise ValueError(f"request_id {request_id} is already live")
        prompt = _as_prompt(prompt_tokens, self.max_model_len)
        if self.num_free_rows == 0:
            raise RuntimeError(f"max_requests ({self.table.max_requests}) requests are live; finish one first")
        self._staging.wait_until_host_writable()
        slot = -1 if self.mamba is None else self.mamba.allocate_slot()
        self.table.insert(request_id, RowGroup.PREFILL, slot)
        self._prompts[request_id] = prompt

    def finish_request(self, request_id: int) -> None:
        """Release the request's KV blocks and Mamba slot and free its row."""
        row = self._live_row(request_id)
        self._require_no_step_in_flight("finish_request")
        self._staging.wait_until_host_writable()
        resize_kv_rows(self.table.host, row, torch.zeros(1, dtype=torch.int64), self.allocator)
        slot = int(self.table.host.mamba_slot_ids[row])
        if self.mamba is not None:
            self.mamba.release_slot(slot)
        self.table.remove(request_id)
        del self._prompts[request_id]
        self._paused_for_kv.pop(request_id, None)

    def pause_request(self, request_id: int) -> None:
        """Stop running the request (its blocks and state stay) until ``resume_request``."""
        self._live_row(request_id)
        self._require_no_step_in_flight("pause_request")
        if self.table.group_of(request_id) == RowGroup.PAUSED:
            raise ValueError(f"request {request_id} is already paused")
        self._staging.wait_until_host_writable()
        self.table.move(request_id, RowGroup.PAUSED)

    def resume_request(self, request_id: int) -> None:
        """Run a paused request again from the next step (decode, or the rest of its prompt)."""
        row = self._live_row(request_id)
        self._require_no_step_in_flight("resume_request")
        if self.table.group_of(request_id) != RowGroup.PAUSED:
            raise ValueError(f"request {request_id} is not paused")
        self._staging.wait_until_host_writable()
        prompt_done = int(self.table.host.kv_length_offsets[row]) >= self._prompts[request_id].shape[0]
        self.table.move(request_id, RowGroup.DECODE if prompt_done else RowGroup.PREFILL)
        self._paused_for_kv.pop(request_id, None)

    # ----- steps -------------------------------------------------------------------------

    def build_step(self) -> Optional[StepMetadata]:
        """Schedule the next forward pass and stage everything it reads; None if no request runs.

        Every decode request runs ``1 + S`` rows; prefill requests then take the rest of
        ``max_tokens_per_step`` in row order (only the last one may stop mid-prompt). Decode
        requests that cannot get their blocks are paused; paused ones are resumed (oldest
        first) when blocks are free again, and no prefill starts while one still waits.
        Raises ``KVCacheFullError`` when requests are live but none can get a block.
        """
        self._require_no_step_in_flight("build_step")
        self._staging.wait_until_host_writable()
        self._pause_decodes_short_of_blocks()
        self._resume_requests_paused_for_kv()
        host, stride = self.table.host, self.num_speculative_tokens + 1
        num_decode = self.table.group_size(RowGroup.DECODE)
        decode_lengths = host.kv_length_offsets[:num_decode]
        too_long = decode_lengths >= self.max_model_len
        if bool(too_long.any()):
            request_id = int(host.request_ids[:num_decode][too_long][0])
            raise ValueError(f"request {request_id} has reached max_model_len ({self.max_model_len}); finish it")
        resize_kv_rows(host, 0, decode_lengths + stride, self.allocator)
        # prefill leaves the blocks that the running decodes take next step, so it cannot starve them
        reserved_blocks = int(self._decode_block_needs().sum())
        chunks = [] if self._paused_for_kv else self._schedule_prefill_chunks(num_decode, reserved_blocks)
        num_requests = num_decode + len(chunks)
        if num_requests == 0:
            if self.table.group_size(RowGroup.PREFILL) or self._paused_for_kv:
                raise KVCacheFullError(
                    f"no live request can get a KV block ({self.allocator.num_free_blocks} free); "
                    "finish or pause requests to make room"
                )
            return None
        query_lengths = torch.full((num_requests,), stride, dtype=torch.int64)  # [n] int64
        query_lengths[num_decode:] = torch.tensor([chunk.shape[0] for chunk in chunks], dtype=torch.int64)
        final_chunk_count = sum(
            1 for row in range(num_decode, num_requests)
            if int(host.kv_length_offsets[row]) == self._prompts[int(host.request_ids[row])].shape[0]
        )
        padded_batch_size = None if chunks else round_up_batch_size(num_decode, self.cuda_graph_batch_sizes)
        step = self._step_buffers.build(query_lengths, num_decode, chunks, final_chunk_count, padded_batch_size)
        self._step_in_flight = step
        return step

    def commit_step(self, step: StepMetadata, accepted_counts: Tokens) -> None:
        """Apply the step's outcome to the host mirror: what ``rewind_kv_cache`` did on the device.

        ``accepted_counts``: accepted drafts of each decode request of the step (``[num_decode]``
        ints in ``[0, S]``, CPU tensor or sequence). Decode lengths become
        ``old + 1 + accepted``; blocks past them return to the allocator; prefill requests that
        finished their prompt become decode requests. Call it after the device step ran.
        """
        if step is not self._step_in_flight:
            raise ValueError("step is not the step in flight (build_step returned another one)")
        accepted = _as_accepted_counts(accepted_counts, step.num_decode, self.num_speculative_tokens)
        self._staging.wait_until_host_writable()
        host, num_decode = self.table.host, step.num_decode
        rewinds = self.num_speculative_tokens - accepted  # [nd] int64
        resize_kv_rows(host, 0, host.kv_length_offsets[:num_decode] - rewinds, self.allocator)
        finished_prompts = step.request_ids[num_decode : num_decode + step.num_final_prefill_chunks]
        for row in range(num_decode, num_decode + len(finished_prompts)):
            self.table.set_prefill_status(row, 0)
        for request_id in finished_prompts:
            self.table.move(request_id, RowGroup.DECODE)
        self._step_in_flight = None

    # ----- scheduling helpers ------------------------------------------------------------

    def _decode_block_needs(self) -> torch.Tensor:
        """``[nd]`` int64: blocks each decode request needs for its next 1 + S rows."""
        num_decode = self.table.group_size(RowGroup.DECODE)
        lengths = self.table.host.kv_length_offsets[:num_decode] + self.num_speculative_tokens + 1
        return blocks_to_add(self.table.host, 0, lengths, self.allocator.block_size_tokens)

    def _pause_decodes_short_of_blocks(self) -> None:
        """Decode requests get blocks in row order; the first that does not fit and every later
        one that needs a block is paused."""
        needs = self._decode_block_needs()
        fits = (needs == 0) | (torch.cumsum(needs, 0) <= self.allocator.num_free_blocks)
        num_decode = needs.shape[0]
        for request_id in self.table.host.request_ids[:num_decode][~fits].tolist():  # host-ok: host rows
            self.table.move(request_id, RowGroup.PAUSED)
            self._paused_for_kv[request_id] = None

    def _resume_requests_paused_for_kv(self) -> None:
        spare_blocks = self.allocator.num_free_blocks - int(self._decode_block_needs().sum())
        stride = self.num_speculative_tokens + 1
        for request_id in list(self._paused_for_kv):
            row = self.table.row_of(request_id)
            new_length = self.table.host.kv_length_offsets[row : row + 1] + stride
            need = int(blocks_to_add(self.table.host, row, new_length, self.allocator.block_size_tokens))
            if need > spare_blocks:
                return  # oldest first: a younger request does not overtake
            self.table.move(request_id, RowGroup.DECODE)
            del self._paused_for_kv[request_id]
            spare_blocks -= need

    def _schedule_prefill_chunks(self, num_decode: int, reserved_blocks: int) -> list:
        """Give prefill requests, in row order, chunks under the token budget and the free
        blocks less ``reserved_blocks``; take their blocks. Returns each chunk's prompt tokens
        (``[q]`` int64)."""
        host, block_size = self.table.host, self.allocator.block_size_tokens
        budget = self.max_tokens_per_step - num_decode * (self.num_speculative_tokens + 1)
        chunks = []
        start, end = self.table.group_rows(RowGroup.PREFILL)
        for row in range(start, end):
            prompt = self._prompts[int(host.request_ids[row])]
            length = int(host.kv_length_offsets[row])
            spare_blocks = max(self.allocator.num_free_blocks - reserved_blocks, 0)
            capacity = (int(host.kv_block_counts[row]) + spare_blocks) * block_size - length
            chunk_length = min(prompt.shape[0] - length, budget, capacity)
            if chunk_length <= 0:
                break
            resize_kv_rows(host, row, torch.tensor([length + chunk_length]), self.allocator)
            chunks.append(prompt[length : length + chunk_length])
            budget -= chunk_length
            if length + chunk_length < prompt.shape[0]:
                break  # a partial chunk is the last one of the step
        return chunks

    def _live_row(self, request_id: int) -> int:
        if request_id not in self.table:
            raise ValueError(f"request_id {request_id!r} is not a live request (unknown or finished)")
        return self.table.row_of(request_id)

    def _require_no_step_in_flight(self, what: str) -> None:
        if self._step_in_flight is not None:
            raise RuntimeError(f"{what}: a step is in flight; call commit_step first")


def _as_prompt(prompt_tokens: Tokens, max_model_len: int) -> torch.Tensor:
    if isinstance(prompt_tokens, torch.Tensor):
        if prompt_tokens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"prompt_tokens must be int32 or int64, got {prompt_tokens.dtype}")
        if prompt_tokens.device.type != "cpu":
            raise ValueError(f"prompt_tokens must be a CPU tensor (the host schedules prefill), got {prompt_tokens.device}")
        if prompt_tokens.dim() != 1:
            raise ValueError(f"prompt_tokens must be 1-D, got shape {tuple(prompt_tokens.shape)}")
        prompt = prompt_tokens.to(torch.int64, copy=True)
    else:
        tokens = list(prompt_tokens)
        if any(isinstance(token, bool) or not isinstance(token, int) for token in tokens):
            raise TypeError("prompt_tokens must hold ints")
        prompt = torch.tensor(tokens, dtype=torch.int64)
    if prompt.numel() == 0:
        raise ValueError("prompt_tokens is empty")
    if prompt.numel() > max_model_len:
        raise ValueError(f"prompt_tokens has {prompt.numel()} tokens, more than max_model_len ({max_model_len})")
    if int(prompt.min()) < 0:
        raise ValueError("prompt_tokens must be non-negative token ids")
    return prompt


def _as_accepted_counts(accepted_counts: Tokens, num_decode: int, num_speculative_tokens: int) -> torch.Tensor:
    if isinstance(accepted_counts, torch.Tensor):
        if accepted_counts.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"accepted_counts must be int32 or int64, got {accepted_counts.dtype}")
        if accepted_counts.device.type != "cpu":
            raise ValueError(f"accepted_counts must be a CPU tensor (read back by the caller), got {accepted_counts.device}")
        counts = accepted_counts.to(torch.int64).reshape(-1)
    else:
        counts = torch.tensor(list(accepted_counts), dtype=torch.int64)
    if counts.shape[0] != num_decode:
        raise ValueError(f"accepted_counts has {counts.shape[0]} entries, the step has {num_decode} decode requests")
    if counts.numel() and (int(counts.min()) < 0 or int(counts.max()) > num_speculative_tokens):
        raise ValueError(f"accepted_counts must lie in [0, {num_speculative_tokens}], got {counts.tolist()}")  # host-ok: host values
    return counts
