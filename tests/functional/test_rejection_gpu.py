"""rejection_sample on CUDA: kernel == torch twin (vocabulary up to 128k, with and without q),
capture in a CUDA graph and replay with new inputs, no host sync."""

import pytest
import torch

from mtp_ctrl.triton_ops import reference, rejection_sample
from tests.unit.rejection_cases import make_case

CUDA = "cuda"
NAMES = ("target_probs", "draft_probs", "draft_tokens", "target_tokens", "temperature", "seeds", "positions",
         "draft_indices")


def _cuda_args(case):
    return [None if case[name] is None else case[name].to(CUDA) for name in NAMES]


@pytest.mark.parametrize("num_rows,vocab_size,with_q,zeros,dtype", [
    (0, 32000, True, 0.0, torch.float32), (1, 32000, True, 0.0, torch.float32), (24, 32000, True, 0.3, torch.float32),
    (24, 128256, False, 0.3, torch.float32), (33, 128256, True, 0.9, torch.bfloat16), (7, 5, True, 0.2, torch.float32)])
def test_kernel_matches_twin_on_cuda(num_rows, vocab_size, with_q, zeros, dtype):
    args = _cuda_args(make_case(num_rows, vocab_size, num_rows + vocab_size, with_q, zeros, dtype))
    got = rejection_sample(*args)
    assert torch.equal(got, reference.rejection_sample(*args))


def test_graph_capture_replay_without_host_sync():
    args = _cuda_args(make_case(24, 4096, 1))
    out = torch.empty(24, dtype=torch.int64, device=CUDA)
    rejection_sample(*args, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            rejection_sample(*args, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    fresh = _cuda_args(make_case(24, 4096, 2))
    for arg, new in zip(args, fresh):
        arg.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, reference.rejection_sample(*fresh))
