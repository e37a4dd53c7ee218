"""DynamicInferenceContext: step metadata by hand, chunked prefill, padded buckets, KV
exhaustion, commit_step against rewind_kv_cache on the device rows, and bad input."""

import random

import pytest
import torch

from mtp_ctrl.state import (
    BatchDimensions,
    DynamicInferenceContext,
    KVCacheFullError,
    KVCacheSpec,
    MambaSpec,
    RowGroup,
)
from mtp_ctrl.triton_ops import rewind_kv_cache

KV_SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)


def make_context(**overrides):
    args = dict(
        max_requests=4,
        max_model_len=32,
        block_size_tokens=4,
        num_speculative_tokens=2,
        max_tokens_per_step=12,
        kv_cache=KV_SPEC,
        device="cpu",
        num_blocks=24,
    )
    args.update(overrides)
    return DynamicInferenceContext(**args)


def run_device_rewind(ctx, step, accepted):
    """What the controller does on the device between build_step and commit_step."""
    n = step.num_requests
    accepted_counts = torch.zeros(n, dtype=torch.int64)  # [n] int64, prefill rows ignored
    accepted_counts[: step.num_decode] = torch.as_tensor(accepted, dtype=torch.int64)
    rows = ctx.table.device
    blocks, remove = rewind_kv_cache(
        accepted_counts,
        rows.prefill_status[:n],
        rows.last_kv_block_offset[:n],
        rows.kv_length_offsets[:n],
        rows.kv_block_counts[:n],
        rows.last_kv_block_id[:n],
        rows.kv_block_ids[:n],
        ctx.num_speculative_tokens,
        ctx.allocator.block_size_tokens,
    )
    return sorted(blocks[remove].tolist())


def step_and_commit(ctx, accepted=None):
    step = ctx.build_step()
    accepted = [0] * step.num_decode if accepted is None else accepted
    run_device_rewind(ctx, step, accepted)
    ctx.commit_step(step, accepted)
    assert ctx.table.mismatched_fields() == []
    return step


def test_hand_computed_step_of_two_decodes_and_a_prefill_chunk():
    """bs = 4, S = 2, budget 12. Requests 0 (prompt 5) and 1 (prompt 3) prefill, then decode
    next to request 2 (prompt 10), which gets the 12 - 2 * 3 = 6 remaining rows."""
    ctx = make_context()
    ctx.add_request(0, [10, 11, 12, 13, 14])
    ctx.add_request(1, [20, 21, 22])
    first = step_and_commit(ctx)
    assert first.num_prefill == 2 and first.num_final_prefill_chunks == 2
    assert first.logits_indices.tolist() == [4, 7]  # the last row of each prompt
    assert ctx.table.request_ids_in(RowGroup.DECODE) == [0, 1]

    ctx.table.next_tokens[:2] = torch.tensor([15, 23])
    ctx.table.draft_tokens[:2] = torch.tensor([[16, 17], [24, 25]])
    ctx.add_request(2, list(range(30, 40)))
    step = ctx.build_step()
    att = step.attention
    assert step.request_ids == (0, 1, 2)
    assert (step.num_decode, step.num_prefill, step.num_final_prefill_chunks) == (2, 1, 0)
    assert step.num_sampling_requests == 2
    assert step.input_ids.tolist() == [15, 16, 17, 23, 24, 25, 30, 31, 32, 33, 34, 35]
    assert att.positions.tolist() == [5, 6, 7, 3, 4, 5, 0, 1, 2, 3, 4, 5]
    # request 0: blocks [0, 1]; request 1: [2] + new 3; request 2: new [4, 5]
    assert att.slot_mapping.tolist() == [5, 6, 7, 11, 12, 13, 16, 17, 18, 19, 20, 21]
    assert att.query_start_loc.tolist() == [0, 3, 6, 12]
    assert att.seq_lens.tolist() == [8, 6, 6]
    assert att.block_table[:, :3].tolist() == [[0, 1, -1], [2, 3, -1], [4, 5, -1]]
    assert (att.num_actual_tokens, att.max_query_len, att.max_seq_len) == (12, 6, 8)
    assert step.logits_indices.tolist() == [0, 1, 2, 3, 4, 5]  # the partial chunk samples nothing
    assert step.dimensions == BatchDimensions(token_count=12, decode_request_count=2, prefill_request_count=1)
    rows = ctx.table.device  # what the step kernels see: this step's rows counted
    assert rows.kv_length_offsets[:3].tolist() == [8, 6, 6]
    assert rows.last_kv_block_offset[:3].tolist() == [3, 1, 1]
    assert rows.kv_block_counts[:3].tolist() == [2, 2, 2]
    assert rows.last_kv_block_id[:3].tolist() == [1, 3, 5]
    assert rows.prefill_status[:3].tolist() == [0, 0, 1]

    # request 0 accepts both drafts; request 1 none: it rewinds back into block 2 and frees 3
    assert run_device_rewind(ctx, step, [2, 0]) == [3]
    ctx.commit_step(step, [2, 0])
    assert ctx.table.mismatched_fields() == []
    assert ctx.table.host.kv_length_offsets[:3].tolist() == [8, 4, 6]
    assert not ctx.allocator.is_allocated(3)
    assert ctx.allocator.num_allocated_blocks == 5


