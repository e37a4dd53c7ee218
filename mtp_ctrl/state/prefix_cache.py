"""Prefix caching: which full KV blocks of a prompt can be reused, and under which key.

A full block's key is a chained hash: ``key_b = sha256(key_{b-1} | salt | tokens[b*bs : (b+1)*bs + L])``
(``key_{-1}`` is the request's namespace, empty by default: requests of different namespaces never
share a block, e.g. those whose blocks lack a proposer's state). ``L``, the *lookahead*, is how many tokens past the block the content of
the block depends on: 0 for the decoder's own KV (position ``p`` depends on tokens ``<= p``), ``S``
for MTP depths' paged caches (depth ``k`` at position ``p`` embeds ``t_{p+k+1}``), which live in
the same blocks. The salt names everything else that changes a block's content (the proposer and
its depth). Equal keys, equal prefix, equal content: a request that attaches a cached block sees
exactly what it would have computed itself.

Rules (the allocator keeps the reference counts, see :class:`KVBlockAllocator`):

- Only blocks of a request's *prefill tokens* are cached (its prompt; after a preemption, the
  prompt plus the output so far), and only those followed by at least ``max(L, 1)`` more prefill
  tokens: the prompt's last token (whose logits the request needs) and the lookahead are always
  computed by the request itself, so a shared block is never written.
- A block is registered when the step whose prefill chunk completes it (and its lookahead) is
  built: every later step, on the same stream, reads it after it is written. A step built before
  that, in flight, never reads it (it was not attached when that step was built).
- A request attaches the longest run of cached blocks at the start of its prefill tokens when it
  joins (one reference each) and prefills the rest.

Example, ``bs = 4``, ``L = 2``, prefill tokens ``[0..10]`` (11 tokens): blocks 0 and 1 are
cacheable (``(b + 1) * 4 + 2 <= 11``), block 1's key hashes tokens 4..9. A second request with the
same first 10 tokens attaches both and starts its KV at length 8.

Hybrid models (recurrent layers, with ``snapshots``): a block is only worth reusing with the
recurrent state after it (``state/state_snapshots.py``), so a hit is the longest run of cached
blocks whose last block has a snapshot, restored into the request's state slot. Snapshots are
taken where a chunk ends exactly at a *snapshot boundary* of the request (the context makes its
chunks end there, :meth:`PrefixCache.snapshot_boundary`): after its last cacheable block (a later
turn of a chat resends the whole prompt), and after the cached blocks it found without a snapshot
(the point where its prompt leaves an earlier one, e.g. the end of a shared system prompt: the
next request with that prefix hits). Example: A = sys + a, B = sys + b, C = sys + c, joining one
after the other: A snapshots after its last block; B finds sys's blocks cached without a
snapshot, takes no hit and snapshots at the end of sys; C hits sys.
"""

import hashlib
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mtp_ctrl.state.kv_block_allocator import KVBlockAllocator
from mtp_ctrl.state.mamba_slots import MambaStateSlots
from mtp_ctrl.state.state_snapshots import RecurrentStateSnapshots

SnapshotDue = Tuple[int, int, int]  # (request id, blocks before the boundary, its Mamba slot)
_KEY_MEMO_ENTRIES = 1 << 15  # block keys remembered (~0.4 KB each at 16-token blocks, ~14 MB): the memo's bound


