"""Scheduler: the step loop's policy alone (sizes in, decisions out), hand-worked answers and
hypothesis properties; then the context carrying its decisions out over random runs with no
model (the device half of each step is not run: only the host's books are checked)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtp_ctrl.state import DynamicInferenceContext, KVCacheFullError, KVCacheSpec
from mtp_ctrl.state.engine_shape import EngineShape
from mtp_ctrl.state.scheduler import Scheduler, decode_run_lengths, worst_case_blocks


def make_scheduler(**overrides) -> Scheduler:
    args = dict(max_requests=4, max_model_len=32, block_size_tokens=4, num_speculative_tokens=2,
                max_tokens_per_step=16)
    args.update(overrides)
    return Scheduler(EngineShape(**args))


def test_worst_case_formula_known_answers():
    # S = 2, bs = 4: known 5 tokens, one step in flight -> 5 + 3 * 2 = 11 tokens -> 3 blocks
    assert worst_case_blocks(5, 1, 2, 4) == 3
    assert worst_case_blocks(5, 0, 2, 4) == 2  # 8 tokens
    assert worst_case_blocks(np.array([0, 1, 4]), 0, 0, 4).tolist() == [1, 1, 2]
    scheduler = make_scheduler()
    assert scheduler.shape.max_blocks_per_request == 10 == worst_case_blocks(32, 1, 2, 4)  # 38 tokens
    assert scheduler.worst_case_blocks(100, 1) == 10  # capped
    assert scheduler.max_block_writes_per_step == 4 * (2 + 1) + 4 + 1
    needs = scheduler.blocks_needed(np.array([5, 5, 30]), np.array([2, 3, 10]), steps_in_flight=1)
    assert needs.tolist() == [1, 0, 0]


def test_admission_and_preemption_known_answers():
    scheduler = make_scheduler()
    assert not scheduler.can_admit(3, preempted=False, free_rows=0, free_blocks=99)
    assert scheduler.can_admit(30, preempted=False, free_rows=1, free_blocks=0)  # a new prompt just waits for blocks
    # an evicted request of 10 tokens comes back only when 10 + 2 * 3 = 16 tokens (4 blocks) are free
    assert not scheduler.can_admit(10, preempted=True, free_rows=1, free_blocks=3)
    assert scheduler.can_admit(10, preempted=True, free_rows=1, free_blocks=4)
    # prefilling requests with 16 prompt tokens left fill the 16-token budget: the next one would get
    # no chunk next step (chunks go in row order, stopping at the first partial one), so it waits
    assert scheduler.can_admit(3, preempted=False, free_rows=1, free_blocks=99, prefill_backlog=15)
    assert not scheduler.can_admit(3, preempted=False, free_rows=1, free_blocks=99, prefill_backlog=16)
    for request_id in (7, 3, 9):
        scheduler.admitted(request_id)
    assert scheduler.preemption_victim() == 9
    scheduler.released(9)
    scheduler.released(7)
    assert scheduler.preemption_victim() == 3
    assert scheduler.should_preempt(num_live=2, steps_in_flight=0)
    assert not scheduler.should_preempt(num_live=1, steps_in_flight=0)  # evicting the only request frees nothing useful
    assert not scheduler.should_preempt(num_live=3, steps_in_flight=1)  # learn the step in flight's outcome first
    scheduler.released(3)
    with pytest.raises(ValueError, match="no live request"):
        scheduler.preemption_victim()


def test_pause_resume_and_chunk_known_answers():
    scheduler = make_scheduler()
    # rows need 1, 0, 2, 1 blocks, 2 free: row 0 takes 1, row 1 none, row 2 does not fit -> it and row 3 pause
    assert scheduler.decodes_to_pause(np.array([1, 0, 2, 1]), 2).tolist() == [False, False, True, True]
    assert scheduler.decodes_to_pause(np.array([1, 0, 2, 0]), 2).tolist() == [False, False, True, False]
    assert scheduler.num_to_resume([1, 2, 1], 3) == 2
    assert scheduler.num_to_resume([4, 1], 3) == 0  # the oldest does not fit: the younger waits too
    # budget 16 - 2 decodes * 3 = 10 tokens; 20 free less 2 * 1 reserved blocks: prompts of 6, 9, 3 left
    lengths = scheduler.prefill_chunk_lengths(np.array([6, 9, 3]), np.array([0, 0, 0]), np.array([0, 0, 0]), 20, 2)
    assert lengths == [6, 4]  # the second stops mid-prompt: the last chunk of the step
    # 3 free blocks less 2 reserved = 1: a request holding 1 block with 2 tokens can take 2 + 4 more
    assert scheduler.prefill_chunk_lengths(np.array([9]), np.array([2]), np.array([1]), 3, 2) == [6]
    assert scheduler.prefill_chunk_lengths(np.array([9]), np.array([4]), np.array([1]), 1, 2) == []


def test_constructor_errors():
    for name, value in (("max_requests", 0), ("block_size_tokens", True), ("num_speculative_tokens", -1),
                        ("max_tokens_per_step", 1.5), ("max_model_len", 0)):
        with pytest.raises(ValueError, match=name):
            make_scheduler(**{name: value})


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.integers(0, 3), st.integers(0, 3),
       st.lists(st.tuples(st.integers(1, 40), st.integers(0, 10)), min_size=0, max_size=6),
       st.integers(0, 30), st.integers(0, 4))
def test_chunks_respect_the_token_budget_and_the_free_blocks(block_size, S, num_decode, prefills, free_blocks, offset):
    scheduler = make_scheduler(block_size_tokens=block_size, num_speculative_tokens=S, max_model_len=64,
                               max_tokens_per_step=4 * (S + 1) + offset * 5)
    remaining = np.array([left for left, _ in prefills], np.int64)
    known = np.array([done for _, done in prefills], np.int64)
    held = scheduler.blocks_for(known) + np.array([done % 2 for _, done in prefills], np.int64)  # some spare blocks
    lengths = scheduler.prefill_chunk_lengths(remaining, known, held, free_blocks, num_decode)
    assert len(lengths) <= len(prefills)
    assert all(length > 0 for length in lengths)
    assert sum(lengths) <= scheduler.prefill_budget(num_decode)
    assert all(length <= left for length, left in zip(lengths, remaining.tolist()))
    assert all(length == left for length, left in zip(lengths[:-1], remaining.tolist()))  # only the last is partial
    taken = sum(max(int(scheduler.blocks_for(k + n)) - h, 0) for n, k, h in zip(lengths, known.tolist(), held.tolist()))
    assert taken <= max(free_blocks - scheduler.decode_reserve(num_decode), 0)  # never over-allocates


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=8), st.integers(0, 20))
def test_pausing_never_over_allocates_and_resuming_goes_oldest_first(needs, free_blocks):
    scheduler = make_scheduler()
    pause = scheduler.decodes_to_pause(np.array(needs, np.int64), free_blocks)
    running = [need for need, paused in zip(needs, pause.tolist()) if not paused]
    assert sum(running) <= free_blocks
    if pause.any():  # the first paused row is the first that did not fit, in row order
        first = int(np.argmax(pause))
        assert sum(needs[: first + 1]) > free_blocks and needs[first] > 0
    count = scheduler.num_to_resume(needs, free_blocks)
    assert sum(needs[:count]) <= free_blocks
    assert count == len(needs) or sum(needs[: count + 1]) > free_blocks


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), min_size=1, max_size=30))
def test_the_preemption_victim_is_always_the_newest_live_request(events):
    scheduler, live, next_id = make_scheduler(), [], 0
    for admit, pick in events:
        if admit or not live:
            scheduler.admitted(next_id)
            live.append(next_id)
            next_id += 1
        else:
            request_id = live.pop(pick % len(live))
            scheduler.released(request_id)
        if live:
            assert scheduler.preemption_victim() == live[-1]


# ----- the context carrying the decisions out -----------------------------------------------

KV_SPEC = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(0, 2), st.integers(0, 2**31 - 1), st.booleans())
def test_random_runs_never_over_allocate_and_leak_nothing(block_size, S, seed, overlap):
    """Random admissions, accepted counts and finishes through the context with a tight pool (so
    decodes pause and resume, and chunks wait for blocks); one step in flight whenever the
    context allows. Checked at every step: no block held twice, the allocator's count equals
    what the slots hold, every decode holds its worst-case reserve, paused requests resume oldest
    first; after everything finishes, every block is free."""
    rng = np.random.default_rng(seed)
    stride = S + 1
    shape = EngineShape(max_requests=3, max_model_len=16, block_size_tokens=block_size, num_speculative_tokens=S,
                        max_tokens_per_step=3 * stride + 4)
    ctx = DynamicInferenceContext(shape, kv_cache=KV_SPEC, num_blocks=int(ctx_blocks(block_size, S)))
    scheduler, host, allocator = ctx.scheduler, ctx.table.host, ctx.allocator
    next_id, pending = 0, None

    def check_books():
        live = ctx.table.live_slots()
        held = host.block_ids[live][host.block_ids[live] >= 0].tolist()
        assert len(held) == len(set(held)) == allocator.num_allocated_blocks <= allocator.num_blocks
        assert (host.block_counts[live] <= scheduler.shape.max_blocks_per_request).all()

    for _ in range(40):
        if pending is not None and (not overlap or ctx.needs_sync() or rng.random() < 0.3):
            ctx.commit_readback(*pending)
            pending = None
        if pending is None:
            for row in ctx.table.live_slots()[::-1].tolist():  # finish long or random requests
                request_id = int(host.request_ids[row])
                if host.known_lengths[row] >= 12 or rng.random() < 0.05:
                    ctx.finish_request(request_id)
        # admitting with a step pending is fine even with paused requests: nothing moves, and the
        # pending step's commit touches its decode requests' slots
        if ctx.num_free_rows and rng.random() < 0.6:
            ctx.add_request(next_id, rng.integers(0, 50, int(rng.integers(1, 10))).tolist())
            next_id += 1
        paused_before = list(scheduler.paused_for_kv)
        try:
            step = ctx.build_step()
        except KVCacheFullError:  # nobody can run: learn the step in flight, else evict the newest
            if pending is not None:
                ctx.commit_readback(*pending)
                pending = None
            else:
                ctx.finish_request(scheduler.preemption_victim())
            continue
        if step is None:
            continue  # nothing live
        still_paused = [request_id for request_id in paused_before if request_id in scheduler.paused_for_kv]
        assert still_paused == paused_before[len(paused_before) - len(still_paused):]  # oldest resumed first
        check_books()
        decode = step.host_slot_ids[: step.num_decode]
        in_flight = ctx.steps_in_flight - 1  # those before this one
        assert (host.block_counts[decode] >= scheduler.worst_case_blocks(host.known_lengths[decode], in_flight)).all()
        accepted = rng.integers(0, stride, step.num_decode)
        if pending is not None:
            ctx.commit_readback(*pending)
        pending = (step, accepted)
    if pending is not None:
        ctx.commit_readback(*pending)
    for request_id in host.request_ids[ctx.table.live_slots()].tolist():
        ctx.finish_request(request_id)
    assert allocator.num_free_blocks == allocator.num_blocks  # no block leaked
    assert not scheduler.admission_order and not scheduler.paused_for_kv


def ctx_blocks(block_size: int, S: int) -> int:
    """A pool of one and a half requests' worst case: tight enough that decodes pause."""
    return worst_case_blocks(16, 1, S, block_size) * 3 // 2