def test_chunked_prefill_under_the_token_budget():
    ctx = make_context(max_requests=1, num_speculative_tokens=3, max_tokens_per_step=4)
    prompt = list(range(100, 110))
    ctx.add_request(7, prompt)
    seen = []
    for expected_rows in (4, 4, 2):
        step = step_and_commit(ctx)
        assert step.num_prefill == 1 and step.attention.num_actual_tokens == expected_rows
        seen += step.input_ids.tolist()
        final = expected_rows == 2
        assert step.num_final_prefill_chunks == int(final)
        assert step.logits_indices.tolist() == ([expected_rows - 1] if final else [])
    assert seen == prompt
    assert ctx.table.group_of(7) == RowGroup.DECODE
    assert ctx.table.host.kv_length_offsets[0] == 10 and ctx.table.host.prefill_status[0] == 0
    decode = step_and_commit(ctx, [3])
    assert decode.attention.positions.tolist() == [10, 11, 12, 13]
    assert ctx.table.host.kv_length_offsets[0] == 14


def test_decode_step_padded_to_a_cuda_graph_bucket():
    ctx = make_context(max_requests=5, max_tokens_per_step=15, cuda_graph_batch_sizes=(1, 2, 4))
    for request_id in range(3):
        ctx.add_request(request_id, [1, 2, 3])
    step_and_commit(ctx)
    ctx.add_request(9, [4, 5])
    ctx.pause_request(9)  # a paused row sits in the padding rows and must stay untouched
    ctx.table.draft_tokens[3] = -1  # whatever a paused row's tokens are, padding reads none
    before = ctx.table.host.kv_block_ids[3].clone()
    step = ctx.build_step()
    att = step.attention
    assert step.dimensions == BatchDimensions.decode_only(4, 2)
    assert (step.num_decode, step.num_prefill) == (3, 0)
    assert step.input_ids.shape == (12,) and step.input_ids[9:].tolist() == [0, 0, 0]
    assert att.slot_mapping[9:].tolist() == [-1, -1, -1]
    assert att.positions[9:].tolist() == [0, 0, 0]
    assert att.query_start_loc.tolist() == [0, 3, 6, 9, 9]
    assert att.seq_lens.tolist() == [6, 6, 6, 0]
    assert att.block_table[3].tolist() == [-1] * ctx.max_blocks_per_request
    assert att.num_actual_tokens == 9
    assert step.logits_indices.tolist() == list(range(12))
    run_device_rewind(ctx, step, [1, 2, 0])
    ctx.commit_step(step, [1, 2, 0])
    assert torch.equal(ctx.table.host.kv_block_ids[3], before)
    assert ctx.table.mismatched_fields() == []

    ctx.add_request(3, [1])
    step_and_commit(ctx)
    ctx.resume_request(9)
    step = ctx.build_step()  # a prefill chunk in the step: eager, exact dimensions
    assert (step.num_decode, step.num_prefill) == (4, 1)
    assert step.dimensions == BatchDimensions(token_count=14, decode_request_count=4, prefill_request_count=1)
    run_device_rewind(ctx, step, [0] * 4)
    ctx.commit_step(step, [0] * 4)
    step = ctx.build_step()  # 5 decode requests: above every bucket, eager
    assert step.dimensions == BatchDimensions.decode_only(5, 2) and step.attention.num_actual_tokens == 15


