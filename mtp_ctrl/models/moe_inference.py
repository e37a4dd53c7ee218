"""A sync-free MoE forward for inference: megatron's routing, expert dispatch sized on the device.

megatron's ``MoELayer`` sizes its expert batches on the host (``tokens_per_expert.cpu()`` in the
all-gather dispatcher, ``.tolist()`` in ``SequentialMLP``), so a step with an MoE layer syncs and
cannot be captured in a CUDA graph. :func:`graph_moe_forward` computes the same layer with every
size fixed by the step's row count T alone:

1. the shared experts (megatron's ``SharedExpertMLP``, gate included) on the rows; inside a
   paged forward with fused glue their activation is one launch (``bias_activation``);
2. with expert-TP or EP > 1, the rows are all-gathered over the expert TP x EP group, as
   megatron's all-gather dispatcher does (graph-capturable on NCCL);
3. megatron's routing math (its router's gating, softmax / sigmoid scores, its group-limited
   top-k, expert bias, top-k scaling factor): each row's top-k experts and their probabilities,
   after the gate's GEMM one launch for fp32 logits (:func:`~mtp_ctrl.triton_ops.route_top_k`);
4. the T x top-k (row, expert) pairs are sorted by local expert on the device and cut into tiles
   that never straddle two experts (:func:`~mtp_ctrl.triton_ops.align_expert_pairs`, one launch at
   decode, three for many pairs; pairs of another rank's experts go last): no count is read on
   the host;
5. fc1 as one grouped product over all segments (gathering each pair's row), megatron's
   activation (GLU ``act(a) * (b + offset)`` with its clamp) and the routing probability applied
   after it (megatron's ``per_token_scale``; one launch, :func:`~mtp_ctrl.triton_ops.scaled_pair_activation`,
   unless a clamp, an offset or another activation needs torch's ops), fc2 as a second grouped
   product that writes each pair back to its row's slot;
6. each row's k products are summed (fp32), reduce-scattered over the expert TP x EP group when
   it is larger than one, and added to the shared experts' output (one launch without the
   reduce-scatter: :func:`~mtp_ctrl.triton_ops.combine_expert_pairs`).

At decode (T = 1, bench/RESULTS.md) a layer is 13 kernels (42 before): the shared experts' two
GEMMs (cuBLAS adds a split-K reduction) and GLU, the router's fp32 cast and GEMV (two kernels),
routing, pair sort, fc1, activation, fc2, combine.

The grouped products are :func:`mtp_ctrl.triton_ops.grouped_expert_matmul` (backend
``"triton"``: a fused-MoE kernel on block-aligned expert segments; ``"grouped_mm"``: torch's
grouped GEMM). Every row routes and computes exactly as it would alone (dropless, no capacity),
so speculative output equals plain output.

Parameters stay megatron's: the experts are ``SequentialMLP``'s ``local_experts.<i>.linear_fc1 /
linear_fc2`` (GLU fc1 ``[2F, H]`` as ``[gate; up]``). The grouped products read them as one
``[E, N, K]`` tensor per layer: on first use each expert's weight is moved into a stacked tensor
and the parameter becomes a view of its slice (no second copy; ``load_state_dict`` writes through
the views; moving the model re-stacks on the next forward).

The layer keeps megatron's forward outside a paged forward and when the runner asks for it
(``moe_backend="megatron"``), for comparison and for settings this path refuses
(:func:`check_graph_moe_layer`).
"""

from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.activations import fast_gelu, quick_gelu, squared_relu
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import group_limited_topk
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

from mtp_ctrl.models.forward_context import current_moe_backend, fused_glue_enabled
from mtp_ctrl.models.fused_layers import mlp_activation
from mtp_ctrl.models.moe import _gather_rows, _reduce_scatter_rows, moe_layers
from mtp_ctrl.triton_ops import (
    align_expert_pairs,
    bias_activation,
    block_rows_for,
    combine_expert_pairs,
    grouped_expert_matmul,
    route_top_k,
    scaled_pair_activation,
)