def test_decode_run_lengths_are_the_powers_of_two_below_the_most_and_it():
    assert decode_run_lengths(1) == (1,)
    assert decode_run_lengths(4) == (1, 2, 4)
    assert decode_run_lengths(6) == (1, 2, 4, 6)


def test_worst_case_blocks_covers_every_step_of_a_run():
    assert worst_case_blocks(5, 1, 2, 4, new_steps=4) == 5  # 5 + 3 * (4 + 1) = 20 tokens
    assert worst_case_blocks(5, 1, 2, 4, new_steps=1) == worst_case_blocks(5, 1, 2, 4)


@settings(max_examples=200, deadline=None)
@given(S=st.integers(0, 3), most=st.integers(1, 9), in_flight=st.integers(0, 9), to_model_len=st.integers(0, 80),
       most_left=st.integers(0, 80), tokens_per_step=st.floats(1.0, 4.0))
def test_a_decode_run_never_reaches_max_model_len_before_its_last_step(S, most, in_flight, to_model_len, most_left,
                                                                       tokens_per_step):
    """Whatever the budgets: the run length is one of the run lengths; a run longer than one step
    ends before any request can reach max_model_len (each step adds at most 1 + S tokens), and
    its last step is expected to be of use; the longest such run is taken."""
    scheduler = Scheduler(EngineShape(max_requests=4, max_model_len=64, block_size_tokens=4, num_speculative_tokens=S,
                                      max_tokens_per_step=64, decode_steps_per_launch=most))
    steps = scheduler.decode_run_steps(to_model_len, most_left, in_flight, tokens_per_step)

    def allowed(length):
        last = in_flight + length - 1
        return (S + 1) * last < to_model_len and last * tokens_per_step < most_left

    assert steps in scheduler.run_lengths
    assert steps == 1 or allowed(steps)
    assert not any(allowed(length) for length in scheduler.run_lengths if length > steps)


