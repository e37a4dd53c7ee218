"""rejection_sample on CUDA: kernel == torch twin (vocabulary up to 128k, with and without the
drafter's logits, top-k / top-p), capture in a CUDA graph and replay with new inputs, no host sync."""

import pytest
import torch

from mtp_ctrl.triton_ops import reference, rejection_sample
from tests.functional.sync_checks import no_host_sync
from tests.unit.rejection_cases import args_of, make_case

CUDA = "cuda"


@pytest.mark.parametrize("num_decode,num_other,S,vocab_size,with_q,zeros,dtype", [
    (0, 0, 2, 32000, True, 0.0, torch.float32), (1, 0, 1, 32000, True, 0.0, torch.float32),
    (6, 4, 3, 32000, True, 0.3, torch.float32), (8, 0, 2, 128256, False, 0.3, torch.float32),
    (10, 3, 2, 128256, True, 0.9, torch.bfloat16), (2, 1, 2, 5, True, 0.2, torch.float32)])
def test_kernel_matches_twin_on_cuda(num_decode, num_other, S, vocab_size, with_q, zeros, dtype):
    case = make_case(num_decode, num_other, S, vocab_size, num_decode + vocab_size, with_q, zeros, dtype)
    args = args_of(case, CUDA)
    got = rejection_sample(*args)
    assert torch.equal(got, reference.rejection_sample(*args))


def test_graph_capture_replay_without_host_sync():
    args = args_of(make_case(8, 3, 2, 4096, 1), CUDA)
    out = torch.empty(27, dtype=torch.int64, device=CUDA)
    rejection_sample(*args, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with no_host_sync():
        with torch.cuda.graph(graph):
            rejection_sample(*args, out=out)
    fresh = args_of(make_case(8, 3, 2, 4096, 2), CUDA)
    for arg, new in zip(args, fresh):
        if isinstance(arg, torch.Tensor):
            arg.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, reference.rejection_sample(*fresh))


def test_controller_in_rejection_mode_replays_graphs_without_host_sync():
    """``acceptance="rejection"`` through the controller on CUDA: every step (prefill chunks too)
    replays a warmed-up graph without a host sync; a seed gives the same tokens run after run;
    greedy requests equal plain decoding; nothing leaks."""
    from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
    from tests.functional.test_controller_gpu import AllStepsSyncChecked
    from tests.unit.megatron_fixtures import build_tiny_model, ensure_single_process_groups, tiny_config

    ensure_single_process_groups()
    model = build_tiny_model(tiny_config(mtp_num_layers=2)).cuda()
    prompts = [[5, 17, 3, 88, 41], [9, 9, 2], [60, 1, 33, 70, 12, 8, 45], [4] * 11]
    sampled = [SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=i) for i in range(4)]
    greedy = SamplingParams(max_new_tokens=12)

    def config(S, acceptance="exact_match"):
        return InferenceConfig(num_speculative_tokens=S, max_requests=4, block_size_tokens=4, max_model_len=64,
                               max_tokens_per_step=64, cuda_graph_batch_sizes=(1, 2, 4), acceptance=acceptance)

    runs = []
    for _ in range(2):
        controller = AllStepsSyncChecked(model, config(2, "rejection"))
        graphs = controller.warmup()
        runs.append([r.output_tokens for r in controller.generate(prompts, sampled)])
        greedy_tokens = [r.output_tokens for r in controller.generate(prompts, greedy)]
        assert controller.debug_view().num_cuda_graphs == graphs and controller.mixed_replays > 0
        assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks
    assert runs[0] == runs[1]  # reproducible for a seed
    plain = TextGenerationController(model, config(0)).generate(prompts, greedy)
    assert greedy_tokens == [r.output_tokens for r in plain]
