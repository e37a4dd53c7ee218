"""MTP step ops on CUDA: kernel == reference, CUDA-graph capture and replay with new inputs, no host sync."""

import pytest
import torch

from mtp_ctrl.triton_ops import (
    mamba_state_selective_copy,
    prepare_next_forward_pass,
    reference,
    rewind_kv_cache,
    verify_and_commit,
    verify_speculative_tokens,
)
from mtp_ctrl.triton_ops.fused_step import StepCommit
from mtp_ctrl.triton_ops.kv_rewind import max_released_blocks
from tests.functional.sync_checks import no_host_sync
from tests.unit.step_cases import assert_all_equal, clone_all, make_kv_state, make_token_case

CUDA = "cuda"


def _buffers(num_rows, num_spec):
    """(sampled_tokens_buf, last_accepted_seq_buf, accepted_tokens_per_request, accepted_token_counts)."""
    return [torch.full((num_rows,), -1, device=CUDA), torch.full((num_rows,), -1, device=CUDA),
            torch.full((num_rows, num_spec), -1, device=CUDA), torch.zeros(num_rows, dtype=torch.int64, device=CUDA)]


def _fused(op, case, buffers, kv_state, block_size, num_active=None, out=None):
    result = op(case.input_tokens, case.output_tokens, case.required_logit_indices, *buffers, *kv_state,
                case.num_decode_requests, case.num_prefill_requests, case.num_speculative_tokens, block_size,
                num_active, out)
    return list(result) + buffers + kv_state


def _mamba_case(num_layers, num_slots, num_spec, state_shape, num_requests, dtype, seed):
    generator = torch.Generator(device=CUDA).manual_seed(seed)
    intermediate = torch.randn((num_layers, num_slots, num_spec + 1) + state_shape, generator=generator,
                               device=CUDA).to(dtype)
    current = torch.randn((num_layers, num_slots) + state_shape, generator=generator, device=CUDA).to(dtype)
    state_idx = torch.randperm(num_slots, generator=generator, device=CUDA)[:num_requests]
    prefill_status = (torch.rand(num_requests, generator=generator, device=CUDA) < 0.2).int()
    accepted = torch.randint(0, num_spec + 1, (num_requests,), generator=generator, device=CUDA)
    return intermediate, current, prefill_status, state_idx, accepted


@pytest.mark.parametrize("num_decode,num_prefill,num_spec", [(0, 0, 3), (1, 0, 3), (37, 5, 3), (256, 0, 7), (3, 60, 1)])
def test_verify_and_prepare_match_reference(num_decode, num_prefill, num_spec):
    case = make_token_case(num_decode, num_prefill, num_spec, seed=num_decode, extra_rows=9, device=CUDA)
    args = (case.input_tokens, case.output_tokens, num_decode, num_prefill, num_spec)
    got = verify_speculative_tokens(*args)
    want = reference.verify_speculative_tokens(*args)
    assert_all_equal(list(got), list(want))
    buffers = [_buffers(case.num_requests + 3, num_spec) for _ in range(2)]
    for op, bufs in zip((prepare_next_forward_pass, reference.prepare_next_forward_pass), buffers):
        op(num_decode, case.output_tokens, case.required_logit_indices, want[0], want[1], want[2], *bufs, num_spec)
    assert_all_equal(buffers[0], buffers[1])


@pytest.mark.parametrize("num_spec,block_size", [(3, 16), (3, 4), (4, 4), (7, 2), (5, 1)])
@pytest.mark.parametrize("num_active", [None, 50, "tensor"])
def test_rewind_matches_reference(num_spec, block_size, num_active):
    num_requests = 64
    if num_active == "tensor":
        num_active = torch.tensor([41], device=CUDA, dtype=torch.int32)
    generator = torch.Generator().manual_seed(num_spec * 100 + block_size)
    accepted = torch.randint(0, num_spec + 1, (num_requests,), generator=generator).to(CUDA)
    prefill = (torch.rand(num_requests, generator=generator) < 0.2).long().to(CUDA)
    state = make_kv_state(num_requests, num_spec, block_size, seed=block_size, views=True, device=CUDA)
    want_state = clone_all(state)
    got = rewind_kv_cache(accepted, prefill, *state, num_spec, block_size, num_active)
    want = reference.rewind_kv_cache(accepted, prefill, *want_state, num_spec, block_size, num_active)
    assert_all_equal(list(got) + state, list(want) + want_state)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("state_shape", [(4, 8448), (64, 64, 128), (3, 5)])
