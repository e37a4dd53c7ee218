"""paged_attention: Triton kernel (interpreter) == torch reference == dense SDPA on unpaged K/V."""

import pytest
import torch

from mtp_ctrl.triton_ops import paged_attention, reference
from tests.unit.paged_attention_cases import (dense_attention, make_paged_case, nan_filled_empty,
                                               random_mixed_lengths)

TOL = dict(atol=2e-5, rtol=2e-5)


def _check_all_paths(case, **hints):
    expected = dense_attention(case)
    ref_out = reference.paged_attention(*case.op_args(), **hints)
    kernel_out = paged_attention(*case.op_args(), **hints)
    torch.testing.assert_close(ref_out, expected, **TOL)
    torch.testing.assert_close(kernel_out, expected, **TOL)


def test_reference_hand_worked_single_row():
    # One request, one kv head, D = 1: row at position 1 sees keys [1, 0] -> scores [2, 0].
    case = make_paged_case([1], [2], num_query_heads=1, num_kv_heads=1, head_dim=1, block_size_tokens=2)
    block = int(case.block_table[0, 0])
    case.key_cache[block, :, 0, 0] = torch.tensor([1.0, 0.0])
    case.value_cache[block, :, 0, 0] = torch.tensor([10.0, 20.0])
    case.query[0, 0, 0] = 2.0
    case.softmax_scale = 1.0
    weight = torch.softmax(torch.tensor([2.0, 0.0]), dim=0)
    want = weight[0] * 10.0 + weight[1] * 20.0
    torch.testing.assert_close(reference.paged_attention(*case.op_args())[0, 0, 0], want)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_query_heads,num_kv_heads", [(4, 2), (3, 1), (2, 2)])
def test_mixed_prefill_decode_matches_dense(head_dim, num_query_heads, num_kv_heads):
    q_lens = [4, 11, 1, 0, 6]  # decode 1 + 3, prefill chunk, plain decode, padding, full prompt
    seq_lens = [37, 20, 9, 0, 6]
    case = make_paged_case(q_lens, seq_lens, num_query_heads=num_query_heads, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, block_size_tokens=8, padding_rows=3, seed=head_dim)
    _check_all_paths(case)


@pytest.mark.parametrize("num_kv_splits", [2, 3, 32])
def test_split_kv_matches_dense(num_kv_splits):
    """32 splits of 150 tokens: most splits of the short requests see nothing (empty partials), and
    the combine reads splits in chunks of the head dim."""
    case = make_paged_case([4, 2, 1], [150, 70, 3], num_query_heads=4, num_kv_heads=2, head_dim=32,
                           block_size_tokens=16, seed=num_kv_splits)
    expected = dense_attention(case)
    # each tile cuts its own context into the splits: 150 tokens in 2 or 3 pieces rounded to the kv tile
    out = paged_attention(*case.op_args(), max_query_len=4, max_seq_len=150, num_kv_splits=num_kv_splits)
    torch.testing.assert_close(out, expected, **TOL)


def test_many_splits_with_a_bound_far_above_the_contexts():
    """A CUDA graph bounds the context by max_model_len: 16 splits of contexts of 9-64 tokens, so
    most splits of a tile are empty (a split is whole kv tiles); odd head dim and 5 query heads per
    kv head."""
    case = make_paged_case([1, 3, 0, 2], [40, 9, 0, 64], num_query_heads=10, num_kv_heads=2, head_dim=24,
                           block_size_tokens=8, seed=7)
    expected = dense_attention(case)
    out = paged_attention(*case.op_args(), max_query_len=3, max_seq_len=1024, num_kv_splits=16)
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("seed", range(3))
def test_few_rows_over_long_cached_contexts(seed):
    """A prefix-cache hit: a few prefill rows over a long cached context (ending mid-block), beside
    decode rows, a padding request and padding rows, in a graph whose bound (2048) is far above every
    context; each tile splits its own context, 2-16 ways."""
    generator = torch.Generator().manual_seed(seed)

    def draw(low, high):
        return int(torch.randint(low, high + 1, (1,), generator=generator))

    hit_rows, hit_context = draw(1, 12), draw(130, 330)
    decode_context = draw(3, 200)
    q_lens, seq_lens = [3, hit_rows, 0, draw(1, 3)], [decode_context, hit_context, 0, draw(3, 70)]
    case = make_paged_case(q_lens, seq_lens, num_query_heads=4, num_kv_heads=2, head_dim=16,
                           block_size_tokens=16 if seed else 5, padding_rows=draw(0, 4), seed=seed)
    out = paged_attention(*case.op_args(), max_query_len=16, max_seq_len=2048, num_kv_splits=(2, 7, 16)[seed])
    torch.testing.assert_close(out, dense_attention(case), **TOL)


