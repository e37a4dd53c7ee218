"""verify_and_commit: one kernel (interpreter) == the reference == the three separate ops in a row."""

import pytest
import torch

from mtp_ctrl.triton_ops import (
    prepare_next_forward_pass,
    reference,
    rewind_kv_cache,
    verify_and_commit,
    verify_speculative_tokens,
)
from mtp_ctrl.triton_ops._step_common import request_row_tile
from mtp_ctrl.triton_ops.fused_step import StepCommit
from mtp_ctrl.triton_ops.kv_rewind import max_released_blocks
from tests.unit.step_cases import assert_all_equal, clone_all, make_kv_state, make_token_case

OPS = [verify_and_commit, reference.verify_and_commit]
UNTOUCHED = 77


def _buffers(num_rows, num_spec, dtype=torch.int64):
    """(sampled_tokens_buf, last_accepted_seq_buf, accepted_tokens_per_request, accepted_token_counts)."""
    return [torch.full((num_rows,), UNTOUCHED, dtype=dtype), torch.full((num_rows,), UNTOUCHED, dtype=dtype),
            torch.full((num_rows, num_spec), UNTOUCHED, dtype=dtype), torch.full((num_rows,), UNTOUCHED, dtype=dtype)]


def _run(op, case, buffers, kv_state, block_size, num_active=None, out=None, input_tokens=None):
    """Call ``op``; return its outputs followed by every tensor it may write."""
    result = op(case.input_tokens if input_tokens is None else input_tokens, case.output_tokens,
                case.required_logit_indices, *buffers, *kv_state, case.num_decode_requests,
                case.num_prefill_requests, case.num_speculative_tokens, block_size, num_active, out)
    return list(result) + buffers + kv_state


def _kv_state_of(kv_lens, block_ids, block_size, max_blocks):
    kv_len = torch.tensor(kv_lens)
    ids = torch.full((len(kv_lens), max_blocks), -1)
    for request, blocks in enumerate(block_ids):
        ids[request, : len(blocks)] = torch.tensor(blocks)
    counts = (kv_len - 1) // block_size + 1
    return [(kv_len - 1) % block_size, kv_len, counts, ids.gather(1, (counts - 1)[:, None]).squeeze(1), ids]


def _known_case():
    # S = 2, block size 2: decode requests a, b, c accept 1, 2, 0 drafts; d and e are prefill rows.
    case = make_token_case(3, 2, 2, seed=0)
    case.input_tokens = torch.tensor([105, 106, 107, 203, 204, 205, 306, 307, 308, 402, 504])
    case.output_tokens = torch.tensor([106, 999, 998, 204, 205, 206, 777, 308, 309, 403, 505])
    case.required_logit_indices = torch.arange(11) + 100
    kv_state = _kv_state_of([7, 8, 6, 3, 1], [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32], [40, 41], [50]],
                            block_size=2, max_blocks=4)
    return case, kv_state


@pytest.mark.parametrize("op", OPS)
def test_known_answer_three_decode_two_prefill(op):
    case, kv_state = _known_case()
    buffers = _buffers(6, 2)
    last_one, mask, blocks, remove = _run(op, case, buffers, kv_state, 2)[:4]
    assert last_one.tolist() == [1, 5, 6, 9, 10]
    assert mask.tolist() == [True, True, False, True, True, True, True, False, False, True, True]
    sampled, last_seq, drafts, counts = buffers
    assert sampled.tolist() == [999, 206, 777, 403, 505, UNTOUCHED]
    assert last_seq.tolist() == [101, 105, 106, 109, 110, UNTOUCHED]
    assert drafts[:3].tolist() == [[106, -1], [204, 205], [-1, -1]] and (drafts[3:] == UNTOUCHED).all()
    assert counts.tolist() == [1, 2, 0, UNTOUCHED, UNTOUCHED, UNTOUCHED]
    # a rewinds 1 token back across a block boundary, b none, c 2 tokens (back into block 31)
    assert blocks.tolist() == [13, 23, 32, 41, 50] and remove.tolist() == [True, False, True, False, False]
    offset, kv_len, block_counts, last_id, ids = kv_state
    assert kv_len.tolist() == [6, 8, 4, 3, 1] and offset.tolist() == [1, 1, 1, 0, 0]
    assert block_counts.tolist() == [3, 4, 2, 2, 1] and last_id.tolist() == [12, 23, 31, 41, 50]
    assert ids[0].tolist() == [10, 11, 12, -1] and ids[2].tolist() == [30, 31, -1, -1]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("num_active", [4, torch.tensor([4])], ids=["int", "tensor"])
