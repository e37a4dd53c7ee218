"""The MoE layer's one-launch ops (interpreted kernels) == their torch twins == megatron:
route_top_k (megatron's topk_routing_with_score_function: softmax before / after the top-k,
sigmoid with and without expert bias, group-limited, scaling, k = 1, no rows, equal scores),
scaled_pair_activation and combine_expert_pairs (fp32 and bf16, megatron's roundings), and the
fused shared-expert activation through graph_moe_forward == megatron's MoELayer."""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

from mtp_ctrl.models import moe_layers
from mtp_ctrl.models.moe_inference import graph_moe_forward
from mtp_ctrl.triton_ops import combine_expert_pairs, reference, route_top_k, scaled_pair_activation
from tests.unit.megatron_fixtures import build_tiny_model, ensure_single_process_groups
from tests.unit.moe_fixtures import moe_config

ROUTINGS = [  # (rows, experts, k, score function, pre-softmax, groups, group top-k, scaling, expert bias)
    (5, 8, 2, "softmax", False, None, None, None, False),
    (5, 8, 2, "softmax", True, None, None, 2.5, False),
    (7, 64, 6, "sigmoid", False, 8, 4, 2.5, True),  # DeepSeek-V3's routing, scaled down
    (3, 16, 4, "sigmoid", False, 4, 2, None, False),
    (4, 12, 1, "sigmoid", False, None, None, None, True),  # k = 1: no normalisation
    (3, 6, 3, "softmax", True, 3, 2, 1.5, False),  # groups of 2, a group's score from its best 1
    (0, 8, 2, "softmax", False, None, None, None, False),  # no rows
]


@pytest.mark.parametrize("case", ROUTINGS, ids=lambda case: "-".join(str(v) for v in case))
def test_route_top_k_equals_twin_and_megatron(case):
    num_rows, num_experts, top_k, score, pre, groups, group_topk, scaling, with_bias = case
    generator = torch.Generator().manual_seed(num_rows * 100 + num_experts)
    logits = torch.randn(num_rows, num_experts, generator=generator)  # [T, E] fp32
    bias = torch.randn(num_experts, generator=generator) * 0.1 if with_bias else None
    ids, probs = route_top_k(logits, bias, top_k, score, pre, groups, group_topk, scaling)
    want_ids, want_probs = reference.route_top_k(logits, bias, top_k, score, pre, groups, group_topk, scaling)
    assert ids.dtype == torch.int64 and ids.shape == (num_rows, top_k) and torch.equal(ids, want_ids)
    torch.testing.assert_close(probs, want_probs)
    megatron_probs, megatron_map = topk_routing_with_score_function(
        logits, top_k, use_pre_softmax=pre, num_groups=groups, group_topk=group_topk, scaling_factor=scaling,
        score_function=score, expert_bias=bias)  # [T, E] dense
    dense = torch.zeros(num_rows, num_experts).scatter(1, ids, probs)
    torch.testing.assert_close(dense, megatron_probs)
    assert torch.equal(dense != 0, megatron_map)


def test_route_top_k_orders_by_score_then_lower_id():
    """Descending scores, the lower id first among equal ones (a zero padding row: all equal)."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [0.0, 0.0, 0.0, 0.0]])
    for op in (route_top_k, reference.route_top_k):
        ids, probs = op(logits, None, 3, "softmax")
        assert ids.tolist() == [[1, 3, 2], [0, 1, 2]]
        torch.testing.assert_close(probs[1], torch.full((3,), 1 / 3))


def test_route_top_k_rejects_bad_arguments():
    logits = torch.randn(2, 8)
    with pytest.raises(TypeError, match="logits"):
        route_top_k(logits.double(), None, 2, "softmax")
    with pytest.raises(ValueError, match="score_function"):
        route_top_k(logits, None, 2, "sqrtsoftplus")
    with pytest.raises(ValueError, match="expert_bias"):
        route_top_k(logits, torch.zeros(8), 2, "softmax")
    with pytest.raises(ValueError, match="top_k"):
        route_top_k(logits, None, 9, "softmax")
    with pytest.raises(ValueError, match="num_groups"):
        route_top_k(logits, None, 2, "sigmoid", num_groups=3, group_topk=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation, gated", [("silu", True), ("gelu", False), ("relu", True)])
def test_scaled_pair_activation_equals_twin(dtype, activation, gated):
    generator = torch.Generator().manual_seed(3)
    num_rows, top_k, width = 5, 3, 40
    fc1 = torch.randn(num_rows * top_k, 2 * width if gated else width, generator=generator).to(dtype)  # [P, F1]
    probs = torch.rand(num_rows, top_k, generator=generator)  # [T, k] fp32 (the router's dtype)
    sorted_pairs = torch.randperm(num_rows * top_k, generator=generator)  # [P]
    got = scaled_pair_activation(fc1, probs, sorted_pairs, activation, gated)
    want = reference.scaled_pair_activation(fc1, probs, sorted_pairs, activation, gated)
    assert got.dtype == dtype and got.shape == (num_rows * top_k, width)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5 if dtype == torch.float32 else 8e-3)
    empty = scaled_pair_activation(fc1[:0], probs[:0], sorted_pairs[:0], activation, gated)
    assert empty.shape == (0, width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_expert_pairs_equals_twin(dtype):
    generator = torch.Generator().manual_seed(4)
    num_rows, top_k, hidden = 6, 4, 48
    pairs = torch.randn(num_rows * top_k, hidden, generator=generator).to(dtype)  # [T * k, H]
    shared = torch.randn(num_rows, hidden, generator=generator).to(dtype)  # [T, H]
    for shared_rows, out_dtype in ((shared, dtype), (None, dtype), (None, torch.float32)):
        got = combine_expert_pairs(pairs, top_k, shared_rows, out_dtype)
        want = reference.combine_expert_pairs(pairs, top_k, shared_rows, out_dtype)
        assert got.dtype == out_dtype
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # equal up to the fp32 sum's order
    assert combine_expert_pairs(pairs[:0], top_k, None, dtype).shape == (0, hidden)
    with pytest.raises(ValueError, match="top_k"):
        combine_expert_pairs(pairs[:5], top_k, None, dtype)
    with pytest.raises(TypeError, match="shared"):
        combine_expert_pairs(pairs, top_k, shared.float() if dtype != torch.float32 else shared.half(), dtype)


@torch.no_grad()
@pytest.mark.parametrize("gate", [False, True])
def test_fused_shared_expert_activation_equals_megatron(gate):
    """graph_moe_forward with the shared experts' activation as one kernel == megatron's MoELayer."""
    ensure_single_process_groups()
    model = build_tiny_model(moe_config(mtp_num_layers=1, gated_linear_unit=True, activation_func=F.silu,
                                        moe_shared_expert_gate=gate))
    layer = moe_layers(model)[0]
    rows = torch.randn(5, 1, 64, generator=torch.Generator().manual_seed(6))  # [T, 1, H]
    expected, _ = layer(rows)  # outside a paged forward: megatron's own MoELayer
    torch.testing.assert_close(graph_moe_forward(layer, rows, backend="grouped_mm", fused_glue=True), expected,
                               atol=1e-5, rtol=1e-5)
