"""DynamicInferenceContext: step metadata by hand (after prepare_inputs), chunked prefill,
padded buckets, KV exhaustion, the worst-case block reserve of the overlapped loop, random
steps with the device step simulated on the CPU (prepare_inputs, rewind, commit_readback), and
bad input."""

import random

import numpy as np
import pytest
import torch

from mtp_ctrl.state import BatchDimensions, KVCacheFullError, KVCacheSpec, MambaSpec, RowGroup
from tests.unit.context_fixtures import KV_SPEC, device_rewind, held_blocks, make_context, run_device_step, \
    step_and_commit


def test_hand_computed_step_of_two_decodes_and_a_prefill_chunk():
    """bs = 4, S = 2, budget 12. Requests 0 (prompt 5) and 1 (prompt 3) prefill, then decode
    next to request 2 (prompt 10), which gets the 12 - 2 * 3 = 6 remaining rows."""
    ctx = make_context()
    ctx.add_request(0, [10, 11, 12, 13, 14])
    ctx.add_request(1, [20, 21, 22])
    first = step_and_commit(ctx)
    assert first.num_prefill == 2 and first.num_final_prefill_chunks == 2
    assert first.logits_indices.tolist() == [4, 7, 0, 0, 0, 0]  # each prompt's last row, then 1 + S per request
    assert first.host_first_positions.tolist() == [0, 0]
    assert ctx.table.request_ids_in(RowGroup.PREFILL) == [0, 1]  # decode from the next build_step

    ctx.table.next_tokens[:2] = torch.tensor([15, 23])
    ctx.table.draft_tokens[:2] = torch.tensor([[16, 17], [24, 25]])
    ctx.add_request(2, list(range(30, 40)))
    step = ctx.build_step()
    assert ctx.table.request_ids_in(RowGroup.DECODE) == [0, 1]
    ctx.prepare_inputs(step)
    att = step.attention
    assert step.request_ids == (0, 1, 2)
    assert (step.num_decode, step.num_prefill, step.num_final_prefill_chunks) == (2, 1, 0)
    assert step.num_sampling_requests == 2
    assert step.host_query_lengths.tolist() == [3, 3, 6]
    assert step.host_first_positions.tolist() == [-1, -1, 0]  # decode positions: the device's
    assert step.input_ids.tolist() == [15, 16, 17, 23, 24, 25, 30, 31, 32, 33, 34, 35]
    assert att.positions.tolist() == [5, 6, 7, 3, 4, 5, 0, 1, 2, 3, 4, 5]
    # request 0: blocks [0, 1]; request 1: [2] + new 3; request 2: new [4, 5]
    assert att.slot_mapping.tolist() == [5, 6, 7, 11, 12, 13, 16, 17, 18, 19, 20, 21]
    assert att.query_start_loc.tolist() == [0, 3, 6, 12]
    assert att.seq_lens.tolist() == [8, 6, 6]
    assert att.block_table[:, :3].tolist() == [[0, 1, -1], [2, 3, -1], [4, 5, -1]]
    assert (att.num_actual_tokens, att.max_query_len, att.max_seq_len) == (12, 6, 8)
    assert step.logits_indices.tolist() == [0, 1, 2, 3, 4, 5, 0, 0, 0]  # the partial chunk samples nothing
    assert step.dimensions == BatchDimensions(token_count=12, request_count=3, has_prefill=True)
    rows = ctx.table.device  # what the step kernels see: this step's rows counted
    assert rows.kv_length_offsets[:3].tolist() == [8, 6, 6]
    assert rows.last_kv_block_offset[:3].tolist() == [3, 1, 1]
    assert rows.kv_block_counts[:3].tolist() == [2, 2, 2]
    assert rows.last_kv_block_id[:3].tolist() == [1, 3, 5]
    assert rows.prefill_status[:3].tolist() == [0, 0, 1]
    assert ctx.table.host.known_lengths[:3].tolist() == [5, 3, 6]  # decodes: as of the last read-back

    # request 0 accepts both drafts; request 1 none: it rewinds back into block 2, keeps block 3
    device_rewind(ctx, step, [2, 0])
    assert rows.kv_length_offsets[:3].tolist() == [8, 4, 6]
    assert rows.kv_block_counts[:3].tolist() == [2, 1, 2] and rows.last_kv_block_id[:3].tolist() == [1, 2, 5]
    ctx.commit_readback(step, np.array([2, 0]))
    assert ctx.table.mismatched_rows() == []
    assert ctx.table.host.known_lengths[:3].tolist() == [8, 4, 6]
    assert ctx.table.host.block_ids[1, :2].tolist() == [2, 3] and ctx.allocator.is_allocated(3)
    assert ctx.allocator.num_allocated_blocks == 6