def test_known_answer_with_a_padding_slot(op, num_active):
    case, kv_state = _known_case()
    before = clone_all(kv_state)
    buffers = _buffers(6, 2)
    last_one, mask, blocks, remove = _run(op, case, buffers, kv_state, 2, num_active)[:4]
    assert last_one.tolist() == [1, 5, 6, 9, -1]
    assert mask.tolist() == [True, True, False, True, True, True, True, False, False, True, False]
    assert buffers[0][4] == UNTOUCHED and buffers[1][4] == UNTOUCHED
    assert blocks.tolist() == [13, 23, 32, 41, 0] and remove.tolist() == [True, False, True, False, False]
    for new, old in zip(kv_state, before):
        assert torch.equal(new[4], old[4])


@pytest.mark.parametrize("num_decode,num_prefill,num_spec,block_size", [(3, 2, 2, 2), (6, 0, 5, 2), (2, 3, 8, 1)])
def test_equals_the_three_separate_ops_in_a_row(num_decode, num_prefill, num_spec, block_size):
    case = make_token_case(num_decode, num_prefill, num_spec, seed=7, extra_rows=3)
    kv_state = make_kv_state(case.num_requests, num_spec, block_size, seed=7)
    buffers = _buffers(case.num_requests + 1, num_spec)
    separate_buffers, separate_state = clone_all(buffers), clone_all(kv_state)
    last_one, mask, tokens = verify_speculative_tokens(case.input_tokens, case.output_tokens, num_decode,
                                                       num_prefill, num_spec)
    prepare_next_forward_pass(num_decode, case.output_tokens, case.required_logit_indices, last_one, mask, tokens,
                              *separate_buffers, num_spec)
    accepted = torch.zeros(case.num_requests, dtype=torch.int64)
    accepted[:num_decode] = separate_buffers[3][:num_decode]
    is_prefill = (torch.arange(case.num_requests) >= num_decode).long()
    blocks, remove = rewind_kv_cache(accepted, is_prefill, *separate_state, num_spec, block_size)
    want = [last_one, mask, blocks, remove] + separate_buffers + separate_state
    for op in OPS:
        assert_all_equal(_run(op, case, clone_all(buffers), clone_all(kv_state), block_size), want)


@pytest.mark.parametrize(
    "num_decode,num_prefill,num_spec,block_size",
    [(1, 0, 1, 4), (0, 3, 3, 4), (3, 2, 0, 4), (5, 2, 3, 4), (7, 4, 6, 3), (40, 1, 3, 16), (9, 2, 8, 2), (4, 4, 4, 64)],
)
@pytest.mark.parametrize("padding", ["none", "int", "tensor"])
def test_random_cases_kernel_equals_reference(num_decode, num_prefill, num_spec, block_size, padding):
    for seed in range(2):
        case = make_token_case(num_decode, num_prefill, num_spec, seed=seed, extra_rows=3 * seed)
        num_requests = case.num_requests
        active = {"none": None, "int": num_requests - num_requests // 3,
                  "tensor": torch.tensor(max(num_requests - 2, 0))}[padding]
        dtype = (torch.int64, torch.int32)[seed]
        kv_state = make_kv_state(num_requests, num_spec, block_size, seed=seed, dtype=dtype, views=seed == 1)
        buffers = _buffers(num_requests + 2, num_spec, dtype)
        input_tokens = case.input_tokens[None, :] if seed == 1 else None  # [1, T] as the forward pass has it
        results = [_run(op, case, clone_all(buffers), clone_all(kv_state), block_size, active,
                        input_tokens=input_tokens) for op in OPS]
        assert_all_equal(results[0], results[1])


@pytest.mark.parametrize("num_spec,block_size", [(3, 4), (6, 2)])
def test_out_buffers_are_overwritten_and_returned(num_spec, block_size):
    case = make_token_case(4, 2, num_spec, seed=3, extra_rows=300)  # tail longer than one clearing tile
    kv_state = make_kv_state(6, num_spec, block_size, seed=3)
    width = max_released_blocks(num_spec, block_size)
    release = (6,) if width == 1 else (6, width)
    out = StepCommit(torch.full((6,), 123), torch.ones(case.input_tokens.shape[0], dtype=torch.bool),
                     torch.full(release, 123), torch.ones(release, dtype=torch.bool))
    want = _run(reference.verify_and_commit, case, _buffers(6, num_spec), clone_all(kv_state), block_size, 4)
    got = _run(verify_and_commit, case, _buffers(6, num_spec), clone_all(kv_state), block_size, 4, out)
    assert all(g.data_ptr() == o.data_ptr() for g, o in zip(got[:4], out))
    assert_all_equal(got, want)


