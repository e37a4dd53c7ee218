"""A pool of fixed-size KV blocks: sizes in, block ids out.

The allocator only counts blocks. It knows nothing of requests, tensors of the KV cache or the
context; a block id ``b`` names rows ``b * block_size_tokens ... (b + 1) * block_size_tokens - 1``
of every layer's cache, and whoever holds the id decides what is written there.

The free list lives on the host (a Python list used as a stack) with one "allocated" flag per
block, so ``allocate`` and ``release`` cost O(count) and never touch the GPU.

Example::

    pool = KVBlockAllocator(num_blocks=4, block_size_tokens=16)
    a = pool.allocate(3)        # tensor([0, 1, 2])
    pool.allocate(2)            # KVCacheFullError: 1 free, pool unchanged
    pool.release(a[:2])         # 3 free
    pool.release([0])           # ValueError: block 0 is not allocated (double free)
"""

from typing import Sequence, Union

import torch

BlockIds = Union[torch.Tensor, Sequence[int]]


class KVCacheFullError(RuntimeError):
    """Fewer free KV blocks than asked for; nothing was allocated."""


class KVBlockAllocator:
    """Hands out and takes back KV block ids in ``[0, num_blocks)``."""

    def __init__(self, num_blocks: int, block_size_tokens: int, device: Union[str, torch.device] = "cpu"):
        _check_positive_int("num_blocks", num_blocks)
        _check_positive_int("block_size_tokens", block_size_tokens)
        self.num_blocks = num_blocks
        self.block_size_tokens = block_size_tokens
        self.device = torch.device(device)  # where allocate() puts the ids it returns
        # Popped from the end, so block 0 is handed out first.
        self._free_ids = list(range(num_blocks - 1, -1, -1))
        self._is_allocated = bytearray(num_blocks)  # [num_blocks], 1 = held by someone

    @classmethod
    def from_memory_budget(cls, memory_bytes: int, bytes_per_block: int, block_size_tokens: int,
                           device: Union[str, torch.device] = "cpu") -> "KVBlockAllocator":
        """The largest pool whose blocks fit in ``memory_bytes``.

        ``bytes_per_block`` is what one block costs across every layer (keys and values), e.g.
        ``layers * 2 * block_size_tokens * kv_heads * head_dim * dtype_bytes``.
        """
        _check_positive_int("memory_bytes", memory_bytes)
        _check_positive_int("bytes_per_block", bytes_per_block)
        num_blocks = memory_bytes // bytes_per_block
        if num_blocks == 0:
            raise ValueError(f"memory_bytes ({memory_bytes}) is smaller than one block ({bytes_per_block} bytes)")
        return cls(num_blocks, block_size_tokens, device)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids)

    @property
    def num_allocated_blocks(self) -> int:
        return self.num_blocks - len(self._free_ids)

    def blocks_for_tokens(self, token_count: int) -> int:
        """Blocks that hold ``token_count`` tokens: ``ceil(token_count / block_size_tokens)``."""
        return -(-token_count // self.block_size_tokens)

    def allocate(self, count: int) -> torch.Tensor:
        """Take ``count`` free blocks; return their ids, ``[count]`` int64 on ``self.device``.

        Raises ``KVCacheFullError`` (pool unchanged) when fewer than ``count`` are free.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be a non-negative int, got {count!r}")
        if count > len(self._free_ids):
            raise KVCacheFullError(f"asked for {count} KV blocks, {len(self._free_ids)} of {self.num_blocks} are free")
        taken = self._free_ids[len(self._free_ids) - count :][::-1]  # the stack's top first
        del self._free_ids[len(self._free_ids) - count :]
        for block_id in taken:
            self._is_allocated[block_id] = 1
        return torch.tensor(taken, dtype=torch.int64, device=self.device)

    def release(self, block_ids: BlockIds) -> None:
        """Give allocated blocks back.

        ``block_ids``: an integer tensor (any shape) or a sequence of ints. Every id must be
        allocated and appear once; otherwise ``ValueError`` and the pool is unchanged. A tensor
        on a GPU is read back to the host (a synchronisation: the context's step never does
        this, it releases from its host mirror).
        """
        ids = _as_id_list(block_ids)
        seen = set()
        for block_id in ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block_ids: {block_id} is outside the pool [0, {self.num_blocks})")
            if not self._is_allocated[block_id] or block_id in seen:
                raise ValueError(f"block_ids: block {block_id} is not allocated (double free)")
            seen.add(block_id)
        for block_id in ids:
            self._is_allocated[block_id] = 0
        self._free_ids.extend(ids)

    def is_allocated(self, block_id: int) -> bool:
        return 0 <= block_id < self.num_blocks and bool(self._is_allocated[block_id])


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _as_id_list(block_ids: BlockIds) -> list:
    if isinstance(block_ids, torch.Tensor):
        if block_ids.is_floating_point() or block_ids.is_complex() or block_ids.dtype == torch.bool:
            raise TypeError(f"block_ids must be an integer tensor, got {block_ids.dtype}")
        return block_ids.reshape(-1).tolist()  # host-ok: the free list lives on the host
    ids = list(block_ids)
    for block_id in ids:
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise TypeError(f"block_ids entries must be ints, got {type(block_id).__name__}")
    return ids
