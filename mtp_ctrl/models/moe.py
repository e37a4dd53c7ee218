"""megatron-core's mixture-of-experts layer inside the paged model: settings, router, checks.

The MoE layer is megatron's own ``MoELayer`` (router, experts, token dispatcher) from its layer
specs; this module only decides where it goes and refuses settings under which a row's output
would depend on the other rows of the step.

Why routing must be per row. A verify step runs ``1 + S`` rows per request (the base token and S
drafts) where plain decoding runs one; speculative output equals plain output only if every row
routes and computes exactly as it would alone. megatron's top-k routing (softmax or sigmoid
scores, group-limited routing, expert bias, sinkhorn at eval) is a function of the row alone, and
the dispatchers are dropless unless a capacity factor is set. Refused, because they couple rows
or draw noise: ``moe_expert_capacity_factor`` (drops tokens by the batch's load),
``moe_input_jitter_eps`` (random noise on the router's input), ``moe_router_force_load_balancing``
(random logits). Aux and z losses are training-only (megatron adds them only with grad enabled in
training mode; the runner runs in eval mode under ``no_grad``).

Dispatchers. ``allgather`` (megatron's default) runs on any backend, gloo included, and under
tensor and expert parallelism without sequence parallelism: every TP rank holds every row, the
dispatcher gathers rows over the TP x EP group, each rank runs its local experts (sharded over the
expert-TP group) on the rows routed to them, and a reduce-scatter sums the partial outputs back.
``alltoall`` needs CUDA (it creates a CUDA stream when built); ``flex`` needs DeepEP or HybridEP.

CUDA graphs. Every megatron expert path sizes its expert batches on the host: the allgather
dispatcher reads ``tokens_per_expert`` with ``.cpu()``, ``SequentialMLP`` splits rows with
``.tolist()``, the alltoall dispatcher synchronises on its D2H stream. megatron's forward of an MoE
layer therefore syncs and cannot be captured; the runner's forwards take the sync-free path of
``models/moe_inference.py`` instead (megatron's stays behind ``moe_backend="megatron"``).
"""

import dataclasses
from typing import List, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig

# settings under which a row's routing depends on the rest of the batch, or on random draws
_ROW_COUPLING_SETTINGS = (
    ("moe_expert_capacity_factor", "token dropping by expert capacity depends on the whole batch"),
    ("moe_input_jitter_eps", "input jitter adds random noise to the router's input"),
    ("moe_router_force_load_balancing", "forced load balancing routes by random logits"),
)
SUPPORTED_DISPATCHERS = ("allgather", "alltoall")


class InferenceTopKRouter(TopKRouter):
    """megatron's ``TopKRouter`` with an inference gate: ``x @ W^T (+ b)`` in the router dtype,
    on the device where the weight lives. Routing (scores, top-k, groups, expert bias) is megatron's.

    Two things in megatron-core 0.16.1's ``Router.gating`` do not fit inference here: it moves a
    CPU weight to ``torch.cuda.current_device()`` on first use (for training set-ups that build
    on CPU; it fails on a CPU-only build and moves a weight behind the caller's back), and its
    ``router_gating_linear`` names ``te_general_gemm``, which is undefined when Transformer
    Engine is not installed (NameError). The product is the one megatron computes without TE;
    the parameters keep their names, so checkpoints load unchanged.
    """

    def __init__(self, config: TransformerConfig, pg_collection=None):
        # megatron allocates the expert-bias buffers on torch.cuda.current_device(), which a CPU-only
        # build of torch cannot do: build without them, then register them (same names, persistence
        # and dtype) on the current CUDA device when there is one, else on the CPU
        with_bias = config.moe_router_enable_expert_bias and not torch.cuda.is_available()
        super().__init__(config=dataclasses.replace(config, moe_router_enable_expert_bias=False) if with_bias
                         else config, pg_collection=pg_collection)
        if with_bias:
            self.config = config
            self.enable_expert_bias = True
            del self.local_tokens_per_expert, self.expert_bias  # megatron set both to None
            self.register_buffer("local_tokens_per_expert", torch.zeros(config.num_moe_experts), persistent=False)
            self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts))  # [E] fp32

    def _weight_in(self, dtype: torch.dtype) -> torch.Tensor:  # [E, H]
        """The gate weight in ``dtype`` (the router dtype): a cast copy kept while the weight is
        unchanged (same storage and version), so a step does not cast it again in every layer."""
        weight = self.weight
        if weight.dtype == dtype:
            return weight
        key = (weight.data_ptr(), weight._version, dtype)
        cached = getattr(self, "_cast_weight", None)
        if cached is None or cached[0] != key:
            cached = (key, weight.detach().to(dtype))
            self._cast_weight = cached
        return cached[1]

    def gating(self, input: torch.Tensor) -> torch.Tensor:  # [T, 1, H] -> [T, 1, E]
        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        rows = input.reshape(-1, input.shape[-1]).to(router_dtype)  # [T, H]
        weight = self._weight_in(router_dtype).t()  # [H, E]
        if self.bias is None:
            logits = torch.mm(rows, weight)
        else:
            logits = torch.addmm(self.bias.to(router_dtype), rows, weight)  # [T, E]
        return logits.view(*input.shape[:-1], -1)