def test_mamba_copy_matches_reference(dtype, state_shape):
    intermediate, current, prefill, state_idx, accepted = _mamba_case(2, 48, 3, state_shape, 33, dtype, seed=0)
    want = current.clone()
    reference.mamba_state_selective_copy(intermediate, want, prefill, state_idx, accepted, 2)
    mamba_state_selective_copy(intermediate, current, prefill, state_idx, accepted.int(), 2)
    assert torch.equal(current, want)


def test_mamba_copy_from_strided_views():
    storage = torch.randn(40, 4, 3, 16, 64, device=CUDA)  # (M, S + 1, L, *state) storage
    intermediate = storage.permute(2, 0, 1, 3, 4)[:, 2:, :]  # (L, M - 2, S + 1, *state) view
    current = torch.randn(38, 3, 16, 64, device=CUDA).transpose(0, 1)  # (L, M - 2, *state) view
    prefill = torch.tensor([0, 0, 1, 0], device=CUDA)
    state_idx = torch.tensor([5, 0, 7, 37], device=CUDA)
    accepted = torch.tensor([3, 0, 2, 1], device=CUDA)
    want = current.clone()
    reference.mamba_state_selective_copy(intermediate, want, prefill, state_idx, accepted, 3)
    mamba_state_selective_copy(intermediate, current, prefill, state_idx, accepted, 3)
    assert torch.equal(current, want)


@pytest.mark.parametrize("num_decode,num_prefill,num_spec,block_size", [(64, 0, 3, 16), (30, 7, 5, 2), (1, 0, 3, 64)])
@pytest.mark.parametrize("num_active", [None, "int", "tensor"])
def test_fused_matches_reference(num_decode, num_prefill, num_spec, block_size, num_active):
    case = make_token_case(num_decode, num_prefill, num_spec, seed=1, extra_rows=200, device=CUDA)
    if num_active == "int":
        num_active = case.num_requests // 2
    elif num_active == "tensor":
        num_active = torch.tensor(case.num_requests - 1, device=CUDA)
    kv_state = make_kv_state(case.num_requests, num_spec, block_size, seed=1, dtype=torch.int32, device=CUDA)
    buffers = _buffers(case.num_requests, num_spec)
    got = _fused(verify_and_commit, case, clone_all(buffers), clone_all(kv_state), block_size, num_active)
    want = _fused(reference.verify_and_commit, case, clone_all(buffers), clone_all(kv_state), block_size, num_active)
    assert_all_equal(got, want)


def test_every_op_runs_without_host_sync():
    num_spec, block_size = 3, 4
    case = make_token_case(16, 4, num_spec, seed=2, device=CUDA)
    kv_state = make_kv_state(20, num_spec, block_size, seed=2, device=CUDA)
    buffers = _buffers(20, num_spec)
    num_active = torch.tensor([17], device=CUDA)
    mamba = _mamba_case(2, 32, num_spec, (4, 256), 20, torch.bfloat16, seed=2)

    def step():
        last, mask, tokens = verify_speculative_tokens(case.input_tokens, case.output_tokens, 16, 4, num_spec)
        prepare_next_forward_pass(16, case.output_tokens, case.required_logit_indices, last, mask, tokens,
                                  *buffers, num_spec)
        rewind_kv_cache(buffers[3], mamba[2], *kv_state, num_spec, block_size, num_active)
        rewind_kv_cache(buffers[3], mamba[2], *kv_state, num_spec, block_size, 12)
        mamba_state_selective_copy(*mamba, 2)
        _fused(verify_and_commit, case, buffers, kv_state, block_size, num_active)
        _fused(verify_and_commit, case, buffers, kv_state, block_size, 9)

    step()  # compile every kernel first
    torch.cuda.synchronize()
    with no_host_sync():
        step()
    torch.cuda.synchronize()


