"""The sync-free MoE forward (models/moe_inference.py) == megatron's MoELayer forward, same weights,
fp32 on CPU: softmax and sigmoid scores, group-limited routing, expert bias, top-k scaling,
shared experts with and without their gate, GLU and not, padded rows, a step where every row
picks the same experts, empty experts; both grouped-GEMM backends (the Triton kernel through the
interpreter). Settings the path does not cover are refused with errors naming them."""

import pytest
import torch
import torch.nn.functional as F

from mtp_ctrl.controllers import InferenceConfig, TextGenerationController
from mtp_ctrl.models import PagedGPTRunner, moe_layers
from mtp_ctrl.models.moe_inference import InferenceMoELayer, graph_moe_forward, packed_expert_weights
from tests.unit.megatron_fixtures import build_tiny_model, ensure_single_process_groups
from tests.unit.moe_fixtures import moe_config

VARIANTS = {
    "softmax-glu-shared": dict(gated_linear_unit=True, activation_func=F.silu),
    "softmax-pre-scaled": dict(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5),
    "sigmoid-groups-bias": dict(moe_router_score_function="sigmoid", moe_router_num_groups=2, moe_router_group_topk=1,
                                moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=1.5),
    "shared-gate-gelu": dict(moe_shared_expert_gate=True, activation_func=F.gelu),
    "no-shared": dict(moe_shared_expert_intermediate_size=None),
}


@pytest.fixture(scope="module", autouse=True)
def megatron_groups():
    ensure_single_process_groups()


def _moe_layer(**overrides):
    model = build_tiny_model(moe_config(mtp_num_layers=1, **overrides))
    layer = moe_layers(model)[0]
    if layer.router.expert_bias is not None:  # a trained bias: large enough to change the top-k
        layer.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.25]))
    return layer


def _rows(num_rows=9, seed=0):
    rows = torch.randn(num_rows, 1, 64, generator=torch.Generator().manual_seed(seed))  # [T, 1, H]
    rows[-2:] = 0.0  # CUDA-graph padding rows
    return rows


