"""sampling_probs on CUDA: the kernel keeps the twin's sort-based kept set and gives its softmax
(vocabulary up to 128k, ties, half precision); capture in a CUDA graph and replay with new inputs,
no host sync."""

import pytest
import torch

from mtp_ctrl.triton_ops import reference, sampling_probs
from tests.functional.sync_checks import no_host_sync
from tests.unit.sampling_cases import make_case

CUDA = "cuda"
NAMES = ("logits", "temperature", "top_k", "top_p")


def _cuda_args(case):
    return [case[name].to(CUDA) for name in NAMES]


@pytest.mark.parametrize("num_rows,vocab_size,ties,dtype", [
    (0, 32000, False, torch.float32), (24, 256, False, torch.float32), (24, 256, True, torch.float32),
    (24, 32000, False, torch.float32), (33, 128256, True, torch.bfloat16), (7, 5, True, torch.float32)])
def test_kernel_keeps_the_twins_set_on_cuda(num_rows, vocab_size, ties, dtype):
    args = _cuda_args(make_case(num_rows, vocab_size, num_rows + vocab_size, ties=ties, dtype=dtype))
    got = sampling_probs(*args)
    want = reference.sampling_probs(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    logits, temperature = args[0].float(), args[1]
    scale = torch.where(temperature < 1e-5, torch.ones_like(temperature), temperature)
    z = logits / scale[:, None]
    representable = (z - z.max(dim=-1, keepdim=True).values) > -80.0  # exp(z - m) underflows below
    assert torch.equal((got > 0) & representable, (want > 0) & representable)


def test_graph_capture_replay_without_host_sync():
    args = _cuda_args(make_case(24, 4096, 1))
    out = torch.empty(24, 4096, dtype=torch.float32, device=CUDA)
    sampling_probs(*args, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with no_host_sync():
        with torch.cuda.graph(graph):
            sampling_probs(*args, out=out)
    fresh = _cuda_args(make_case(24, 4096, 2))
    for arg, new in zip(args, fresh):
        arg.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, reference.sampling_probs(*fresh), rtol=1e-5, atol=1e-7)
