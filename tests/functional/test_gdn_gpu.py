"""Gated DeltaNet hybrids on CUDA: the GDN kernels == their torch twins on the GPU; the mixer ==
megatron-core's own GatedDeltaNet with flash-linear-attention's kernels (skipped without fla);
the hybrid's decode steps run without host sync and their CUDA-graph replays (decode, verify and
mixed steps) give the eager tokens, which are the plain (S = 0) ones."""

import pytest
import torch

from mtp_ctrl.controllers import SamplingParams, TextGenerationController
from mtp_ctrl.triton_ops import (
    gdn_decode_rows,
    gdn_mark_pending_rows,
    gdn_row_input_width,
    gdn_varlen_scan,
    gdn_verify_rows,
    reference,
)
from tests.functional.test_controller_gpu import (
    PROMPTS,
    SyncCheckedController,
    _mixed_steps_replay_warmed_up_graphs,
    make_config,
)
from mtp_ctrl.triton_ops.gdn_tiles import GDNTiles
from tests.unit.gdn_fixtures import build_gdn_model
from tests.unit.megatron_fixtures import ensure_single_process_groups
from tests.unit.test_gdn_kernels import rows

if not torch.cuda.is_available():
    pytest.skip("CUDA is required", allow_module_level=True)


def test_kernels_equal_twins_on_the_gpu():
    inputs = {name: value.cuda() for name, value in rows(1, 40, key_heads=16, heads=32, key_dim=128,
                                                          value_dim=128).items()}
    generator = torch.Generator().manual_seed(2)
    states = torch.randn(1, 9, 32, 128, 128, generator=generator).cuda() * 0.1
    inter, want_inter = torch.zeros(1, 9, 4, 32, 128, 128).cuda(), torch.zeros(1, 9, 4, 32, 128, 128).cuda()
    slots = torch.tensor([3, 0, 7, 8, 8, 8, 8, 8, 8, 8, 8], device="cuda")  # 8: a shared scratch slot (44 rows > T)
    o = gdn_decode_rows(states, inter, 0, slots, **inputs)
    want = reference.gdn_decode_rows(states, want_inter, 0, slots, **inputs)
    torch.testing.assert_close(o[:12], want[:12], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(inter[:, :8], want_inter[:, :8], rtol=1e-4, atol=1e-4)
    starts, counts = torch.tensor([0, 5, 5, 30], device="cuda"), torch.tensor([5, 0, 25, 10], device="cuda")
    pool, want_pool = states[0].clone(), states[0].clone()
    seg_slots = torch.tensor([1, 8, 2, 5], device="cuda")
    o, _ = gdn_varlen_scan(pool, **inputs, row_start=starts, row_count=counts, slot_ids=seg_slots)
    want, _ = reference.gdn_varlen_scan(want_pool, **inputs, row_start=starts, row_count=counts, slot_ids=seg_slots)
    torch.testing.assert_close(o, want, rtol=1e-3, atol=1e-3)  # recurrent vs chunked form
    torch.testing.assert_close(pool, want_pool, rtol=1e-3, atol=1e-3)


QWEN3_NEXT_HEADS = dict(key_heads=16, heads=32, key_dim=128, value_dim=128)
HEADS, KEY_DIM, VALUE_DIM = (QWEN3_NEXT_HEADS[name] for name in ("heads", "key_dim", "value_dim"))
WIDTH = gdn_row_input_width(QWEN3_NEXT_HEADS["key_heads"], KEY_DIM, HEADS, VALUE_DIM)


def _pending_pools(seed, num_slots, stored_rows, pending):
    """States [2, M, H, K, V], row inputs [2, M, 2, P, F] (g <= 0), pending rows and parity [M]
    (``pending`` for slots 0.., random parity) on the GPU."""
    generator = torch.Generator().manual_seed(seed)
    states = torch.randn(2, num_slots, HEADS, KEY_DIM, VALUE_DIM, generator=generator) * 0.1
    row_inputs = torch.randn(2, num_slots, 2, stored_rows, WIDTH, generator=generator) * 0.1
    row_inputs[..., -HEADS:] = -row_inputs[..., -HEADS:].abs()  # g <= 0 ([k | u | g])
    pending_rows = torch.zeros(num_slots, dtype=torch.int32)
    pending_rows[:len(pending)] = torch.tensor(pending, dtype=torch.int32)
    parity = torch.randint(0, 2, (num_slots,), generator=generator, dtype=torch.int32)
    return [tensor.cuda() for tensor in (states, row_inputs, pending_rows, parity)]


def test_verify_kernel_and_pending_rows_equal_twins_on_the_gpu():
    """Qwen3-Next's head shape: verify rows with pending rows applied first (R = 3, padding past T
    on a shared scratch slot; R = 1 in place) and the commit's bookkeeping == the twins."""
    inputs = {name: value.cuda() for name, value in rows(3, 40, **QWEN3_NEXT_HEADS).items()}
    states, row_inputs, pending, parity = _pending_pools(4, 9, 3, (3, 0, 1, 2, 0, 0, 0, 2))
    want_states, want_inputs = states.clone(), row_inputs.clone()
    slots = torch.tensor([3, 0, 7, 1, 8, 8, 8, 8, 8, 8, 8], device="cuda")  # 8: a shared scratch slot (33 rows > T)
    for layer in (0, 1):
        o = gdn_verify_rows(states, row_inputs, pending, parity, layer, slots, **inputs, rows_per_request=3)
        want = reference.gdn_verify_rows(want_states, want_inputs, pending, parity, layer, slots, **inputs,
                                         rows_per_request=3)
        torch.testing.assert_close(o[:12], want[:12], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(row_inputs[:, :8], want_inputs[:, :8])
    torch.testing.assert_close(states[:, :8], want_states[:, :8], rtol=1e-4, atol=1e-4)
    status, accepted = torch.tensor([0, 0, 0, 1, 0], device="cuda"), torch.tensor([2, 0, 1, 2, 1], device="cuda")
    want_pending, want_parity = pending.clone(), parity.clone()
    gdn_mark_pending_rows(pending, parity, status, slots[:5], accepted, 3, 8)
    reference.gdn_mark_pending_rows(want_pending, want_parity, status, slots[:5], accepted, 3, 8)
    assert torch.equal(pending, want_pending) and torch.equal(parity, want_parity)
    o = gdn_verify_rows(states, row_inputs, pending, parity, 0, slots[:4], **inputs, rows_per_request=1)
    want = reference.gdn_verify_rows(want_states, want_inputs, pending, parity, 0, slots[:4], **inputs,
                                     rows_per_request=1)
    torch.testing.assert_close(o, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[:, :8], want_states[:, :8], rtol=1e-4, atol=1e-4)


def _bit_for_bit_cases():
    """(S, tiles): S = 2 under the table's shape; S = 4 under every candidate shape (the one
    shape for all launches may move to any of them on figures), and under the table's shape with
    every candidate row schedule at S = 3 and 4 (any R may take any of them on figures)."""
    from mtp_ctrl.triton_ops.gdn_tiles import CANDIDATE_SCHEDULES, CANDIDATE_TILES, DEFAULT_TILES, GDNTiles

    schedules = [GDNTiles(DEFAULT_TILES.block_v, DEFAULT_TILES.num_warps, schedule) for schedule in CANDIDATE_SCHEDULES]
    return ([(2, DEFAULT_TILES)] + [(4, tiles) for tiles in dict.fromkeys((DEFAULT_TILES,) + CANDIDATE_TILES)]
            + [(S, tiles) for S in (4, 3) for tiles in schedules])


def _case_id(S, tiles):
    schedule = "" if tiles.schedule is None else "-" + tiles.schedule.label().replace("/", "_")
    return f"S{S}-{tiles.block_v}x{tiles.num_warps}{schedule}"


@pytest.mark.parametrize("S, tiles", _bit_for_bit_cases(), ids=[_case_id(S, t) for S, t in _bit_for_bit_cases()])
def test_speculative_steps_equal_plain_rows_bit_for_bit_on_the_gpu(S, tiles):
    """Verify steps of 1 + S rows with the deferred commit (all, none and some drafts accepted; a
    zero-draft step; a padding request on the scratch slot) == R = 1 steps over the kept rows,
    torch.equal: every kept row's output and, after a last R = 1 step, every state (Qwen3-Next's
    heads; every launch under ``tiles``'s shape, as every launch takes the one shape; the plain
    steps under the table's row schedule: a schedule only moves loads)."""
    plain_tiles = GDNTiles(tiles.block_v, tiles.num_warps)
    num_slots, scratch, R = 5, 4, 1 + S
    states, row_inputs, pending, parity = _pending_pools(8, num_slots, R, ())
    plain_states = states.clone()
    plain_inputs = torch.zeros(2, num_slots, 2, 1, WIDTH, device="cuda")
    plain_pending, plain_parity = torch.zeros_like(pending), torch.zeros_like(parity)
    top = S  # the most drafts a request can accept
    steps = [([0, 1, 2, 3], R, [top, 0, 1, top]), ([3, 2, 1, 0], R, [0, 0, top, 1]), ([0, 1, 2, 3], 1, [0, 0, 0, 0]),
             ([1, 0, scratch, 2], R, [top, top, 0, 0]), ([0, 1, 2, 3], R, [1, top, top - 1, 0]),
             ([0, 1, 2, 3], 1, [0, 0, 0, 0])]
    for number, (slots, stride, accepted) in enumerate(steps):
        inputs = {name: value.cuda() for name, value in rows(20 + number, len(slots) * stride,
                                                              **QWEN3_NEXT_HEADS).items()}
        slot_ids = torch.tensor(slots, device="cuda")
        for layer in (0, 1):
            o = gdn_verify_rows(states, row_inputs, pending, parity, layer, slot_ids, **inputs, rows_per_request=stride,
                                tiles=tiles)
            for index, slot in enumerate(slots):
                if slot == scratch:
                    continue
                for row in range(1 + accepted[index]):
                    at = index * stride + row
                    want = gdn_verify_rows(plain_states, plain_inputs, plain_pending, plain_parity, layer,
                                           slot_ids[index:index + 1],
                                           **{name: value[at:at + 1] for name, value in inputs.items()},
                                           rows_per_request=1, tiles=plain_tiles)
                    assert torch.equal(o[at:at + 1], want), (number, layer, slot, row)
        gdn_mark_pending_rows(pending, parity, torch.zeros(len(slots), dtype=torch.int64, device="cuda"), slot_ids,
                              torch.tensor(accepted, device="cuda"), stride, scratch)
    assert int(pending[:scratch].sum()) == 0
    assert torch.equal(states[:, :scratch], plain_states[:, :scratch])


def test_every_table_launch_shape_equals_twins_on_the_gpu():
    """Each launch shape of the tile table, the default and the candidates at Qwen3-Next's head
    shape, compiled with its warps: verify rows (R = 3) after pending rows == the twin."""
    from mtp_ctrl.triton_ops.gdn_tiles import CANDIDATE_TILES, DEFAULT_TILES, VERIFY_TILE_TABLE

    inputs = {name: value.cuda() for name, value in rows(5, 15, **QWEN3_NEXT_HEADS).items()}
    start, start_inputs, pending, parity = _pending_pools(6, 6, 3, (3, 1, 0, 2, 0))
    slots = torch.tensor([3, 0, 5, 1, 2], device="cuda")
    want_states, want_inputs = start.clone(), start_inputs.clone()
    want_o = reference.gdn_verify_rows(want_states, want_inputs, pending, parity, 0, slots, **inputs,
                                       rows_per_request=3)
    shapes = [DEFAULT_TILES] + [tiles for _, tiles in VERIFY_TILE_TABLE] + list(CANDIDATE_TILES)
    for tiles in dict.fromkeys(shapes):
        states, row_inputs = start.clone(), start_inputs.clone()
        o = gdn_verify_rows(states, row_inputs, pending, parity, 0, slots, **inputs, rows_per_request=3, tiles=tiles)
        torch.testing.assert_close(o, want_o, rtol=1e-4, atol=1e-4, msg=lambda text: f"{tiles}: {text}")
        torch.testing.assert_close(row_inputs, want_inputs)
        torch.testing.assert_close(states, want_states, rtol=1e-4, atol=1e-4, msg=lambda text: f"{tiles}: {text}")


@pytest.fixture(scope="module")
def gdn_model():
    ensure_single_process_groups()
    return build_gdn_model(mtp_num_layers=2).cuda()


def test_gdn_hybrid_graphs_equal_eager_without_host_sync(gdn_model):
    params = [SamplingParams(max_new_tokens=10 + i, temperature=0.7 * (i % 2), seed=i) for i in range(len(PROMPTS))]
    plain = TextGenerationController(gdn_model, make_config(0)).generate(PROMPTS, params)
    eager_controller = SyncCheckedController(gdn_model, make_config(2))
    eager = eager_controller.generate(PROMPTS, params)
    graphed_controller = SyncCheckedController(gdn_model, make_config(2, graphs=True))
    graphed = graphed_controller.generate(PROMPTS, params)
    assert eager_controller.decode_launches > 10 and graphed_controller.debug_view().num_cuda_graphs > 0
    tokens = [[r.output_tokens for r in results] for results in (plain, eager, graphed)]
    assert tokens[0] == tokens[1] == tokens[2]
    assert graphed_controller.context.mamba.num_free_slots == graphed_controller.context.mamba.num_slots


def test_gdn_hybrid_mixed_steps_replay_warmed_up_graphs_and_equal_eager(gdn_model):
    controller = _mixed_steps_replay_warmed_up_graphs(gdn_model)
    assert any(shape.has_prefill for shape in controller.context.graph_shapes())
    assert controller.context.mamba.num_free_slots == controller.context.mamba.num_slots
