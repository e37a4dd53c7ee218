"""megatron's top-k routing of an MoE layer's rows in one launch: scores, group-limited top-k,
expert bias, normalisation and scaling.

megatron's ``topk_routing_with_score_function`` (unfused) runs about 20 kernels on the router's
``[T, E]`` logits: the sigmoid or softmax, the expert bias add, the group scores (a top-k, a sum, a
top-k of groups, a scatter into a mask, the mask's negation and fill), the final top-k, the gather
of the unbiased scores, the sum, the division and the scaling. :func:`route_top_k` computes the same
``(ids, probs)`` with one program per row, which at decode (T = 1) is one short launch instead of
20 (bench/RESULTS.md, "MoE decode step").

The math, per row, in fp32 (the logits' dtype; megatron's ``moe_router_dtype="fp32"``):

- ``"softmax"``: with ``pre_softmax`` the softmax over all experts, then the top-k of the
  probabilities; otherwise the top-k of the logits, then the softmax over those k.
- ``"sigmoid"``: the sigmoid; the top-k is chosen on ``score + expert_bias`` when a bias is given,
  the probabilities are the unbiased scores, divided by their sum plus 1e-20 when k > 1.
- Group-limited (``group_topk``): the experts form ``num_groups`` equal groups; a group's score
  is the sum of its ``top_k // group_topk`` highest selection scores; only the ``group_topk``
  best groups' experts can be picked (megatron's ``group_limited_topk``).
- Then the probabilities times ``scaling_factor`` when it is set.

The top-k comes out in descending order of the selection score; among equal scores the lower
expert id comes first (torch.topk leaves that order unspecified; with real-valued scores ties do
not happen). Every row is routed on its own, so a row routes the same whatever the step holds.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import check_int, check_tensor
from mtp_ctrl.triton_ops._dispatch import use_triton

SCORE_FUNCTIONS = ("softmax", "sigmoid")
_NO_INDEX = tl.constexpr(1 << 30)  # larger than any expert id: the "not found" of an index minimum


@triton.jit
def _first_max(values, indices):
    """``(max, lowest index holding it)`` of a 2-D block (``indices`` of the same shape)."""
    best = tl.max(tl.max(values, axis=1), axis=0)
    at = tl.min(tl.min(tl.where(values == best, indices, _NO_INDEX), axis=1), axis=0)
    return best, at


@triton.jit
def _route_rows_kernel(
    LOGITS_PTR, BIAS_PTR, IDS_PTR, PROBS_PTR, logits_stride, top_k, group_topk, per_group, scaling,
    SCORE: tl.constexpr, PRE_SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALING: tl.constexpr,
    GROUPED: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, G_PAD: tl.constexpr,
    S_PAD: tl.constexpr, K_PAD: tl.constexpr,
):
    """Program t: row t's ``top_k`` expert ids and probabilities (module docstring). The experts
    are held as a ``[groups, group size]`` block (one group when routing is not group-limited)."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, G_PAD)
    members = tl.arange(0, S_PAD)
    experts = groups[:, None] * GROUP_SIZE + members[None, :]  # [G_PAD, S_PAD] expert id
    valid = (groups[:, None] < NUM_GROUPS) & (members[None, :] < GROUP_SIZE)
    logits = tl.load(LOGITS_PTR + row * logits_stride + experts, mask=valid, other=float("-inf")).to(tl.float32)
    if SCORE == 1:  # sigmoid
        scores = 1.0 / (1.0 + tl.exp(-logits))
        scores = tl.where(valid, scores, float("-inf"))
    elif PRE_SOFTMAX:
        shifted = tl.exp(logits - tl.max(tl.max(logits, axis=1), axis=0))
        shifted = tl.where(valid, shifted, 0.0)
        scores = shifted / tl.sum(tl.sum(shifted, axis=1), axis=0)
        scores = tl.where(valid, scores, float("-inf"))
    else:
        scores = logits
    select = scores  # [G_PAD, S_PAD] the score the top-k is chosen on
    if HAS_BIAS:
        select = scores + tl.load(BIAS_PTR + experts, mask=valid, other=0.0).to(tl.float32)
    if GROUPED:  # megatron's group_limited_topk
        group_score = tl.zeros((G_PAD,), dtype=tl.float32)
        left = select
        # (each loop names its own values: Triton carries a name reassigned in a loop through it)
        for _member_pick in range(per_group):  # the sum of each group's per_group best
            member_best = tl.max(left, axis=1)  # [G_PAD]
            member_at = tl.min(tl.where(left == member_best[:, None], members[None, :], _NO_INDEX), axis=1)
            group_score += member_best
            left = tl.where(members[None, :] == member_at[:, None], float("-inf"), left)
        group_score = tl.where(groups < NUM_GROUPS, group_score, float("-inf"))
        chosen = groups < 0  # [G_PAD] all False
        for _group_pick in range(group_topk):
            group_best = tl.max(group_score, axis=0)
            group_at = tl.min(tl.where(group_score == group_best, groups, _NO_INDEX), axis=0)
            chosen = chosen | (groups == group_at)
            group_score = tl.where(groups == group_at, float("-inf"), group_score)
        select = tl.where(chosen[:, None], select, float("-inf"))
    slots = tl.arange(0, K_PAD)
    picked = tl.zeros((K_PAD,), dtype=tl.int64)
    values = tl.zeros((K_PAD,), dtype=tl.float32)
    for slot in range(top_k):
        expert_at = _first_max(select, experts)[1]
        value = tl.sum(tl.sum(tl.where(experts == expert_at, scores, 0.0), axis=1), axis=0)  # unbiased score
        picked = tl.where(slots == slot, expert_at.to(tl.int64), picked)
        values = tl.where(slots == slot, value, values)
        select = tl.where(experts == expert_at, float("-inf"), select)
    in_k = slots < top_k
    if SCORE == 1:
        if top_k > 1:
            values = values / (tl.sum(tl.where(in_k, values, 0.0), axis=0) + 1e-20)
    elif not PRE_SOFTMAX:  # softmax over the k chosen logits
        shifted = tl.where(in_k, tl.exp(values - tl.max(tl.where(in_k, values, float("-inf")), axis=0)), 0.0)
        values = shifted / tl.sum(shifted, axis=0)
    if HAS_SCALING:
        values = values * scaling
    tl.store(IDS_PTR + row * top_k + slots, picked, mask=in_k)
    tl.store(PROBS_PTR + row * top_k + slots, values.to(PROBS_PTR.dtype.element_ty), mask=in_k)


