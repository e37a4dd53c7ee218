"""What one forward pass needs, built once per step: :class:`StepMetadata` and its buffers.

Letters: R = max_requests, T = query rows, MB = max_blocks_per_request, S = drafts.

Rows are packed request by request in table order: every decode request has ``1 + S`` rows
(its base token, then its drafts), then every prefill request its chunk. Example, ``S = 1``,
``block_size_tokens = 4``; request 0 decodes with 6 tokens cached in blocks ``[3, 5]``, request
1 prefills the final chunk ``t4 t5 t6`` of a 7-token prompt (block ``0`` holds ``t0..t3``, block
``1`` is new)::

    input_ids       = [base0, draft0, t4, t5, t6]   (decode tokens gathered on the device)
    positions       = [6, 7, 4, 5, 6]
    slot_mapping    = [5*4+2, 5*4+3, 1*4+0, 1*4+1, 1*4+2]
    query_start_loc = [0, 2, 5]          seq_lens = [8, 7]
    logits_indices  = [0, 1, 4]          (every decode row; the last row of a final chunk)

A decode-only step padded to a CUDA-graph batch ``B`` has exactly ``B * (1 + S)`` rows:
padding requests have no query rows (``query_start_loc`` repeats, ``seq_lens == 0``, block
table row ``-1``), padding rows carry token 0, position 0 and slot ``-1`` (no KV write), and
``logits_indices`` covers all ``B * (1 + S)`` rows (padding logits are ignored).

All tensors are views of buffers allocated once; a StepMetadata is valid until the next step.
"""

import dataclasses
from typing import List, Optional, Tuple

import torch

from mtp_ctrl.state.attention_metadata import AttentionMetadata
from mtp_ctrl.state.batch_dimensions import BatchDimensions
from mtp_ctrl.state.request_table import RequestTable
from mtp_ctrl.state.staging import SectionSpec, StagingBuffers


@dataclasses.dataclass(frozen=True)
class StepMetadata:
    attention: AttentionMetadata  # B = dimensions.request_count, T = dimensions.token_count
    input_ids: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [K] int64, packed rows whose logits are computed, in order
    request_ids: Tuple[int, ...]  # the real requests, in row order (table rows [0, num_requests))
    num_decode: int  # real decode requests (rows [0, num_decode) of the table)
    num_prefill: int  # prefill requests after them
    num_final_prefill_chunks: int  # the first this many prefill requests finish their prompt
    dimensions: BatchDimensions  # padded to a CUDA-graph batch for decode-only steps
    host_query_start_loc: torch.Tensor  # [num_requests + 1] int64 (CPU): real requests' rows
    host_first_positions: torch.Tensor  # [num_requests] int64 (CPU): position of each request's first row

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