def test_joins_held_known_answers():
    scheduler = make_scheduler(max_requests=8, max_tokens_per_step=24, join_hold_steps=4)
    assert scheduler.join_group_rows == 2  # a quarter of the table
    for request_id in range(5):
        scheduler.enqueue(request_id)
    held = dict(num_running=7, next_preempted=False)
    assert not scheduler.joins_held(free_rows=0, **held)  # no row to hold
    assert scheduler.joins_held(free_rows=1, **held)  # 1 of the 2 rows wanted: the clock starts
    scheduler.built(2)
    assert scheduler.joins_held(free_rows=1, **held)
    scheduler.built(2)  # 4 steps since the hold began: it ends
    assert not scheduler.joins_held(free_rows=1, **held)
    scheduler.built(1)  # the row was let go (can_admit may still refuse a join: a prefill backlog) ...
    assert not scheduler.joins_held(free_rows=1, **held)  # ... and is not held again
    assert not scheduler.joins_held(free_rows=0, **held)  # the rows filled up: a later hold starts afresh
    assert scheduler.joins_held(free_rows=1, **held)
    assert not scheduler.joins_held(free_rows=2, **held)  # enough rows
    for others in (dict(num_running=0, next_preempted=False), dict(num_running=7, next_preempted=True)):
        assert scheduler.joins_held(free_rows=1, **held)  # (enough rows above: a new hold)
        assert not scheduler.joins_held(free_rows=1, **others)  # nothing else runs; an evicted request
        assert not scheduler.joins_held(free_rows=1, **held)  # let go: not held again
        assert not scheduler.joins_held(free_rows=0, **held)
    scheduler.paused_for_kv_space(9)
    assert not scheduler.joins_held(free_rows=1, **held)  # a pause for KV: nothing frees rows by running
    scheduler.resumed(9)
    assert not scheduler.joins_held(free_rows=0, **held)
    scheduler.drop_waiting(range(1, 5))  # one waits: one free row takes it
    assert not scheduler.joins_held(free_rows=1, **held)
    assert not make_scheduler(max_requests=8, max_tokens_per_step=24).joins_held(free_rows=1, **held)  # off


