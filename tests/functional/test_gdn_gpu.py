"""Gated DeltaNet hybrids on CUDA: the GDN kernels == their torch twins on the GPU; the mixer ==
megatron-core's own GatedDeltaNet with flash-linear-attention's kernels (skipped without fla);
the hybrid's decode steps run without host sync and their CUDA-graph replays (decode, verify and
mixed steps) give the eager tokens, which are the plain (S = 0) ones."""

import pytest
import torch

from mtp_ctrl.controllers import SamplingParams, TextGenerationController
from mtp_ctrl.triton_ops import (
    gdn_decode_rows,
    gdn_replay_accepted,
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


def test_verify_and_replay_kernels_equal_twins_on_the_gpu():
    """Qwen3-Next's head shape: verify rows (R = 3, padding past T on a shared scratch slot, and
    R = 1 in place) and the replay commit (prefill, none, some and all accepted) == the twins."""
    inputs = {name: value.cuda() for name, value in rows(3, 40, key_heads=16, heads=32, key_dim=128,
                                                          value_dim=128).items()}
    generator = torch.Generator().manual_seed(4)
    states = torch.randn(2, 9, 32, 128, 128, generator=generator).cuda() * 0.1
    row_inputs = torch.zeros(2, 9, 3, gdn_row_input_width(16, 128, 32, 128), device="cuda")
    want_states, want_inputs = states.clone(), row_inputs.clone()
    slots = torch.tensor([3, 0, 7, 1, 8, 8, 8, 8, 8, 8, 8], device="cuda")  # 8: a shared scratch slot (33 rows > T)
    for layer in (0, 1):
        o = gdn_verify_rows(states, row_inputs, layer, slots, **inputs)
        want = reference.gdn_verify_rows(want_states, want_inputs, layer, slots, **inputs)
        torch.testing.assert_close(o[:12], want[:12], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(row_inputs[:, :8], want_inputs[:, :8])
    assert torch.equal(states, want_states)  # verify rows only read the state
    status, accepted = torch.tensor([0, 0, 0, 1, 0], device="cuda"), torch.tensor([2, 0, 1, 2, 1], device="cuda")
    gdn_replay_accepted(states, row_inputs, status, slots[:5], accepted, 16)
    reference.gdn_replay_accepted(want_states, row_inputs, status, slots[:5], accepted, 16)
    torch.testing.assert_close(states[:, :8], want_states[:, :8], rtol=1e-4, atol=1e-4)
    one_row = row_inputs[:, :, :1]
    o = gdn_verify_rows(states, one_row, 0, slots[:4], **inputs)
    want = reference.gdn_verify_rows(want_states, one_row.clone(), 0, slots[:4], **inputs)
    torch.testing.assert_close(o, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[:, :8], want_states[:, :8], rtol=1e-4, atol=1e-4)


def test_every_table_launch_shape_equals_twins_on_the_gpu():
    """Each launch shape of the tile tables (and the default) at Qwen3-Next's head shape, compiled
    with its warps: verify rows (R = 3) and the replay (some accepted) == the twins."""
    from mtp_ctrl.triton_ops.gdn_tiles import DEFAULT_TILES, REPLAY_TILE_TABLE, VERIFY_TILE_TABLE

    inputs = {name: value.cuda() for name, value in rows(5, 15, key_heads=16, heads=32, key_dim=128,
                                                          value_dim=128).items()}
    generator = torch.Generator().manual_seed(6)
    start = torch.randn(1, 6, 32, 128, 128, generator=generator).cuda() * 0.1
    slots, status, accepted = (torch.tensor(x, device="cuda") for x in ([3, 0, 5, 1, 2], [0, 0, 1, 0, 0],
                                                                         [2, 0, 1, 1, 2]))
    want_inputs = torch.zeros(1, 6, 3, gdn_row_input_width(16, 128, 32, 128), device="cuda")
    want_states = start.clone()
    want_o = reference.gdn_verify_rows(want_states, want_inputs, 0, slots, **inputs)
    reference.gdn_replay_accepted(want_states, want_inputs, status, slots, accepted, 16)
    for tiles in dict.fromkeys([DEFAULT_TILES] + [tiles for _, tiles in VERIFY_TILE_TABLE + REPLAY_TILE_TABLE]):
        states, row_inputs = start.clone(), torch.zeros_like(want_inputs)
        o = gdn_verify_rows(states, row_inputs, 0, slots, **inputs, tiles=tiles)
        torch.testing.assert_close(o, want_o, rtol=1e-4, atol=1e-4, msg=lambda text: f"{tiles}: {text}")
        torch.testing.assert_close(row_inputs, want_inputs)
        gdn_replay_accepted(states, row_inputs, status, slots, accepted, 16, tiles=tiles)
        torch.testing.assert_close(states, want_states, rtol=1e-4, atol=1e-4, msg=lambda text: f"{tiles}: {text}")


def test_mixer_equals_megatron_gated_delta_net_with_fla():
    pytest.importorskip("fla")
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, model_parallel_cuda_manual_seed

    from mtp_ctrl.models import PagedGatedDeltaNet
    from tests.unit.gdn_fixtures import gdn_config
    from tests.unit.test_gdn_mixer import HIDDEN, S, commit, make_slots, run

    ensure_single_process_groups()
    model_parallel_cuda_manual_seed(5)
    config = gdn_config()
    ours = PagedGatedDeltaNet(config, layer_number=1).cuda().eval()
    ours.mamba_layer_index = 0
    theirs = GatedDeltaNet(config, GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=LNImpl,
                                                           out_proj=RowParallelLinear),
                           layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups()).cuda().eval()
    theirs.load_state_dict(ours.state_dict())
    hidden = torch.randn(9 + 1 + S + 3, HIDDEN, generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        want = theirs(hidden[:, None], attention_mask=None)[0][:, 0]
    slots = {name: value.cuda() for name, value in make_slots(ours, 2).items()}
    got = [run(ours, slots, hidden[:9], prefill=((0, 9, 1),)),
           run(ours, slots, hidden[9:10 + S], decode_slots=(1,))]
    commit(slots, [1], [S])
    got.append(run(ours, slots, hidden[10 + S:], prefill=((0, 3, 1),)))
    torch.testing.assert_close(torch.cat(got), want, rtol=5e-3, atol=5e-3)  # fla's chunk kernel: TF32 dots


def test_long_prefill_through_fla_equals_our_scan():
    """An eager prefill step with a 1100-row segment (>= FLA_PREFILL_MIN_ROWS: fla-core's chunked
    kernel) beside a 7-row one (ours) == the same step all through our scan, outputs and states."""
    pytest.importorskip("fla")
    from mtp_ctrl.models import MambaForward, PagedGatedDeltaNet
    from mtp_ctrl.models.forward_context import paged_forward_context
    from tests.unit.gdn_fixtures import gdn_config
    from tests.unit.megatron_fixtures import make_metadata
    from tests.unit.test_gdn_mixer import HIDDEN, make_slots

    ensure_single_process_groups()
    torch.manual_seed(6)
    # fla's tiles want head dims of 16 and more; 64 as its own tests use
    mixer = PagedGatedDeltaNet(gdn_config(linear_key_head_dim=64, linear_value_head_dim=64), layer_number=1)
    mixer = mixer.cuda().eval()
    mixer.mamba_layer_index = 0
    hidden = torch.randn(1107, HIDDEN, generator=torch.Generator().manual_seed(3)).cuda() * 0.5
    results = []
    for threshold in (1024, None):
        mixer.fla_prefill_min_rows = threshold
        slots = {name: (value.cuda() if value is not None else None) for name, value in make_slots(mixer, 3, "replay").items()}
        slots["ssm_states"].normal_(generator=torch.Generator("cuda").manual_seed(1)).mul_(0.1)
        mamba = MambaForward(**slots, decode_slot_ids=torch.zeros(0, dtype=torch.int64, device="cuda"),
                             prefill_row_start=torch.tensor([0, 1100], device="cuda"),
                             prefill_row_count=torch.tensor([1100, 7], device="cuda"),
                             prefill_slot_ids=torch.tensor([2, 0], device="cuda"),
                             host_prefill_segments=((0, 0, 1100), (1, 1100, 7)))
        metadata = make_metadata([list(range(300))], [(0, hidden.shape[0])], device="cuda")
        with torch.no_grad(), paged_forward_context(metadata, [], mamba=mamba):
            results.append((mixer(hidden[:, None])[0][:, 0], slots))
    (fla_out, fla_slots), (ours_out, ours_slots) = results
    # fla's chunk kernel computes with TF32 dots; a wrong slot or row would be off by O(1)
    torch.testing.assert_close(fla_out, ours_out, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fla_slots["ssm_states"], ours_slots["ssm_states"], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fla_slots["conv_states"], ours_slots["conv_states"])


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