def _capture(fn):
    """Warm up ``fn`` on a side stream, then capture it in a CUDA graph (no host sync allowed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with no_host_sync(), torch.cuda.graph(graph):
        fn()
    return graph


@pytest.mark.parametrize("num_spec,block_size", [(3, 4), (5, 2)])
def test_fused_op_replays_from_a_cuda_graph_with_a_changing_batch(num_spec, block_size):
    num_decode, num_prefill = 12, 4  # the bucket: 16 request slots
    num_requests = num_decode + num_prefill
    static_case = make_token_case(num_decode, num_prefill, num_spec, seed=0, extra_rows=8, device=CUDA)
    static_buffers = _buffers(num_requests, num_spec)
    static_state = make_kv_state(num_requests, num_spec, block_size, seed=0, device=CUDA)
    static_active = torch.tensor([num_requests], device=CUDA)
    width = max_released_blocks(num_spec, block_size)
    release = (num_requests,) if width == 1 else (num_requests, width)
    out = StepCommit(torch.empty(num_requests, dtype=torch.int64, device=CUDA),
                     torch.empty(static_case.input_tokens.shape[0], dtype=torch.bool, device=CUDA),
                     torch.empty(release, dtype=torch.int64, device=CUDA),
                     torch.empty(release, dtype=torch.bool, device=CUDA))
    graph = _capture(lambda: _fused(verify_and_commit, static_case, static_buffers, static_state, block_size,
                                    static_active, out))
    for replay, real_count in enumerate([16, 11, 3, 0, 16]):
        case = make_token_case(num_decode, num_prefill, num_spec, seed=replay + 1, extra_rows=8, device=CUDA)
        buffers = _buffers(num_requests, num_spec)
        state = make_kv_state(num_requests, num_spec, block_size, seed=replay + 1, device=CUDA)
        want = _fused(reference.verify_and_commit, case, clone_all(buffers), clone_all(state), block_size,
                      real_count)
        for static, new in zip([static_case.input_tokens, static_case.output_tokens,
                                static_case.required_logit_indices] + static_buffers + static_state,
                               [case.input_tokens, case.output_tokens, case.required_logit_indices] + buffers + state):
            static.copy_(new)
        static_active.fill_(real_count)
        graph.replay()
        torch.cuda.synchronize()
        assert_all_equal(list(out) + static_buffers + static_state, want)


def test_three_separate_ops_replay_from_a_cuda_graph():
    num_decode, num_prefill, num_spec, block_size = 10, 2, 3, 4
    num_requests = num_decode + num_prefill
    static_case = make_token_case(num_decode, num_prefill, num_spec, seed=0, device=CUDA)
    static_buffers = _buffers(num_requests, num_spec)
    static_state = make_kv_state(num_requests, num_spec, block_size, seed=0, device=CUDA)
    prefill_status = (torch.arange(num_requests, device=CUDA) >= num_decode).int()
    static_active = torch.tensor(num_requests, device=CUDA)
    outputs = {}

    def step(ops, case, buffers, state, num_active):
        verify, prepare, rewind = ops
        last, mask, tokens = verify(case.input_tokens, case.output_tokens, num_decode, num_prefill, num_spec)
        prepare(num_decode, case.output_tokens, case.required_logit_indices, last, mask, tokens, *buffers, num_spec)
        blocks, remove = rewind(buffers[3], prefill_status, *state, num_spec, block_size, num_active)
        return [last, mask, blocks, remove]

    kernels = (verify_speculative_tokens, prepare_next_forward_pass, rewind_kv_cache)
    references = (reference.verify_speculative_tokens, reference.prepare_next_forward_pass,
                  reference.rewind_kv_cache)
    graph = _capture(lambda: outputs.update(
        result=step(kernels, static_case, static_buffers, static_state, static_active)))
    for replay, real_count in enumerate([12, 7, 12]):
        case = make_token_case(num_decode, num_prefill, num_spec, seed=replay + 1, device=CUDA)
        buffers = _buffers(num_requests, num_spec)
        state = make_kv_state(num_requests, num_spec, block_size, seed=replay + 1, device=CUDA)
        want_buffers, want_state = clone_all(buffers), clone_all(state)
        want = step(references, case, want_buffers, want_state, real_count)
        for static, new in zip([static_case.input_tokens, static_case.output_tokens,
                                static_case.required_logit_indices] + static_buffers + static_state,
                               [case.input_tokens, case.output_tokens, case.required_logit_indices] + buffers + state):
            static.copy_(new)
        static_active.fill_(real_count)
        graph.replay()
        torch.cuda.synchronize()
        assert_all_equal(outputs["result"] + static_buffers + static_state, want + want_buffers + want_state)