@pytest.mark.parametrize("op", OPS)
def test_no_requests_clears_the_mask(op):
    case = make_token_case(0, 0, 3, seed=0, extra_rows=5)
    out = StepCommit(torch.zeros(0, dtype=torch.int64), torch.ones(5, dtype=torch.bool),
                     torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool))
    result = _run(op, case, _buffers(0, 3), make_kv_state(0, 3, 4, seed=0), 4, None, out)
    assert not result[1].any() and result[0].shape == (0,)


def _valid_args():
    case = make_token_case(2, 1, 2, seed=0)
    return [case.input_tokens, case.output_tokens, case.required_logit_indices, *_buffers(3, 2),
            *make_kv_state(3, 2, 4, seed=0), 2, 1, 2, 4, None, None]


def _out(num_rows=3, mask_rows=7, release=(3,), **changes):
    fields = dict(last_one_indices=torch.zeros(num_rows, dtype=torch.int64),
                  accepted_tokens_mask=torch.zeros(mask_rows, dtype=torch.bool),
                  blocks_to_release=torch.zeros(release, dtype=torch.int64),
                  remove_mask=torch.zeros(release, dtype=torch.bool))
    fields.update(changes)
    return StepCommit(**fields)


@pytest.mark.parametrize(
    "index,bad,error,match",
    [
        (0, lambda t: t.float(), TypeError, "input_tokens"),
        (0, lambda t: t[:5], ValueError, "input_tokens"),
        (1, lambda t: t.to("meta"), ValueError, "output_tokens"),
        (2, lambda t: t[:5], ValueError, "required_logit_indices"),
        (3, lambda t: t[:2], ValueError, "sampled_tokens_buf"),
        (4, lambda t: t.float(), TypeError, "last_accepted_seq_buf"),
        (5, lambda t: t[:, :1], ValueError, "accepted_tokens_per_request"),
        (6, lambda t: t[:1], ValueError, "accepted_token_counts"),
        (7, lambda t: t[:2], ValueError, "last_kv_block_offset"),
        (8, lambda t: t.float(), TypeError, "kv_length_offsets"),
        (9, lambda t: t.to("meta"), ValueError, "kv_block_counts"),
        (10, lambda t: t[:, None], ValueError, "last_kv_block_id"),
        (11, lambda t: t[:, :0], ValueError, "kv_block_ids"),
        (12, lambda n: -1, ValueError, "num_decode_requests"),
        (13, lambda n: 2, ValueError, "input_tokens"),
        (14, lambda s: -1, ValueError, "num_speculative_tokens"),
        (15, lambda b: 0, ValueError, "block_size_tokens"),
        (16, lambda n: 4, ValueError, "num_active_requests"),
        (16, lambda n: torch.tensor([1.0]), TypeError, "num_active_requests"),
        (17, lambda o: "out", TypeError, "out"),
        (17, lambda o: _out()[:3], TypeError, "out"),
        (17, lambda o: _out(num_rows=4), ValueError, "out.last_one_indices"),
        (17, lambda o: _out(mask_rows=8), ValueError, "out.accepted_tokens_mask"),
        (17, lambda o: _out(release=(3, 1)), ValueError, "out.blocks_to_release"),
        (17, lambda o: _out(remove_mask=torch.zeros(3, dtype=torch.int64)), TypeError, "out.remove_mask"),
        (17, lambda o: _out(blocks_to_release=torch.zeros(3, dtype=torch.int32)), TypeError, "out.blocks_to_release"),
    ],
)
def test_bad_arguments(index, bad, error, match):
    args = _valid_args()
    args[index] = bad(args[index])
    with pytest.raises(error, match=match):
        verify_and_commit(*args)


def test_request_row_tile_is_the_next_power_of_two_of_the_request_rows():
    assert [request_row_tile(num_spec) for num_spec in range(9)] == [2, 2, 4, 4, 8, 8, 8, 8, 16]