def test_chunked_prefill_under_the_token_budget():
    ctx = make_context(max_requests=1, num_speculative_tokens=3, max_tokens_per_step=4)
    prompt = list(range(100, 110))
    ctx.add_request(7, prompt)
    seen = []
    for expected_rows in (4, 4, 2):
        step = step_and_commit(ctx)
        assert step.num_prefill == 1 and step.attention.num_actual_tokens == expected_rows
        assert step.attention.positions.tolist() == list(range(len(seen), len(seen) + expected_rows))
        seen += step.input_ids.tolist()
        final = expected_rows == 2
        assert step.num_final_prefill_chunks == int(final)
        assert step.logits_indices.tolist() == ([expected_rows - 1, 0, 0, 0] if final else [0] * 4)
    assert seen == prompt
    # the final chunk ran at the first prefill row: it becomes a decode in place, no sync needed
    assert ctx.table.group_of(7) == RowGroup.PREFILL and not ctx.needs_sync()
    assert ctx.table.host.known_lengths[0] == 10
    ctx.table.next_tokens[0] = 110
    ctx.table.draft_tokens[0] = torch.tensor([111, 112, 113])
    decode = step_and_commit(ctx, [3])
    assert ctx.table.group_of(7) == RowGroup.DECODE
    assert ctx.table.host.prefill_status[0] == 0 and ctx.table.device.prefill_status[0] == 0
    assert decode.input_ids.tolist() == [110, 111, 112, 113]
    assert decode.attention.positions.tolist() == [10, 11, 12, 13]
    assert ctx.table.host.known_lengths[0] == 14


def test_decode_step_padded_to_a_cuda_graph_bucket():
    ctx = make_context(max_requests=5, max_tokens_per_step=15, cuda_graph_batch_sizes=(1, 2, 4))
    for request_id in range(3):
        ctx.add_request(request_id, [1, 2, 3])
    step_and_commit(ctx)
    ctx.add_request(9, [4, 5])
    ctx.pause_request(9)  # a paused request runs in no step and its slot must stay untouched
    before = ctx.table.host.block_ids[3].copy()
    step = ctx.build_step()
    ctx.prepare_inputs(step)
    att = step.attention
    assert step.dimensions == BatchDimensions.decode_only(4, 2)
    assert (step.num_decode, step.num_prefill) == (3, 0)
    assert step.request_ids == (0, 1, 2) and ctx.table.slot_of(9) == 3
    assert step.input_ids.shape == (12,)
    assert att.slot_mapping[9:].tolist() == [-1, -1, -1]  # padding rows write no KV
    assert att.positions[9:].tolist() == [0, 0, 0]
    assert att.positions[:9].tolist() == [3, 4, 5] * 3
    assert att.query_start_loc.tolist() == [0, 3, 6, 9, 9]
    assert att.seq_lens.tolist() == [6, 6, 6, 0]
    # the padding request reads the scratch slot: every column points at the scratch block
    assert att.block_table[3].tolist() == [ctx.scratch_block] * ctx.shape.max_blocks_per_request
    assert step.slot_ids.tolist() == [0, 1, 2, ctx.table.scratch_row]
    assert att.num_actual_tokens == 9 and att.max_seq_len == ctx.shape.max_blocks_per_request * 4
    assert int(step.num_active[0]) == 3
    assert step.logits_indices.tolist() == list(range(9)) + [0, 0, 0]  # padding rows point at row 0
    assert ctx.table.device.kv_length_offsets[3] == 0  # the paused row's KV length is untouched
    device_rewind(ctx, step, [1, 2, 0])
    ctx.commit_readback(step, np.array([1, 2, 0]))
    assert np.array_equal(ctx.table.host.block_ids[3], before)
    assert ctx.table.mismatched_rows() == []

    ctx.add_request(3, [1])
    step_and_commit(ctx)
    ctx.resume_request(9)
    step = ctx.build_step()  # a prefill chunk in the step: eager, exact dimensions
    assert (step.num_decode, step.num_prefill) == (4, 1)
    assert step.dimensions == BatchDimensions(token_count=14, request_count=5, has_prefill=True)
    run_device_step(ctx, step, [0] * 4)
    ctx.commit_readback(step, np.zeros(4, np.int64))
    step = ctx.build_step()  # 5 decode requests: above every bucket, eager
    assert step.dimensions == BatchDimensions.decode_only(5, 2) and step.attention.num_actual_tokens == 15


