"""KVBlockAllocator: exact accounting under long random sequences, and every rejection."""

import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mtp_ctrl.state import KVBlockAllocator, KVCacheFullError


def check_accounting(pool: KVBlockAllocator, held: dict) -> None:
    """Every id is either held by exactly one owner or free, and the counts say so."""
    held_ids = [block for blocks in held.values() for block in blocks]
    assert len(held_ids) == len(set(held_ids)), "an id was handed out twice"
    assert pool.num_allocated_blocks == len(held_ids)
    assert pool.num_free_blocks == pool.num_blocks - len(held_ids)
    assert all(pool.is_allocated(block) for block in held_ids)
    assert sum(pool.is_allocated(block) for block in range(pool.num_blocks)) == len(held_ids)


def test_allocate_and_release_known_answer():
    pool = KVBlockAllocator(num_blocks=4, block_size_tokens=16)
    assert torch.equal(pool.allocate(3), torch.tensor([0, 1, 2]))
    with pytest.raises(KVCacheFullError, match="asked for 2 KV blocks, 1 of 4"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.release(torch.tensor([0, 1]))
    assert pool.num_free_blocks == 3
    with pytest.raises(ValueError, match="block 0 is not allocated"):
        pool.release([0])
    assert pool.allocate(0).shape == (0,)
    assert pool.allocate(0).dtype == torch.int64
    assert pool.blocks_for_tokens(33) == 3 and pool.blocks_for_tokens(0) == 0


def test_take_hands_out_host_ints_with_allocates_accounting():
    """``take`` (the context's reservations: no tensor a step) is ``allocate`` as a list of ints."""
    pool = KVBlockAllocator(num_blocks=4, block_size_tokens=16)
    assert pool.take(2) == [0, 1] and pool.take(0) == []
    assert pool.is_allocated(1) and pool.num_free_blocks == 2
    with pytest.raises(KVCacheFullError):
        pool.take(3)
    assert pool.num_free_blocks == 2  # unchanged by the refusal
    with pytest.raises(ValueError, match="count"):
        pool.take(-1)
    pool.release([0, 1])
    assert sorted(pool.take(4)) == [0, 1, 2, 3]


def test_release_validates_everything_before_changing_anything():
    pool = KVBlockAllocator(num_blocks=5, block_size_tokens=2)
    held = pool.allocate(3).tolist()
    for bad, error in (
        ([held[0], 4], "not allocated"),  # 4 is free: a foreign id
        ([held[0], held[0]], "not allocated"),  # duplicate within one call
        ([held[1], 5], "outside the pool"),
        ([-1], "outside the pool"),
    ):
        with pytest.raises(ValueError, match=error):
            pool.release(bad)
        check_accounting(pool, {"owner": held})
    with pytest.raises(TypeError, match="integer tensor"):
        pool.release(torch.tensor([0.0]))
    with pytest.raises(TypeError, match="entries must be ints"):
        pool.release([True])


def test_constructor_and_budget_sizing():
    pool = KVBlockAllocator.from_memory_budget(memory_bytes=1000, bytes_per_block=96, block_size_tokens=8)
    assert pool.num_blocks == 10 and pool.block_size_tokens == 8
    with pytest.raises(ValueError, match="smaller than one block"):
        KVBlockAllocator.from_memory_budget(memory_bytes=95, bytes_per_block=96, block_size_tokens=8)
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        KVBlockAllocator(0, 16)
    with pytest.raises(TypeError, match="block_size_tokens must be an int"):
        KVBlockAllocator(4, 2.0)
    with pytest.raises(ValueError, match="count must be a non-negative int"):
        KVBlockAllocator(4, 2).allocate(-1)


@pytest.mark.parametrize("seed", range(6))
def test_seeded_request_like_sequences(seed):
    """Requests grow, rewind their last blocks, finish; bad releases are rejected; the pool fills."""
    rng = random.Random(seed)
    pool = KVBlockAllocator(num_blocks=rng.choice([1, 7, 32]), block_size_tokens=4)
    held = {}
    for _ in range(400):
        action = rng.random()
        owner = rng.randrange(6)
        blocks = held.setdefault(owner, [])
        if action < 0.45:
            count = rng.randrange(0, 4)
            if count > pool.num_free_blocks:
                with pytest.raises(KVCacheFullError):
                    pool.allocate(count)
            else:
                blocks.extend(pool.allocate(count).tolist())
        elif action < 0.7 and blocks:  # a rewind crossing back over its last block(s)
            count = rng.randrange(1, len(blocks) + 1)
            pool.release(torch.tensor(blocks[-count:]))
            del blocks[-count:]
        elif action < 0.8:  # the request finishes
            pool.release(blocks)
            blocks.clear()
        elif action < 0.9 and blocks:  # double free
            victim = blocks.pop(rng.randrange(len(blocks)))
            pool.release([victim])
            with pytest.raises(ValueError):
                pool.release([victim, *blocks[:1]])
        else:  # an id nobody holds, or outside the pool
            free = [block for block in range(pool.num_blocks) if not pool.is_allocated(block)]
            bad = rng.choice(free) if free and rng.random() < 0.5 else pool.num_blocks + rng.randrange(3)
            with pytest.raises(ValueError):
                pool.release([*blocks[:1], bad])
        check_accounting(pool, held)


class AllocatorMachine(RuleBasedStateMachine):
    """The same invariants, with hypothesis choosing (and shrinking) the sequence."""

    def __init__(self):
        super().__init__()
        self.pool = KVBlockAllocator(num_blocks=9, block_size_tokens=2)
        self.held = []

    @rule(count=st.integers(0, 5))
    def allocate(self, count):
        if count > self.pool.num_free_blocks:
            with pytest.raises(KVCacheFullError):
                self.pool.allocate(count)
        else:
            self.held.extend(self.pool.allocate(count).tolist())

    @rule(count=st.integers(1, 3))
    def rewind_release(self, count):
        released = self.held[-count:]
        self.pool.release(released)
        del self.held[-count:]

    @rule(block=st.integers(-2, 11))
    def release_unheld(self, block):
        if block not in self.held:
            with pytest.raises(ValueError):
                self.pool.release([block])

    @invariant()
    def accounting(self):
        check_accounting(self.pool, {"all": self.held})


AllocatorMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase


def test_ids_are_returned_on_the_allocators_device():
    pool = KVBlockAllocator(num_blocks=3, block_size_tokens=4, device="cpu")
    ids = pool.allocate(2)
    assert ids.device == torch.device("cpu") and ids.dtype == torch.int64
    pool.release(ids)
    assert pool.num_free_blocks == 3
