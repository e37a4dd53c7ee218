"""Torch twins of the MoE ops (:mod:`mtp_ctrl.triton_ops.moe_gemm`): a stable sort for the pair
layout, one dense product per expert kept on its segment for the grouped product (E times the
work). No host sync either."""

import torch

from mtp_ctrl.triton_ops._moe_common import ExpertSegments


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
                          gather_rows: bool = True, scatter_pairs: bool = False,
                          backend: str = "reference") -> torch.Tensor:  # [P, N] rows.dtype
    gathered = rows.index_select(0, segments.sorted_rows) if gather_rows else rows  # [P, K]
    offsets = segments.expert_offsets
    positions = torch.arange(gathered.shape[0], device=rows.device)  # [P]
    out = torch.zeros((gathered.shape[0], weight.shape[1]), dtype=torch.float32, device=rows.device)  # [P, N]
    for expert in range(weight.shape[0]):
        inside = (positions >= offsets[expert]) & (positions < offsets[expert + 1])  # [P]
        out = torch.where(inside[:, None], gathered.float() @ weight[expert].float().t(), out)
    out = out.to(rows.dtype)
    return torch.zeros_like(out).index_copy_(0, segments.sorted_pairs, out) if scatter_pairs else out