def test_pause_on_kv_exhaustion_and_resume_when_blocks_free_up():
    """bs = 2, S = 1, max_model_len 8: a request holds at most ceil((8 + 4) / 2) = 6 blocks;
    pool of 7. Two 5-token prompts take 3 blocks each, 1 is left."""
    ctx = make_context(max_requests=2, max_model_len=8, block_size_tokens=2, num_speculative_tokens=1,
                       max_tokens_per_step=10, num_blocks=7)
    ctx.add_request(0, [1, 2, 3, 4, 5])
    ctx.add_request(1, [5, 6, 7, 8, 9])
    step_and_commit(ctx)
    assert ctx.allocator.num_free_blocks == 1
    ctx.table.next_tokens[:2] = torch.tensor([40, 50])
    ctx.table.draft_tokens[:2] = torch.tensor([[41], [51]])
    step = ctx.build_step()  # both need a 4th block for positions 5, 6: only request 0 gets it
    assert step.request_ids == (0,)
    assert ctx.table.group_of(1) == RowGroup.PAUSED
    paused_row = ctx.table.slot_of(1)
    assert ctx.table.host.known_lengths[paused_row] == 5
    assert ctx.table.host.block_ids[paused_row, :4].tolist() == [3, 4, 5, -1]
    run_device_step(ctx, step, [1])
    assert step.input_ids.tolist() == [40, 41]
    ctx.commit_readback(step, np.array([1]))
    assert ctx.table.mismatched_rows() == []
    assert ctx.allocator.num_free_blocks == 0

    assert ctx.needs_sync()  # a request waits for blocks
    with pytest.raises(KVCacheFullError, match="no live request can get a KV block"):
        ctx.build_step()  # request 0 (7 tokens) needs a 5th block too: nobody can run
    assert ctx.table.group_of(0) == RowGroup.PAUSED and ctx.table.group_of(1) == RowGroup.PAUSED

    ctx.finish_request(0)
    assert ctx.allocator.num_free_blocks == 4
    step = ctx.build_step()  # request 1 resumes with its tokens and state
    assert step.request_ids == (1,) and ctx.table.group_of(1) == RowGroup.DECODE
    run_device_step(ctx, step, [0])
    assert step.input_ids.tolist() == [50, 51]
    assert step.attention.positions.tolist() == [5, 6]
    ctx.commit_readback(step, np.array([0]))
    assert ctx.table.mismatched_rows() == []


def test_rewind_across_two_blocks_when_drafts_outnumber_the_block_size():
    """bs = 2, S = 3: 3 cached tokens (blocks [0, 1]) + 4 rows -> 7 tokens in 4 blocks; no draft
    accepted -> back to 4 tokens in 2 blocks. Blocks 2 and 3 stay the request's reserve: the
    next step writes into them without taking a new block."""
    ctx = make_context(block_size_tokens=2, num_speculative_tokens=3, max_tokens_per_step=16)
    ctx.add_request(0, [1, 2, 3])
    step_and_commit(ctx)
    step = ctx.build_step()
    ctx.prepare_inputs(step)
    assert ctx.table.device.kv_block_ids[0, :5].tolist() == [0, 1, 2, 3, -1]
    assert ctx.table.device.kv_block_counts[0] == 4
    device_rewind(ctx, step, [0])
    assert ctx.table.device.kv_length_offsets[0] == 4 and ctx.table.device.kv_block_counts[0] == 2
    assert ctx.table.device.last_kv_block_id[0] == 1
    ctx.commit_readback(step, np.array([0]))
    assert ctx.table.mismatched_rows() == []
    assert ctx.table.host.block_ids[0, :5].tolist() == [0, 1, 2, 3, -1]
    assert ctx.allocator.num_allocated_blocks == 4

    step = ctx.build_step()  # 4 + 4 tokens fit the 4 blocks held
    ctx.prepare_inputs(step)
    assert ctx.allocator.num_allocated_blocks == 4
    assert step.attention.positions.tolist() == [4, 5, 6, 7]
    assert step.attention.slot_mapping.tolist() == [4, 5, 6, 7]  # blocks 2 and 3
    device_rewind(ctx, step, [0])
    ctx.commit_readback(step, np.array([0]))
    ctx.finish_request(0)
    assert ctx.allocator.num_free_blocks == ctx.allocator.num_blocks