@pytest.mark.parametrize("op", OPS)
def test_keep_released_blocks_rewinds_lengths_but_keeps_every_block_id(op):
    """The overlapped controller's mode: the same lengths, offsets, counts and last ids as the
    releasing rewind (hand-worked in test_known_answer_three_decode_two_prefill), every id stays
    in the table and nothing is reported released."""
    case, kv_state = _known_case()
    ids_before = kv_state[4].clone()
    buffers = _buffers(6, 2)
    result = op(case.input_tokens, case.output_tokens, case.required_logit_indices, *buffers, *kv_state,
                case.num_decode_requests, case.num_prefill_requests, case.num_speculative_tokens, 2,
                keep_released_blocks=True)
    assert result.remove_mask.tolist() == [False] * 5
    offset, kv_len, block_counts, last_id, ids = kv_state
    assert kv_len.tolist() == [6, 8, 4, 3, 1] and offset.tolist() == [1, 1, 1, 0, 0]
    assert block_counts.tolist() == [3, 4, 2, 2, 1] and last_id.tolist() == [12, 23, 31, 41, 50]
    assert torch.equal(ids, ids_before)


@pytest.mark.parametrize("seed", range(6))
def test_keep_released_blocks_kernel_equals_reference(seed):
    generator = torch.Generator().manual_seed(seed)
    num_spec, block_size = int(torch.randint(1, 5, (1,), generator=generator)), int(torch.randint(1, 4, (1,), generator=generator))
    case = make_token_case(3, 2, num_spec, seed=seed)
    outputs = []
    for op in OPS:
        kv_state = make_kv_state(case.num_decode_requests + case.num_prefill_requests, num_spec, block_size, seed=seed)
        buffers = _buffers(6, num_spec)
        result = op(case.input_tokens, case.output_tokens, case.required_logit_indices, *buffers, *kv_state,
                    case.num_decode_requests, case.num_prefill_requests, num_spec, block_size,
                    keep_released_blocks=True)
        outputs.append(list(result) + buffers + kv_state)
    assert_all_equal(outputs[0], outputs[1])


def test_keep_released_blocks_must_be_a_bool():
    case, kv_state = _known_case()
    with pytest.raises(TypeError, match="keep_released_blocks"):
        verify_and_commit(case.input_tokens, case.output_tokens, case.required_logit_indices, *_buffers(6, 2),
                          *kv_state, 3, 2, 2, 2, keep_released_blocks=1)


@pytest.mark.parametrize("num_decode,num_prefill,num_spec,block_size", [(0, 2, 2, 4), (3, 2, 2, 2), (5, 1, 3, 4), (4, 0, 1, 3)])
@pytest.mark.parametrize("num_active", [None, "tensor"])
def test_decode_count_on_the_device_equals_the_host_split(num_decode, num_prefill, num_spec, block_size, num_active):
    """A mixed step replayed from a graph passes its decode count as a tensor and the grid as the
    bound: the results equal the call with the split as host ints (kernel and twin)."""
    for seed in range(2):
        case = make_token_case(num_decode, num_prefill, num_spec, seed=seed, extra_rows=num_prefill * num_spec + seed)
        num_requests = case.num_requests
        active = None if num_active is None else torch.tensor([max(num_requests - 1, 0)])
        kv_state = make_kv_state(num_requests, num_spec, block_size, seed=seed)
        buffers = _buffers(num_requests + 1, num_spec)
        want = _run(reference.verify_and_commit, case, clone_all(buffers), clone_all(kv_state), block_size, active)
        for op in OPS:
            got_buffers, got_state = clone_all(buffers), clone_all(kv_state)
            result = op(case.input_tokens, case.output_tokens, case.required_logit_indices, *got_buffers, *got_state,
                        num_requests, 0, num_spec, block_size, active, decode_count=torch.tensor([num_decode]))
            assert_all_equal(list(result) + got_buffers + got_state, want)


def test_decode_count_must_be_one_element():
    case, kv_state = _known_case()
    with pytest.raises(ValueError, match="decode_count"):
        verify_and_commit(case.input_tokens, case.output_tokens, case.required_logit_indices, *_buffers(6, 2),
                          *kv_state, 3, 2, 2, 2, decode_count=torch.tensor([1, 2]))


