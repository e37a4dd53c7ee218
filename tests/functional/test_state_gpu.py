"""DynamicInferenceContext on CUDA: same steps as on the CPU (prepare_inputs, the Triton rewind
keeping blocks, commit_readback, one step in flight where needs_sync allows), host block table
== device table, no host sync in build_step / prepare_inputs / commit_readback, static step
buffers for CUDA graphs."""

import random

import numpy as np
import pytest
import torch

from mtp_ctrl.state import DynamicInferenceContext, EngineShape, KVCacheSpec
from mtp_ctrl.triton_ops import rewind_kv_cache
from tests.functional.sync_checks import no_host_sync

KV_SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)


def make_context(device, block_size_tokens=4, num_speculative_tokens=2):
    shape = EngineShape(max_requests=4, max_model_len=40, block_size_tokens=block_size_tokens,
                        num_speculative_tokens=num_speculative_tokens,
                        max_tokens_per_step=4 * (num_speculative_tokens + 1) + 3, device=device)
    return DynamicInferenceContext(shape, kv_cache=KV_SPEC, num_blocks=64, cuda_graph_batch_sizes=(1, 2, 4))


def device_step(ctx, step, accepted_counts):
    """The controller's device work: prepare_inputs, then the rewind over the step's grid (its
    requests' state gathered from their slots, padding from the scratch slot) with
    num_active_requests = n, written back to the real requests' slots; the rewind sees a copy of
    the block ids, so every block stays held (verify_and_commit(keep_released_blocks=True))."""
    ctx.prepare_inputs(step)
    batch, slots, n = step.dimensions.request_count, step.slot_ids, step.num_requests
    rows = ctx.table.device
    state = [rows.last_kv_block_offset, rows.kv_length_offsets, rows.kv_block_counts, rows.last_kv_block_id]
    gathered = [tensor[slots] for tensor in state]  # [B] each
    rewind_kv_cache(
        accepted_counts[:batch],
        rows.prefill_status[slots],
        *gathered,
        rows.kv_block_ids[slots].clone(),
        ctx.shape.num_speculative_tokens,
        ctx.allocator.block_size_tokens,
        num_active_requests=n,
    )
    for tensor, values in zip(state, gathered):
        tensor[slots[:n]] = values[:n]


def run_scenario(device, seed, block_size_tokens, num_speculative_tokens, steps=12):
    """Random admissions, steps (overlapped when allowed) and finishes; returns every step's
    tensors on the CPU."""
    rng = random.Random(seed)
    ctx = make_context(device, block_size_tokens, num_speculative_tokens)
    stride = num_speculative_tokens + 1
    host = ctx.table.host
    record, next_id, pending = [], 0, None

    def launch(steps_in_flight):
        live = ctx.table.num_live
        ctx.table.next_tokens[:live] = torch.arange(live) + 1000 * seed
        ctx.table.draft_tokens[:live] = torch.arange(live * num_speculative_tokens).view(live, -1)
        step = ctx.build_step()
        accepted = np.array([rng.randrange(stride) for _ in range(step.num_decode)], dtype=np.int64)
        accepted_buffer = torch.zeros(4, dtype=torch.int64, device=device)  # [R] int64
        accepted_buffer[: step.num_decode] = torch.from_numpy(accepted)
        device_step(ctx, step, accepted_buffer)
        att = step.attention
        # clone: later steps overwrite the step buffers
        record.append([t.cpu().clone() for t in (step.input_ids, step.logits_indices, att.positions, att.slot_mapping,
                                                 att.query_start_loc, att.seq_lens, att.block_table)])
        record.append(step.request_ids)
        return step, accepted

    for _ in range(steps):
        short = host.known_lengths[ctx.table.live_slots()].max(initial=0) <= 16
        if pending is not None and short and not ctx.needs_sync() and rng.random() < 0.7:
            launched = launch(steps_in_flight=1)
            ctx.commit_readback(*pending)
            pending = launched
            continue
        if pending is not None:
            ctx.commit_readback(*pending)
            pending = None
            assert ctx.table.mismatched_rows() == []
            for request_id in host.request_ids[ctx.table.live_slots()].tolist():
                if host.known_lengths[ctx.table.slot_of(request_id)] > 16:
                    ctx.finish_request(request_id)
        while ctx.num_free_rows:
            ctx.add_request(next_id, [rng.randrange(100) for _ in range(rng.randrange(1, 12))])
            next_id += 1
        pending = launch(steps_in_flight=0)
    ctx.commit_readback(*pending)
    assert ctx.table.mismatched_rows() == []
    for request_id in host.request_ids[ctx.table.live_slots()].tolist():
        ctx.finish_request(request_id)
    assert ctx.allocator.num_free_blocks == ctx.allocator.num_blocks
    return record