def test_prefill_chunk_leaves_the_decodes_next_blocks_and_waits_behind_a_paused_decode():
    """bs = 1, S = 1 (a decode step needs 2 blocks), max_model_len 8 (12 blocks per request),
    pool of 12. A prefill chunk takes only the free blocks that the running decodes will not
    need next step, so it cannot starve them."""
    ctx = make_context(max_requests=2, max_model_len=8, block_size_tokens=1, num_speculative_tokens=1,
                       max_tokens_per_step=8, num_blocks=12)
    ctx.add_request(0, [1, 2, 3])
    step_and_commit(ctx)  # 3 blocks
    ctx.add_request(1, [4, 5, 6, 7, 8, 9, 10, 11])
    step = ctx.build_step()  # decode 0 takes 2 blocks; of the 7 left, 2 are kept for its next step
    assert step.attention.query_start_loc.tolist() == [0, 2, 7]
    assert step.input_ids[2:].tolist() == [4, 5, 6, 7, 8] and step.num_final_prefill_chunks == 0
    run_device_step(ctx, step, [0])
    ctx.commit_readback(step, np.array([0]))  # request 0 keeps 4 tokens; its 5th block stays held
    assert ctx.allocator.num_free_blocks == 2

    step = ctx.build_step()  # decode 0 takes 1 (1 left, less than its next 2): no prefill chunk
    assert step.request_ids == (0,)
    run_device_step(ctx, step, [1])
    ctx.commit_readback(step, np.array([1]))  # both rows accepted: request 0 holds 6 tokens
    assert ctx.allocator.num_free_blocks == 1

    with pytest.raises(KVCacheFullError):
        ctx.build_step()  # decode 0 needs 2 blocks: paused; the prefill may not take the free one
    assert ctx.table.group_of(0) == RowGroup.PAUSED
    assert ctx.allocator.num_free_blocks == 1
    assert ctx.table.host.known_lengths[ctx.table.slot_of(1)] == 5

    ctx.finish_request(1)
    step = ctx.build_step()
    ctx.prepare_inputs(step)
    assert step.request_ids == (0,) and step.attention.positions.tolist() == [6, 7]


def test_reserve_covers_the_steps_in_flight():
    """bs = 4, S = 2: a decode request of 5 tokens holds blocks for 5 + 3 = 8 tokens (2 blocks);
    building the next step before the read-back (1 step in flight) raises that to 5 + 2 * 3 = 11
    tokens (3 blocks), so the device never needs a block the host has not given it."""
    ctx = make_context()
    ctx.add_request(0, [1, 2, 3, 4, 5])
    step_and_commit(ctx)
    assert not ctx.needs_sync()  # the final chunk ran: the request becomes a decode in place
    first = ctx.build_step()
    assert not ctx.needs_sync()
    assert ctx.table.host.block_counts[0] == 2
    run_device_step(ctx, first, [2])  # the device is at 8 tokens; the host still knows 5
    second = ctx.build_step()
    assert ctx.table.host.block_counts[0] == 3 == ctx.blocks_for(5 + 2 * 3)
    ctx.commit_readback(first, np.array([2]))
    assert ctx.table.host.known_lengths[0] == 8
    run_device_step(ctx, second, [0])
    assert second.attention.positions.tolist() == [8, 9, 10]
    assert second.attention.slot_mapping.tolist() == [2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2]
    ctx.commit_readback(second, np.array([0]))
    assert ctx.table.host.known_lengths[0] == 9 and ctx.table.mismatched_rows() == []


