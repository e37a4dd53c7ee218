"""Recurrent-state snapshots of cached blocks (RecurrentStateSnapshots + PrefixCache + the
allocator), as a hypothesis state machine over attach (restore) / write (chunks ending at snapshot
boundaries, then the snapshot) / free / evict / abandon: no snapshot outlives its block, a
snapshot holds the state after exactly its block's prefix and never changes while owned, a hit
restores it, none leaks."""

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mtp_ctrl.state.kv_block_allocator import KVBlockAllocator, KVCacheFullError
from mtp_ctrl.state.mamba_slots import MambaSpec, MambaStateSlots
from mtp_ctrl.state.prefix_cache import PrefixCache
from mtp_ctrl.state.state_snapshots import RecurrentStateSnapshots

BLOCK = 2
NUM_BLOCKS = 10
LOOKAHEAD = 1
NUM_SNAPSHOTS = 3
SPEC = MambaSpec(num_layers=2, conv_state_shape=(1,), ssm_state_shape=(1,), dtype=torch.float64)


def state_after(tokens) -> float:
    """The model's 'recurrent state' after a token prefix (exact in fp64); 0 is the empty state."""
    return float(hash(tuple(int(token) for token in tokens)) % 2**40 + 1) if len(tokens) else 0.0


class PrefixSnapshots(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = KVBlockAllocator(NUM_BLOCKS, BLOCK)
        self.states = MambaStateSlots(SPEC, num_slots=4, num_speculative_tokens=0, device="cpu")
        self.snapshots = RecurrentStateSnapshots(SPEC, NUM_SNAPSHOTS, "cpu")
        self.cache = PrefixCache(self.pool, LOOKAHEAD, salt=b"t", snapshots=self.snapshots)
        self.requests = {}  # request id -> [tokens, block ids, known length, state slot]
        self.prefix_of_key = {}  # block key -> the tokens up to the end of its block
        self.next_id = 0

    def _state(self, slot: int) -> float:
        conv, ssm = self.states.conv_states[:, slot, 0], self.states.ssm_states[:, slot, 0]
        assert bool((conv == conv[0]).all()) and bool((ssm == conv[0]).all())
        return float(conv[0])

    @precondition(lambda self: self.states.num_free_slots > 0)
    @rule(prefix=st.sampled_from([(), (1, 2), (1, 2, 3, 4), (1, 2, 3, 5), (1, 2, 3, 4, 6, 7)]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def attach(self, prefix, tail):
        tokens = np.array(prefix + tuple(tail), dtype=np.int64)
        request_id, self.next_id = self.next_id, self.next_id + 1
        slot = self.states.allocate_slot()
        hit = self.cache.attach(request_id, tokens, True, self.states, slot)
        assert self._state(slot) == state_after(tokens[: len(hit) * BLOCK]), "a hit restores its block's snapshot"
        for index, key in enumerate(self.cache.block_keys(tokens)):
            self.prefix_of_key[key] = tuple(tokens[: (index + 1) * BLOCK])
        self.requests[request_id] = [tokens, list(hit), len(hit) * BLOCK, slot]

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), chunk=st.integers(1, 4))
    def write(self, data, chunk):
        """A prefill chunk (ending at the request's snapshot boundary, if it reaches it): blocks,
        the state after it, registration, then the snapshot (as after the step's launch)."""
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        tokens, blocks, known, slot = self.requests[request_id]
        end = min(known + chunk, tokens.shape[0])
        boundary = self.cache.snapshot_boundary(request_id, known)
        if boundary is not None:
            end = min(end, boundary)
        try:
            blocks.extend(self.pool.allocate(-(-end // BLOCK) - len(blocks)).tolist())
        except KVCacheFullError:
            return
        for state in (self.states.conv_states, self.states.ssm_states):
            state[:, slot] = state_after(tokens[:end])
        self.requests[request_id][2] = end
        self.cache.register_written(request_id, np.array(blocks), end)
        if end == boundary:
            self.cache.take_snapshots([(request_id, end // BLOCK, slot)], self.states)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data):
        """Finish (or preempt) a request: its blocks, pending snapshots and state slot go back."""
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        _, blocks, _, slot = self.requests.pop(request_id)
        self.pool.release(blocks)
        self.cache.forget(request_id)
        self.states.release_slot(slot)
        assert self.snapshots.pending(request_id) == {}

    @rule(count=st.integers(1, NUM_BLOCKS))
    def evict(self, count):
        if count <= self.pool.num_free_blocks:
            self.pool.release(self.pool.allocate(count))

    @rule()
    def abandon(self):
        self.pool.drop_cached()
        assert self.snapshots.num_owned == 0

    @invariant()
    def no_snapshot_outlives_its_block(self):
        assert set(self.snapshots.owned()) <= set(self.pool.cached_blocks().values())

    @invariant()
    def snapshots_hold_their_prefix(self):
        for key, snapshot in self.snapshots.owned().items():
            expected = state_after(self.prefix_of_key[key])
            assert float(self.snapshots.conv_states[0, snapshot, 0]) == expected
            assert float(self.snapshots.ssm_states[1, snapshot, 0]) == expected

    @invariant()
    def none_leaks(self):
        pending = [s for request_id in self.requests for s in self.snapshots.pending(request_id).values()]
        owned = list(self.snapshots.owned().values())
        assert len(set(pending + owned)) == len(pending) + len(owned)
        assert len(pending) + len(owned) + self.snapshots.num_free == NUM_SNAPSHOTS


PrefixSnapshots.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
test_prefix_snapshots = PrefixSnapshots.TestCase


def test_snapshot_pool_bad_input_and_bytes():
    with pytest.raises(ValueError, match="num_snapshots"):
        RecurrentStateSnapshots(SPEC, 0, "cpu")
    assert RecurrentStateSnapshots.bytes_per_snapshot(SPEC) == 2 * (1 + 1) * 8


def test_a_shared_prefix_hits_from_the_third_request():
    """The module docstring's example: A = sys + a snapshots after its last block, B = sys + b
    finds sys cached without a snapshot (no hit) and snapshots where it leaves A, C = sys + c hits
    sys and starts from the state after it. Evicting sys's last block drops its snapshot."""
    pool = KVBlockAllocator(NUM_BLOCKS, BLOCK)
    states = MambaStateSlots(SPEC, num_slots=3, num_speculative_tokens=0, device="cpu")
    cache = PrefixCache(pool, LOOKAHEAD, snapshots=RecurrentStateSnapshots(SPEC, NUM_SNAPSHOTS, "cpu"))
    system = [5, 6, 7, 8, 9]  # 2 blocks, and the token their keys look ahead to
    hits, held = [], []
    for request_id, tail in enumerate([[1, 1, 1], [2, 2, 2], [3, 3, 3]]):
        tokens = np.array(system + tail, dtype=np.int64)
        slot = states.allocate_slot()
        hit = cache.attach(request_id, tokens, True, states, slot)
        hits.append(len(hit))
        assert float(states.conv_states[0, slot, 0]) == state_after(tokens[: len(hit) * BLOCK])  # restored
        blocks, known = list(hit), len(hit) * BLOCK
        while known < tokens.shape[0]:  # one-token chunks, ending at each snapshot boundary
            end = known + 1
            blocks.extend(pool.allocate(-(-end // BLOCK) - len(blocks)).tolist())
            states.conv_states[:, slot] = states.ssm_states[:, slot] = state_after(tokens[:end])
            cache.register_written(request_id, np.array(blocks), end)
            if end == cache.snapshot_boundary(request_id, known):
                cache.take_snapshots([(request_id, end // BLOCK, slot)], states)
            known = end
        held.append(blocks)
    assert hits == [0, 0, 2]
    for request_id, blocks in enumerate(held):
        pool.release(blocks)
        cache.forget(request_id)
    sys_key = cache.block_keys(np.array(system + [3, 3, 3], dtype=np.int64))[1]
    assert cache.snapshots.has(sys_key)
    pool.release(pool.allocate(pool.num_free_blocks))  # evicts every cached block
    assert cache.snapshots.num_owned == 0 and cache.snapshots.num_free == NUM_SNAPSHOTS
