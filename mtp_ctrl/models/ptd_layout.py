"""Parallel drafting (PTD) with an EAGLE head: the rows of one drafting forward, and the dense
training layout that puts every position of a sequence in that situation at once.

At inference (:class:`~mtp_ctrl.controllers.ParallelDraftingProposer`), once a step verified
the tokens up to the bonus token ``t_e``, the head runs ONE forward over the step's verified
rows (row at position ``p``: feature ``fc(aux_p)``, token ``t_{p+1}``) followed by ``S - 1``
mask rows at positions ``e .. e + S - 2`` (feature ``head.mask_hidden``, token
``head.mask_token_id``), causally. The last verified row (position ``e - 1``, token ``t_e``)
drafts ``d_1``; the mask row at position ``e + k - 2`` drafts ``d_k``.

Training over ``n`` verified rows makes every row ``p`` an anchor (the last verified row) at
once: the ``n`` verified rows, then ``m = S - 1`` mask rows per anchor at positions
``p + 1 .. p + m``. A mask row attends to the verified rows ``<= p`` and to its own anchor's
earlier mask rows (itself included): what it sees at inference. A verified row is causal.

Rows: verified row ``p`` is row ``p`` (position ``p``); anchor ``p``'s ``j``-th mask row
(``1 <= j <= m``) is row ``n + p * m + j - 1`` at position ``p + j``. Example ``n = 3, m = 2``::

    row       0 1 2 | 3 4 | 5 6 | 7 8
    position  0 1 2 | 1 2 | 2 3 | 3 4
    anchor    - - - | 0 0 | 1 1 | 2 2      row 6 (anchor 1, j = 2) attends to rows 0, 1, 5, 6

Anchor ``p``'s draft ``k`` (``1 <= k <= m + 1``) predicts ``t_{p+k+1}``; its row is
:func:`ptd_draft_rows` ``[p, k - 1]``.
"""

from typing import Tuple

import torch
from megatron.core.models.gpt import GPTModel

from mtp_ctrl.models.eagle_head import EagleHead


def _check_counts(num_verified: int, num_mask_rows: int) -> None:
    for name, value in (("num_verified", num_verified), ("num_mask_rows", num_mask_rows)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def ptd_training_layout(num_verified: int, num_mask_rows: int,
                        device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(positions [n * (1 + m)] int64, blocked [n * (1 + m), n * (1 + m)] bool)``: each row's
    position and where it may NOT attend (True, megatron's convention), as in the module docstring."""
    _check_counts(num_verified, num_mask_rows)
    n, m = num_verified, num_mask_rows
    verified = torch.arange(n, device=device)  # [n]
    anchors = verified.repeat_interleave(m)  # [n * m] anchor of each mask row
    offsets = torch.arange(1, m + 1, device=device).repeat(n)  # [n * m] j of each mask row
    positions = torch.cat([verified, anchors + offsets])  # [R]
    is_mask = torch.cat([torch.zeros(n, dtype=torch.bool, device=device),
                         torch.ones(n * m, dtype=torch.bool, device=device)])  # [R]
    # the verified row a row's context ends at: its own (verified rows) or its anchor (mask rows)
    context_end = torch.cat([verified, anchors])  # [R]
    group = torch.cat([torch.full((n,), -1, device=device), anchors])  # [R] -1: verified row
    column_is_mask = is_mask[None, :]
    sees_verified = ~column_is_mask & (positions[None, :] <= context_end[:, None])  # [R, R]
    sees_mask = column_is_mask & (group[None, :] == group[:, None]) & (positions[None, :] <= positions[:, None])
    return positions, ~(sees_verified | sees_mask)


def ptd_draft_rows(num_verified: int, num_mask_rows: int, device=None) -> torch.Tensor:
    """``[n, m + 1]`` int64: the row of anchor ``p``'s draft ``k`` at ``[p, k - 1]`` (column 0:
    the verified row itself; column ``j``: its ``j``-th mask row)."""
    _check_counts(num_verified, num_mask_rows)
    n, m = num_verified, num_mask_rows
    anchors = torch.arange(n, device=device)[:, None]  # [n, 1]
    mask_rows = n + anchors * m + torch.arange(m, device=device)[None, :]  # [n, m]
    return torch.cat([anchors, mask_rows], dim=1)


def dense_ptd_forward(target_model: GPTModel, head: EagleHead, features: torch.Tensor, next_tokens: torch.Tensor,
                      num_mask_rows: int) -> torch.Tensor:
    """One forward of a dense parallel-drafting head (``build_eagle_head(..., dense=True,
    parallel_drafting=True)``) over the training layout: ``features`` ``[n, b, H]``
    (``fc`` of the aux states, positions ``0 .. n - 1``), ``next_tokens`` ``[b, n]`` int64 (row
    ``p``'s token ``t_{p+1}``) -> the head's output ``[n * (1 + m), b, H]`` (rows as in the module
    docstring; the caller applies :func:`~mtp_ctrl.models.eagle_head.eagle_logits`).
    ``target_model`` is the dense twin (its embedding and rotary)."""
    if not isinstance(head, EagleHead) or not head.parallel_drafting:
        raise ValueError("head must be an EagleHead built with parallel_drafting=True (it has no mask_hidden)")
    batch, n = next_tokens.shape
    if features.dim() != 3 or features.shape[:2] != (n, batch):
        raise ValueError(f"features must be [n, b, H] = [{n}, {batch}, H], got {tuple(features.shape)}")
    positions, blocked = ptd_training_layout(n, num_mask_rows, next_tokens.device)  # [R], [R, R]
    rows = positions.shape[0]
    mask_tokens = next_tokens.new_full((batch, rows - n), head.mask_token_id)  # [b, n * m]
    tokens = torch.cat([next_tokens, mask_tokens], dim=1)  # [b, R]
    mask_features = head.mask_hidden.to(features.dtype)[None, None, :].expand(rows - n, batch, -1)  # [n * m, b, H]
    all_features = torch.cat([features, mask_features], dim=0)  # [R, b, H]
    position_ids = positions
    if target_model.position_embedding_type == "learned_absolute":
        position_ids = position_ids.clamp(max=target_model.max_sequence_length - 2)
    embedded = target_model.embedding(input_ids=tokens, position_ids=(position_ids + 1)[None, :].expand(batch, -1))
    rotary = None
    if target_model.position_embedding_type == "rope":
        rotary = target_model.rotary_pos_emb(int(n + num_mask_rows))[positions]  # [R, 1, 1, rotary_dim]
    return head(embedded, all_features, rotary_pos_emb=rotary, attention_mask=blocked)