def test_needs_sync_when_the_reserve_would_not_fit():
    """bs = 4, S = 2, pool of 5: two 4-token decodes hold 2 blocks each (4 + 3 tokens); a step in
    flight would need 3 each (4 + 6 tokens), 2 more than the 1 free block: needs_sync says so, and
    a build with the step in flight (which pauses nothing) raises KVCacheFullError, changing nothing."""
    ctx = make_context(max_requests=2, max_model_len=8, max_tokens_per_step=8, num_blocks=5)
    ctx.add_request(0, [1, 2, 3, 4])
    ctx.add_request(1, [5, 6, 7, 8])
    assert not ctx.needs_sync()  # nothing to move yet
    step_and_commit(ctx)
    assert ctx.needs_sync()
    step = ctx.build_step()
    assert ctx.allocator.num_free_blocks == 1
    assert ctx.needs_sync()
    with pytest.raises(KVCacheFullError):
        ctx.build_step()
    assert ctx.allocator.num_free_blocks == 1 and ctx.steps_in_flight == 1
    run_device_step(ctx, step, [0, 0])
    ctx.commit_readback(step, np.zeros(2, np.int64))
    assert ctx.table.mismatched_rows() == []


def test_needs_sync_agrees_with_every_decodes_worst_case():
    """Random admissions, steps and finishes over small pools: whenever every live request decodes
    and none is paused, needs_sync says whether the decodes' worst-case blocks for a step in flight
    and the next one exceed the free blocks (its O(1) bound for a roomy pool gives the same answer)."""
    checked = {True: 0, False: 0}
    for seed in range(6):
        check_needs_sync_on_random_steps(random.Random(seed), checked)
    assert checked[True] > 0 and checked[False] > 0  # both answers, each often from the full count


def check_needs_sync_on_random_steps(rng, checked):
    ctx = make_context(max_requests=3, max_model_len=24, block_size_tokens=4, num_speculative_tokens=2,
                       max_tokens_per_step=11, num_blocks=rng.randrange(9, 16))
    host, next_id = ctx.table.host, 0
    for _ in range(60):
        while ctx.num_free_rows and rng.random() < 0.4:
            ctx.add_request(next_id, [rng.randrange(50) for _ in range(rng.randrange(1, 6))])
            next_id += 1
        try:
            step = ctx.build_step()
        except KVCacheFullError:
            ctx.finish_request(int(host.request_ids[rng.choice(ctx.table.live_slots().tolist())]))
            continue
        if step is None:
            continue
        accepted = np.array([rng.randrange(3) for _ in range(step.num_decode)], dtype=np.int64)
        run_device_step(ctx, step, accepted)
        ctx.commit_readback(step, accepted)
        for request_id in host.request_ids[ctx.table.live_slots()].tolist():
            if host.known_lengths[ctx.table.slot_of(request_id)] > 12 or rng.random() < 0.05:
                ctx.finish_request(request_id)
        if ctx.table.slots_in(RowGroup.PREFILL).shape[0] == 0 and not ctx.scheduler.paused_for_kv:
            slots = ctx.table.slots_in(RowGroup.DECODE)
            needs = ctx.scheduler.blocks_needed(host.known_lengths[slots], host.block_counts[slots], 1)
            expected = int(needs.sum()) > ctx.allocator.num_free_blocks
            assert ctx.needs_sync() == expected
            checked[expected] += 1


@pytest.mark.parametrize(
    "block_size_tokens, num_speculative_tokens",
    [(4, 2), (2, 3), (1, 2)],  # the last two have S >= block_size: a rewind may cross several blocks
)
def test_random_overlapped_steps_keep_host_and_device_in_step(block_size_tokens, num_speculative_tokens):
    """Random admissions, steps (one step in flight whenever needs_sync allows), accepted counts
    and finishes; the device step is simulated on the CPU. Whenever nothing is in flight the
    host's block table and known lengths equal the device's; no block is held twice or lost."""
    rng = random.Random(block_size_tokens * 10 + num_speculative_tokens)
    stride = num_speculative_tokens + 1
    ctx = make_context(
        max_requests=3,
        max_model_len=24,
        block_size_tokens=block_size_tokens,
        num_speculative_tokens=num_speculative_tokens,
        max_tokens_per_step=3 * stride + 2,
        num_blocks=60,
    )
    host = ctx.table.host
    next_id, pending, overlapped = 0, None, 0
    for _ in range(30):
        short = host.known_lengths[ctx.table.live_slots()].max(initial=0) <= 10  # far from max_model_len
        if pending is not None and short and not ctx.needs_sync() and rng.random() < 0.7:
            step = ctx.build_step()  # built before the previous read-back
            overlapped += 1
            decode = step.host_slot_ids[: step.num_decode]
            assert (host.block_counts[decode] >= ctx.blocks_for(host.known_lengths[decode] + 2 * stride)).all()
            accepted = np.array([rng.randrange(stride) for _ in range(step.num_decode)], dtype=np.int64)
            run_device_step(ctx, step, accepted)
            ctx.commit_readback(*pending)
            pending = (step, accepted)
            continue
        if pending is not None:
            ctx.commit_readback(*pending)
            pending = None
            assert ctx.table.mismatched_rows() == []
            held = held_blocks(ctx)
            assert len(held) == len(set(held)) == ctx.allocator.num_allocated_blocks
            for request_id in host.request_ids[ctx.table.live_slots()].tolist():
                if host.known_lengths[ctx.table.slot_of(request_id)] > 10:
                    ctx.finish_request(request_id)
        while ctx.num_free_rows:
            ctx.add_request(next_id, [rng.randrange(50) for _ in range(rng.randrange(1, 9))])
            next_id += 1
        step = ctx.build_step()
        accepted = np.array([rng.randrange(stride) for _ in range(step.num_decode)], dtype=np.int64)
        run_device_step(ctx, step, accepted)
        pending = (step, accepted)
    ctx.commit_readback(*pending)
    assert ctx.table.mismatched_rows() == []
    assert overlapped > 3 and next_id > 3
    for request_id in host.request_ids[ctx.table.live_slots()].tolist():
        ctx.finish_request(request_id)
    assert ctx.allocator.num_free_blocks == ctx.allocator.num_blocks  # no block leaked


