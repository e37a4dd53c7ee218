"""grouped_expert_matmul: the fused-MoE Triton kernel (interpreter) and torch's grouped GEMM ==
the per-expert torch twin, on random sorted segments (empty experts, one expert taking every
position, positions of other ranks' experts past the last segment, no positions at all)."""

import pytest
import torch

from mtp_ctrl.triton_ops import expert_blocks, grouped_expert_matmul, reference


def _segments(counts, tail=0):
    """expert_offsets [E + 1] int64 for per-expert counts, and P = sum(counts) + tail."""
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
    return offsets, int(offsets[-1]) + tail


def test_reference_known_answer():
    rows = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # [R = 3, K = 2]
    weight = torch.stack([torch.eye(2), 2 * torch.eye(2), torch.tensor([[1.0, 1.0], [0.0, 0.0]])])  # [E = 3, N = 2, K = 2]
    offsets = torch.tensor([0, 1, 1, 3])  # position 0 -> expert 0; 1, 2 -> expert 2; expert 1 empty
    out = reference.grouped_expert_matmul(rows, weight, offsets, torch.tensor([2, 0, 2]))
    assert out.tolist() == [[1.0, 1.0], [1.0, 0.0], [2.0, 0.0]]
    tail = reference.grouped_expert_matmul(rows, weight, torch.tensor([0, 1, 1, 1]), torch.tensor([2, 0, 2]))
    assert tail[1:].abs().sum() == 0  # positions past the last segment (another rank's experts) are zero


def test_expert_blocks_worked_example():
    experts, starts = expert_blocks(torch.tensor([0, 3, 3, 7]), 7, 2)
    assert experts.tolist() == [0, 0, 2, 2, -1, -1, -1] and starts[:4].tolist() == [0, 2, 3, 5]


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
@pytest.mark.parametrize("counts, tail", [
    ([3, 0, 5, 1], 0),  # an empty expert
    ([0, 0, 9, 0], 0),  # every position on one expert
    ([2, 1, 0, 4], 3),  # 3 positions of another rank's experts
    ([0, 0, 0, 0], 0),  # no positions
    ([17, 0, 33, 2], 5),  # segments longer than a tile
])
def test_backends_equal_reference(backend, counts, tail):
    generator = torch.Generator().manual_seed(sum(counts) + tail)
    offsets, num_positions = _segments(counts, tail)
    rows = torch.randn(7, 24, generator=generator)  # [R, K]
    weight = torch.randn(len(counts), 40, 24, generator=generator)  # [E, N, K]
    row_ids = torch.randint(0, 7, (num_positions,), generator=generator)  # [P]
    expected = reference.grouped_expert_matmul(rows, weight, offsets, row_ids)
    got = grouped_expert_matmul(rows, weight, offsets, row_ids, backend=backend)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # no row_ids: position p reads row p; a transposed weight view (GroupedMLP's layout) works too
    square = torch.randn(num_positions, 24, generator=generator)
    transposed = torch.randn(len(counts), 24, 40, generator=generator).transpose(1, 2)  # [E, N, K], K strided
    torch.testing.assert_close(grouped_expert_matmul(square, transposed, offsets, backend=backend),
                               reference.grouped_expert_matmul(square, transposed, offsets), atol=1e-5, rtol=1e-5)


def test_bad_arguments_name_the_argument():
    rows, weight, offsets = torch.randn(4, 8), torch.randn(2, 6, 8), torch.tensor([0, 2, 4])
    with pytest.raises(ValueError, match="weight"):
        grouped_expert_matmul(rows, torch.randn(2, 6, 5), offsets)
    with pytest.raises(TypeError, match="weight"):
        grouped_expert_matmul(rows, weight.double(), offsets)
    with pytest.raises(ValueError, match="expert_offsets"):
        grouped_expert_matmul(rows, weight, torch.tensor([0, 4]))
    with pytest.raises(TypeError, match="expert_offsets"):
        grouped_expert_matmul(rows, weight, offsets.int())
    with pytest.raises(ValueError, match="row_ids"):
        grouped_expert_matmul(rows, weight, offsets, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="backend"):
        grouped_expert_matmul(rows, weight, offsets, backend="cutlass")
