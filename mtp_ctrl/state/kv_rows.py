"""Grow or shrink the KV cache of a range of request rows (host side), block ids included.

One function serves the three places a KV length changes: ``build_step`` grows rows by this
step's query rows, ``commit_step`` shrinks decode rows by their rejected drafts (what
``rewind_kv_cache`` does on the device), ``finish_request`` shrinks a row to 0.

Example, ``block_size_tokens = 4``: a row with ``kv_length_offsets = 5`` and blocks ``[7, 2]``
resized to 9 takes one block from the allocator (say 9): blocks ``[7, 2, 9]``,
``kv_block_counts = 3``, ``last_kv_block_id = 9``, ``last_kv_block_offset = (9 - 1) % 4 = 0``.
Resized back to 7, block 9 returns to the allocator and the row reads ``[7, 2]``, 2, 2, 2.
"""

import torch

from mtp_ctrl.state.kv_block_allocator import KVBlockAllocator
from mtp_ctrl.state.request_table import RequestRows


def blocks_to_add(rows: RequestRows, start: int, new_lengths: torch.Tensor, block_size_tokens: int) -> torch.Tensor:
    """``[n]`` int64: blocks rows ``[start, start + n)`` must take to hold ``new_lengths`` (>= 0)."""
    end = start + new_lengths.shape[0]
    new_counts = -(-new_lengths // block_size_tokens)
    return (new_counts - rows.kv_block_counts[start:end]).clamp(min=0)


def resize_kv_rows(rows: RequestRows, start: int, new_lengths: torch.Tensor, allocator: KVBlockAllocator) -> None:
    """Set ``kv_length_offsets[start : start + n] = new_lengths`` (``[n]`` int64, host rows).

    Takes the blocks the rows need from ``allocator`` (in row order, then position order) and
    returns the blocks they no longer need. Raises ``KVCacheFullError`` before changing anything
    when the allocator has too few free blocks.
    """
    end = start + new_lengths.shape[0]
    block_size = allocator.block_size_tokens
    counts = rows.kv_block_counts[start:end]  # [n] int64
    block_ids = rows.kv_block_ids[start:end]  # [n, MB] int64
    new_counts = -(-new_lengths // block_size)  # [n] int64
    if new_counts.numel() and int(new_counts.max()) > block_ids.shape[1]:
        raise ValueError(f"a KV length of {int(new_lengths.max())} needs more than {block_ids.shape[1]} blocks")
    columns = torch.arange(block_ids.shape[1])  # [MB] int64
    adding = (columns >= counts[:, None]) & (columns < new_counts[:, None])  # [n, MB] bool
    removing = (columns >= new_counts[:, None]) & (columns < counts[:, None])  # [n, MB] bool
    new_ids = allocator.allocate(int(adding.sum()))
    allocator.release(block_ids[removing])
    block_ids[removing] = -1
    block_ids[adding] = new_ids  # a boolean mask fills row by row, columns ascending
    counts.copy_(new_counts)
    rows.kv_length_offsets[start:end] = new_lengths
    last_column = (new_counts - 1).clamp(min=0)[:, None]  # [n, 1] int64
    last_ids = block_ids.gather(1, last_column).squeeze(1)  # [n] int64
    rows.last_kv_block_id[start:end] = torch.where(new_counts > 0, last_ids, -1)
    rows.last_kv_block_offset[start:end] = torch.remainder(new_lengths - 1, block_size)
