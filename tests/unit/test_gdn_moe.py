"""A Gated DeltaNet hybrid whose FFNs are mixtures of experts (megatron's MoE settings on the GDN
hybrid: decoder layers GDN + dense MLP, attention + MoE, GDN + dense, attention + MoE; the MTP
layers follow the last decoder layer, so they are MoE too): the layers are what megatron builds,
and S = 2 == S = 0 under arrivals, greedy and seeded sampled."""

import pytest
import torch

from mtp_ctrl.models import PagedGatedDeltaNet
from tests.unit.controller_fixtures import make_controller, run_with_arrivals
from tests.unit.gdn_fixtures import build_gdn_model
from tests.unit.megatron_fixtures import ensure_single_process_groups
from tests.unit.megatron_fixtures import torch_twins as twin_ops
from tests.unit.test_controller_gdn import CONFIG, _arrivals, _assert_released

MOE_FIELDS = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=32,
                  moe_layer_freq=[0, 1, 0, 1], add_bias_linear=False)


@pytest.fixture(scope="module")
def model():
    ensure_single_process_groups()
    return build_gdn_model(mtp_num_layers=2, **MOE_FIELDS)


def test_the_hybrid_has_gdn_and_moe_layers(model):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layers = model.decoder.layers
    assert [isinstance(layer.self_attention, PagedGatedDeltaNet) for layer in layers] == [True, False, True, False]
    assert [isinstance(layer.mlp, MoELayer) for layer in layers] == [False, True, False, True]
    assert all(isinstance(layer.transformer_layer.mlp, MoELayer) for layer in model.mtp.layers)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_speculative_equals_plain(model, sampled, torch_twins):
    plain = run_with_arrivals(make_controller(model, 0, **CONFIG), _arrivals(sampled))
    controller = make_controller(model, 2, **CONFIG)
    assert run_with_arrivals(controller, _arrivals(sampled)) == plain
    assert sum(len(tokens) for tokens in plain) > 0
    _assert_released(controller)