def _gather_rows(tensor: torch.Tensor, group) -> torch.Tensor:  # [n, ...] -> [n * group size, ...]
    """All-gather along the first dim, in rank order, on the tensor's own device (bool goes as uint8)."""
    world_size = dist.get_world_size(group=group)
    source = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor.contiguous()
    output = source.new_empty((tensor.shape[0] * world_size, *tensor.shape[1:]))
    dist.all_gather_into_tensor(output, source, group=group)
    return output.bool() if tensor.dtype == torch.bool else output


def _reduce_scatter_rows(tensor: torch.Tensor, group) -> torch.Tensor:  # [n * group size, ...] -> [n, ...]
    """Sum over the group, each rank keeping its own slice of the first dim."""
    world_size = dist.get_world_size(group=group)
    output = tensor.new_empty((tensor.shape[0] // world_size, *tensor.shape[1:]))
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(output, tensor.contiguous(), group=group)
    return output


class InferenceAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """megatron's all-gather dispatcher with its two collectives on the rows' own device.

    megatron's ``gather_from_sequence_parallel_region`` and ``reduce_scatter_to_sequence_parallel_region``
    allocate their outputs on ``torch.cuda.current_device()``, so TP or EP > 1 fails on CPU (gloo).
    The communication is the same (all-gather of routing map, probs and rows over the expert TP x
    EP group, then a reduce-scatter of the expert outputs in the probs' dtype); the permutation
    and the expert computation are megatron's.
    """

    def token_dispatch(self, hidden_states, probs):  # rows [n, H], probs [n, E] -> [n * TP * EP, ...]
        if self.tp_size > 1 or self.ep_size > 1:
            self.routing_map = _gather_rows(self.routing_map, self.tp_ep_group)
            probs = _gather_rows(probs, self.tp_ep_group)
            hidden_states = _gather_rows(hidden_states, self.tp_ep_group)
        return hidden_states, probs

    def token_combine(self, hidden_states):  # [n * TP * EP, H] partial sums -> [n, H]
        if self.tp_size > 1 or self.ep_size > 1:
            hidden_states = _reduce_scatter_rows(hidden_states.to(self.local_probs.dtype),
                                                 self.tp_ep_group).to(hidden_states.dtype)
        return hidden_states


def use_inference_dispatchers(model) -> int:
    """Give every MoE layer whose dispatcher is megatron's all-gather one an
    :class:`InferenceAllGatherTokenDispatcher` over the same process groups (a dispatcher holds no
    parameters); returns how many were replaced. (The layer stays megatron's ``MoELayer``: its
    TransformerLayer hands process groups only to that exact class.)"""
    replaced = 0
    for layer in moe_layers(model):
        old = layer.token_dispatcher
        if type(old) is MoEAllGatherTokenDispatcher:
            layer.token_dispatcher = InferenceAllGatherTokenDispatcher(
                layer.num_local_experts, layer.local_expert_indices, config=layer.config,
                pg_collection=_dispatcher_groups(old))
            replaced += 1
    return replaced


def _dispatcher_groups(dispatcher) -> ProcessGroupCollection:
    groups = ProcessGroupCollection()
    groups.ep, groups.expt_tp, groups.tp_ep = dispatcher.ep_group, dispatcher.tp_group, dispatcher.tp_ep_group
    return groups


def is_moe_config(config: TransformerConfig) -> bool:
    return config.num_moe_experts is not None


def moe_layer_pattern(config: TransformerConfig) -> List[bool]:
    """Which decoder layers are MoE layers, read from megatron's ``moe_layer_freq`` as megatron
    reads it: an int N makes layers 0, N, 2N, ... MoE; a list holds one 0 (dense) or 1 (MoE) per
    layer. All False for a model without experts.

    >>> moe_layer_pattern(TransformerConfig(num_layers=4, num_moe_experts=4, moe_layer_freq=2, ...))
    [True, False, True, False]
    """
    num_layers = config.num_layers
    if not is_moe_config(config):
        return [False] * num_layers
    freq: Union[int, Sequence[int]] = config.moe_layer_freq
    if isinstance(freq, int) and not isinstance(freq, bool):
        if freq < 1:
            raise ValueError(f"config.moe_layer_freq must be >= 1, got {freq}")
        return [layer % freq == 0 for layer in range(num_layers)]
    if isinstance(freq, (list, tuple)) and len(freq) == num_layers and all(
            not isinstance(flag, bool) and flag in (0, 1) for flag in freq):
        return [flag == 1 for flag in freq]
    raise ValueError(f"config.moe_layer_freq must be an int >= 1 or a list of {num_layers} (config.num_layers) "
                     f"values, each 0 (dense) or 1 (MoE); got {freq!r}")


def check_moe_config(config: TransformerConfig, expert_parallel_size: int) -> None:
    """Raise ValueError for MoE settings the paged model cannot serve losslessly (module docstring)."""
    if not is_moe_config(config):
        if expert_parallel_size != 1:
            raise ValueError(f"expert_model_parallel_size is {expert_parallel_size} but config.num_moe_experts is unset")
        return
    for name, reason in _ROW_COUPLING_SETTINGS:
        if getattr(config, name, None) not in (None, False):
            raise ValueError(f"config.{name}={getattr(config, name)!r} is not supported: {reason}, so verify rows "
                             "would not route as they would one at a time; leave it unset for inference")
    if config.moe_token_dispatcher_type not in SUPPORTED_DISPATCHERS:
        raise ValueError(f"config.moe_token_dispatcher_type={config.moe_token_dispatcher_type!r} is not supported; "
                         f"use one of {SUPPORTED_DISPATCHERS}")
    if config.moe_token_dispatcher_type == "alltoall" and not torch.cuda.is_available():
        raise ValueError("config.moe_token_dispatcher_type='alltoall' needs CUDA (megatron builds a CUDA stream); "
                         "use 'allgather' on CPU")
    if config.num_moe_experts % expert_parallel_size != 0:
        raise ValueError(f"config.num_moe_experts={config.num_moe_experts} is not divisible by the expert-parallel "
                         f"size {expert_parallel_size}")
    if config.expert_model_parallel_size != expert_parallel_size:
        raise ValueError(f"config.expert_model_parallel_size={config.expert_model_parallel_size} differs from "
                         f"parallel_state's expert-parallel size {expert_parallel_size}")
    moe_layer_pattern(config)  # ValueError for a bad moe_layer_freq


def moe_layers(model) -> List[MoELayer]:
    """The model's MoE layers (decoder, then MTP depths); empty for a dense model."""
    return [module for module in model.modules() if isinstance(module, MoELayer)]


def has_moe_layers(model) -> bool:
    """True when a step of the model contains an MoE layer (on megatron's path its expert
    dispatch reads token counts on the host: such steps run eagerly; module docstring)."""
    return any(True for _ in moe_layers(model))
