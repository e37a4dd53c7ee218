"""Random paged-KV cases for the attention tests, and a dense SDPA oracle built from unpaged K/V.

Shared by tests/unit (CPU, interpreter) and tests/functional (CUDA).
"""

import contextlib
import dataclasses
from typing import List

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class PagedCase:
    query: torch.Tensor  # [T, Hq, D]; rows past query_start_loc[-1] are padding
    key_cache: torch.Tensor  # [num_blocks, block_size_tokens, Hkv, D]
    value_cache: torch.Tensor  # [num_blocks, block_size_tokens, Hkv, D]
    block_table: torch.Tensor  # [B, max_blocks] int32, -1 past each request's blocks
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    keys: List[torch.Tensor]  # per request [seq_len_b, Hkv, D], unpaged
    values: List[torch.Tensor]  # per request [seq_len_b, Hkv, D], unpaged
    softmax_scale: float

    def op_args(self):
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.seq_lens,
                self.query_start_loc, self.softmax_scale)


def make_paged_case(q_lens, seq_lens, *, num_query_heads, num_kv_heads, head_dim, block_size_tokens,
                    dtype=torch.float32, device="cpu", padding_rows=0, seed=0) -> PagedCase:
    """Scatter random per-request K/V into randomly ordered cache blocks (unused blocks hold noise)."""
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-seq_len // block_size_tokens) for seq_len in seq_lens]
    max_blocks = max(blocks_needed + [0]) + 1  # one extra column that stays -1
    num_blocks = sum(blocks_needed) + 2
    order = torch.randperm(num_blocks, generator=generator)
    block_table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    taken = 0
    for request, count in enumerate(blocks_needed):
        block_table[request, :count] = order[taken:taken + count].int()
        taken += count
    cache_shape = (num_blocks, block_size_tokens, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    value_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    keys, values = [], []
    for request, seq_len in enumerate(seq_lens):
        ids = block_table[request, :blocks_needed[request]].long()
        keys.append(key_cache[ids].flatten(0, 1)[:seq_len])
        values.append(value_cache[ids].flatten(0, 1)[:seq_len])
    num_rows = sum(q_lens) + padding_rows
    query = torch.randn((num_rows, num_query_heads, head_dim), generator=generator).to(dtype)
    query_start_loc = torch.tensor([0] + list(q_lens), dtype=torch.int64).cumsum(0).int()
    return PagedCase(
        query=query.to(device),
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        keys=[k.to(device) for k in keys],
        values=[v.to(device) for v in values],
        softmax_scale=head_dim ** -0.5,
    )


def dense_attention(case: PagedCase) -> torch.Tensor:
    """fp32 SDPA per request over its unpaged K/V with the causal offset; padding rows stay 0."""
    output = torch.zeros(case.query.shape, dtype=torch.float32, device=case.query.device)
    starts = case.query_start_loc.tolist()
    for request, (keys, values) in enumerate(zip(case.keys, case.values)):
        start, end = starts[request], starts[request + 1]
        q_len, seq_len = end - start, keys.shape[0]
        if q_len == 0:
            continue
        positions = torch.arange(seq_len - q_len, seq_len, device=keys.device)  # [q]
        mask = torch.arange(seq_len, device=keys.device)[None, :] <= positions[:, None]  # [q, seq]
        attended = F.scaled_dot_product_attention(
            case.query[start:end].transpose(0, 1).float(),  # [Hq, q, D]
            keys.transpose(0, 1).float(),  # [Hkv, seq, D]
            values.transpose(0, 1).float(),
            attn_mask=mask,
            scale=case.softmax_scale,
            enable_gqa=True,
        )
        output[start:end] = attended.transpose(0, 1)
    return output


def random_mixed_lengths(generator: torch.Generator, num_requests: int, max_context: int):
    """(q_lens, seq_lens): a mix of decodes (1 + S <= 8 rows), full and chunked prefills, padding."""
    q_lens, seq_lens = [], []
    for _ in range(num_requests):
        kind = int(torch.randint(0, 4, (1,), generator=generator))
        seq_len = int(torch.randint(1, max_context + 1, (1,), generator=generator))
        if kind == 0:  # decode with drafts
            q_len = min(seq_len, int(torch.randint(1, 9, (1,), generator=generator)))
        elif kind == 1:  # whole prompt
            q_len = seq_len
        elif kind == 2:  # chunked prefill
            q_len = int(torch.randint(1, seq_len + 1, (1,), generator=generator))
        else:  # padding request of a CUDA-graph bucket
            q_len, seq_len = 0, 0
        q_lens.append(q_len)
        seq_lens.append(seq_len)
    return q_lens, seq_lens


@contextlib.contextmanager
def nan_filled_empty():
    """Within it every floating-point ``torch.empty`` comes back filled with NaN: a kernel whose
    output is not zero-filled first must still write (or zero) every row it owns."""
    empty = torch.empty

    def dirty_empty(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    torch.empty = dirty_empty
    try:
        yield
    finally:
        torch.empty = empty