GRAPH_BACKENDS = ("triton", "grouped_mm")  # the sync-free path, by grouped-GEMM implementation
MEGATRON_BACKEND = "megatron"  # megatron's eager MoELayer (syncs: steps run without CUDA graphs)
MOE_BACKENDS = GRAPH_BACKENDS + (MEGATRON_BACKEND,)
DEFAULT_MOE_BACKEND = "triton"  # the faster grouped product on an H100 (bench/RESULTS.md, bench_moe.py)
_ACTIVATIONS = (F.silu, F.gelu, F.relu, squared_relu, quick_gelu, fast_gelu)  # element-wise, megatron's MLP's
_KERNEL_ACTIVATIONS = {F.silu: "silu", F.gelu: "gelu", F.relu: "relu"}  # scaled_pair_activation's names
# settings the sync-free path refuses when they are set (truthy), and why
_REFUSED_SETTINGS = (
    ("moe_grouped_gemm", "its GroupedMLP / TEGroupedMLP experts are not read by the sync-free path; build with "
                         "moe_grouped_gemm=False (SequentialMLP; torch_dist checkpoints of either layout load into it)"),
    ("add_bias_linear", "expert biases are not applied by the sync-free path"),
    ("moe_apply_probs_on_input", "the path applies probabilities after the activation, as megatron's default"),
    ("moe_latent_size", "latent expert projections are not implemented by the sync-free path"),
    ("fp8", "fp8 expert GEMMs are not implemented by the sync-free path"),
    ("fp4", "fp4 expert GEMMs are not implemented by the sync-free path"),
    ("moe_shared_expert_overlap", "the path computes the shared experts itself, not overlapped with a dispatcher"),
)


class InferenceMoELayer(MoELayer):
    """megatron's ``MoELayer`` (same submodules, parameters and process groups) whose forward takes
    the sync-free path inside a paged forward that asks for it (module docstring). The builder
    turns each MoE layer into this class after megatron built it (:func:`use_inference_moe_layers`):
    megatron's ``TransformerLayer`` hands process groups only to the exact ``MoELayer`` class."""

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        backend = current_moe_backend()
        if backend is None or backend == MEGATRON_BACKEND or intermediate_tensors is not None:
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        return graph_moe_forward(self, hidden_states, backend), None


def use_inference_moe_layers(model) -> int:
    """Make every megatron ``MoELayer`` of ``model`` an :class:`InferenceMoELayer`; returns how many."""
    layers = moe_layers(model)
    for layer in layers:
        if type(layer) is MoELayer:
            layer.__class__ = InferenceMoELayer
    return len(layers)


def check_graph_moe_layer(layer: MoELayer) -> None:
    """Raise ValueError naming the setting when the sync-free path cannot compute ``layer``."""
    config = layer.config
    for name, reason in _REFUSED_SETTINGS:
        value = getattr(config, name, None)
        if value:
            raise ValueError(f"config.{name}={value!r} is not supported by the graph MoE path: {reason}; "
                             f"use moe_backend={MEGATRON_BACKEND!r} for megatron's eager MoELayer")
    if not isinstance(layer.experts, SequentialMLP):
        raise ValueError(f"config.moe_grouped_gemm: the graph MoE path reads SequentialMLP experts, this layer has "
                         f"{type(layer.experts).__name__}; build with moe_grouped_gemm=False or use "
                         f"moe_backend={MEGATRON_BACKEND!r}")
    if config.activation_func not in _ACTIVATIONS:
        raise ValueError(f"config.activation_func={getattr(config.activation_func, '__name__', config.activation_func)}"
                         f" is not supported by the graph MoE path (supported: "
                         f"{', '.join(f.__name__ for f in _ACTIVATIONS)}); use moe_backend={MEGATRON_BACKEND!r}")
    if getattr(config, "moe_router_fusion", False):
        raise ValueError("config.moe_router_fusion=True (Transformer Engine's fused router) is not supported by the "
                         f"graph MoE path (it runs megatron's unfused routing math); use moe_backend={MEGATRON_BACKEND!r}")
    if getattr(layer.router, "router_replay", None) is not None:
        raise ValueError("config.moe_enable_routing_replay: replayed routing is not supported by the graph MoE path; "
                         f"use moe_backend={MEGATRON_BACKEND!r}")
    if getattr(layer.router, "score_function", None) not in ("softmax", "sigmoid"):
        raise ValueError(f"config.moe_router_score_function={layer.router.score_function!r} is not supported by the "
                         f"graph MoE path (softmax, sigmoid); use moe_backend={MEGATRON_BACKEND!r}")
    if getattr(layer.router, "routing_type", None) == "sinkhorn":
        raise ValueError("config.moe_router_load_balancing_type='sinkhorn' is not supported by the graph MoE path; "
                         f"use moe_backend={MEGATRON_BACKEND!r}")


