"""DynamicInferenceContext on CUDA: same steps as on the CPU, host mirror == device table after
the Triton rewind, no host sync in build_step/commit_step, static step buffers for CUDA graphs."""

import random

import pytest
import torch

from mtp_ctrl.state import DynamicInferenceContext, KVCacheSpec
from mtp_ctrl.triton_ops import rewind_kv_cache

KV_SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)


def make_context(device, block_size_tokens=4, num_speculative_tokens=2):
    return DynamicInferenceContext(
        max_requests=4,
        max_model_len=40,
        block_size_tokens=block_size_tokens,
        num_speculative_tokens=num_speculative_tokens,
        max_tokens_per_step=4 * (num_speculative_tokens + 1) + 3,
        kv_cache=KV_SPEC,
        device=device,
        num_blocks=64,
        cuda_graph_batch_sizes=(1, 2, 4),
    )


def device_rewind(ctx, step, accepted_counts):
    """The controller's device work: rewind over rows [0, B) with num_active_requests = n."""
    batch = step.dimensions.request_count
    rows = ctx.table.device
    return rewind_kv_cache(
        accepted_counts[:batch],
        rows.prefill_status[:batch],
        rows.last_kv_block_offset[:batch],
        rows.kv_length_offsets[:batch],
        rows.kv_block_counts[:batch],
        rows.last_kv_block_id[:batch],
        rows.kv_block_ids[:batch],
        ctx.num_speculative_tokens,
        ctx.allocator.block_size_tokens,
        num_active_requests=step.num_requests,
    )


def run_scenario(device, seed, block_size_tokens, num_speculative_tokens, steps=10):
    """Random admissions, steps and finishes; returns every step's tensors on the CPU."""
    rng = random.Random(seed)
    ctx = make_context(device, block_size_tokens, num_speculative_tokens)
    accepted_buffer = torch.zeros(4, dtype=torch.int64, device=device)  # [R] int64
    record, next_id = [], 0
    for _ in range(steps):
        while ctx.num_free_rows:
            ctx.add_request(next_id, [rng.randrange(100) for _ in range(rng.randrange(1, 12))])
            next_id += 1
        live = ctx.table.num_live
        ctx.table.next_tokens[:live] = torch.arange(live) + 1000 * seed
        ctx.table.draft_tokens[:live] = torch.arange(live * num_speculative_tokens).view(live, -1)
        step = ctx.build_step()
        accepted = [rng.randrange(num_speculative_tokens + 1) for _ in range(step.num_decode)]
        accepted_buffer.zero_()
        accepted_buffer[: step.num_decode] = torch.tensor(accepted, dtype=torch.int64)
        device_rewind(ctx, step, accepted_buffer)
        ctx.commit_step(step, accepted)
        assert ctx.table.mismatched_fields() == []
        att = step.attention
        # clone: on the CPU run .cpu() returns the staging buffer itself, which later steps overwrite
        record.append([t.cpu().clone() for t in (step.input_ids, step.logits_indices, att.positions, att.slot_mapping,
                                          att.query_start_loc, att.seq_lens, att.block_table)])
        record.append(step.request_ids)
        for request_id in step.request_ids:
            row = ctx.table.row_of(request_id)
            if int(ctx.table.host.kv_length_offsets[row]) > 24:
                ctx.finish_request(request_id)
    return record


@pytest.mark.parametrize("block_size_tokens, num_speculative_tokens", [(4, 2), (2, 3), (16, 3)])
def test_cuda_steps_equal_cpu_steps(block_size_tokens, num_speculative_tokens):
    for seed in range(3):
        on_cpu = run_scenario("cpu", seed, block_size_tokens, num_speculative_tokens)
        on_cuda = run_scenario("cuda", seed, block_size_tokens, num_speculative_tokens)
        for cpu_item, cuda_item in zip(on_cpu, on_cuda):
            if isinstance(cpu_item, tuple):
                assert cpu_item == cuda_item
            else:
                for expected, got in zip(cpu_item, cuda_item):
                    assert torch.equal(expected, got)


def test_staging_is_pinned_and_step_buffers_are_static():
    ctx = make_context("cuda")
    assert ctx.table.host.kv_length_offsets.is_pinned()
    for request_id in range(3):
        ctx.add_request(request_id, [1, 2, 3, 4, 5])
    accepted = torch.zeros(4, dtype=torch.int64, device="cuda")
    step = ctx.build_step()
    device_rewind(ctx, step, accepted)
    ctx.commit_step(step, [])
    pointers = None
    for _ in range(3):
        step = ctx.build_step()
        att = step.attention
        now = [t.data_ptr() for t in (step.input_ids, step.logits_indices, att.positions, att.slot_mapping,
                                      att.query_start_loc, att.seq_lens, att.block_table)]
        assert pointers is None or now == pointers
        pointers = now
        device_rewind(ctx, step, accepted)
        ctx.commit_step(step, [0, 0, 0])


def test_build_and_commit_do_not_sync():
    ctx = make_context("cuda")
    for request_id in range(3):
        ctx.add_request(request_id, list(range(9)))
    accepted = torch.ones(4, dtype=torch.int64, device="cuda")
    step = ctx.build_step()  # warm-up: compiles the rewind kernel
    device_rewind(ctx, step, accepted)
    ctx.commit_step(step, [1] * step.num_decode)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            step = ctx.build_step()
            device_rewind(ctx, step, accepted)
            ctx.commit_step(step, [1] * step.num_decode)
        ctx.finish_request(0)
        ctx.add_request(7, [3, 4])  # its device row arrives with the next step's copy
        ctx.build_step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert ctx.table.mismatched_fields(rows=ctx.table.num_live) == []
