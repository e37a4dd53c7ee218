"""Reference-counted, content-addressed KV blocks (KVBlockAllocator + PrefixCache), as a
hypothesis state machine over attach / write / free / evict / preempt / abandon: no block is handed out
while referenced, none leaks, and a cached block's content never changes while it is cached."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mtp_ctrl.state.kv_block_allocator import KVBlockAllocator, KVCacheFullError
from mtp_ctrl.state.prefix_cache import PrefixCache

BLOCK = 2
NUM_BLOCKS = 10
LOOKAHEAD = 1


class PrefixBlocks(RuleBasedStateMachine):
    """Requests as the context runs them: attach a cached prefix at admission, prefill the rest in
    chunks (each block's 'content' = the tokens written into it), finish or get preempted. A
    model of the pool's memory checks what an attached block holds."""

    def __init__(self):
        super().__init__()
        self.pool = KVBlockAllocator(NUM_BLOCKS, BLOCK)
        self.cache = PrefixCache(self.pool, LOOKAHEAD, salt=b"t")
        self.memory = {}  # block id -> tuple of the tokens written there (its content)
        self.requests = {}  # request id -> [tokens, block ids, known length]
        self.next_id = 0

    @rule(prefix=st.sampled_from([(), (1, 2), (1, 2, 3, 4), (1, 2, 3, 5)]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def attach(self, prefix, tail):
        tokens = np.array(prefix + tuple(tail), dtype=np.int64)
        request_id, self.next_id = self.next_id, self.next_id + 1
        hit = self.cache.attach(request_id, tokens)
        for index, block_id in enumerate(hit):  # a hit holds exactly this prefix's tokens
            assert self.memory[block_id] == tuple(tokens[index * BLOCK : (index + 1) * BLOCK])
        assert len(hit) * BLOCK + max(LOOKAHEAD, 1) <= tokens.shape[0]
        self.requests[request_id] = [tokens, list(hit), len(hit) * BLOCK]

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), chunk=st.integers(1, 4))
    def write(self, data, chunk):
        """A prefill chunk: take blocks, write the tokens, register what became final."""
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        tokens, blocks, known = self.requests[request_id]
        end = min(known + chunk, tokens.shape[0])
        needed = -(-end // BLOCK) - len(blocks)
        try:
            new = self.pool.allocate(needed).tolist()
        except KVCacheFullError:
            return
        for block_id in new:
            assert self.pool.reference_count(block_id) == 1
            self.memory[block_id] = ()  # evicted or free: its old content is gone
        blocks.extend(new)
        for position in range(known, end):
            block_id = blocks[position // BLOCK]
            assert self.pool.reference_count(block_id) == 1, "a shared block is never written"
            assert block_id not in self.pool.cached_blocks(), "a cached block is never written"
            self.memory[block_id] = self.memory[block_id] + (int(tokens[position]),)
        self.requests[request_id][2] = end
        self.cache.register_written(request_id, np.array(blocks), end)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data):
        """Finish (or preempt: the same for the blocks) a request: only its own references go."""
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        _, blocks, _ = self.requests.pop(request_id)
        counts = [self.pool.reference_count(block_id) for block_id in blocks]
        self.pool.release(blocks)
        self.cache.forget(request_id)
        assert [self.pool.reference_count(block_id) for block_id in blocks] == [count - 1 for count in counts]

    @rule(count=st.integers(1, NUM_BLOCKS))
    def evict(self, count):
        """Someone else needs blocks: cached unreferenced ones are evicted, never held ones."""
        if count > self.pool.num_free_blocks:
            with pytest.raises(KVCacheFullError):
                self.pool.allocate(count)
            return
        taken = self.pool.allocate(count).tolist()
        held = {block_id for _, blocks, _ in self.requests.values() for block_id in blocks}
        assert not held & set(taken)
        for block_id in taken:
            self.memory[block_id] = ()
        self.pool.release(taken)

    @rule()
    def abandon(self):
        """Steps in flight failed (``context.abandon_steps_in_flight``): every key is forgotten;
        held blocks stay held, cached free ones become plain free blocks."""
        self.pool.drop_cached()
        assert self.pool.num_cached_blocks == 0 and self.pool.cached_blocks() == {}

    @invariant()
    def counts_match_holders(self):
        holders = {}
        for _, blocks, _ in self.requests.values():
            for block_id in blocks:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block_id in range(NUM_BLOCKS):
            assert self.pool.reference_count(block_id) == holders.get(block_id, 0)
        assert self.pool.num_free_blocks == NUM_BLOCKS - len(holders)  # none leaks

    @invariant()
    def cached_content_is_its_key(self):
        """A cached block holds the tokens its key was made from (content never changes)."""
        for block_id, key in self.pool.cached_blocks().items():
            assert len(self.memory[block_id]) == BLOCK
            assert self.pool.lookup([key]) == [block_id]


PrefixBlocks.TestCase.settings = settings(max_examples=80, stateful_step_count=25, deadline=None)
test_prefix_blocks = PrefixBlocks.TestCase


def test_keys_and_cacheable_blocks():
    """Worked example of the module docstring: bs 4, L 2, 11 tokens -> 2 cacheable blocks; keys
    chain (a different first block changes every key) and cover the lookahead."""
    pool = KVBlockAllocator(8, 4)
    cache = PrefixCache(pool, 2)
    tokens = np.arange(11)
    keys = cache.block_keys(tokens)
    assert len(keys) == 2 and cache.cacheable_blocks(11) == 2 and cache.cacheable_blocks(10) == 2
    assert cache.cacheable_blocks(9) == 1
    changed_lookahead = tokens.copy()
    changed_lookahead[9] = 99
    assert cache.block_keys(changed_lookahead)[0] == keys[0] and cache.block_keys(changed_lookahead)[1] != keys[1]
    changed_first = tokens.copy()
    changed_first[0] = 99
    assert all(a != b for a, b in zip(cache.block_keys(changed_first), keys))
    assert PrefixCache(pool, 2, salt=b"x").block_keys(tokens)[0] != keys[0]
    assert PrefixCache(pool, None).block_keys(tokens) == []
    # keys are a function of the tokens alone: a cache that hashed other prompts first (its memo of
    # shared blocks warm) gives every prompt the keys a fresh one does
    for prompt in (changed_first, changed_lookahead, tokens, np.arange(30)):
        assert cache.block_keys(prompt) == PrefixCache(pool, 2).block_keys(prompt)


def test_allocator_register_and_bad_input():
    pool = KVBlockAllocator(3, 4)
    a = pool.allocate(2).tolist()
    assert pool.register(a[0], b"k") and not pool.register(a[1], b"k") and not pool.register(a[0], b"j")
    pool.release(a)
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 1 and pool.lookup([b"k", b"z"]) == [a[0]]
    pool.retain([a[0]])
    assert pool.num_free_blocks == 2 and pool.reference_count(a[0]) == 1
    with pytest.raises(ValueError, match="not allocated"):
        pool.register(a[1], b"z")
    with pytest.raises(ValueError, match="not a cached block"):
        pool.retain([a[1]])
    pool.release([a[0]])
    taken = pool.allocate(3).tolist()  # the two plain free blocks first, then the cached one
    assert taken[-1] == a[0] and pool.num_evictions == 1 and pool.num_cached_blocks == 0
    with pytest.raises(ValueError, match="lookahead"):
        PrefixCache(pool, -1)
    with pytest.raises(TypeError, match="salt"):
        PrefixCache(pool, 0, salt="x")