def _check_route_args(logits, expert_bias, top_k, score_function, pre_softmax, num_groups, group_topk):
    check_tensor("logits", logits, dtypes=(torch.float32,), ndim=2)
    num_experts = logits.shape[1]
    if expert_bias is not None:
        check_tensor("expert_bias", expert_bias, dtypes=(torch.float32,), shape=(num_experts,), device=logits.device)
        if score_function != "sigmoid":
            raise ValueError("expert_bias: megatron applies an expert bias to sigmoid scores only")
    check_int("top_k", top_k, low=1, high=max(num_experts, 1))
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    if not isinstance(pre_softmax, bool):
        raise TypeError(f"pre_softmax must be a bool, got {type(pre_softmax).__name__}")
    if group_topk:
        check_int("group_topk", group_topk, low=1)
        check_int("num_groups", num_groups, low=group_topk)
        if num_experts % num_groups != 0 or top_k > group_topk * (num_experts // num_groups):
            raise ValueError(f"num_groups={num_groups}, group_topk={group_topk}: the groups must split the "
                             f"{num_experts} experts evenly and the chosen groups hold top_k={top_k} experts")


def route_top_k(
    logits: torch.Tensor,  # [T, E] fp32: the router's gate output
    expert_bias: Optional[torch.Tensor],  # [E] fp32 (sigmoid only) or None
    top_k: int,
    score_function: str,  # "softmax" or "sigmoid"
    pre_softmax: bool = False,  # softmax: the softmax before the top-k (else over the k chosen logits)
    num_groups: Optional[int] = None,  # group-limited routing: expert groups ...
    group_topk: Optional[int] = None,  # ... of which each row may use this many (None or 0: not limited)
    scaling_factor: Optional[float] = None,  # probabilities times this when set
) -> Tuple[torch.Tensor, torch.Tensor]:  # (ids [T, k] int64, probs [T, k] fp32)
    """Each row's ``top_k`` experts and routing probabilities, megatron's math (module docstring).

    Example: logits ``[[0, 2, 1]]``, ``"softmax"``, k = 2 -> ids ``[[1, 2]]``, probs
    ``softmax([2, 1]) = [[0.731, 0.269]]``.
    """
    _check_route_args(logits, expert_bias, top_k, score_function, pre_softmax, num_groups, group_topk)
    if not use_triton(logits):
        return reference.route_top_k(logits, expert_bias, top_k, score_function, pre_softmax, num_groups,
                                     group_topk, scaling_factor)
    num_rows, num_experts = logits.shape
    ids = torch.empty((num_rows, top_k), dtype=torch.int64, device=logits.device)
    probs = torch.empty((num_rows, top_k), dtype=logits.dtype, device=logits.device)
    if num_rows == 0:
        return ids, probs
    groups = num_groups if group_topk else 1
    group_size = num_experts // groups
    _route_rows_kernel[(num_rows,)](
        logits, logits if expert_bias is None else expert_bias, ids, probs, logits.stride(0), top_k,
        group_topk or 0, top_k // group_topk if group_topk else 0, float(scaling_factor or 0.0),
        SCORE=SCORE_FUNCTIONS.index(score_function), PRE_SOFTMAX=pre_softmax, HAS_BIAS=expert_bias is not None,
        HAS_SCALING=bool(scaling_factor), GROUPED=bool(group_topk), NUM_GROUPS=groups, GROUP_SIZE=group_size,
        G_PAD=triton.next_power_of_2(groups), S_PAD=triton.next_power_of_2(group_size),
        K_PAD=triton.next_power_of_2(top_k), num_warps=1 if num_experts <= 256 else 4,
    )
    return ids, probs