def test_mamba_slots_follow_requests():
    mamba = MambaSpec(num_layers=1, conv_state_shape=(2, 3), ssm_state_shape=(2, 2), dtype=torch.float32)
    ctx = make_context(mamba=mamba)
    ctx.add_request(5, [1, 2])
    ctx.add_request(6, [1, 2])
    assert ctx.table.host.mamba_slot_ids[:2].tolist() == [0, 1]
    assert ctx.mamba.intermediate_ssm_states.shape == (1, 5, 3, 2, 2)  # 4 slots + scratch
    ctx.finish_request(5)
    assert ctx.mamba.num_free_slots == 3
    assert ctx.table.host.mamba_slot_ids[:2].tolist() == [-1, 1]  # request 6 keeps its table slot


def test_mamba_steps_with_prefill_pad_to_token_buckets():
    """A Mamba model's steps that carry prefill chunks pad to (batch bucket, token bucket) like an
    attention-only model's (their Mamba layout is on the device), and warm-up covers those shapes."""
    mamba = MambaSpec(num_layers=1, conv_state_shape=(2, 3), ssm_state_shape=(2, 2), dtype=torch.float32)
    ctx = make_context(mamba=mamba, cuda_graph_batch_sizes=(1, 2, 4))
    assert ctx.cuda_graph_token_counts == (12,)
    assert {shape for shape in ctx.graph_shapes() if shape.has_prefill} == {
        BatchDimensions(12, size, True) for size in (1, 2, 4)}
    ctx.add_request(0, [1, 2, 3])
    first = step_and_commit(ctx)
    assert first.graph_padded and first.dimensions == BatchDimensions(12, 1, True)
    ctx.add_request(1, [4, 5, 6, 7])
    mixed = step_and_commit(ctx)
    assert (mixed.num_decode, mixed.num_prefill) == (1, 1)
    assert mixed.graph_padded and mixed.dimensions == BatchDimensions(12, 2, True)


def test_kv_caches_and_byte_budget():
    bytes_per_block = KV_SPEC.bytes_per_block(4)
    assert bytes_per_block == 2 * 2 * 4 * 1 * 4 * 4
    ctx = make_context(num_blocks=None, kv_cache_bytes=20 * bytes_per_block + 7)
    assert ctx.allocator.num_blocks == 19  # the budget also holds the scratch block free rows point at
    assert len(ctx.kv_caches) == 2
    key_cache, value_cache = ctx.kv_caches[1]
    assert key_cache.shape == value_cache.shape == (20, 4, 1, 4) and ctx.scratch_block == 19
    assert key_cache.is_contiguous() and key_cache.data_ptr() != value_cache.data_ptr()