class StepBuffers:
    """The step's host sections (staged with the table's rows) and its device-only block table."""

    def __init__(self, staging: StagingBuffers, table: RequestTable, max_tokens_per_step: int):
        self.staging = staging
        self.table = table
        self.host = {name: staging.host[name] for name in self.sections(table.max_requests, max_tokens_per_step)}
        self.device = {name: staging.device[name] for name in self.host}
        self.block_table = torch.full(  # [R, MB] int32, -1 = unused
            (table.max_requests, table.max_blocks_per_request), -1, dtype=torch.int32, device=table.next_tokens.device
        )

    @staticmethod
    def sections(max_requests: int, max_tokens_per_step: int) -> dict:
        rows: SectionSpec = ((max_tokens_per_step,), torch.int64)
        return {
            "input_ids": rows,
            "positions": rows,
            "slot_mapping": rows,
            "logits_indices": rows,
            "query_start_loc": ((max_requests + 1,), torch.int32),
            "seq_lens": ((max_requests,), torch.int32),
        }

    def build(
        self,
        query_lengths: torch.Tensor,
        num_decode: int,
        prefill_chunks: List[torch.Tensor],
        num_final_prefill_chunks: int,
        padded_batch_size: Optional[int],
    ) -> StepMetadata:
        """Stage the step of the requests at table rows ``[0, n)``, run the one staging copy
        (the table's rows go with it), then gather the decode tokens and the block table on
        the device.

        ``query_lengths``: ``[n]`` int64 rows per request; the table's host rows must already
        count them (``kv_length_offsets`` includes this step's rows). ``prefill_chunks``: the
        prompt tokens of each prefill request's chunk (``[q]`` int64), in row order.
        ``padded_batch_size``: the CUDA-graph batch of a decode-only step, or None.
        """
        rows, block_size = self.table.host, self.table.block_size_tokens
        num_requests = query_lengths.shape[0]
        stride = self.table.num_speculative_tokens + 1
        decode_rows = num_decode * stride
        query_start_loc = torch.zeros(num_requests + 1, dtype=torch.int64)  # [n + 1] int64
        torch.cumsum(query_lengths, 0, out=query_start_loc[1:])
        token_count = int(query_start_loc[-1])
        seq_lens = rows.kv_length_offsets[:num_requests]  # [n] int64, this step's rows included
        request_of_row = torch.repeat_interleave(torch.arange(num_requests), query_lengths)  # [t] int64
        row_in_query = torch.arange(token_count) - query_start_loc[request_of_row]  # [t] int64
        positions = (seq_lens - query_lengths)[request_of_row] + row_in_query  # [t] int64
        block_ids = rows.kv_block_ids[request_of_row, positions // block_size]  # [t] int64
        if padded_batch_size is None:
            batch_size, padded_tokens = num_requests, token_count
            logits_indices = torch.cat(  # [nd * (1 + S) + final chunks] int64
                [torch.arange(decode_rows), query_start_loc[num_decode + 1 :][:num_final_prefill_chunks] - 1]
            )
        else:
            batch_size, padded_tokens = padded_batch_size, padded_batch_size * stride
            logits_indices = torch.arange(padded_tokens)  # [B * (1 + S)] int64

        host = self.host
        host["input_ids"][:decode_rows] = 0  # the device copies the table's decode tokens here
        if prefill_chunks:
            torch.cat(prefill_chunks, out=host["input_ids"][decode_rows:token_count])
        host["positions"][:token_count] = positions
        host["slot_mapping"][:token_count] = block_ids * block_size + positions % block_size
        for name, padding_value in (("input_ids", 0), ("positions", 0), ("slot_mapping", -1)):
            host[name][token_count:padded_tokens] = padding_value
        host["query_start_loc"][: num_requests + 1] = query_start_loc
        host["query_start_loc"][num_requests + 1 : batch_size + 1] = token_count
        host["seq_lens"][:num_requests] = seq_lens
        host["seq_lens"][num_requests:batch_size] = 0
        host["logits_indices"][: logits_indices.shape[0]] = logits_indices

        self.staging.copy_to_device()

        table, device = self.table, self.device
        decode_ids = device["input_ids"][:decode_rows].view(num_decode, stride)  # [nd, 1 + S] int64
        decode_ids[:, 0].copy_(table.next_tokens[:num_decode])
        decode_ids[:, 1:].copy_(table.draft_tokens[:num_decode])
        self.block_table[:num_requests].copy_(table.device.kv_block_ids[:num_requests])
        self.block_table[num_requests:batch_size].fill_(-1)
        attention = AttentionMetadata(
            query_start_loc=device["query_start_loc"][: batch_size + 1],
            seq_lens=device["seq_lens"][:batch_size],
            slot_mapping=device["slot_mapping"][:padded_tokens],
            block_table=self.block_table[:batch_size],
            positions=device["positions"][:padded_tokens],
            num_actual_tokens=token_count,
            max_query_len=int(query_lengths.max()) if num_requests else 0,
            max_seq_len=int(seq_lens.max()) if num_requests else 0,
        )
        num_prefill = num_requests - num_decode
        return StepMetadata(
            attention=attention,
            input_ids=device["input_ids"][:padded_tokens],
            logits_indices=device["logits_indices"][: logits_indices.shape[0]],
            request_ids=tuple(rows.request_ids[:num_requests].tolist()),  # host-ok: host rows
            num_decode=num_decode,
            num_prefill=num_prefill,
            num_final_prefill_chunks=num_final_prefill_chunks,
            dimensions=BatchDimensions(padded_tokens, batch_size - num_prefill, num_prefill),
            host_query_start_loc=query_start_loc,
            host_first_positions=seq_lens - query_lengths,
        )
