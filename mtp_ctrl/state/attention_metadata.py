"""Attention metadata of one forward pass over packed query rows.

Letters: B requests in the batch (padded to a CUDA-graph bucket), T packed query rows.
Request b owns rows ``query_start_loc[b] : query_start_loc[b + 1]``; its last row sits at
position ``seq_lens[b] - 1``. Padding requests have zero query rows and ``seq_lens == 0``;
padding rows carry slot ``-1`` (no KV write).

Example, two requests: a 3-token prefill of a new prompt and a decode with 1 + S = 2 rows
over a context of 5 cached tokens::

    query_start_loc = [0, 3, 5]      seq_lens = [3, 7]
    positions       = [0, 1, 2, 5, 6]
"""

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B + 1] int32, prefix sum of query rows per request
    seq_lens: torch.Tensor  # [B] int32, context length incl. this step's rows
    slot_mapping: torch.Tensor  # [T] int64, KV slot (block_id * block_size + offset) per row; -1 = none
    block_table: torch.Tensor  # [B, max_blocks_per_request] int32, KV block ids; -1 = unused
    positions: torch.Tensor  # [T] int64, token position of each query row
    num_actual_tokens: int  # real (unpadded) query rows, <= T
    max_query_len: int  # longest query of the batch
    max_seq_len: int  # longest context of the batch

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]