@pytest.mark.parametrize("num_decode,num_prefill,num_spec,block_size", [(3, 2, 2, 2), (5, 1, 3, 4), (0, 2, 1, 4), (6, 0, 6, 3)])
@pytest.mark.parametrize("num_padding", [0, 2])
def test_request_slots_equal_the_state_by_request(num_decode, num_prefill, num_spec, block_size, num_padding):
    """The KV state in scattered table slots (``request_slots``; padding requests share the scratch
    slot) gives what the state indexed by request gives, and no other slot changes."""
    case = make_token_case(num_decode, num_prefill, num_spec, seed=4, extra_rows=2)
    num_real = case.num_requests
    num_requests, num_slots = num_real + num_padding, num_real + 4  # the last slot is the scratch slot
    grid = dict(num_decode_requests=case.num_decode_requests, num_prefill_requests=case.num_prefill_requests + num_padding)
    compact = make_kv_state(num_requests, num_spec, block_size, seed=4)
    generator = torch.Generator().manual_seed(5)
    slots = torch.cat([torch.randperm(num_slots - 1, generator=generator)[:num_real],
                       torch.full((num_padding,), num_slots - 1)])
    scattered = [torch.randint(0, 9, (num_slots, *tensor.shape[1:]), generator=generator) for tensor in compact]
    for tensor, rows in zip(scattered, compact):
        tensor[slots[:num_real]] = rows[:num_real]
    active = torch.tensor([num_real])
    for op in OPS:
        want_buffers, want_state = _buffers(num_requests, num_spec), clone_all(compact)
        want = op(case.input_tokens, case.output_tokens, case.required_logit_indices, *want_buffers, *want_state,
                  *grid.values(), num_spec, block_size, active, keep_released_blocks=True)
        got_buffers, got_state = _buffers(num_requests, num_spec), clone_all(scattered)
        got = op(case.input_tokens, case.output_tokens, case.required_logit_indices, *got_buffers, *got_state,
                 *grid.values(), num_spec, block_size, active, keep_released_blocks=True, request_slots=slots)
        assert_all_equal(list(got) + got_buffers, list(want) + want_buffers)
        others = torch.ones(num_slots, dtype=torch.bool)
        others[slots[:num_real]] = False
        for got_rows, want_rows, before in zip(got_state, want_state, scattered):
            assert torch.equal(got_rows[slots[:num_real]], want_rows[:num_real])
            assert torch.equal(got_rows[others], before[others])


def _ragged_case(drafts, num_spec, seed):
    """Decode requests that ran ``1 + drafts[r]`` packed rows (ragged), their logits rows strided
    (``1 + S`` each; rows past ``s_r`` repeat row ``s_r`` with a masked draft, as the controller lays
    them out): (input tokens, output tokens, logits indices, query_start_loc) of the logits rows."""
    generator = torch.Generator().manual_seed(seed)
    stride, num_decode = num_spec + 1, len(drafts)
    starts = torch.zeros(num_decode + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(drafts, dtype=torch.int32) + 1, 0)
    depth = torch.arange(num_decode * stride) % stride
    request = torch.arange(num_decode * stride) // stride
    lengths = torch.tensor(drafts)[request]
    logits_indices = starts[:-1].long()[request] + torch.minimum(depth, lengths)  # [Nd * (1 + S)]
    output_tokens = torch.randint(0, 9, (num_decode * stride,), generator=generator)
    input_tokens = torch.randint(0, 9, (num_decode * stride,), generator=generator)
    copied = torch.rand(input_tokens.shape[0], generator=generator) < 0.7
    input_tokens[1:][copied[1:]] = output_tokens[:-1][copied[1:]]
    input_tokens[depth == 0] = 5
    input_tokens[depth > lengths] = -1  # drafts past s_r were not made: masked
    return input_tokens, output_tokens, logits_indices, starts


