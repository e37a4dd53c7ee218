"""Recurrent-state snapshots of prompt blocks: what lets a hybrid model (Mamba-2, Gated DeltaNet)
reuse a cached prefix.

An attention layer's state at a block boundary is the KV of the blocks before it; a recurrent
layer's is one conv window and one SSM state per layer, which the state slot overwrites as the
prompt goes on. So a request whose prefill chunk ends exactly at a boundary the prefix cache
wants (``PrefixCache.snapshot_boundary``) copies its slot's current states into a snapshot slot
of this pool right after that step is launched (stream-ordered: after the step, before the next).
A request whose prompt starts with cached blocks copies the snapshot of its last reused block
into its own state slot when it joins and prefills the rest.

Letters: L recurrent layers, K snapshot slots.

Ownership (host only, nothing waits for the GPU):

- a snapshot taken before its block is cached is *pending*, held by its request
  (:meth:`take`); once the block's key is cached the key owns it (:meth:`own`); a request that
  leaves first gives its pending snapshots back (:meth:`release_pending`);
- the allocator evicting (or forgetting) a block drops the key's snapshot (:meth:`drop`,
  :meth:`drop_all`): no snapshot outlives its block;
- a full pool takes the least recently used owned snapshot (its block stays cached, without a
  snapshot); with none owned, no snapshot is taken (the request simply is not a source of hits);
- a snapshot's content is written once, by :meth:`take`; every later reader is stream-ordered
  after that copy and before any reuse of the slot (the same argument as for KV blocks).
"""

import collections
from typing import Dict, Hashable, Optional

import torch

from mtp_ctrl.state.mamba_slots import MambaSpec, MambaStateSlots


class RecurrentStateSnapshots:
    """``num_snapshots`` snapshot slots of every recurrent layer's conv and SSM state."""

    def __init__(self, spec: MambaSpec, num_snapshots: int, device):
        if isinstance(num_snapshots, bool) or not isinstance(num_snapshots, int) or num_snapshots < 1:
            raise ValueError(f"num_snapshots must be an int >= 1, got {num_snapshots!r}")
        self.num_snapshots = num_snapshots
        options = dict(dtype=spec.dtype, device=device)
        self.conv_states = torch.zeros(spec.num_layers, num_snapshots, *spec.conv_state_shape, **options)  # [L, K, *conv]
        self.ssm_states = torch.zeros(spec.num_layers, num_snapshots, *spec.ssm_state_shape, **options)  # [L, K, *ssm]
        self._free = list(range(num_snapshots - 1, -1, -1))  # popped from the end: snapshot 0 first
        # owned snapshots: key -> snapshot slot, least recently used first (an ordered dict)
        self._snapshot_of_key: "collections.OrderedDict[Hashable, int]" = collections.OrderedDict()
        self._pending: Dict[int, Dict[int, int]] = {}  # request id -> {block index: snapshot slot}
        self.num_evictions = 0  # owned snapshots dropped to take a new one

    @staticmethod
    def bytes_per_snapshot(spec: MambaSpec) -> int:
        element = torch.empty((), dtype=spec.dtype).element_size()
        numel = sum(torch.Size(shape).numel() for shape in (spec.conv_state_shape, spec.ssm_state_shape))
        return spec.num_layers * numel * element

    @property
    def num_owned(self) -> int:
        return len(self._snapshot_of_key)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def has(self, key: Hashable) -> bool:
        return key in self._snapshot_of_key

    def owned(self) -> Dict[Hashable, int]:
        """Owned snapshots: key -> snapshot slot (a copy; for tests)."""
        return dict(self._snapshot_of_key)

    def pending(self, request_id: int) -> Dict[int, int]:
        """The request's pending snapshots: block index -> snapshot slot (a copy; for tests)."""
        return dict(self._pending.get(request_id, {}))

    def take(self, request_id: int, block_index: int, states: MambaStateSlots, mamba_slot: int) -> Optional[int]:
        """Copy the current states of ``mamba_slot`` (its request's state after ``block_index + 1``
        full blocks) into a snapshot slot held by the request; returns the slot, or None when every
        slot is pending (nothing is copied)."""
        if not self._free:
            if not self._snapshot_of_key:
                return None
            _, evicted = self._snapshot_of_key.popitem(last=False)
            self._free.append(evicted)
            self.num_evictions += 1
        snapshot = self._free.pop()
        self.conv_states[:, snapshot].copy_(states.conv_states[:, mamba_slot])  # device copies: no sync
        self.ssm_states[:, snapshot].copy_(states.ssm_states[:, mamba_slot])
        self._pending.setdefault(request_id, {})[block_index] = snapshot
        return snapshot

    def own(self, request_id: int, block_index: int, key: Hashable) -> None:
        """The request's block ``block_index`` is cached under ``key``: its pending snapshot (if
        any) becomes the key's, or is given back when the key has one already (same content)."""
        snapshot = self._pending.get(request_id, {}).pop(block_index, None)
        if snapshot is None:
            return
        if key in self._snapshot_of_key:
            self._free.append(snapshot)
        else:
            self._snapshot_of_key[key] = snapshot

    def restore(self, key: Hashable, states: MambaStateSlots, mamba_slot: int) -> None:
        """Copy the key's snapshot into ``mamba_slot``'s current states (a joining request)."""
        snapshot = self._snapshot_of_key[key]
        self._snapshot_of_key.move_to_end(key)  # the most recently used: evicted last
        states.conv_states[:, mamba_slot].copy_(self.conv_states[:, snapshot])
        states.ssm_states[:, mamba_slot].copy_(self.ssm_states[:, snapshot])

    def drop(self, key: Hashable) -> None:
        """The block cached under ``key`` was evicted: its snapshot goes with it."""
        snapshot = self._snapshot_of_key.pop(key, None)
        if snapshot is not None:
            self._free.append(snapshot)

    def drop_all(self) -> None:
        """Every cached block was forgotten (``KVBlockAllocator.drop_cached``)."""
        self._free.extend(self._snapshot_of_key.values())
        self._snapshot_of_key.clear()

    def release_pending(self, request_id: int) -> None:
        """The request left: its snapshots whose blocks were never cached are free again."""
        self._free.extend(self._pending.pop(request_id, {}).values())