def packed_expert_weights(layer: MoELayer) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(fc1 [E, F1, H], fc2 [E, H, F])``: the local experts' weights as two stacked tensors whose
    slices are the experts' parameters (module docstring). Re-stacks when a parameter was replaced
    (a ``.to()`` or ``.cuda()`` of the model); otherwise reads only pointers."""
    experts = layer.experts.local_experts
    fc1 = [expert.linear_fc1.weight for expert in experts]
    fc2 = [expert.linear_fc2.weight for expert in experts]
    packed = getattr(layer, "_packed_expert_weights", None)
    if packed is None or not all(p.data_ptr() == s.data_ptr() and p.shape == s.shape
                                 for params, stacked in zip((fc1, fc2), packed) for p, s in zip(params, stacked)):
        packed = tuple(torch.stack([p.data for p in params]) for params in (fc1, fc2))
        for params, stacked in zip((fc1, fc2), packed):
            for index, param in enumerate(params):
                param.data = stacked[index]
        layer._packed_expert_weights = packed
    return packed


def _expert_activation(config) -> Optional[str]:
    """The name :func:`scaled_pair_activation` knows the experts' activation by; None when it does
    not cover it (another function, a GLU clamp or offset): then torch runs it (:func:`_activation`)."""
    name = _KERNEL_ACTIVATIONS.get(config.activation_func)
    if config.gated_linear_unit and (config.activation_func_clamp_value is not None or config.glu_linear_offset):
        return None
    return name


def _activation(fc1: torch.Tensor, config) -> torch.Tensor:  # [P, F1] -> [P, F]
    """megatron's MLP activation without bias fusion (``MLP.forward``), GLU clamp and offset included."""
    if not config.gated_linear_unit:
        return config.activation_func(fc1)
    gate, linear = torch.chunk(fc1, 2, dim=-1)
    clamp = config.activation_func_clamp_value
    if clamp is not None:
        gate, linear = gate.clamp(min=None, max=clamp), linear.clamp(min=-clamp, max=clamp)
    if config.glu_linear_offset:  # adding 0.0 would be one more launch for the same values
        linear = linear + config.glu_linear_offset
    return config.activation_func(gate) * linear


def _expert_group(layer: MoELayer):
    """The expert TP x EP group and its size (cached on the layer: the size is a host call)."""
    cached = getattr(layer, "_expert_group_size", None)
    group = layer.token_dispatcher.tp_ep_group
    if cached is None:
        cached = dist.get_world_size(group=group) if dist.is_initialized() else 1
        layer._expert_group_size = cached
    return group, cached


def route_rows(layer: MoELayer, rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """megatron's routing of ``rows`` ``[T, H]``: ``(expert ids [T, k] int64, their probs [T, k])``.

    The math of megatron's ``TopKRouter`` (its gating, then ``topk_routing_with_score_function``:
    softmax before or after the top-k, or sigmoid with the expert bias steering the choice only,
    megatron's ``group_limited_topk``, the sum normalisation, the scaling factor), stopped before
    megatron scatters the top-k into dense ``[T, E]`` maps that this path would only read back.
    fp32 logits take :func:`~mtp_ctrl.triton_ops.route_top_k` (the same math in one launch; the top-k
    in descending order, lower id first on ties); other router dtypes run megatron's torch ops,
    whose roundings in the router dtype the kernel does not model."""
    router, config = layer.router, layer.config
    router._maintain_float32_expert_bias()
    logits = router.gating(rows[:, None]).view(rows.shape[0], -1)  # [T, E] router dtype
    top_k, groups, group_topk = config.moe_router_topk, config.moe_router_num_groups, config.moe_router_group_topk
    if logits.dtype == torch.float32:  # megatron's moe_router_dtype="fp32" (or an fp32 model): one launch
        sigmoid = router.score_function == "sigmoid"
        return route_top_k(logits, router.expert_bias if sigmoid else None, top_k, router.score_function,
                           bool(config.moe_router_pre_softmax), groups, group_topk,
                           config.moe_router_topk_scaling_factor)

    def top(scores):  # -> (values, ids) [T, k]
        if group_topk:
            return group_limited_topk(scores, top_k, scores.shape[0], scores.shape[1], groups, group_topk)
        return torch.topk(scores, k=top_k, dim=1)

    if router.score_function == "softmax":
        if config.moe_router_pre_softmax:
            probs, ids = top(torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits))
        else:
            scores, ids = top(logits)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
    else:  # sigmoid
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if router.expert_bias is not None:
            _, ids = top(scores + router.expert_bias)
            scores = torch.gather(scores, 1, ids).type_as(logits)
        else:
            scores, ids = top(scores)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if top_k > 1 else scores
    if config.moe_router_topk_scaling_factor:
        probs = probs * config.moe_router_topk_scaling_factor
    return ids, probs