def test_a_hold_asked_while_nobody_waits_does_not_carry_its_clock_over():
    """The waiting requests of a hold go (aborted); later others wait: their hold gets a full clock."""
    scheduler = make_scheduler(max_requests=8, max_tokens_per_step=24, join_hold_steps=4)
    for request_id in range(5):
        scheduler.enqueue(request_id)
    held = dict(num_running=7, next_preempted=False)
    assert scheduler.joins_held(free_rows=1, **held)
    scheduler.drop_waiting(range(5))
    assert not scheduler.joins_held(free_rows=1, **held)  # nobody waits (admit_waiting asks anyway)
    scheduler.built(40)
    for request_id in range(10, 15):
        scheduler.enqueue(request_id)
    assert scheduler.joins_held(free_rows=1, **held)


@settings(max_examples=60, deadline=None)
@given(hold=st.integers(0, 6), rows=st.integers(1, 16),
       calls=st.lists(st.tuples(st.integers(0, 16), st.integers(0, 16), st.integers(0, 4), st.integers(0, 4),
                                st.booleans()), min_size=1, max_size=40))
def test_a_hold_never_outlasts_join_hold_steps(hold, rows, calls):
    """Random admission rounds (free rows, running requests, waiting requests, steps built after,
    next evicted): a hold holds only rows fewer than the waiting requests and the group want, while
    something runs, and ends at the first round ``join_hold_steps`` built steps after it began; rows
    let go are not held again until none is free, nobody waits, or enough are free."""
    scheduler = make_scheduler(max_requests=rows, max_tokens_per_step=3 * rows, join_hold_steps=hold)
    held_since, let_go, steps = None, False, 0
    for free, running, waiting, built, preempted in calls:
        free = min(free, rows)
        scheduler.drop_waiting(scheduler.waiting_ids(99))
        for request_id in range(waiting):
            scheduler.enqueue(request_id)
        held = scheduler.joins_held(free, running, preempted)
        if free == 0 or waiting == 0 or free >= min(waiting, scheduler.join_group_rows):
            held_since, let_go = None, False
            assert not held
        elif held:
            assert hold > 0 and running > 0 and not preempted and not let_go
            held_since = steps if held_since is None else held_since
            assert steps - held_since < hold
        else:
            held_since, let_go = None, True
        scheduler.built(built)
        steps += built
