"""rewind_kv_cache: Triton kernel (interpreter) == torch reference, known answers, and the
invariant "the state is that of the shorter sequence, and every freed block is returned once"."""

import pytest
import torch

from mtp_ctrl.triton_ops import reference, rewind_kv_cache
from mtp_ctrl.triton_ops.kv_rewind import max_released_blocks
from tests.unit.step_cases import assert_all_equal, clone_all, make_kv_state

OPS = [rewind_kv_cache, reference.rewind_kv_cache]


def _kv_state_of(kv_lens, block_ids, block_size, max_blocks):
    """Consistent bookkeeping for requests with ``kv_lens[r]`` tokens in blocks ``block_ids[r]``."""
    kv_len = torch.tensor(kv_lens)
    ids = torch.full((len(kv_lens), max_blocks), -1)
    for request, blocks in enumerate(block_ids):
        ids[request, : len(blocks)] = torch.tensor(blocks)
    counts = (kv_len - 1) // block_size + 1
    return [(kv_len - 1) % block_size, kv_len, counts, ids.gather(1, (counts - 1)[:, None]).squeeze(1), ids]


@pytest.mark.parametrize("op", OPS)
def test_one_block_crossing_no_crossing_prefill_and_padding(op):
    # block_size 4, S = 3. Request 0: 9 tokens in [7, 2, 9], accepts 1 -> rewinds 2 and frees block 9.
    # Request 1: 11 tokens in [5, 6, 8] (offset 2), accepts 1 -> rewinds 2 inside block 8.
    # Request 2: prefill, no rewind. Slot 3: padding (num_active_requests = 3).
    state = _kv_state_of([9, 11, 6, 5], [[7, 2, 9], [5, 6, 8], [1, 3], [4, 0]], block_size=4, max_blocks=4)
    accepted = torch.tensor([1, 1, 0, 0])
    prefill = torch.tensor([0, 0, 1, 0])
    blocks, remove = op(accepted, prefill, *state, 3, 4, 3)
    offset, kv_len, counts, last_id, ids = state
    assert blocks.tolist() == [9, 8, 3, 0] and remove.tolist() == [True, False, False, False]
    assert kv_len.tolist() == [7, 9, 6, 5]
    assert offset.tolist() == [2, 0, 1, 0]
    assert counts.tolist() == [2, 3, 2, 2]
    assert last_id.tolist() == [2, 8, 3, 0]
    assert ids.tolist() == [[7, 2, -1, -1], [5, 6, 8, -1], [1, 3, -1, -1], [4, 0, -1, -1]]


@pytest.mark.parametrize("op", OPS)
def test_rewind_across_two_blocks(op):
    # block_size 2, S = 5 (W = 3): 7 tokens in [10, 11, 12, 13] (last at offset 0), 1 draft accepted:
    # rewind 4 leaves 3 tokens in [10, 11]; blocks 13 and 12 are freed.
    state = _kv_state_of([7], [[10, 11, 12, 13]], block_size=2, max_blocks=5)
    blocks, remove = op(torch.tensor([1]), torch.tensor([0]), *state, 5, 2)
    offset, kv_len, counts, last_id, ids = state
    assert blocks.tolist() == [[13, 12, 0]] and remove.tolist() == [[True, True, False]]
    assert (offset.item(), kv_len.item(), counts.item(), last_id.item()) == (0, 3, 2, 11)
    assert ids.tolist() == [[10, 11, -1, -1, -1]]


@pytest.mark.parametrize("op", OPS)
def test_rewind_of_exactly_one_block_keeps_the_1d_form(op):
    # S == block_size == 3: 7 tokens in [4, 5, 6] (offset 0), nothing accepted: rewind 3 frees block 6 only.
    state = _kv_state_of([7], [[4, 5, 6]], block_size=3, max_blocks=3)
    blocks, remove = op(torch.tensor([0]), torch.tensor([0]), *state, 3, 3)
    assert blocks.tolist() == [6] and remove.tolist() == [True]
    assert [t.tolist() for t in state[:4]] == [[0], [4], [2], [5]]


def _check_invariant(old_state, new_state, accepted, prefill, num_active, num_spec, block_size, blocks, remove):
    """Compare with the state of the shorter sequence, built from scratch."""
    old_offset, old_len, old_counts, old_last, old_ids = old_state
    offset, kv_len, counts, last_id, ids = new_state
    num_requests = old_len.shape[0]
    real = torch.arange(num_requests) < num_active
    rewind = torch.where(real & (prefill == 0), num_spec - accepted, 0)
    want_len = old_len - rewind
    want_counts = (want_len - 1) // block_size + 1
    assert torch.equal(kv_len, want_len) and torch.equal(counts, want_counts)
    assert torch.equal(offset, torch.where(real, (want_len - 1) % block_size, old_offset))
    held = torch.arange(old_ids.shape[1])[None, :] < want_counts[:, None]
    assert torch.equal(ids, torch.where(held, old_ids, -1))
    assert torch.equal(last_id, ids.gather(1, (want_counts - 1)[:, None]).squeeze(1))
    blocks, remove = blocks.reshape(num_requests, -1), remove.reshape(num_requests, -1)
    for request in range(num_requests):
        freed = old_ids[request, want_counts[request] : old_counts[request]].tolist()
        assert sorted(blocks[request][remove[request]].tolist()) == sorted(freed)
        if not real[request]:
            assert (blocks[request] == 0).all() and not remove[request].any()
        else:
            assert blocks[request, 0] == old_last[request]


