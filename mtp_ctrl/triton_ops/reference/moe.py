"""Torch twin of :func:`mtp_ctrl.triton_ops.grouped_expert_matmul`: one dense product per expert,
kept only on that expert's segment of sorted positions (E times the work; no host sync)."""

from typing import Optional

import torch


def grouped_expert_matmul(
    rows: torch.Tensor,  # [R, K] float
    weight: torch.Tensor,  # [E, N, K]
    expert_offsets: torch.Tensor,  # [E + 1] int64
    row_ids: Optional[torch.Tensor] = None,  # [P] int
    backend: str = "reference",
) -> torch.Tensor:  # [P, N] rows.dtype
    gathered = rows if row_ids is None else rows.index_select(0, row_ids.long())  # [P, K]
    positions = torch.arange(gathered.shape[0], device=rows.device)  # [P]
    out = torch.zeros((gathered.shape[0], weight.shape[1]), dtype=torch.float32, device=rows.device)  # [P, N]
    for expert in range(weight.shape[0]):
        inside = (positions >= expert_offsets[expert]) & (positions < expert_offsets[expert + 1])  # [P]
        product = gathered.float() @ weight[expert].float().t()  # [P, N] fp32
        out = torch.where(inside[:, None], product, out)
    return out.to(rows.dtype)