def test_pause_on_kv_exhaustion_and_resume_when_blocks_free_up():
    """bs = 2, S = 1: pool of 5 blocks (one request of max_model_len 8 + 1 draft)."""
    ctx = make_context(max_requests=2, max_model_len=8, block_size_tokens=2, num_speculative_tokens=1,
                       max_tokens_per_step=8, num_blocks=5)
    ctx.add_request(0, [1, 2, 3, 4])
    ctx.add_request(1, [5, 6, 7, 8])
    step_and_commit(ctx)  # 2 + 2 blocks taken, 1 free
    ctx.table.next_tokens[:2] = torch.tensor([40, 50])
    ctx.table.draft_tokens[:2] = torch.tensor([[41], [51]])
    step = ctx.build_step()  # both need a block for positions 4, 5: only request 0 gets it
    assert step.request_ids == (0,) and step.input_ids.tolist() == [40, 41]
    assert ctx.table.group_of(1) == RowGroup.PAUSED
    paused_row = ctx.table.row_of(1)
    assert ctx.table.host.kv_length_offsets[paused_row] == 4
    assert ctx.table.host.kv_block_ids[paused_row, :2].tolist() == [2, 3]
    run_device_rewind(ctx, step, [1])
    ctx.commit_step(step, [1])
    assert ctx.table.mismatched_fields() == []
    assert ctx.allocator.num_free_blocks == 0

    with pytest.raises(KVCacheFullError, match="no live request can get a KV block"):
        ctx.build_step()  # request 0 needs a 4th block too: nobody can run
    assert ctx.table.group_of(0) == RowGroup.PAUSED and ctx.table.group_of(1) == RowGroup.PAUSED

    ctx.finish_request(0)
    assert ctx.allocator.num_free_blocks == 3
    step = ctx.build_step()  # request 1 resumes with its tokens and state
    assert step.request_ids == (1,) and step.input_ids.tolist() == [50, 51]
    assert step.attention.positions.tolist() == [4, 5]
    run_device_rewind(ctx, step, [0])
    ctx.commit_step(step, [0])
    assert ctx.table.mismatched_fields() == []


def test_rewind_across_two_blocks_when_drafts_outnumber_the_block_size():
    """bs = 2, S = 3: 3 cached tokens (blocks [0, 1]) + 4 rows -> 7 tokens in 4 blocks; no draft
    accepted -> back to 4 tokens: blocks 2 and 3 are freed by one rewind."""
    ctx = make_context(block_size_tokens=2, num_speculative_tokens=3, max_tokens_per_step=16)
    ctx.add_request(0, [1, 2, 3])
    step_and_commit(ctx)
    step = ctx.build_step()
    assert ctx.table.device.kv_block_ids[0, :4].tolist() == [0, 1, 2, 3]
    assert run_device_rewind(ctx, step, [0]) == [2, 3]
    ctx.commit_step(step, [0])
    assert ctx.table.mismatched_fields() == []
    assert ctx.table.host.kv_block_ids[0, :4].tolist() == [0, 1, -1, -1]
    assert ctx.allocator.num_allocated_blocks == 2


def test_prefill_chunk_leaves_the_decodes_next_blocks_and_waits_behind_a_paused_decode():
    """bs = 1, S = 1 (a decode step needs 2 blocks), pool of 9 blocks. A prefill chunk takes only
    the free blocks that the running decodes will not need next step, so it cannot starve them."""
    ctx = make_context(max_requests=2, max_model_len=8, block_size_tokens=1, num_speculative_tokens=1,
                       max_tokens_per_step=8, num_blocks=9)
    ctx.add_request(0, [1, 2, 3])
    step_and_commit(ctx)  # 3 blocks
    ctx.add_request(1, [4, 5, 6, 7, 8, 9, 10, 11])
    step = ctx.build_step()  # decode 0 takes 2 blocks; of the 4 left, 2 are kept for its next step
    assert step.attention.query_start_loc.tolist() == [0, 2, 4]
    assert step.input_ids[2:].tolist() == [4, 5] and step.num_final_prefill_chunks == 0
    run_device_rewind(ctx, step, [0])
    ctx.commit_step(step, [0])  # request 0 keeps 4 tokens: 1 block back
    assert ctx.allocator.num_free_blocks == 3

    step = ctx.build_step()  # decode 0 takes 2 (1 left, less than its next 2): no prefill chunk
    assert step.request_ids == (0,)
    run_device_rewind(ctx, step, [1])
    ctx.commit_step(step, [1])  # both rows accepted: request 0 holds 6 tokens
    assert ctx.allocator.num_free_blocks == 1

    with pytest.raises(KVCacheFullError):
        ctx.build_step()  # decode 0 needs 2 blocks: paused; the prefill may not take the free one
    assert ctx.table.group_of(0) == RowGroup.PAUSED
    assert ctx.allocator.num_free_blocks == 1
    assert ctx.table.host.kv_length_offsets[ctx.table.row_of(1)] == 2

    ctx.finish_request(1)
    step = ctx.build_step()
    assert step.request_ids == (0,) and step.attention.positions.tolist() == [6, 7]


