"""Torch twins of the MoE ops (:mod:`mtp_ctrl.triton_ops.moe_gemm`, ``moe_routing``, ``moe_pairs``):
a stable sort for the pair layout, one dense product per expert kept on its segment for the grouped
product (E times the work), megatron's routing math with stable top-k orders, megatron's
activation / scale / combine roundings. No host sync either."""

import torch

from mtp_ctrl.triton_ops._moe_common import ExpertSegments
from mtp_ctrl.triton_ops.reference.glue import bias_activation


def align_expert_pairs(expert_ids: torch.Tensor, first_expert: int, num_experts: int,
                       block_rows: int) -> ExpertSegments:
    num_pairs = expert_ids.numel()
    device = expert_ids.device
    local = expert_ids.flatten() - first_expert  # [P]
    buckets = torch.where((local >= 0) & (local < num_experts), local, num_experts)  # [P]
    sorted_buckets, sorted_pairs = torch.sort(buckets, stable=True)  # [P] each
    offsets = torch.searchsorted(sorted_buckets, torch.arange(num_experts + 1, device=device))  # [E + 1]
    counts = offsets[1:] - offsets[:-1]  # [E]
    tiles = (counts + block_rows - 1) // block_rows  # [E]
    tile_ends = torch.cumsum(tiles, 0)  # [E]
    num_blocks = -(-num_pairs // block_rows) + num_experts
    blocks = torch.arange(num_blocks, device=device)  # [NB]
    expert = torch.searchsorted(tile_ends, blocks, right=True)  # [NB] in [0, E]: E past the last segment
    clamped = expert.clamp(max=num_experts - 1)
    starts = offsets[clamped] + (blocks - (tile_ends - tiles)[clamped]) * block_rows
    found = expert < num_experts
    top_k = max(expert_ids.shape[1], 1)
    return ExpertSegments(sorted_pairs, sorted_pairs // top_k, offsets, torch.where(found, expert, -1),
                          torch.where(found, starts, 0), block_rows)


def grouped_expert_matmul(rows: torch.Tensor, weight: torch.Tensor, segments: ExpertSegments,
                          gather_rows: bool = True, scatter_pairs: bool = False, backend: str = "reference",
                          all_experts_local: bool = False) -> torch.Tensor:  # [P, N] rows.dtype
    gathered = rows.index_select(0, segments.sorted_rows) if gather_rows else rows  # [P, K]
    offsets = segments.expert_offsets
    positions = torch.arange(gathered.shape[0], device=rows.device)  # [P]
    out = torch.zeros((gathered.shape[0], weight.shape[1]), dtype=torch.float32, device=rows.device)  # [P, N]
    for expert in range(weight.shape[0]):
        inside = (positions >= offsets[expert]) & (positions < offsets[expert + 1])  # [P]
        out = torch.where(inside[:, None], gathered.float() @ weight[expert].float().t(), out)
    out = out.to(rows.dtype)
    return torch.zeros_like(out).index_copy_(0, segments.sorted_pairs, out) if scatter_pairs else out


def _stable_top(values: torch.Tensor, k: int) -> torch.Tensor:  # [..., n] -> [..., k] indices
    """The k largest in descending order, the lower index first among equals (the kernel's order)."""
    return torch.sort(values, dim=-1, descending=True, stable=True)[1][..., :k]


def route_top_k(logits: torch.Tensor, expert_bias, top_k: int, score_function: str, pre_softmax: bool = False,
                num_groups=None, group_topk=None, scaling_factor=None):  # -> (ids [T, k] int64, probs [T, k])
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)  # [T, E]
        select = scores if expert_bias is None else scores + expert_bias
    else:
        scores = torch.softmax(logits, dim=-1) if pre_softmax else logits
        select = scores
    if group_topk:  # megatron's group_limited_topk
        grouped = select.view(select.shape[0], num_groups, -1)  # [T, G, E / G]
        group_scores = grouped.gather(2, _stable_top(grouped, top_k // group_topk)).sum(-1)  # [T, G]
        chosen = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, _stable_top(group_scores, group_topk),
                                                                          True)
        select = select.masked_fill(~chosen.repeat_interleave(grouped.shape[2], dim=1), float("-inf"))
    ids = _stable_top(select, top_k)  # [T, k]
    probs = scores.gather(1, ids)
    if score_function == "sigmoid" and top_k > 1:
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    elif score_function == "softmax" and not pre_softmax:
        probs = torch.softmax(probs, dim=-1)
    if scaling_factor:
        probs = probs * scaling_factor
    return ids, probs


def scaled_pair_activation(fc1: torch.Tensor, probs: torch.Tensor, sorted_pairs: torch.Tensor, activation: str,
                           gated: bool) -> torch.Tensor:  # [P, F] fc1's dtype
    activated = bias_activation(fc1, None, activation, gated)  # megatron's roundings
    scale = probs.flatten()[sorted_pairs]  # [P]
    return (activated * scale[:, None]).to(fc1.dtype)  # megatron's per_token_scale


def combine_expert_pairs(pairs: torch.Tensor, top_k: int, shared, out_dtype: torch.dtype) -> torch.Tensor:
    total = pairs.view(-1, top_k, pairs.shape[1]).sum(1, dtype=torch.float32).to(out_dtype)  # [T, H]
    return total if shared is None else total + shared
