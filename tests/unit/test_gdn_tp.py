"""Gated DeltaNet layers under tensor parallelism (CPU, gloo): the GDN hybrid at TP = 2, loaded
from the TP = 1 state_dict (megatron's layout: each of in_proj's q, k, v, z, b, a sections and the
conv's q, k, v channels split over the ranks), gives TP = 1's logits (prefill, verify rows, state
commit, chunked prefill) and the controller's greedy tokens (S = 0 and S = 2); each rank's state
slots hold its own heads only."""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mtp_ctrl.models import PagedGatedDeltaNet, PagedGPTRunner
from tests.unit.gdn_fixtures import build_gdn_model, gdn_config
from tests.unit.megatron_fixtures import ensure_single_process_groups, free_port, init_process_groups, spawn_ranks
from tests.unit.test_mamba_tp import _greedy_tokens, _schedule_logits

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # the scripts import siblings by name
import demo_model  # noqa: E402

# TP = 1: conv channels 2 * (2 key heads * 16) + 4 value heads * 8 = 96; state [4, 16, 8]; TP = 2 halves heads
STATE_SHAPES = {1: ((96, 3), (4, 16, 8)), 2: ((48, 3), (2, 16, 8))}
# a plain (not gated) MLP: the TP = 1 -> TP = 2 loader of the tests does not split GLU weights
MLP = dict(gated_linear_unit=False)


def tp_worker(rank: int, world_size: int, port: int, expected_path: str) -> None:
    init_process_groups(rank, world_size, port, world_size)
    try:
        expected = torch.load(expected_path)
        model = build_gdn_model(tensor_parallel_size=world_size, **MLP)
        demo_model.load_full_state_dict(model, expected["state_dict"])
        runner = PagedGPTRunner(model)
        spec = runner.mamba_spec
        assert (spec.conv_state_shape, spec.ssm_state_shape) == STATE_SHAPES[world_size], spec
        torch.testing.assert_close(_schedule_logits(runner, world_size), expected["logits"], atol=1e-4, rtol=1e-4)
        got = _greedy_tokens(model)
        assert got == expected["tokens"], f"rank {rank}: {got} != {expected['tokens']}"
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp1_expected_path(tmp_path_factory):
    ensure_single_process_groups()
    model = build_gdn_model(**MLP)
    state_dict = {name: value.clone() if torch.is_tensor(value) else value for name, value in model.state_dict().items()}
    runner = PagedGPTRunner(model)
    assert (runner.mamba_spec.conv_state_shape, runner.mamba_spec.ssm_state_shape) == STATE_SHAPES[1]
    tokens = _greedy_tokens(model)
    assert tokens[0] == tokens[1]  # speculation changes nothing
    path = str(tmp_path_factory.mktemp("gdn_tp") / "tp1.pt")
    torch.save({"state_dict": state_dict, "logits": _schedule_logits(runner, 1), "tokens": tokens}, path)
    return path


def test_tp2_gdn_hybrid_matches_tp1(tp1_expected_path):
    spawn_ranks(tp_worker, (2, free_port(), tp1_expected_path))


def test_heads_must_split_over_the_ranks():
    ensure_single_process_groups()

    class _Group:  # a tensor-parallel group of 4 ranks, as megatron's pg_collection.tp reports it
        def size(self):
            return 4

    class _Groups:
        tp = _Group()

    with pytest.raises(ValueError, match="linear_num_key_heads .2. must be divisible by the tensor-parallel size .4."):
        PagedGatedDeltaNet(gdn_config(), pg_collection=_Groups())
