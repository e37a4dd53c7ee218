"""The layout of one MoE layer's (row, expert) pairs sorted by expert, shared by the MoE ops and
their references (torch only)."""

from typing import NamedTuple

import torch


class ExpertSegments(NamedTuple):
    """Pairs of a step sorted by local expert (stable), and tiles of ``block_rows`` positions that
    never straddle two experts. ``P = T * k`` pairs; pair ``t * k + j`` is row t's j-th expert.
    ``NB = cdiv(P, block_rows) + E`` tiles (the worst case: every segment ends in a partial tile).

    Example (T = 2, k = 2, E = 3, first expert 0, block_rows 2): expert ids ``[[2, 0], [2, 1]]`` ->
    sorted_pairs ``[1, 3, 0, 2]``, sorted_rows ``[0, 1, 0, 1]``, expert_offsets ``[0, 1, 2, 4]``,
    block_experts ``[0, 1, 2, -1, -1]``, block_starts ``[0, 1, 2, 0, 0]``.
    """

    sorted_pairs: torch.Tensor  # [P] int64: pair id at each sorted position (other ranks' experts last)
    sorted_rows: torch.Tensor  # [P] int64: sorted_pairs // k, the input row of each position
    expert_offsets: torch.Tensor  # [E + 1] int64: expert e owns positions [offsets[e], offsets[e + 1])
    block_experts: torch.Tensor  # [NB] int64: the expert of each tile, -1 past the last segment
    block_starts: torch.Tensor  # [NB] int64: first position of each tile (0 past the last segment)
    block_rows: int  # positions per tile
