"""prepare_step_inputs: kernel == reference on random steps (decode rows, prefill chunks, padding
requests and rows sharing the scratch slot, requests in scattered slots, block boundaries, block
writes), the module's worked example, named errors."""

import pytest
import torch

from mtp_ctrl.triton_ops import prepare_step_inputs, reference

NAMES = ("block_writes", "block_ids", "query_start_loc", "slot_ids", "kv_length_offsets", "kv_block_counts",
         "last_kv_block_offset", "last_kv_block_id", "next_tokens", "draft_tokens", "num_decode", "block_size",
         "out_seq_lens", "out_positions", "out_slot_mapping", "input_ids", "out_block_table")


def step_inputs_case(generator, num_decode, prefill_lengths, num_padding, S, block_size=4, max_requests=10,
          padding_rows=3, num_writes=5, decode_drafts=None):
    """``decode_drafts``: each decode request's drafts (ragged rows, ``1 + s_r`` each); None: S each."""
    def randint(low, high, size=()):
        return torch.randint(low, high, size, generator=generator)

    G = num_decode + len(prefill_lengths) + num_padding
    R, MB = max_requests, 32  # room for the longest case (30 + 70 tokens)
    query_lengths = [1 + s for s in (decode_drafts or [S] * num_decode)] + list(prefill_lengths) + [0] * num_padding
    starts = torch.zeros(G + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lengths, dtype=torch.int32), 0)
    T = int(starts[-1]) + padding_rows
    num_real = G - num_padding
    # real requests in distinct scattered slots, padding in the scratch slot R (with no KV: it never grows)
    slot_ids = torch.cat([torch.randperm(R, generator=generator)[:num_real], torch.full((num_padding,), R)])
    kv_lengths = randint(0, 30, (R + 1,))
    kv_lengths[slot_ids[num_decode: num_decode + 1]] = 0  # a prompt's first chunk
    kv_lengths[R] = 0
    block_ids = randint(0, 100, (R + 1, MB))
    cells = torch.randperm((R + 1) * MB, generator=generator)[:num_writes]  # distinct (slot, column) cells
    writes = torch.stack([cells // MB, cells % MB, randint(100, 200, (cells.shape[0],))])  # [3, k] int64
    writes[0, -1] = R  # an unused entry: the scratch slot
    return dict(
        block_writes=writes, block_ids=block_ids, query_start_loc=starts, slot_ids=slot_ids,
        kv_length_offsets=kv_lengths, kv_block_counts=randint(0, 9, (R + 1,)),
        last_kv_block_offset=randint(0, 9, (R + 1,)), last_kv_block_id=randint(0, 9, (R + 1,)),
        next_tokens=randint(0, 50, (R + 1,)), draft_tokens=randint(0, 50, (R + 1, S)),
        num_decode=torch.tensor([num_decode]), block_size=block_size,
        out_seq_lens=torch.full((R,), -7, dtype=torch.int32), out_positions=torch.full((T,), -7),
        out_slot_mapping=torch.full((T,), -7), input_ids=randint(0, 50, (T,)),
        out_block_table=torch.full((R, MB), -7),
    )


def _clone(case):
    return {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in case.items()}


@pytest.mark.parametrize("S", [0, 1, 3])
@pytest.mark.parametrize("shape", [(0, (), 0), (1, (), 0), (3, (), 2), (0, (5,), 0), (2, (7, 3), 1),
                                   (0, (70,), 2), (4, (1, 6), 0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_matches_reference(S, shape, seed):
    num_decode, prefill_lengths, num_padding = shape
    case = step_inputs_case(torch.Generator().manual_seed(seed * 100 + S * 10 + num_decode), num_decode, prefill_lengths,
                 num_padding, S)
    want = _clone(case)
    prepare_step_inputs(**case)
    reference.prepare_step_inputs(**want)
    for name in NAMES:
        if isinstance(case[name], torch.Tensor):
            assert torch.equal(case[name], want[name]), name


@pytest.mark.parametrize("op", [prepare_step_inputs, reference.prepare_step_inputs])
def test_worked_example(op):
    case = step_inputs_case(torch.Generator().manual_seed(0), 1, (3,), 0, 1, padding_rows=1, num_writes=1)
    case["slot_ids"] = torch.tensor([3, 0])
    case["kv_length_offsets"][[3, 0]] = torch.tensor([6, 0])
    case["block_writes"] = torch.tensor([[3], [1], [42]])  # the decode request's second block
    op(**case)
    assert case["out_positions"].tolist() == [6, 7, 0, 1, 2, 0]
    assert case["out_slot_mapping"].tolist()[:2] == [42 * 4 + 2, 42 * 4 + 3] and case["out_slot_mapping"][5] == -1
    assert case["input_ids"][:2].tolist() == [int(case["next_tokens"][3]), int(case["draft_tokens"][3, 0])]
    assert case["kv_length_offsets"][[3, 0]].tolist() == [8, 3] and case["out_seq_lens"][:2].tolist() == [8, 3]
    assert case["kv_block_counts"][[3, 0]].tolist() == [2, 1] and case["last_kv_block_id"][3] == 42
    assert case["last_kv_block_offset"][[3, 0]].tolist() == [3, 2]
    assert torch.equal(case["out_block_table"][:2], case["block_ids"][[3, 0]])


@pytest.mark.parametrize("name, value, error", [
    ("block_writes", torch.zeros(2, 3, dtype=torch.int64), ValueError),
    ("query_start_loc", torch.zeros(3, dtype=torch.int64), TypeError),
    ("kv_length_offsets", torch.zeros(1, dtype=torch.int64), ValueError),
    ("slot_ids", torch.zeros(5, dtype=torch.int64), ValueError),
    ("out_block_table", torch.zeros(10, 3, dtype=torch.int64), ValueError),
    ("num_decode", torch.zeros(2, dtype=torch.int64), ValueError),
    ("block_size", 0, ValueError),
    ("out_slot_mapping", torch.zeros(2, dtype=torch.int64), ValueError),
])
def test_bad_arguments_are_named(name, value, error):
    case = step_inputs_case(torch.Generator().manual_seed(2), 2, (), 0, 1)
    case[name] = value
    with pytest.raises(error, match=name):
        prepare_step_inputs(**case)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("decode_drafts,prefill_lengths", [([0, 3, 1, 2], ()), ([2, 0], (5,)), ([0, 0, 0], ())])
def test_ragged_decode_rows(seed, decode_drafts, prefill_lengths):
    """Decode requests of ``1 + s_r`` rows (S = 3), with and without a prefill chunk after them, and
    an all-zero step: kernel == reference; each decode request's rows take its base token, then its
    first ``s_r`` drafts, at its own positions."""
    S, num_decode = 3, len(decode_drafts)
    case = step_inputs_case(torch.Generator().manual_seed(seed), num_decode, prefill_lengths, 1, S,
                            decode_drafts=decode_drafts)
    want, before = _clone(case), _clone(case)
    prepare_step_inputs(**case)
    reference.prepare_step_inputs(**want)
    for name in NAMES:
        if isinstance(case[name], torch.Tensor):
            assert torch.equal(case[name], want[name]), name
    starts, slots = case["query_start_loc"].tolist(), case["slot_ids"]
    for r, s in enumerate(decode_drafts):
        slot, rows = int(slots[r]), slice(starts[r], starts[r + 1])
        assert starts[r + 1] - starts[r] == 1 + s
        expected = [int(before["next_tokens"][slot])] + before["draft_tokens"][slot, :s].tolist()
        assert case["input_ids"][rows].tolist() == expected
        first = int(before["kv_length_offsets"][slot])
        assert case["out_positions"][rows].tolist() == list(range(first, first + 1 + s))