class PrefixCache:
    """Keys, attachment and registration of prompt blocks for one context.

    lookahead: ``L`` above, or None when the proposer's state cannot be reused (then nothing is
    ever cached: requests take no hit). salt: bytes that name the model/proposer variant.
    snapshots: the recurrent-state snapshot pool of a hybrid model (None: no recurrent layers).
    """

    def __init__(self, allocator: KVBlockAllocator, lookahead: Optional[int], salt: bytes = b"",
                 snapshots: Optional[RecurrentStateSnapshots] = None):
        if lookahead is not None and (isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0):
            raise ValueError(f"lookahead must be None or an int >= 0, got {lookahead!r}")
        if not isinstance(salt, bytes):
            raise TypeError(f"salt must be bytes, got {type(salt).__name__}")
        self.allocator = allocator
        self.lookahead = lookahead
        self.salt = salt
        self.snapshots = snapshots
        if snapshots is not None:
            allocator.on_forget(snapshots.drop)  # no snapshot outlives its block
        self._keys: Dict[int, List[bytes]] = {}  # request id -> keys of its cacheable blocks
        self._boundaries: Dict[int, List[int]] = {}  # request id -> block counts to snapshot after (ascending)
        self._registered: Dict[int, int] = {}  # request id -> blocks of it registered (or attached) so far
        # (previous key, block + lookahead bytes) -> key: requests sharing a prefix hash it once (a
        # dict lookup compares the bytes exactly; sha256 of a block costs ~5x more). A pure memo of
        # the key formula, so clearing it when it outgrows _KEY_MEMO_ENTRIES changes no key.
        self._key_memo: Dict[Tuple[bytes, bytes], bytes] = {}
        self.queried_tokens = 0  # prefill tokens of requests that looked up the cache
        self.hit_tokens = 0  # of those, tokens found cached

    @property
    def enabled(self) -> bool:
        return self.lookahead is not None

    def cacheable_blocks(self, token_count: int) -> int:
        """Full blocks of ``token_count`` prefill tokens that may be cached (see the module docstring)."""
        if not self.enabled:
            return 0
        block_size = self.allocator.block_size_tokens
        return max(token_count - max(self.lookahead, 1), 0) // block_size

    def block_keys(self, tokens: np.ndarray, namespace: bytes = b"") -> List[bytes]:
        """Keys of the cacheable blocks of ``tokens`` (``[P]`` int64). ``namespace`` seeds the chain
        (``key_{-1}``): blocks of different namespaces never share a key."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        if not self.enabled:
            return []
        raw, block_bytes, lookahead_bytes = tokens.tobytes(), self.allocator.block_size_tokens * 8, self.lookahead * 8
        keys, previous, sha256, salt = [], namespace, hashlib.sha256, self.salt
        memo = self._key_memo
        if len(memo) > _KEY_MEMO_ENTRIES:
            memo.clear()
        for start in range(0, self.cacheable_blocks(tokens.shape[0]) * block_bytes, block_bytes):
            # at most one hash call a block (a 16k-token prompt has ~1000): the digest of the concatenation
            content = raw[start : start + block_bytes + lookahead_bytes]
            key = memo.get((previous, content))
            if key is None:
                key = memo[(previous, content)] = sha256(previous + salt + content).digest()
            keys.append(key)
            previous = key
        return keys

    def attach(self, request_id: int, tokens: np.ndarray, use_cache: bool = True,
               states: Optional[MambaStateSlots] = None, mamba_slot: int = -1, namespace: bytes = b"") -> List[int]:
        """A joining request: the cached blocks its prefill tokens start with, one reference
        taken on each (the caller puts them in its block table). ``use_cache=False``: the
        request neither attaches nor registers blocks. ``namespace``: its blocks are looked up and
        registered under keys of that namespace only (:meth:`block_keys`). With snapshots,
        ``states`` / ``mamba_slot`` are the request's state slot: the hit's last snapshot is
        copied into it."""
        keys = self.block_keys(tokens, namespace) if self.enabled and use_cache else []
        hit = self.allocator.lookup(keys)
        if self.snapshots is not None and keys:
            found = len(hit)
            while hit and not self.snapshots.has(keys[len(hit) - 1]):
                hit.pop()
            if hit:
                self.snapshots.restore(keys[len(hit) - 1], states, mamba_slot)
            self._boundaries[request_id] = sorted({found, len(keys)} - set(range(len(hit) + 1)))
        self.allocator.retain(hit)
        self._keys[request_id] = keys
        self._registered[request_id] = len(hit)
        if keys:
            self.queried_tokens += int(tokens.shape[0])
            self.hit_tokens += len(hit) * self.allocator.block_size_tokens
        return hit

    def register_written(self, request_id: int, block_ids: np.ndarray, known_length: int) -> None:
        """The request's prefill reached ``known_length`` KV rows (in a step just built):
        register its blocks that are now final (each full, with its lookahead computed).
        ``block_ids``: ``[>= blocks]`` int64, the request's block table row."""
        keys = self._keys.get(request_id)
        if not keys:
            return
        block_size, start = self.allocator.block_size_tokens, self._registered[request_id]
        end = min(len(keys), max(known_length - self.lookahead, 0) // block_size)
        for block in range(start, end):
            self.allocator.register(int(block_ids[block]), keys[block])
            self._own_snapshot(request_id, block)
        self._registered[request_id] = max(start, end)

    def snapshot_boundary(self, request_id: int, known_length: int) -> Optional[int]:
        """The next token count past ``known_length`` at which the request's state is snapshotted
        (its prefill chunk must end there), or None."""
        block_size = self.allocator.block_size_tokens
        for blocks in self._boundaries.get(request_id, ()):
            if blocks * block_size > known_length:
                return blocks * block_size
        return None

    def snapshot_boundaries(self, request_ids: np.ndarray, known_lengths: np.ndarray) -> np.ndarray:
        """:meth:`snapshot_boundary` of each request (``[p]`` int64 ids and lengths), -1 for none:
        ``[p]`` int64 (all -1 without snapshots)."""
        boundaries = np.full(request_ids.shape[0], -1, dtype=np.int64)
        if self.snapshots is not None and self.enabled:
            for index, (request_id, known) in enumerate(zip(request_ids.tolist(), known_lengths.tolist())):  # host-ok: numpy
                boundary = self.snapshot_boundary(request_id, known)
                boundaries[index] = -1 if boundary is None else boundary
        return boundaries

    def take_snapshots(self, due: Sequence[SnapshotDue], states: MambaStateSlots) -> None:
        """Copy the state slots of requests whose chunk (in a step just launched) ended at a
        snapshot boundary; owned by the boundary's block key once that block is cached."""
        for request_id, blocks, mamba_slot in due:
            if request_id in self._keys and self.snapshots.take(request_id, blocks - 1, states, mamba_slot) is not None \
                    and self._registered[request_id] >= blocks:
                self._own_snapshot(request_id, blocks - 1)

    def _own_snapshot(self, request_id: int, block: int) -> None:
        if self.snapshots is None or block not in self.snapshots.pending(request_id):
            return
        key = self._keys[request_id][block]
        if self.allocator.lookup([key]):  # cached (by this request, or one with the same prefix)
            self.snapshots.own(request_id, block, key)

    def forget(self, request_id: int) -> None:
        """The request left (its blocks are released by the caller)."""
        self._keys.pop(request_id, None)
        self._registered.pop(request_id, None)
        self._boundaries.pop(request_id, None)
        if self.snapshots is not None:
            self.snapshots.release_pending(request_id)

    def hit_rate(self) -> float:
        """Prefill tokens found cached / prefill tokens looked up (0.0 before any lookup)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
