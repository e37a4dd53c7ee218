"""Paged KV write and paged attention on CUDA in bf16: kernel == reference == dense SDPA, CUDA graphs."""

import pytest
import torch

from mtp_ctrl.triton_ops import paged_attention, reference, write_kv_cache
from tests.functional.sync_checks import no_host_sync
from tests.unit.paged_attention_cases import dense_attention, make_paged_case, random_mixed_lengths

BF16_TOL = dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("num_kv_splits", [None, 1, 4])
def test_mixed_batch_bf16(head_dim, num_kv_splits):
    q_lens = [4, 300, 1, 0, 77, 8]
    seq_lens = [2000, 300, 513, 0, 1077, 64]
    case = make_paged_case(q_lens, seq_lens, num_query_heads=32, num_kv_heads=8, head_dim=head_dim,
                           block_size_tokens=16, dtype=torch.bfloat16, device="cuda", padding_rows=5)
    expected = dense_attention(case)
    out = paged_attention(*case.op_args(), max_query_len=300, max_seq_len=2000, num_kv_splits=num_kv_splits)
    torch.testing.assert_close(out.float(), expected, **BF16_TOL)
    torch.testing.assert_close(reference.paged_attention(*case.op_args()).float(), expected, **BF16_TOL)
    assert out[-5:].abs().sum() == 0


@pytest.mark.parametrize("shape", [(2, 32, 128, 512), (4, 40, 64, 512), (3, 9, 16, 128)])
def test_split_combine_large_and_small_partials(shape):
    """The combine's large tile (MLA's 128 heads x 512 dims at batch 32: whole rows, 8 warps) and
    its small one merge random partials as torch does; padding rows' partials are NaN and their
    output is left alone."""
    from mtp_ctrl.triton_ops.paged_attn import combine_kv_splits

    num_splits, num_tokens, num_heads, head_dim = shape
    valid_tokens = num_tokens - 3
    generator = torch.Generator(device="cuda").manual_seed(num_tokens)
    acc = torch.randn(shape, device="cuda", generator=generator)
    split_max = 4 * torch.randn(shape[:3], device="cuda", generator=generator)
    split_sum = torch.rand(shape[:3], device="cuda", generator=generator) + 0.5
    split_max[1, 2], split_sum[1, 2], acc[1, 2] = float("-inf"), 0.0, 0.0  # an empty split
    for tensor in (acc, split_max, split_sum):
        tensor[:, valid_tokens:] = float("nan")
    starts = torch.tensor([0, 1, valid_tokens], dtype=torch.int32, device="cuda")
    weight = torch.exp2(split_max - split_max.amax(0))[..., None]
    expected = (acc * weight).sum(0) / (split_sum[..., None] * weight).sum(0)
    out = torch.full(shape[1:], 3.0, dtype=torch.bfloat16, device="cuda")
    combine_kv_splits(acc, split_max, split_sum, starts, out)
    torch.testing.assert_close(out[:valid_tokens].float(), expected[:valid_tokens], atol=1e-2, rtol=1e-2)
    assert (out[valid_tokens:] == 3.0).all()


@pytest.mark.parametrize("seed", range(3))
def test_random_batches_fp32(seed):
    generator = torch.Generator().manual_seed(seed)
    q_lens, seq_lens = random_mixed_lengths(generator, num_requests=16, max_context=700)
    case = make_paged_case(q_lens, seq_lens, num_query_heads=12, num_kv_heads=4, head_dim=128,
                           block_size_tokens=32, device="cuda", seed=seed)
    torch.testing.assert_close(paged_attention(*case.op_args()), dense_attention(case), atol=1e-4, rtol=1e-4)


def test_kv_write_matches_reference_bf16():
    num_tokens, num_kv_heads, head_dim = 300, 8, 128
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    caches = [torch.zeros(40, 16, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    slots = torch.randperm(40 * 16, device="cuda")[:num_tokens]
    slots[::7] = -1
    write_kv_cache(key, value, caches[0], caches[1], slots)
    reference.write_kv_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_decode_step_in_cuda_graph_without_host_sync():
    """Capture write + attention for a decode batch, then replay with new queries and keys."""
    batch, rows_per_request, num_kv_heads, head_dim = 8, 4, 8, 128
    case = make_paged_case([rows_per_request] * batch, [1000 + 37 * b for b in range(batch)],
                           num_query_heads=32, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           block_size_tokens=16, dtype=torch.bfloat16, device="cuda")
    num_rows = batch * rows_per_request
    # slot of each row: its position in its request's blocks
    positions = case.seq_lens.long().repeat_interleave(rows_per_request) - rows_per_request + torch.arange(
        rows_per_request, device="cuda").repeat(batch)  # [T]
    request_of_row = torch.arange(batch, device="cuda").repeat_interleave(rows_per_request)  # [T]
    block_ids = case.block_table[request_of_row, positions // 16].long()
    slot_mapping = block_ids * 16 + positions % 16  # [T] int64
    new_key = torch.empty(num_rows, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    new_value = torch.empty_like(new_key)

    def step():
        write_kv_cache(new_key, new_value, case.key_cache, case.value_cache, slot_mapping)
        return paged_attention(*case.op_args(), max_query_len=rows_per_request, max_seq_len=2000)

    new_key.normal_()
    new_value.normal_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with no_host_sync():
        with torch.cuda.graph(graph):
            graph_out = step()
    for _ in range(2):
        case.query.normal_()
        new_key.normal_()
        new_value.normal_()
        graph.replay()
        torch.cuda.synchronize()
        expected_cache = (case.key_cache.clone(), case.value_cache.clone())
        want = reference.paged_attention(*case.op_args())
        torch.testing.assert_close(graph_out.float(), want.float(), **BF16_TOL)
        reference.write_kv_cache(new_key, new_value, *expected_cache, slot_mapping)
        assert torch.equal(expected_cache[0], case.key_cache)