@pytest.mark.parametrize("block_size_tokens, num_speculative_tokens", [(4, 2), (2, 3), (16, 3)])
def test_cuda_steps_equal_cpu_steps(block_size_tokens, num_speculative_tokens):
    for seed in range(3):
        on_cpu = run_scenario("cpu", seed, block_size_tokens, num_speculative_tokens)
        on_cuda = run_scenario("cuda", seed, block_size_tokens, num_speculative_tokens)
        assert len(on_cpu) == len(on_cuda)
        for cpu_item, cuda_item in zip(on_cpu, on_cuda):
            if isinstance(cpu_item, tuple):
                assert cpu_item == cuda_item
            else:
                for expected, got in zip(cpu_item, cuda_item):
                    assert torch.equal(expected, got)


def test_staging_is_pinned_and_step_buffers_are_static():
    ctx = make_context("cuda")
    staging = ctx._step_buffers.staging  # the host sections of the one copy per step
    assert all(view.is_pinned() for view in staging.host.values())
    for request_id in range(3):
        ctx.add_request(request_id, [1, 2, 3, 4, 5])
    accepted = torch.zeros(4, dtype=torch.int64, device="cuda")
    step = ctx.build_step()
    device_step(ctx, step, accepted)
    ctx.commit_readback(step, np.zeros(0, np.int64))
    pointers = None
    for _ in range(3):
        step = ctx.build_step()
        att = step.attention
        now = [t.data_ptr() for t in (step.input_ids, step.logits_indices, att.positions, att.slot_mapping,
                                      att.query_start_loc, att.seq_lens, att.block_table)]
        assert pointers is None or now == pointers
        pointers = now
        device_step(ctx, step, accepted)
        ctx.commit_readback(step, np.zeros(3, np.int64))
    assert ctx.table.mismatched_rows() == []


def test_build_prepare_and_commit_do_not_sync():
    ctx = make_context("cuda")
    for request_id in range(3):
        ctx.add_request(request_id, list(range(4)))  # one prefill step: 12 of the 15 rows
    accepted = torch.ones(4, dtype=torch.int64, device="cuda")
    step = ctx.build_step()  # warm-up: compiles the rewind kernel
    device_step(ctx, step, accepted)
    ctx.commit_readback(step, np.ones(step.num_decode, np.int64))
    torch.cuda.synchronize()
    with no_host_sync():
        step = ctx.build_step()
        device_step(ctx, step, accepted)
        for _ in range(3):  # the overlapped loop: build the next step before the read-back
            assert not ctx.needs_sync()
            next_step = ctx.build_step()
            device_step(ctx, next_step, accepted)
            ctx.commit_readback(step, np.ones(step.num_decode, np.int64))
            step = next_step
        ctx.commit_readback(step, np.ones(step.num_decode, np.int64))
        ctx.finish_request(0)
        ctx.add_request(7, [3, 4])  # its device row is reset by stream-ordered writes
        step = ctx.build_step()
        device_step(ctx, step, accepted)
        ctx.commit_readback(step, np.ones(step.num_decode, np.int64))
    assert ctx.table.mismatched_rows() == []
