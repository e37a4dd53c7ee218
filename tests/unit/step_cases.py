"""Random cases for the MTP step ops: packed tokens, consistent KV bookkeeping, helpers.

Shared by tests/unit (CPU, interpreter) and tests/functional (CUDA). Every tensor is built on
the CPU from a seeded generator, then moved to ``device``.
"""

import dataclasses
from typing import List

import torch

KV_STATE_FIELDS = ("last_kv_block_offset", "kv_length_offsets", "kv_block_counts", "last_kv_block_id", "kv_block_ids")


@dataclasses.dataclass
class TokenCase:
    input_tokens: torch.Tensor  # [T] int64 packed rows (+ `extra_rows` rows past the packed region)
    output_tokens: torch.Tensor  # [T] int64, the target's samples
    required_logit_indices: torch.Tensor  # [T] int64, distinct forward-pass positions
    num_decode_requests: int
    num_prefill_requests: int
    num_speculative_tokens: int

    @property
    def num_requests(self) -> int:
        return self.num_decode_requests + self.num_prefill_requests


def make_token_case(num_decode, num_prefill, num_spec, *, seed, extra_rows=0, accept_prob=0.7, vocab=50,
                    device="cpu") -> TokenCase:
    """Drafts match the target's previous sample with probability ``accept_prob`` (else a random token)."""
    generator = torch.Generator().manual_seed(seed)
    stride = num_spec + 1
    num_rows = num_decode * stride + num_prefill + extra_rows
    output_tokens = torch.randint(0, vocab, (num_rows,), generator=generator)
    input_tokens = torch.randint(0, vocab, (num_rows,), generator=generator)
    draft_rows = torch.arange(num_decode * stride)
    draft_rows = draft_rows[draft_rows % stride != 0]  # rows 1..S of every decode request
    copied = torch.rand(draft_rows.shape[0], generator=generator) < accept_prob
    input_tokens[draft_rows[copied]] = output_tokens[draft_rows[copied] - 1]
    required = torch.randperm(4 * num_rows + 1, generator=generator)[:num_rows]
    return TokenCase(input_tokens.to(device), output_tokens.to(device), required.to(device),
                     num_decode, num_prefill, num_spec)


def make_kv_state(num_requests, num_spec, block_size, *, seed, max_blocks=None, dtype=torch.int64, views=False,
                  device="cpu") -> List[torch.Tensor]:
    """Bookkeeping of requests holding ``kv_len >= num_spec + 1`` tokens, in ``KV_STATE_FIELDS`` order.

    ``last_kv_block_offset = (kv_len - 1) % block_size``, ``kv_block_counts = ceil(kv_len / block_size)``,
    distinct block ids, -1 past each request's blocks. With ``views`` every tensor is a strided view of
    a larger table (a column of a wider table, rows offset by one).
    """
    generator = torch.Generator().manual_seed(seed)
    min_blocks = -(-(num_spec + 1) // block_size)
    max_blocks = max_blocks or min_blocks + 3
    kv_len = torch.randint(num_spec + 1, max_blocks * block_size + 1, (num_requests,), generator=generator)
    counts = (kv_len - 1) // block_size + 1
    ids = torch.full((num_requests, max_blocks), -1, dtype=torch.int64)
    pool = torch.randperm(num_requests * max_blocks + 5, generator=generator)
    columns = torch.arange(max_blocks)
    held = columns[None, :] < counts[:, None]
    ids[held] = pool[: int(held.sum())]
    last_id = ids.gather(1, (counts - 1)[:, None]).squeeze(1)
    state = [(kv_len - 1) % block_size, kv_len, counts, last_id, ids]
    state = [tensor.to(dtype=dtype, device=device) for tensor in state]
    return [_strided_view(tensor) for tensor in state] if views else state


def _strided_view(tensor: torch.Tensor) -> torch.Tensor:
    """The same values as a view into a larger table: row offset 1, inner stride 3 (padding in between)."""
    table = torch.full((tensor.shape[0] + 2,) + tensor.shape[1:] + (3,), -7, dtype=tensor.dtype, device=tensor.device)
    view = table[1 : 1 + tensor.shape[0], ..., 1]
    view.copy_(tensor)
    return view


def clone_all(tensors):
    return [tensor.clone() for tensor in tensors]


def assert_all_equal(got, want):
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, (index, a.shape, b.shape, a.dtype, b.dtype)
        assert torch.equal(a, b), (index, a, b)
