"""The inference context on the CPU for the context tests: a small context, and the device half of
a step simulated (prepare_inputs, the KV rewind) so the host and device stay in step."""

import numpy as np
import torch

from mtp_ctrl.state import DynamicInferenceContext, KVCacheSpec
from mtp_ctrl.state.engine_shape import EngineShape
from mtp_ctrl.triton_ops.reference import rewind_kv_cache

SHAPE_FIELDS = ("max_requests", "max_model_len", "block_size_tokens", "num_speculative_tokens", "max_tokens_per_step",
                "decode_steps_per_launch", "device")

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
    shape = EngineShape(**{name: args.pop(name) for name in SHAPE_FIELDS if name in args})
    return DynamicInferenceContext(shape, **args)


def device_rewind(ctx, step, accepted):
    """What verify_and_commit(keep_released_blocks=True, request_slots=...) does to the KV state:
    rewind each decode request (in its slot) past its rejected drafts, keeping every block id
    (the rewind sees a copy of them)."""
    n = step.num_requests
    accepted_counts = torch.zeros(n, dtype=torch.int64)  # [n] int64, prefill rows ignored
    accepted_counts[: step.num_decode] = torch.as_tensor(np.asarray(accepted, dtype=np.int64))
    rows, slots = ctx.table.device, torch.from_numpy(step.host_slot_ids)
    state = [rows.last_kv_block_offset, rows.kv_length_offsets, rows.kv_block_counts, rows.last_kv_block_id]
    gathered = [tensor[slots] for tensor in state]  # [n] each
    rewind_kv_cache(accepted_counts, rows.prefill_status[slots], *gathered, rows.kv_block_ids[slots].clone(),
                    ctx.shape.num_speculative_tokens, ctx.allocator.block_size_tokens)
    for tensor, values in zip(state, gathered):
        tensor[slots] = values


def run_device_step(ctx, step, accepted):
    """The device half of a step: prepare_inputs, check every real row has a KV slot in a block
    the host gave, then the rewind."""
    ctx.prepare_inputs(step)
    rows = step.attention.num_actual_tokens
    assert (step.attention.slot_mapping[:rows] >= 0).all()
    slots = step.host_slot_ids
    assert (ctx.table.device.kv_block_counts[slots].numpy() <= ctx.table.host.block_counts[slots]).all()
    device_rewind(ctx, step, accepted)


def step_and_commit(ctx, accepted=None):
    step = ctx.build_step()
    accepted = np.zeros(step.num_decode, np.int64) if accepted is None else np.asarray(accepted, np.int64)
    run_device_step(ctx, step, accepted)
    ctx.commit_readback(step, accepted)
    assert ctx.table.mismatched_rows() == []
    return step


def held_blocks(ctx):
    host, live = ctx.table.host, ctx.table.num_live
    held = host.block_ids[:live]
    return held[held >= 0].tolist()