@pytest.mark.parametrize("seed", range(3))
def test_split_combine_random_splits_rows_and_padding(seed):
    """The combine reads the splits in chunks and merges them online: random split counts over
    contexts long enough that later chunks hold data (a split is whole 64-token kv tiles) and,
    with sharp scores, often a row's max (the accumulator rescaled across chunks); random rows
    (prefill chunks, decode rows, padding requests, padding rows) so the last row tile is partial;
    odd head dims and group sizes; on NaN-filled memory, so a row the combine reads but no split
    wrote would show."""
    generator = torch.Generator().manual_seed((101, 103, 104)[seed])  # draws with several long contexts

    def draw(low, high):
        return int(torch.randint(low, high + 1, (1,), generator=generator))

    num_requests = draw(1, 4)
    q_lens = [draw(0, 9) for _ in range(num_requests)]
    seq_lens = [q_len + draw(0, 600) if q_len else 0 for q_len in q_lens]
    num_kv_heads, group = ((1, 4), (2, 3), (2, 1))[seed]
    case = make_paged_case(q_lens, seq_lens, num_query_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                           head_dim=(16, 24, 40)[seed], block_size_tokens=(16, 5, 8)[seed],
                           padding_rows=draw(0, 5), seed=seed)
    case.softmax_scale = 1.0
    with nan_filled_empty():
        out = paged_attention(*case.op_args(), max_query_len=max(q_lens + [1]), max_seq_len=1024,
                              num_kv_splits=(5, 17, 9)[seed])
    torch.testing.assert_close(out, dense_attention(case), **TOL)


@pytest.mark.parametrize("wanted_programs", [1, 64])
def test_split_combine_tiles_on_random_partials(wanted_programs):
    """Both combine tiles (``combine_tile``: whole 512-dim rows when the partials outgrow two small
    tiles a wanted program, here forced by 1 wanted program) merge random partials exactly: MLA's
    512-dim rows and an odd head dim, empty splits (max -inf, sum 0), padding rows left alone
    (their partials NaN, their output untouched)."""
    from mtp_ctrl.triton_ops.paged_attn import combine_tile, launch_combine

    generator = torch.Generator().manual_seed(7)
    for num_splits, num_tokens, num_heads, head_dim, valid_tokens in ((2, 5, 4, 512, 4), (3, 6, 2, 40, 5)):
        acc = torch.randn((num_splits, num_tokens, num_heads, head_dim), generator=generator)
        split_max = 4 * torch.randn((num_splits, num_tokens, num_heads), generator=generator)
        split_sum = torch.rand((num_splits, num_tokens, num_heads), generator=generator) + 0.5
        split_max[0, 1], split_sum[0, 1], acc[0, 1] = float("-inf"), 0.0, 0.0  # an empty split
        for tensor in (acc, split_max, split_sum):
            tensor[:, valid_tokens:] = float("nan")
        starts = torch.tensor([0, 2, valid_tokens], dtype=torch.int32)
        weight = torch.exp2(split_max - split_max.amax(0))[..., None]  # [splits, T, H, 1]
        expected = (acc * weight).sum(0) / (split_sum[..., None] * weight).sum(0)
        out = torch.full((num_tokens, num_heads, head_dim), 3.0)
        tile = combine_tile(num_splits, num_tokens * num_heads, head_dim, wanted_programs)
        assert (tile[1] == 512) == (wanted_programs == 1 and head_dim == 512), tile
        launch_combine(acc, split_max, split_sum, starts, out, *tile)
        torch.testing.assert_close(out[:valid_tokens], expected[:valid_tokens], atol=1e-5, rtol=1e-5)
        assert (out[valid_tokens:] == 3.0).all()