def test_request_errors():
    ctx = make_context(max_requests=2)
    with pytest.raises(ValueError, match="empty"):
        ctx.add_request(0, [])
    with pytest.raises(ValueError, match="more than max_model_len"):
        ctx.add_request(0, [1] * 33)
    with pytest.raises(TypeError, match="int32 or int64"):
        ctx.add_request(0, torch.ones(3))
    with pytest.raises(TypeError, match="must hold ints"):
        ctx.add_request(0, [1.5])
    with pytest.raises(ValueError, match="1-D"):
        ctx.add_request(0, torch.ones(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="non-negative"):
        ctx.add_request(0, [3, -1])
    with pytest.raises(ValueError, match="request_id must be an int"):
        ctx.add_request("a", [1])
    ctx.add_request(0, torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="already live"):
        ctx.add_request(0, [1])
    ctx.add_request(1, [1])
    with pytest.raises(RuntimeError, match="finish one first"):
        ctx.add_request(2, [1])
    for method in (ctx.finish_request, ctx.pause_request, ctx.resume_request):
        with pytest.raises(ValueError, match="not a live request"):
            method(7)
    with pytest.raises(ValueError, match="not paused"):
        ctx.resume_request(0)
    ctx.pause_request(0)
    with pytest.raises(ValueError, match="already paused"):
        ctx.pause_request(0)
    ctx.finish_request(0)
    with pytest.raises(ValueError, match="not a live request"):
        ctx.finish_request(0)


def test_step_errors():
    ctx = make_context()
    assert ctx.build_step() is None
    ctx.add_request(0, [1, 2, 3])
    step = ctx.build_step()
    ctx.prepare_inputs(step)
    ctx.add_request(1, [4])  # admitting is fine after a build: the new row lies past the step's rows
    with pytest.raises(ValueError, match=r"shape \(1, 1\), the step has 1 step\(s\) of 0 decode requests"):
        ctx.commit_readback(step, np.array([1]))
    ctx.commit_readback(step, np.zeros(0, np.int64))
    with pytest.raises(ValueError, match="not the oldest step in flight"):
        ctx.commit_readback(step, np.zeros(0, np.int64))  # committed twice
    second = ctx.build_step()  # request 0 turns into a decode: rows move, nothing is in flight
    for call in (ctx.pause_request, ctx.resume_request):
        with pytest.raises(RuntimeError, match="a step is in flight"):
            call(0)
    ctx.commit_readback(second, np.zeros(second.num_decode, np.int64))
    ctx.pause_request(0)


def test_finish_with_a_step_in_flight_then_commit_skips_the_request_that_left():
    """finish_request needs no sync and moves nothing: the step in flight is committed to the
    slots it ran on, skipping the finished request's (even once a new request holds it); the
    blocks come back, the lengths stay exact."""
    ctx = make_context()
    for request_id in range(3):
        ctx.add_request(request_id, [1, 2, 3])
    step_and_commit(ctx)  # three prompts
    step_and_commit(ctx, [0, 0, 0])  # three decodes
    step = ctx.build_step()
    accepted = np.array([2, 1, 0], np.int64)
    run_device_step(ctx, step, accepted)
    ctx.finish_request(0)
    ctx.add_request(7, [4, 5])  # takes request 0's slot with the step in flight
    assert [ctx.table.slot_of(request_id) for request_id in (7, 1, 2)] == [0, 1, 2]
    ctx.commit_readback(step, accepted)
    assert ctx.table.host.known_lengths[:3].tolist() == [0, 4 + 1 + 1, 4 + 1 + 0]  # requests 7, 1 and 2
    ctx.table.write_inserted_rows()  # request 7's device rows (the next build_step would do it)
    assert ctx.table.mismatched_rows() == []
    for request_id in (1, 2, 7):
        ctx.finish_request(request_id)
    assert ctx.allocator.num_free_blocks == ctx.allocator.num_blocks


def test_request_at_max_model_len_runs_a_step_past_its_stop():
    """A request holds up to ceil((max_model_len + 2 (1 + S)) / bs) blocks: a request of
    max_model_len tokens can still run the step in flight and one more before the host stops it."""
    ctx = make_context(max_model_len=6)
    assert ctx.shape.max_blocks_per_request == 3  # ceil((6 + 6) / 4)
    ctx.add_request(0, [1] * 6)
    step_and_commit(ctx)
    first = ctx.build_step()
    run_device_step(ctx, first, [2])
    second = ctx.build_step()
    ctx.commit_readback(first, np.array([2]))
    run_device_step(ctx, second, [2])
    ctx.commit_readback(second, np.array([2]))
    assert ctx.table.host.known_lengths[0] == 12 == ctx.shape.max_blocks_per_request * 4
    assert ctx.table.mismatched_rows() == []
    ctx.finish_request(0)
    assert ctx.allocator.num_free_blocks == ctx.allocator.num_blocks

def test_constructor_errors():
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        make_context(max_tokens_per_step=11)  # 4 requests x 3 rows
    with pytest.raises(ValueError, match="exactly one of num_blocks and kv_cache_bytes"):
        make_context(kv_cache_bytes=1024)
    with pytest.raises(ValueError, match="cannot hold one request"):
        make_context(num_blocks=9)  # ceil((32 + 2 * 3) / 4) = 10 blocks
    with pytest.raises(ValueError, match="block_size_tokens"):
        make_context(block_size_tokens=0)
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        make_context(cuda_graph_batch_sizes=(2, 8))
    with pytest.raises(TypeError, match="KVCacheSpec"):
        make_context(kv_cache=None)
    with pytest.raises(TypeError, match="floating"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.int8)


def test_a_prompt_done_becomes_a_decode_whatever_left_before_it():
    """Finishing the only decode request with a step in flight, ahead of a prompt whose final
    chunk just ran: the prompt still becomes a decode at the next build without a sync (slots
    do not move; before stable slots this removal forced one)."""
    ctx = make_context()
    ctx.add_request(0, [1, 2, 3])
    step_and_commit(ctx)  # request 0's prompt
    ctx.add_request(1, [4, 5])  # finishes its prompt in the next step
    ctx.add_request(2, list(range(30)))  # still mid-prompt after it
    step = ctx.build_step()
    assert step.request_ids == (0, 1, 2) and step.num_decode == 1
    ctx.finish_request(0)
    assert not ctx.needs_sync()
    second = ctx.build_step()  # with the first still in flight
    assert second.request_ids[:1] == (1,) and second.num_decode == 1 and ctx.table.slot_of(1) == 1
    ctx.commit_readback(step, np.zeros(1, np.int64))
    ctx.commit_readback(second, np.zeros(1, np.int64))


def test_a_decode_run_is_staged_only_for_decode_steps_and_reserves_every_step():
    """bs = 4, S = 2, runs of up to 4 steps: while a prompt is prefilling the build is one step;
    once both requests decode it is a run of 4, holding blocks for 4 steps of 3 rows; the device
    runs the run's steps from one staging, and committing [4, 2] accepted counts leaves host ==
    device. A pool too small for the run falls back to single steps."""
    ctx = make_context(max_requests=2, max_model_len=64, num_blocks=40, decode_steps_per_launch=4)
    ctx.add_request(0, [1, 2, 3, 4, 5])
    ctx.add_request(1, [6, 7])
    budgets = (40, 40, 1.0)
    step = ctx.build_step(length_budgets=budgets)
    assert step.num_steps == 1 and step.num_prefill == 2
    run_device_step(ctx, step, [])
    ctx.commit_readback(step, np.zeros(0, np.int64))
    run = ctx.build_step(length_budgets=budgets)
    assert run.num_steps == 4 and run.num_decode == 2 and ctx.steps_in_flight == 4
    host = ctx.table.host
    assert (host.block_counts[:2] * 4 >= host.known_lengths[:2] + 3 * 4).all()
    accepted = np.array([[2, 0], [1, 2], [0, 0], [2, 1]])
    for step_accepted in accepted:
        run_device_step(ctx, run, step_accepted)
    ctx.commit_readback(run, accepted)
    assert host.known_lengths[:2].tolist() == [5 + 4 + 5, 2 + 4 + 3] and ctx.table.mismatched_rows() == []
    with pytest.raises(ValueError, match=r"the step has 1 step\(s\)"):
        ctx.commit_readback(ctx.build_step(length_budgets=(0, 0, 1.0)), accepted)  # a one-step build
    tight = make_context(max_requests=2, max_model_len=16, num_blocks=6, decode_steps_per_launch=4,
                         cuda_graph_batch_sizes=(1, 2))
    tight.add_request(0, [1, 2, 3, 4, 5])
    tight.add_request(1, [6, 7])
    step_and_commit(tight)
    assert tight.build_step(length_budgets=budgets).num_steps == 1  # a run would need 3 + 3 blocks, 3 free
    with pytest.raises(ValueError, match="decode runs have"):
        tight.build_padding_step(tight.graph_shapes()[0], num_steps=3)