@pytest.mark.parametrize(
    "block_size_tokens, num_speculative_tokens",
    [(4, 2), (2, 3), (1, 2)],  # the last two have S >= block_size: a rewind may cross several blocks
)
def test_commit_matches_rewind_kv_cache_over_random_steps(block_size_tokens, num_speculative_tokens):
    rng = random.Random(block_size_tokens * 10 + num_speculative_tokens)
    ctx = make_context(
        max_requests=3,
        max_model_len=24,
        block_size_tokens=block_size_tokens,
        num_speculative_tokens=num_speculative_tokens,
        max_tokens_per_step=3 * (num_speculative_tokens + 1) + 2,
        num_blocks=60,
    )
    next_id = 0
    for _ in range(12):
        while ctx.num_free_rows:
            ctx.add_request(next_id, [rng.randrange(50) for _ in range(rng.randrange(1, 9))])
            next_id += 1
        step = ctx.build_step()
        accepted = [rng.randrange(num_speculative_tokens + 1) for _ in range(step.num_decode)]
        released = run_device_rewind(ctx, step, accepted)
        free_before = ctx.allocator.num_free_blocks
        ctx.commit_step(step, accepted)
        assert ctx.allocator.num_free_blocks == free_before + len(released)
        assert ctx.table.mismatched_fields() == []
        host = ctx.table.host
        held = host.kv_block_ids[: ctx.table.num_live]
        held = held[held >= 0].tolist()
        assert len(held) == len(set(held)) == ctx.allocator.num_allocated_blocks
        assert torch.equal(host.kv_block_counts[: ctx.table.num_live],
                           -(-host.kv_length_offsets[: ctx.table.num_live] // block_size_tokens))
        for request_id in step.request_ids:
            if request_id in ctx and host.kv_length_offsets[ctx.table.row_of(request_id)] > 14:
                ctx.finish_request(request_id)


def test_mamba_slots_follow_requests():
    mamba = MambaSpec(num_layers=1, conv_state_shape=(2, 3), ssm_state_shape=(2, 2), dtype=torch.float32)
    ctx = make_context(mamba=mamba)
    ctx.add_request(5, [1, 2])
    ctx.add_request(6, [1, 2])
    assert ctx.table.host.mamba_slot_ids[:2].tolist() == [0, 1]
    assert ctx.mamba.intermediate_ssm_states.shape == (1, 5, 3, 2, 2)  # 4 slots + scratch
    ctx.finish_request(5)
    assert ctx.mamba.num_free_slots == 3
    assert ctx.table.host.mamba_slot_ids[0] == 1


def test_kv_caches_and_byte_budget():
    bytes_per_block = KV_SPEC.bytes_per_block(4)
    assert bytes_per_block == 2 * 2 * 4 * 1 * 4 * 4
    ctx = make_context(num_blocks=None, kv_cache_bytes=20 * bytes_per_block + 7)
    assert ctx.allocator.num_blocks == 20
    assert len(ctx.kv_caches) == 2
    key_cache, value_cache = ctx.kv_caches[1]
    assert key_cache.shape == value_cache.shape == (20, 4, 1, 4)
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
    with pytest.raises(RuntimeError, match="a step is in flight"):
        ctx.build_step()
    with pytest.raises(RuntimeError, match="a step is in flight"):
        ctx.finish_request(0)
    ctx.add_request(1, [4])  # admitting is fine mid-step: the new row lies past the step's rows
    with pytest.raises(ValueError, match="has 1 entries, the step has 0"):
        ctx.commit_step(step, [1])
    ctx.commit_step(step, [])
    with pytest.raises(ValueError, match="not the step in flight"):
        ctx.commit_step(step, [])
    step = ctx.build_step()
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\]"):
        ctx.commit_step(step, [3])
    with pytest.raises(TypeError, match="int32 or int64"):
        ctx.commit_step(step, torch.tensor([1.0]))
    ctx.commit_step(step, [2])


def test_request_at_max_model_len_must_be_finished():
    ctx = make_context(max_model_len=6)
    ctx.add_request(0, [1] * 6)
    step_and_commit(ctx)  # prompt of max_model_len tokens: its sampled token completes it
    with pytest.raises(ValueError, match="reached max_model_len"):
        ctx.build_step()
    ctx.finish_request(0)
    assert ctx.allocator.num_free_blocks == ctx.allocator.num_blocks


def test_constructor_errors():
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        make_context(max_tokens_per_step=11)  # 4 requests x 3 rows
    with pytest.raises(ValueError, match="exactly one of num_blocks and kv_cache_bytes"):
        make_context(kv_cache_bytes=1024)
    with pytest.raises(ValueError, match="cannot hold one request"):
        make_context(num_blocks=8)  # ceil((32 + 2) / 4) = 9 blocks
    with pytest.raises(ValueError, match="block_size_tokens"):
        make_context(block_size_tokens=0)
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        make_context(cuda_graph_batch_sizes=(2, 8))
    with pytest.raises(TypeError, match="KVCacheSpec"):
        make_context(kv_cache=None)
    with pytest.raises(TypeError, match="floating"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.int8)