def test_decode_hint_and_odd_block_size():
    case = make_paged_case([4, 4, 4], [5, 33, 18], num_query_heads=8, num_kv_heads=2, head_dim=64,
                           block_size_tokens=5, seed=3)
    _check_all_paths(case, max_query_len=4, max_seq_len=33)


@pytest.mark.parametrize("seed", range(4))
def test_random_batches(seed):
    generator = torch.Generator().manual_seed(seed)
    q_lens, seq_lens = random_mixed_lengths(generator, num_requests=4, max_context=40)
    case = make_paged_case(q_lens, seq_lens, num_query_heads=4, num_kv_heads=2, head_dim=16,
                           block_size_tokens=4, padding_rows=seed, seed=seed)
    _check_all_paths(case)


@pytest.mark.parametrize("seed", range(6))
def test_flat_tiles_random_mixed_steps_on_dirty_memory(seed):
    """Requests with more rows than one query tile (8 here: 8 query heads share 1 kv head) take the
    flat grid: prefill chunks of 9-40 rows among decode requests of 1-4 rows, empty requests and
    padding rows, with the graph's bounds (max_query_len up to every row) or none, 1 or 3 splits,
    on NaN-filled memory: equal to dense SDPA, padding rows exactly 0."""
    generator = torch.Generator().manual_seed(seed)
    q_lens, seq_lens = [], []
    for _ in range(int(torch.randint(1, 7, (), generator=generator))):
        kind = int(torch.randint(0, 3, (), generator=generator))
        q = (0, int(torch.randint(1, 5, (), generator=generator)),
             int(torch.randint(9, 41, (), generator=generator)))[kind]
        q_lens.append(q)
        seq_lens.append(q + (int(torch.randint(0, 30, (), generator=generator)) if q else 0))
    q_lens[int(torch.randint(0, len(q_lens), (), generator=generator))] = 17  # at least one request of 3 tiles
    seq_lens = [max(s, q) for s, q in zip(seq_lens, q_lens)]
    padding_rows = int(torch.randint(0, 21, (), generator=generator))
    case = make_paged_case(q_lens, seq_lens, num_query_heads=8, num_kv_heads=1, head_dim=16, block_size_tokens=4,
                           padding_rows=padding_rows, seed=seed)
    hints = [{}, dict(max_query_len=sum(q_lens) + padding_rows, max_seq_len=80),
             dict(max_query_len=max(q_lens))][seed % 3]
    expected = dense_attention(case)
    with nan_filled_empty():
        out = paged_attention(*case.op_args(), num_kv_splits=(None, 1, 3)[seed % 3], **hints)
    torch.testing.assert_close(out, expected, **TOL)
    assert not out[sum(q_lens):].any()


def test_padding_rows_and_requests_are_zero():
    case = make_paged_case([0, 3, 0], [0, 5, 0], num_query_heads=2, num_kv_heads=1, head_dim=16,
                           block_size_tokens=4, padding_rows=2)
    out = paged_attention(*case.op_args())
    assert out[3:].abs().sum() == 0
    assert out[:3].abs().sum() > 0


@pytest.mark.parametrize("num_kv_splits", [1, 3])
@pytest.mark.parametrize("q_lens,seq_lens,padding_rows", [
    ([0, 3, 0], [0, 5, 0], 2), ([2, 1], [9, 4], 1100), ([1, 1, 1], [3, 7, 2], 0), ([0, 0], [0, 0], 5),
])
def test_padding_rows_are_zeroed_by_the_kernel_on_dirty_memory(q_lens, seq_lens, padding_rows, num_kv_splits):
    """The output is not zero-filled first: the last request's programs zero the rows past every
    request (a share each, in 1024-element stores). With every float torch.empty NaN-filled, the
    kernel still equals the reference, padding rows exactly 0."""
    case = make_paged_case(q_lens, seq_lens, num_query_heads=4, num_kv_heads=2, head_dim=16, block_size_tokens=4,
                           padding_rows=padding_rows, seed=len(q_lens) + padding_rows)
    with nan_filled_empty():
        out = paged_attention(*case.op_args(), num_kv_splits=num_kv_splits)
    torch.testing.assert_close(out, reference.paged_attention(*case.op_args()), **TOL)
    assert not out[sum(q_lens):].any()


