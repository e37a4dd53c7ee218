"""A pool of fixed-size KV blocks: sizes in, block ids out.

The allocator only counts blocks. It knows nothing of requests, tensors of the KV cache or the
context; a block id ``b`` names rows ``b * block_size_tokens ... (b + 1) * block_size_tokens - 1``
of every layer's cache, and whoever holds the id decides what is written there.

The free list lives on the host (a Python list used as a stack) with one reference count per
block, so ``allocate`` and ``release`` cost O(count) and never touch the GPU.

Prefix caching (content-addressed blocks): the holder of a block whose content is final may
:meth:`register` it under a key (a chained hash of the tokens it holds, see
:mod:`mtp_ctrl.state.prefix_cache`). Another holder then finds it (:meth:`lookup`) and takes a
reference (:meth:`retain`); ``release`` drops one reference. A registered block nobody holds stays
cached (its content intact) in least-recently-released order and counts as free: ``allocate``
takes never-cached blocks first, then evicts the least recently released cached ones. A block is
never handed out, evicted or re-registered while referenced, so a cached block's content never
changes while it is cached.

Example::

    pool = KVBlockAllocator(num_blocks=4, block_size_tokens=16)
    a = pool.allocate(3)        # tensor([0, 1, 2])
    pool.allocate(2)            # KVCacheFullError: 1 free, pool unchanged
    pool.release(a[:2])         # 3 free
    pool.release([0])           # ValueError: block 0 is not allocated (double free)
    pool.register(2, b"k")      # block 2's content is final: cached under b"k"
    pool.release([2])           # 4 free, 1 of them cached
    pool.lookup([b"k", b"x"])   # [2]: the longest cached run of keys
    pool.retain([2])            # referenced again: 3 free
"""