@pytest.mark.parametrize("seed", range(4))
def test_ragged_rows_rewind_the_rows_each_request_ran(seed):
    """``query_start_loc``: decode request r ran ``1 + s_r`` rows (s = 0, 3, 1, 2, 0; S = 3) and is
    rewound by ``s_r - accepted``; the kernel equals the twin, and everything else equals the
    strided call's (same logits rows) but the rewind."""
    drafts, S, block_size = [0, 3, 1, 2, 0], 3, 2
    inputs, outputs, indices, starts = _ragged_case(drafts, S, seed)
    N = len(drafts)
    state = make_kv_state(N, S, block_size, seed=seed)
    results = []
    for op in OPS:
        for qsl in (starts, None):
            buffers, kv_state = _buffers(N, S), clone_all(state)
            got = op(inputs, outputs, indices, *buffers, *kv_state, N, 0, S, block_size, None, None,
                     keep_released_blocks=True, query_start_loc=qsl)
            results.append((list(got) + buffers, kv_state))
    (ragged, ragged_state), (strided, strided_state), (twin, twin_state), _ = results
    assert_all_equal(ragged + ragged_state, twin + twin_state)
    same = [0, 1, 3, 4, 5, 6, 7]  # not blocks_to_release (the rewinds differ; with keep_released_blocks it is unused)
    assert_all_equal([ragged[i] for i in same], [strided[i] for i in same])
    accepted = ragged[-1]  # accepted_token_counts
    assert bool((accepted <= torch.tensor(drafts)).all())
    assert torch.equal(ragged_state[1], state[1] - (torch.tensor(drafts) - accepted))  # kv_length_offsets
    assert torch.equal(strided_state[1], state[1] - (S - accepted))


def test_query_start_loc_is_checked():
    inputs, outputs, indices, starts = _ragged_case([1, 2], 2, 0)
    with pytest.raises(ValueError, match="query_start_loc"):
        verify_and_commit(inputs, outputs, indices, *_buffers(2, 2), *make_kv_state(2, 2, 4, seed=0), 2, 0, 2, 4,
                          query_start_loc=starts[:2])


@pytest.mark.parametrize("num_decode,num_prefill,num_spec,block_size,num_padding",
                         [(3, 1, 3, 2, 2), (4, 0, 2, 4, 1), (2, 2, 1, 3, 0)])
def test_ragged_rows_by_slot_with_prefill_chunks_and_padding(num_decode, num_prefill, num_spec, block_size,
                                                             num_padding):
    """The controller's call with ragged rows: decode requests that ran ``1 + s_r`` rows
    (``query_start_loc``; their logical rows past ``s_r`` masked), final prefill chunks after them,
    padding programs (``query_start_loc`` repeats, the scratch slot), the KV state by table slot,
    the decode and active counts on the device: the kernel equals the twin, each decode request is
    rewound by ``s_r - accepted``, and no slot but the real requests' changes."""
    stride, num_real = num_spec + 1, num_decode + num_prefill
    num_requests, num_slots = num_real + num_padding, num_real + 4  # the last slot is the scratch slot
    # logits rows: 1 + S per request of the grid (decode rows, the chunks' last rows, then ignored rows)
    case = make_token_case(num_decode, num_prefill, num_spec, seed=9,
                           extra_rows=num_requests * stride - num_decode * stride - num_prefill)
    generator = torch.Generator().manual_seed(9)
    drafts = torch.randint(0, num_spec + 1, (num_decode,), generator=generator)  # s_r
    inputs = case.input_tokens.clone()
    past = torch.arange(num_decode * stride) % stride > drafts.repeat_interleave(stride)
    inputs[: num_decode * stride][past] = -1  # drafts a request did not make
    lengths = torch.cat([drafts + 1, torch.randint(1, 5, (num_prefill,), generator=generator),
                         torch.zeros(num_padding, dtype=torch.int64)])
    starts = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(lengths, 0)
    slots = torch.cat([torch.randperm(num_slots - 1, generator=generator)[:num_real],
                       torch.full((num_padding,), num_slots - 1)])
    state = make_kv_state(num_slots, num_spec, block_size, seed=9)
    results = []
    for op in OPS:
        buffers, kv_state = _buffers(num_requests, num_spec), clone_all(state)
        got = op(inputs, case.output_tokens, case.required_logit_indices, *buffers, *kv_state, num_requests, 0,
                 num_spec, block_size, torch.tensor([num_real]), keep_released_blocks=True,
                 decode_count=torch.tensor([num_decode]), request_slots=slots, query_start_loc=starts)
        results.append((list(got) + buffers, kv_state))
    (kernel, kernel_state), (twin, twin_state) = results
    assert_all_equal(kernel + kernel_state, twin + twin_state)
    accepted = kernel[-1][:num_decode]  # accepted_token_counts
    assert bool((accepted <= drafts).all())
    decode_slots = slots[:num_decode]
    assert torch.equal(kernel_state[1][decode_slots], state[1][decode_slots] - (drafts - accepted))
    others = torch.ones(num_slots, dtype=torch.bool)
    others[slots[:num_real]] = False
    for got_rows, before in zip(kernel_state, state):
        assert torch.equal(got_rows[others], before[others])