def test_empty_inputs():
    case = make_paged_case([], [], num_query_heads=2, num_kv_heads=1, head_dim=16, block_size_tokens=4)
    assert paged_attention(*case.op_args()).shape == (0, 2, 16)
    assert reference.paged_attention(*case.op_args()).shape == (0, 2, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_half_precision(dtype):
    case = make_paged_case([3, 1], [10, 7], num_query_heads=4, num_kv_heads=2, head_dim=64,
                           block_size_tokens=4, dtype=dtype)
    out = reference.paged_attention(*case.op_args())
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), dense_attention(case), atol=2e-2, rtol=2e-2)


def test_kernel_fp16():
    case = make_paged_case([4, 9], [12, 9], num_query_heads=4, num_kv_heads=2, head_dim=64,
                           block_size_tokens=8, dtype=torch.float16, seed=5)
    out = paged_attention(*case.op_args())
    torch.testing.assert_close(out.float(), dense_attention(case), atol=1e-2, rtol=1e-2)


def _bad_args(case, **changes):
    args = dict(zip(["query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc",
                     "softmax_scale"], case.op_args()))
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda c: dict(query=c.query[:, :3]), ValueError, "not a multiple"),
        (lambda c: dict(query=c.query.double()), TypeError, "query"),
        (lambda c: dict(key_cache=c.key_cache.half()), TypeError, "key_cache"),
        (lambda c: dict(value_cache=c.value_cache[:1]), ValueError, "value_cache"),
        (lambda c: dict(block_table=c.block_table.float()), TypeError, "block_table"),
        (lambda c: dict(seq_lens=c.seq_lens[:1]), ValueError, "seq_lens"),
        (lambda c: dict(query_start_loc=c.query_start_loc[:-1]), ValueError, "query_start_loc"),
        (lambda c: dict(softmax_scale=0.0), ValueError, "softmax_scale"),
        (lambda c: dict(key_cache=c.key_cache[:, :0], value_cache=c.value_cache[:, :0]), ValueError,
         "block_size_tokens"),
        (lambda c: dict(block_table=c.block_table[:, :0]), ValueError, "block_table"),
        (lambda c: dict(query=torch.cat([c.query, c.query], dim=-1)[..., ::2]), ValueError, "contiguous"),
    ],
)
def test_bad_inputs(change, error, match):
    case = make_paged_case([2, 1], [4, 3], num_query_heads=4, num_kv_heads=2, head_dim=16, block_size_tokens=4)
    with pytest.raises(error, match=match):
        paged_attention(**_bad_args(case, **change(case)))


def test_bad_hints():
    case = make_paged_case([2], [4], num_query_heads=2, num_kv_heads=1, head_dim=16, block_size_tokens=4)
    with pytest.raises(ValueError, match="num_kv_splits"):
        paged_attention(*case.op_args(), num_kv_splits=0)
    with pytest.raises(TypeError, match="max_query_len"):
        paged_attention(*case.op_args(), max_query_len=2.0)


def test_split_combine_rejects_bad_partials():
    """The split combine is shared by paged and MLA attention: mismatched partials get an error
    naming the argument, never an out-of-bounds read."""
    from mtp_ctrl.triton_ops.paged_attn import combine_kv_splits

    splits, tokens, heads, dims = 3, 4, 2, 8
    acc = torch.zeros(splits, tokens, heads, dims)
    stats = torch.zeros(splits, tokens, heads)
    starts = torch.tensor([0, 4], dtype=torch.int32)
    out = torch.zeros(tokens, heads, dims)
    with pytest.raises(ValueError, match="partial_max"):
        combine_kv_splits(acc, stats[:, :3], stats, starts, out)
    with pytest.raises(TypeError, match="partial_sum"):
        combine_kv_splits(acc, stats, stats.half(), starts, out)
    with pytest.raises(ValueError, match="output"):
        combine_kv_splits(acc, stats, stats, starts, out[:, :, :4])
    with pytest.raises(ValueError, match="partial_acc must be contiguous"):
        combine_kv_splits(acc.transpose(1, 2).contiguous().transpose(1, 2), stats, stats, starts, out)
    with pytest.raises(TypeError, match="query_start_loc"):
        combine_kv_splits(acc, stats, stats, starts.float(), out)