def _shared_experts(shared: SharedExpertMLP, hidden_states: torch.Tensor, fused_glue: bool) -> torch.Tensor:
    """megatron's ``SharedExpertMLP`` forward ``[T, 1, H] -> [T, 1, H]``; with ``fused_glue`` its
    activation (and GLU product) is one launch (:func:`bias_activation`, megatron's roundings)."""
    activation = mlp_activation(shared, shared.config, SharedExpertMLP) if fused_glue else None
    if activation is None:
        return shared(hidden_states)
    fc1, _ = shared.linear_fc1(hidden_states)  # [T, 1, F1] (no bias: megatron's shared experts have none)
    activated = bias_activation(fc1.reshape(-1, fc1.shape[-1]), None, *activation)  # [T, F]
    output, _ = shared.linear_fc2(activated.view(*fc1.shape[:-1], -1))  # [T, 1, H]
    if shared.use_shared_expert_gate:
        output = output * torch.sigmoid(F.linear(hidden_states, shared.gate_weight))
    return output


def graph_moe_forward(layer: MoELayer, hidden_states: torch.Tensor, backend: str = "triton",
                      fused_glue: Optional[bool] = None) -> torch.Tensor:
    """The MoE layer's output ``[T, 1, H]`` for ``hidden_states`` ``[T, 1, H]``, without a host sync
    (module docstring). ``backend``: the grouped product, ``"triton"`` or ``"grouped_mm"``.
    ``fused_glue``: the shared experts' activation as one kernel (default: as the paged forward asks)."""
    num_rows, hidden_size = hidden_states.shape[0], hidden_states.shape[-1]
    fused_glue = fused_glue_enabled() if fused_glue is None else fused_glue
    shared = _shared_experts(layer.shared_experts, hidden_states, fused_glue) if layer.use_shared_expert else None
    group, group_size = _expert_group(layer)
    rows = hidden_states.reshape(num_rows, hidden_size)  # [T, H]
    if group_size > 1:
        rows = _gather_rows(rows, group)  # [T * G, H]: every rank of the group computes its experts' share
    expert_ids, expert_probs = route_rows(layer, rows)  # [T', k] each
    top_k, num_local = expert_ids.shape[1], layer.num_local_experts
    segments = align_expert_pairs(expert_ids, layer.local_expert_indices[0], num_local,
                                  block_rows_for(expert_ids.numel(), num_local))  # pairs sorted by local expert
    fc1_weight, fc2_weight = packed_expert_weights(layer)  # [E, F1, H], [E, H, F]
    local = group_size == 1  # every pair's expert is here: the products write every position
    fc1 = grouped_expert_matmul(rows, fc1_weight, segments, gather_rows=True, backend=backend,
                                all_experts_local=local)  # [P, F1] sorted
    activation = _expert_activation(layer.config)
    if activation is not None:  # megatron's activation and per_token_scale, one launch
        activated = scaled_pair_activation(fc1, expert_probs, segments.sorted_pairs, activation,
                                           bool(layer.config.gated_linear_unit))  # [P, F]
    else:
        activated = _activation(fc1, layer.config)  # [P, F]
        scale = expert_probs.flatten()[segments.sorted_pairs]  # [P] router dtype, megatron's per_token_scale
        activated = (activated * scale[:, None]).to(activated.dtype)
    pairs = grouped_expert_matmul(activated, fc2_weight, segments, gather_rows=False, scatter_pairs=True,
                                  backend=backend, all_experts_local=local)  # [P, H] in (row, j) order
    if group_size == 1:  # the k products' fp32 sum, rounded, plus the shared experts: one launch
        output = combine_expert_pairs(pairs, top_k, None if shared is None else shared.reshape(num_rows, hidden_size),
                                      hidden_states.dtype)  # [T, H]
        return output.view(num_rows, 1, hidden_size)
    output = combine_expert_pairs(pairs, top_k, None, torch.float32)  # [T', H] (zeros from other ranks' experts)
    output = _reduce_scatter_rows(output, group)  # [T, H]: this rank's rows, summed over the group
    output = output.to(hidden_states.dtype).view(num_rows, 1, hidden_size)
    return output if shared is None else output + shared


def check_moe_backend(model, backend: Optional[str]) -> None:
    """Raise unless ``backend`` is one of :data:`MOE_BACKENDS` and, for a graph backend, every MoE
    layer of ``model`` is one the sync-free path computes (errors name the setting)."""
    if backend not in MOE_BACKENDS:
        raise ValueError(f"moe_backend must be one of {MOE_BACKENDS}, got {backend!r}")
    if backend == MEGATRON_BACKEND:
        return
    for layer in moe_layers(model):
        if not isinstance(layer, InferenceMoELayer):
            raise ValueError(f"moe_backend={backend!r} needs the model's MoE layers built by "
                             "mtp_ctrl.models.build_gpt_model (InferenceMoELayer); use moe_backend='megatron'")
        check_graph_moe_layer(layer)