import collections
from typing import Callable, Dict, Hashable, List, Sequence, Union

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
        self._reference_counts = [0] * num_blocks  # [num_blocks] holders of each block
        self._block_of_key: Dict[Hashable, int] = {}  # registered key -> block id
        self._key_of_block: Dict[int, Hashable] = {}  # registered block id -> key
        # registered blocks nobody holds, least recently released first (an ordered set)
        self._evictable: "collections.OrderedDict[int, None]" = collections.OrderedDict()
        self.num_evictions = 0  # cached blocks dropped to hand their id out again
        self._on_forget: List[Callable[[Hashable], None]] = []  # told each key that stops naming a block

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
        """Blocks ``allocate`` can hand out: never-cached ones and cached ones nobody holds."""
        return len(self._free_ids) + len(self._evictable)

    @property
    def num_allocated_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks (held or not)."""
        return len(self._key_of_block)

    def blocks_for_tokens(self, token_count: int) -> int:
        """Blocks that hold ``token_count`` tokens: ``ceil(token_count / block_size_tokens)``."""
        return -(-token_count // self.block_size_tokens)

    def allocate(self, count: int) -> torch.Tensor:
        """Take ``count`` free blocks; return their ids, ``[count]`` int64 on ``self.device``.

        Raises ``KVCacheFullError`` (pool unchanged) when fewer than ``count`` are free.
        """
        return torch.tensor(self.take(count), dtype=torch.int64, device=self.device)

    def take(self, count: int) -> List[int]:
        """:meth:`allocate` for the host: the ``count`` blocks' ids as ints (the context's
        reservations stage them in its own step copy, so no tensor is built for them)."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be a non-negative int, got {count!r}")
        if count > self.num_free_blocks:
            raise KVCacheFullError(f"asked for {count} KV blocks, {self.num_free_blocks} of {self.num_blocks} are free")
        plain = min(count, len(self._free_ids))
        taken = self._free_ids[len(self._free_ids) - plain :][::-1]  # the stack's top first
        del self._free_ids[len(self._free_ids) - plain :]
        for _ in range(count - plain):  # then evict cached blocks, least recently released first
            block_id, _ = self._evictable.popitem(last=False)
            key = self._key_of_block.pop(block_id)
            del self._block_of_key[key]
            self.num_evictions += 1
            for listener in self._on_forget:
                listener(key)
            taken.append(block_id)
        for block_id in taken:
            self._reference_counts[block_id] = 1
        return taken

    def release(self, block_ids: BlockIds) -> None:
        """Drop one reference to each block; a block nobody holds any more is free again
        (registered ones stay cached until evicted).

        ``block_ids``: an integer tensor (any shape) or a sequence of ints. Every id must be
        allocated and appear once; otherwise ``ValueError`` and the pool is unchanged. A tensor
        on a GPU is read back to the host (a synchronisation: the context's step never does
        this, it releases from its host mirror).
        """
        ids = self._checked_held_ids(block_ids, "not allocated (double free)")
        for block_id in ids:
            self._reference_counts[block_id] -= 1
            if self._reference_counts[block_id] == 0:
                if block_id in self._key_of_block:
                    self._evictable[block_id] = None  # the most recently released: evicted last
                else:
                    self._free_ids.append(block_id)

    def is_allocated(self, block_id: int) -> bool:
        return 0 <= block_id < self.num_blocks and self._reference_counts[block_id] > 0

    def reference_count(self, block_id: int) -> int:
        """Holders of ``block_id`` (0: free or cached, unreferenced)."""
        return self._reference_counts[block_id]

    # ----- content-addressed blocks (prefix caching) ----------------------------------------

    def register(self, block_id: int, key: Hashable) -> bool:
        """Cache a held block whose content is final under ``key``. Returns False (nothing
        changes) when the key already names a cached block or the block has a key already."""
        if not self.is_allocated(block_id):
            raise ValueError(f"block_id: block {block_id} is not allocated; only a held block can be registered")
        if key in self._block_of_key or block_id in self._key_of_block:
            return False
        self._block_of_key[key] = block_id
        self._key_of_block[block_id] = key
        return True

    def lookup(self, keys: Sequence[Hashable]) -> List[int]:
        """Block ids of the longest run ``keys[:n]`` that are all cached (no reference taken)."""
        found = []
        for key in keys:
            block_id = self._block_of_key.get(key)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def retain(self, block_ids: Sequence[int]) -> None:
        """Take one more reference to each cached block (from :meth:`lookup`); an unreferenced
        one stops being evictable."""
        ids, seen = list(block_ids), set()
        for block_id in ids:  # O(len(ids)): a 16k-token prompt attaches ~1000 blocks
            if block_id not in self._key_of_block or block_id in seen:
                raise ValueError(f"block_ids: block {block_id} is not a cached block (or repeats)")
            seen.add(block_id)
        for block_id in ids:
            if self._reference_counts[block_id] == 0:
                del self._evictable[block_id]
            self._reference_counts[block_id] += 1

    def cached_blocks(self) -> Dict[int, Hashable]:
        """Registered blocks: block id -> key (a copy; for tests and metrics)."""
        return dict(self._key_of_block)

    def on_forget(self, listener: Callable[[Hashable], None]) -> None:
        """Call ``listener(key)`` whenever a key stops naming a cached block (eviction,
        :meth:`drop_cached`): whatever else the key owns (a recurrent-state snapshot) goes too."""
        self._on_forget.append(listener)

    def drop_cached(self) -> None:
        """Forget every key (cached blocks nobody holds become plain free blocks), e.g. when
        steps that were writing registered blocks failed."""
        for block_id in self._evictable:
            self._free_ids.append(block_id)
        self._evictable.clear()
        for listener in self._on_forget:
            for key in self._block_of_key:
                listener(key)
        self._block_of_key.clear()
        self._key_of_block.clear()

    def _checked_held_ids(self, block_ids: BlockIds, what: str) -> list:
        ids = _as_id_list(block_ids)
        seen = set()
        for block_id in ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block_ids: {block_id} is outside the pool [0, {self.num_blocks})")
            if self._reference_counts[block_id] == 0 or block_id in seen:
                raise ValueError(f"block_ids: block {block_id} is {what}")
            seen.add(block_id)
        return ids


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
