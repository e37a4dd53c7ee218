"""The MoE ops: align_expert_pairs (the single-program sort kernel, interpreted) == its torch twin,
and grouped_expert_matmul (the fused-MoE Triton kernel and torch's grouped GEMM) == the
per-expert torch twin, on random routings: empty experts, every pair on one expert, pairs of
another rank's experts, one row, no rows, segments longer than a tile."""

import pytest
import torch

from mtp_ctrl.triton_ops import ExpertSegments, align_expert_pairs, block_rows_for, grouped_expert_matmul, reference


def test_align_known_answer():
    """The worked example of ExpertSegments, through the kernel and the twin."""
    ids = torch.tensor([[2, 0], [2, 1]])
    for segments in (align_expert_pairs(ids, 0, 3, 2), reference.align_expert_pairs(ids, 0, 3, 2)):
        assert segments.sorted_pairs.tolist() == [1, 3, 0, 2] and segments.sorted_rows.tolist() == [0, 1, 0, 1]
        assert segments.expert_offsets.tolist() == [0, 1, 2, 4]
        assert segments.block_experts.tolist() == [0, 1, 2, -1, -1]
        assert segments.block_starts.tolist() == [0, 1, 2, 0, 0]


def _routing(num_rows, top_k, num_global, generator, only=None):
    """[T, k] int64: distinct experts per row (``only``: every row on the same experts)."""
    if only is not None:
        return torch.tensor([only] * num_rows, dtype=torch.int64).view(num_rows, top_k)
    return torch.stack([torch.randperm(num_global, generator=generator)[:top_k] for _ in range(num_rows)]) \
        if num_rows else torch.zeros(0, top_k, dtype=torch.int64)


CASES = [  # (rows, k, global experts, first local expert, local experts, block rows, same experts for all)
    (5, 2, 4, 0, 4, 2, None),
    (9, 2, 4, 0, 4, 16, (1, 3)),  # every row on experts 1 and 3: two empty experts
    (7, 3, 8, 4, 4, 4, None),  # EP rank 1 of 2: pairs of experts 0..3 are another rank's
    (1, 2, 6, 0, 6, 16, None),  # one row
    (0, 2, 4, 0, 4, 16, None),  # no rows
    (40, 2, 4, 0, 4, 4, None),  # segments of many tiles
]
MANY_CHUNKS = (400, 3, 16, 8, 8, 16, None)  # 1200 pairs: 19 chunks of 64, more than one tile of chunks


@pytest.mark.parametrize("case", CASES + [MANY_CHUNKS])
def test_align_equals_reference(case):
    num_rows, top_k, num_global, first, num_local, block_rows, only = case
    ids = _routing(num_rows, top_k, num_global, torch.Generator().manual_seed(num_rows), only)
    got, want = align_expert_pairs(ids, first, num_local, block_rows), \
        reference.align_expert_pairs(ids, first, num_local, block_rows)
    for name in ExpertSegments._fields:
        got_value, want_value = getattr(got, name), getattr(want, name)
        assert (got_value == want_value) if isinstance(want_value, int) else torch.equal(got_value, want_value), name


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
@pytest.mark.parametrize("case", CASES)
def test_grouped_matmul_equals_reference(backend, case):
    num_rows, top_k, num_global, first, num_local, block_rows, only = case
    generator = torch.Generator().manual_seed(7 + num_rows)
    ids = _routing(num_rows, top_k, num_global, generator, only)
    segments = reference.align_expert_pairs(ids, first, num_local, block_rows)
    rows = torch.randn(num_rows, 24, generator=generator)  # [T, K]
    weight = torch.randn(num_local, 40, 24, generator=generator)  # [E, N, K]
    want = reference.grouped_expert_matmul(rows, weight, segments)
    torch.testing.assert_close(grouped_expert_matmul(rows, weight, segments, backend=backend), want,
                               atol=1e-5, rtol=1e-5)
    # sorted rows in, pair order out; a transposed weight view (K strided) works too
    sorted_rows = torch.randn(ids.numel(), 24, generator=generator)  # [P, K]
    transposed = torch.randn(num_local, 24, 40, generator=generator).transpose(1, 2)  # [E, N, K]
    torch.testing.assert_close(
        grouped_expert_matmul(sorted_rows, transposed, segments, gather_rows=False, scatter_pairs=True,
                              backend=backend),
        reference.grouped_expert_matmul(sorted_rows, transposed, segments, False, True), atol=1e-5, rtol=1e-5)


def test_reference_known_answer_and_other_ranks_pairs_are_zero():
    rows = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # [T = 2, K = 2]
    weight = torch.stack([torch.eye(2), 2 * torch.eye(2)])  # local experts 2 and 3 of 4 (EP rank 1)
    segments = reference.align_expert_pairs(torch.tensor([[3, 0], [2, 3]]), 2, 2, 16)
    out = reference.grouped_expert_matmul(rows, weight, segments, scatter_pairs=True)  # pair order
    assert out.tolist() == [[2.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 2.0]]


def test_block_rows_grow_with_segments():
    assert block_rows_for(6, 64) == 16 and block_rows_for(64 * 40, 64) == 32 and block_rows_for(64 * 100, 64) == 64


def test_bad_arguments_name_the_argument():
    rows, weight = torch.randn(4, 8), torch.randn(2, 6, 8)
    segments = reference.align_expert_pairs(torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]]), 0, 2, 16)
    with pytest.raises(ValueError, match="weight"):
        grouped_expert_matmul(rows, torch.randn(2, 6, 5), segments)
    with pytest.raises(TypeError, match="weight"):
        grouped_expert_matmul(rows, weight.double(), segments)
    with pytest.raises(ValueError, match="expert_offsets"):
        grouped_expert_matmul(rows, torch.randn(3, 6, 8), segments)
    with pytest.raises(TypeError, match="segments"):
        grouped_expert_matmul(rows, weight, (0, 1))
    with pytest.raises(ValueError, match="gather_rows"):
        grouped_expert_matmul(rows, weight, segments, gather_rows=False)  # 4 rows, 8 sorted positions
    with pytest.raises(ValueError, match="backend"):
        grouped_expert_matmul(rows, weight, segments, backend="cutlass")
    with pytest.raises(TypeError, match="expert_ids"):
        align_expert_pairs(torch.zeros(2, 2, dtype=torch.int32), 0, 2, 16)
    with pytest.raises(ValueError, match="num_experts"):
        align_expert_pairs(torch.zeros(2, 2, dtype=torch.int64), 0, 0, 16)