@pytest.mark.parametrize("num_requests", [1, 7, 40])
@pytest.mark.parametrize("num_spec,block_size", [(0, 4), (1, 1), (3, 4), (4, 4), (5, 2), (8, 1), (8, 3), (2, 16), (7, 64)])
def test_random_states_kernel_equals_reference_and_keeps_the_invariant(num_requests, num_spec, block_size):
    for seed in range(2):
        generator = torch.Generator().manual_seed(seed)
        state = make_kv_state(num_requests, num_spec, block_size, seed=seed)
        accepted = torch.randint(0, num_spec + 1, (num_requests,), generator=generator)
        prefill = (torch.rand(num_requests, generator=generator) < 0.3).long()
        num_active = num_requests - seed * (num_requests // 3)
        results = []
        for op in OPS:
            new_state = clone_all(state)
            blocks, remove = op(accepted, prefill, *new_state, num_spec, block_size, num_active)
            width = max_released_blocks(num_spec, block_size)
            assert blocks.shape == ((num_requests,) if width == 1 else (num_requests, width))
            _check_invariant(state, new_state, accepted, prefill, num_active, num_spec, block_size, blocks, remove)
            results.append(new_state + [blocks, remove])
        assert_all_equal(results[0], results[1])


@pytest.mark.parametrize(
    "num_active",
    [None, 0, 5, torch.tensor(5), torch.tensor([3], dtype=torch.int32), torch.tensor(99)],
    ids=["none", "int0", "int5", "tensor0d", "tensor1el", "tensor_past_grid"],
)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_views_of_larger_tables_and_device_counts(num_active, dtype):
    num_requests, num_spec, block_size = 9, 6, 4
    generator = torch.Generator().manual_seed(4)
    accepted = torch.randint(0, num_spec + 1, (num_requests,), generator=generator).to(dtype)
    prefill = (torch.rand(num_requests, generator=generator) < 0.3).to(dtype)
    base = make_kv_state(num_requests, num_spec, block_size, seed=4, dtype=dtype)
    views = make_kv_state(num_requests, num_spec, block_size, seed=4, dtype=dtype, views=True)
    assert views[0].stride(0) == 3 and views[4].stride(1) == 3
    tables = [view._base.clone() for view in views]
    want = reference.rewind_kv_cache(accepted, prefill, *base, num_spec, block_size, num_active)
    got = rewind_kv_cache(accepted, prefill, *views, num_spec, block_size, num_active)
    assert_all_equal(list(got) + views, list(want) + base)
    for view, table in zip(views, tables):  # nothing outside the views moved
        outside = torch.ones_like(table, dtype=torch.bool)
        outside[1 : 1 + num_requests, ..., 1] = False
        assert torch.equal(view._base[outside], table[outside])


@pytest.mark.parametrize("num_spec,block_size", [(3, 4), (9, 2)])
def test_no_requests_returns_empty_outputs(num_spec, block_size):
    state = make_kv_state(0, num_spec, block_size, seed=0)
    width = max_released_blocks(num_spec, block_size)
    for op in OPS:
        blocks, remove = op(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), *state,
                            num_spec, block_size)
        assert blocks.shape == remove.shape == ((0,) if width == 1 else (0, width))
        assert remove.dtype == torch.bool and blocks.dtype == state[3].dtype


def test_max_released_blocks():
    assert [max_released_blocks(s, 4) for s in (0, 1, 4, 5, 8, 9)] == [1, 1, 1, 2, 2, 3]
    assert max_released_blocks(3, 1) == 3


def _valid_args():
    state = make_kv_state(3, 2, 4, seed=0)
    return [torch.tensor([0, 1, 2]), torch.tensor([0, 0, 1]), *state, 2, 4, None]


@pytest.mark.parametrize(
    "index,bad,error,match",
    [
        (0, lambda t: t.float(), TypeError, "accepted_counts"),
        (0, lambda t: t[:, None], ValueError, "accepted_counts"),
        (1, lambda t: t[:2], ValueError, "prefill_status"),
        (1, lambda t: t.to("meta"), ValueError, "prefill_status"),
        (2, lambda t: t.float(), TypeError, "last_kv_block_offset"),
        (3, lambda t: t[:2], ValueError, "kv_length_offsets"),
        (4, lambda t: t.to("meta"), ValueError, "kv_block_counts"),
        (5, lambda t: t[:, None], ValueError, "last_kv_block_id"),
        (6, lambda t: t[:, 0], ValueError, "kv_block_ids"),
        (6, lambda t: t[:2], ValueError, "kv_block_ids"),
        (6, lambda t: t[:, :0], ValueError, "kv_block_ids"),
        (7, lambda s: -1, ValueError, "num_speculative_tokens"),
        (7, lambda s: 1.5, TypeError, "num_speculative_tokens"),
        (8, lambda b: 0, ValueError, "block_size_tokens"),
        (9, lambda n: 4, ValueError, "num_active_requests"),
        (9, lambda n: -1, ValueError, "num_active_requests"),
        (9, lambda n: 2.5, TypeError, "num_active_requests"),
        (9, lambda n: torch.tensor(2.0), TypeError, "num_active_requests"),
        (9, lambda n: torch.tensor([1, 2]), ValueError, "num_active_requests"),
        (9, lambda n: torch.tensor(2, device="meta"), ValueError, "num_active_requests"),
    ],
)
def test_bad_arguments(index, bad, error, match):
    args = _valid_args()
    args[index] = bad(args[index])
    with pytest.raises(error, match=match):
        rewind_kv_cache(*args)
