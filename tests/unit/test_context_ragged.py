"""DynamicInferenceContext with ragged rows (``enable_ragged_rows``): a decode request runs ``1 + s_r``
rows, its logits rows stay ``1 + V``; a hand-computed step, and the refusal with Mamba layers."""

import numpy as np
import pytest
import torch

from mtp_ctrl.state import BatchDimensions, MambaSpec
from tests.unit.context_fixtures import make_context, run_device_step


def test_hand_computed_ragged_decode_step():
    """Ragged rows (``enable_ragged_rows``), bs = 4, S = 2, grid 4: requests 0, 1, 2 (prompts 5, 3, 4)
    prefill and draft 2, 0 and 1 tokens; the next step runs 1 + s_r rows each (3, 1, 2: 6 rows, a
    ragged count of grid 4: every row from 5 to 12), logits rows strided (1 + V = 3 a request, rows past s_r
    repeating row s_r, the padding request's rows 0); a request that accepted none of its drafts
    rewinds only the rows it ran; then an all-zero step (every s_r = 0) is a plain decode step."""
    ctx = make_context(cuda_graph_batch_sizes=(4,))
    ctx.enable_ragged_rows()
    for request_id, length in enumerate((5, 3, 4)):
        ctx.add_request(request_id, list(range(10 * (request_id + 1), 10 * (request_id + 1) + length)))
    first = ctx.build_step(draft_lengths=lambda ids, n, batch: np.array([2, 0, 1]))
    run_device_step(ctx, first, [])
    ctx.commit_readback(first, np.zeros(0, np.int64))
    ctx.table.next_tokens[:3] = torch.tensor([15, 23, 34])
    ctx.table.draft_tokens[:3] = torch.tensor([[16, 17], [-5, -5], [35, -5]])
    step = ctx.build_step(draft_lengths=lambda ids, n, batch: np.zeros(n, np.int64))
    ctx.prepare_inputs(step)
    att = step.attention
    assert step.host_verify_lengths == (2, 0, 1) and step.verify_width == 2
    assert step.host_query_lengths.tolist() == [3, 1, 2]
    assert step.dimensions == BatchDimensions(token_count=6, request_count=4, has_prefill=False)
    assert att.query_start_loc.tolist() == [0, 3, 4, 6, 6]
    assert step.input_ids[:6].tolist() == [15, 16, 17, 23, 34, 35]
    assert att.positions.tolist() == [5, 6, 7, 3, 4, 5]
    assert (att.slot_mapping >= 0).all()
    assert step.logits_indices.tolist() == [0, 1, 2, 3, 3, 3, 4, 5, 5, 0, 0, 0]
    assert att.seq_lens.tolist() == [8, 4, 6, 0] and att.max_query_len == 3
    rows = ctx.table.device
    device_rewind_ragged = [2 - 0, 0, 1 - 1]  # s_r - accepted: request 0 accepted none, request 2 its one
    before = rows.kv_length_offsets[:3].clone()
    rows.kv_length_offsets[:3] = before - torch.tensor(device_rewind_ragged)  # what verify_and_commit(qsl=) does
    ctx.commit_readback(step, np.array([0, 0, 1]))
    assert ctx.table.host.known_lengths[:3].tolist() == rows.kv_length_offsets[:3].tolist() == [6, 4, 6]
    plain = ctx.build_step(draft_lengths=lambda ids, n, batch: np.zeros(n, np.int64))
    assert plain.verify_width == 0 and plain.host_query_lengths.tolist() == [1, 1, 1]
    assert plain.dimensions == BatchDimensions(token_count=4, request_count=4, has_prefill=False)
    assert plain.logits_indices.tolist() == [0, 1, 2, 0]


def test_a_step_with_prefill_chunks_keeps_one_plus_v_rows_a_decode_request():
    """Ragged rows, S = 2: requests 0 and 1 hold 2 and 0 drafts when request 2 joins. The step
    with its prompt chunk gives both decode requests 1 + V = 3 rows (the MTP windows of a step
    with prefill chunks are bounded by its rows plus S a request, which 1 + s_r rows undercount);
    the next decode-only step is ragged again."""
    ctx = make_context()
    ctx.enable_ragged_rows()
    for request_id, length in enumerate((5, 3)):
        ctx.add_request(request_id, list(range(10 * (request_id + 1), 10 * (request_id + 1) + length)))
    first = ctx.build_step(draft_lengths=lambda ids, n, batch: np.array([2, 0]))
    run_device_step(ctx, first, [])
    ctx.commit_readback(first, np.zeros(0, np.int64))
    ctx.add_request(2, [7, 8, 9, 6])
    mixed = ctx.build_step(draft_lengths=lambda ids, n, batch: np.array([1, 0, 2])[:n])
    assert mixed.host_verify_lengths == (2, 0) and mixed.verify_width == 2
    assert mixed.host_query_lengths.tolist() == [3, 3, 4]
    run_device_step(ctx, mixed, [0, 0])
    ctx.commit_readback(mixed, np.zeros(2, np.int64))
    decode = ctx.build_step(draft_lengths=lambda ids, n, batch: np.zeros(n, np.int64))
    assert decode.host_verify_lengths == (1, 0, 2) and decode.host_query_lengths.tolist() == [2, 1, 3]


def test_ragged_rows_are_refused_with_mamba_layers():
    ctx = make_context(mamba=MambaSpec(num_layers=1, conv_state_shape=(2, 3), ssm_state_shape=(2, 2), dtype=torch.float32))
    with pytest.raises(ValueError, match="Mamba"):
        ctx.enable_ragged_rows()