@torch.no_grad()
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_graph_forward_equals_megatron_moe_layer(variant):
    layer = _moe_layer(**VARIANTS[variant])
    assert isinstance(layer, InferenceMoELayer)
    rows = _rows()
    expected, _ = layer(rows)  # outside a paged forward: megatron's own MoELayer
    torch.testing.assert_close(graph_moe_forward(layer, rows, backend="grouped_mm"), expected, atol=1e-5, rtol=1e-5)
    if variant == "sigmoid-groups-bias":  # one case through the interpreted kernel (slow on CPU)
        torch.testing.assert_close(graph_moe_forward(layer, rows, backend="triton"), expected, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_every_row_on_the_same_experts_and_empty_experts():
    layer = _moe_layer()
    same = _rows(1).expand(6, 1, 64).clone()  # six equal rows: the same two experts, two experts empty
    expected, _ = layer(same)
    torch.testing.assert_close(graph_moe_forward(layer, same, backend="grouped_mm"), expected, atol=1e-5, rtol=1e-5)
    one = _rows(1, seed=4)  # a single row: top-2 of 4 experts, the other two empty
    torch.testing.assert_close(graph_moe_forward(layer, one, backend="triton"), layer(one)[0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_expert_weights_are_views_and_checkpoints_load_through_them():
    layer = _moe_layer()
    fc1, fc2 = packed_expert_weights(layer)  # [E, F1, H], [E, H, F]
    experts = layer.experts.local_experts
    assert fc1.shape == (4, 48, 64) and fc2.shape == (4, 64, 48)
    state = {key: value + 1.0 if isinstance(value, torch.Tensor) else value
             for key, value in layer.state_dict().items()}
    assert "experts.local_experts.3.linear_fc1.weight" in state  # megatron's SequentialMLP names
    layer.load_state_dict(state)
    torch.testing.assert_close(fc1[3], experts[3].linear_fc1.weight)  # written through the view
    assert packed_expert_weights(layer)[0] is fc1
    layer.double().float()  # moving the model replaces the parameters: stacked again on next use
    assert packed_expert_weights(layer)[0] is not fc1
    rows = _rows()
    torch.testing.assert_close(graph_moe_forward(layer, rows, backend="grouped_mm"), layer(rows)[0],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("field, value", [
    ("activation_func", torch.tanh),
    ("add_bias_linear", True),
    ("moe_apply_probs_on_input", True),
    ("moe_router_load_balancing_type", "sinkhorn"),
])
def test_settings_the_graph_path_does_not_cover_are_refused(field, value):
    overrides = {field: value}
    if field == "moe_apply_probs_on_input":
        overrides.update(moe_router_topk=1, moe_router_pre_softmax=True)
    if field == "add_bias_linear":
        overrides["moe_shared_expert_intermediate_size"] = None  # megatron's shared experts reject biases
    if field == "moe_router_load_balancing_type":
        overrides["moe_router_topk"] = 1
    model = build_tiny_model(moe_config(mtp_num_layers=1, **overrides))
    with pytest.raises(ValueError, match=field.replace("_type", "")):
        PagedGPTRunner(model)
    with pytest.raises(ValueError, match=field.replace("_type", "")):  # the controller asks for the graph path too
        TextGenerationController(model, InferenceConfig(max_requests=2, max_model_len=16, max_tokens_per_step=16))
    assert not PagedGPTRunner(model, moe_backend="megatron").cuda_graph_capturable  # the eager comparison


def test_moe_backend_is_validated():
    with pytest.raises(ValueError, match="moe_backend"):
        InferenceConfig(moe_backend="cutlass")
    with pytest.raises(TypeError, match="moe_backend"):
        InferenceConfig(moe_backend=None)
    model = build_tiny_model(moe_config(mtp_num_layers=1))
    with pytest.raises(ValueError, match="moe_backend"):
        PagedGPTRunner(model, moe_backend="reference")
    assert PagedGPTRunner(model).cuda_graph_capturable
    assert PagedGPTRunner(model, moe_backend="grouped_mm").cuda_graph_capturable


@torch.no_grad()
def test_distributed_checkpoint_round_trip_through_stacked_experts(tmp_path):
    """save_distributed_checkpoint of a model whose experts are views of the stacked weights, loaded
    into another such model: same state, same graph-path output (loading writes through the views)."""
    from mtp_ctrl.models import load_distributed_checkpoint, save_distributed_checkpoint

    saved, loaded = (build_tiny_model(moe_config(mtp_num_layers=1), seed=seed) for seed in (1, 2))
    for layer in moe_layers(saved) + moe_layers(loaded):
        packed_expert_weights(layer)
    save_distributed_checkpoint(saved, tmp_path / "checkpoint")
    load_distributed_checkpoint(loaded, tmp_path / "checkpoint")
    rows = _rows()
    for saved_layer, loaded_layer in zip(moe_layers(saved), moe_layers(loaded)):
        assert torch.equal(packed_expert_weights(loaded_layer)[0], packed_expert_weights(saved_layer)[0])
        assert torch.equal(graph_moe_forward(loaded_layer, rows, "grouped_mm"),
                           graph_moe_forward(saved_layer, rows, "grouped_mm"))


@torch.no_grad()
def test_fp32_router_of_a_bf16_model_casts_its_gate_once_per_weight_change():
    """moe_router_dtype="fp32" on a bf16 model: the gate's kept fp32 copy gives x @ W^T in fp32 and
    follows a load_state_dict that changes the weight."""
    layer = _moe_layer(params_dtype=torch.bfloat16, bf16=True, moe_router_dtype="fp32")
    router = layer.router
    rows = _rows().to(torch.bfloat16)
    logits = router.gating(rows)  # [T, 1, E] fp32
    torch.testing.assert_close(logits[:, 0], rows[:, 0].float() @ router.weight.float().t())
    torch.testing.assert_close(router.gating(rows), logits, atol=0, rtol=0)  # the kept fp32 gate
    router.load_state_dict({**router.state_dict(), "weight": router.weight * 2})
    torch.testing.assert_close(router.gating(rows), 2 * logits, rtol=1e-2, atol=1e-3)
