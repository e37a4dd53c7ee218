"""verify_and_commit against oracles that share no code with it (contract: docs/kernels.md).

tests/unit/test_fused_step.py holds the kernel equal to the torch references chained; a bug the
kernel and the references share passes there. Here the expected values come from hand-worked
cases (block boundaries, padding slots, prefill rows) and from a plain-Python model of the
contract (lists and ints, no torch op), checked by hypothesis on both the Triton kernel
(interpreter, CPU tensors) and the torch reference.
"""

from typing import List, NamedTuple, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtp_ctrl.triton_ops import reference, verify_and_commit

OPS = [verify_and_commit, reference.verify_and_commit]
OP_IDS = ["kernel", "reference"]
UNTOUCHED = 77  # what the caller's buffers hold before the call


class KvRequest(NamedTuple):
    length: int  # tokens held (kv_length_offsets)
    blocks: List[int]  # block table row, ceil(length / block_size) ids


def _kv_tensors(requests, block_size, max_blocks, dtype=torch.int64):
    """[last_kv_block_offset, kv_length_offsets, kv_block_counts, last_kv_block_id, kv_block_ids]."""
    rows = [r.blocks + [-1] * (max_blocks - len(r.blocks)) for r in requests]
    return [torch.tensor([(r.length - 1) % block_size for r in requests], dtype=dtype),
            torch.tensor([r.length for r in requests], dtype=dtype),
            torch.tensor([len(r.blocks) for r in requests], dtype=dtype),
            torch.tensor([r.blocks[-1] for r in requests], dtype=dtype),
            torch.tensor(rows, dtype=dtype).reshape(len(requests), max_blocks)]


def _buffers(num_rows, num_spec, dtype=torch.int64):
    """(sampled_tokens_buf, last_accepted_seq_buf, accepted_tokens_per_request, accepted_token_counts)."""
    return [torch.full((num_rows,), UNTOUCHED, dtype=dtype), torch.full((num_rows,), UNTOUCHED, dtype=dtype),
            torch.full((num_rows, num_spec), UNTOUCHED, dtype=dtype), torch.full((num_rows,), UNTOUCHED, dtype=dtype)]


def _call(op, inputs, outputs, buffers, kv, num_decode, num_prefill, num_spec, block_size, num_active=None):
    required = torch.arange(len(inputs)) + 100  # forward-pass position of row k: 100 + k
    return op(torch.tensor(inputs), torch.tensor(outputs), required, *buffers, *kv, num_decode, num_prefill,
              num_spec, block_size, num_active)


# ---------------------------------------------------------------- hand-worked cases

def _case_s3_block4():
    """S = 3, block size 4; three decode requests, two prefill rows, one row past the packed region.

    req 0 accepts all 3 drafts (rewinds 0, its last token stays at offset 0 of block 12);
    req 1 accepts 2 (rewinds 1 from offset 0: back into block 21, block 22 is released);
    req 2's first draft misses, so it accepts 0 although its later drafts match (consecutive only),
    rewinds 3 from offset 3 to exactly offset 0 of block 31 (nothing released);
    req 3 and req 4 are prefill rows (accepted, no rewind).
    """
    inputs = [11, 12, 13, 14, 21, 22, 23, 99, 31, 40, 33, 34, 41, 51, 61]
    outputs = [12, 13, 14, 15, 22, 23, 24, 25, 32, 33, 34, 35, 42, 52, 62]
    kv = [KvRequest(9, [10, 11, 12]), KvRequest(9, [20, 21, 22]), KvRequest(8, [30, 31]),
          KvRequest(5, [40, 41]), KvRequest(3, [50])]
    return inputs, outputs, kv


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_hand_worked_s3_block4_all_real(op):
    """Planted bugs (each on its own, then reverted) that failed this test: `position = old_offset -
    rewind - 1` in the kernel's `_rewind_request` (off by one: offsets and req 1's release wrong);
    the kernel's round-up dropped from `released`; `cumprod` dropped from the reference's verify
    (req 2 accepted its later matching drafts)."""
    inputs, outputs, requests = _case_s3_block4()
    buffers, kv = _buffers(6, 3), _kv_tensors(requests, 4, 3)
    last_one, mask, blocks, remove = _call(op, inputs, outputs, buffers, kv, 3, 2, 3, 4)
    assert last_one.tolist() == [3, 6, 8, 12, 13]
    assert mask.tolist() == [True] * 7 + [False, True, False, False, False, True, True, False]
    sampled, last_seq, drafts, counts = buffers
    assert sampled.tolist() == [15, 24, 32, 42, 52, UNTOUCHED]
    assert last_seq.tolist() == [103, 106, 108, 112, 113, UNTOUCHED]
    assert drafts.tolist()[:3] == [[12, 13, 14], [22, 23, -1], [-1, -1, -1]]
    assert drafts.tolist()[3:] == [[UNTOUCHED] * 3] * 3  # prefill rows left as the caller set them
    assert counts.tolist() == [3, 2, 0, UNTOUCHED, UNTOUCHED, UNTOUCHED]
    assert blocks.tolist() == [12, 22, 31, 41, 50]
    assert remove.tolist() == [False, True, False, False, False]
    offset, length, block_counts, last_id, ids = kv
    assert length.tolist() == [9, 8, 5, 5, 3]
    assert offset.tolist() == [0, 3, 0, 0, 2]
    assert block_counts.tolist() == [3, 2, 2, 2, 1]
    assert last_id.tolist() == [12, 21, 31, 41, 50]
    assert ids.tolist() == [[10, 11, 12], [20, 21, -1], [30, 31, -1], [40, 41, -1], [50, -1, -1]]


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
@pytest.mark.parametrize("num_active", [4, torch.tensor([4]), 2, torch.tensor([0])], ids=["4", "t4", "2", "t0"])
def test_hand_worked_s3_block4_padding_slots(op, num_active):
    """Slots at or past ``num_active_requests`` are padding: mask rows False, last index -1, release
    nothing, and neither the caller's buffers nor their KV state change. Planted bug that failed this
    test: `is_real = request <= count` in the fused kernel and in the reference's `_real_requests`
    (slot `count` treated as real)."""
    inputs, outputs, requests = _case_s3_block4()
    active = int(num_active)
    buffers, kv = _buffers(6, 3), _kv_tensors(requests, 4, 3)
    last_one, mask, blocks, remove = _call(op, inputs, outputs, buffers, kv, 3, 2, 3, 4, num_active)
    real_last = [3, 6, 8, 12, 13]
    real_mask = [[True] * 4, [True, True, True, False], [True, False, False, False], [True], [True]]
    assert last_one.tolist() == [real_last[r] if r < active else -1 for r in range(5)]
    assert mask.tolist() == sum((real_mask[r] if r < active else [False] * len(real_mask[r]) for r in range(5)),
                                []) + [False]
    want_sampled = [15, 24, 32, 42, 52]
    assert buffers[0].tolist() == [want_sampled[r] if r < active else UNTOUCHED for r in range(5)] + [UNTOUCHED]
    want_counts = [3, 2, 0]
    assert buffers[3].tolist()[:3] == [want_counts[r] if r < active else UNTOUCHED for r in range(3)]
    assert blocks.tolist() == [[12, 22, 31, 41, 50][r] if r < active else 0 for r in range(5)]
    assert remove.tolist() == [r == 1 and active > 1 for r in range(5)]
    want_length = [9, 8, 5, 5, 3]
    assert kv[1].tolist() == [want_length[r] if r < active else requests[r].length for r in range(5)]
    want_last_id = [12, 21, 31, 41, 50]
    assert kv[3].tolist() == [want_last_id[r] if r < active else requests[r].blocks[-1] for r in range(5)]
    assert kv[4][1].tolist() == ([20, 21, -1] if active > 1 else [20, 21, 22])


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_hand_worked_multi_block_release(op):
    """S = 5 > block size 2: W = ceil(5 / 2) = 3 release columns, column j the block j places back.

    req 0 accepts 0 from offset 0 of its 4th block: rewinds 5 tokens (7 -> 2), freeing 3 blocks;
    req 1 accepts 1 from offset 1: rewinds 4 (8 -> 4), freeing 2; req 2 accepts all 5; req 3 is
    prefill. Planted bugs that failed this test: the reference's `released = (-position + bs) // bs`
    (a wrong round-up), and the reference clearing only column `new_count` of the block table
    (req 0 kept blocks 12, 13); the kernel's off-by-one rewind above.
    """
    inputs = [1, 9, 9, 9, 9, 9] + [1, 2, 9, 9, 9, 9] + [1, 2, 3, 4, 5, 6] + [8]
    outputs = [2, 3, 4, 5, 6, 7] * 3 + [9]
    requests = [KvRequest(7, [10, 11, 12, 13]), KvRequest(8, [20, 21, 22, 23]), KvRequest(6, [30, 31, 32]),
                KvRequest(1, [40])]
    buffers, kv = _buffers(4, 5), _kv_tensors(requests, 2, 5)
    last_one, mask, blocks, remove = _call(op, inputs, outputs, buffers, kv, 3, 1, 5, 2)
    assert last_one.tolist() == [0, 7, 17, 18]
    assert mask.tolist() == [True] + [False] * 5 + [True, True] + [False] * 4 + [True] * 7
    assert buffers[0].tolist() == [2, 3, 7, 9] and buffers[1].tolist() == [100, 107, 117, 118]
    assert buffers[2].tolist()[:3] == [[-1] * 5, [2, -1, -1, -1, -1], [2, 3, 4, 5, 6]]
    assert buffers[3].tolist() == [0, 1, 5, UNTOUCHED]
    assert blocks.tolist() == [[13, 12, 11], [23, 22, 0], [32, 0, 0], [40, 0, 0]]
    assert remove.tolist() == [[True] * 3, [True, True, False], [False] * 3, [False] * 3]
    offset, length, block_counts, last_id, ids = kv
    assert length.tolist() == [2, 4, 6, 1] and offset.tolist() == [1, 1, 1, 0]
    assert block_counts.tolist() == [1, 2, 3, 1] and last_id.tolist() == [10, 21, 32, 40]
    assert ids.tolist() == [[10, -1, -1, -1, -1], [20, 21, -1, -1, -1], [30, 31, 32, -1, -1],
                            [40, -1, -1, -1, -1]]


# ---------------------------------------------------------------- plain-Python model of the contract

class Expected(NamedTuple):
    last_one: List[int]
    mask: List[bool]
    blocks: List[List[int]]  # [N][W]
    remove: List[List[bool]]
    sampled: List[int]
    last_seq: List[int]
    drafts: List[List[int]]
    counts: List[int]
    kv: List[List]  # offsets, lengths, counts, last ids, table rows


def model_step(inputs, outputs, required, buffers, kv, num_decode, num_prefill, num_spec, block_size,
               num_active) -> Expected:
    """The step from docs/kernels.md on lists of ints, request by request (no torch)."""
    sampled, last_seq, drafts, counts = [list(b) for b in buffers]
    drafts = [list(row) for row in drafts]
    offsets, lengths, block_counts, last_ids, table = [list(x) for x in kv]
    table = [list(row) for row in table]
    stride = num_spec + 1
    width = max(1, -(-num_spec // block_size))
    num_requests = num_decode + num_prefill
    mask = [False] * len(inputs)
    last_one, blocks, remove = [], [], []
    for r in range(num_requests):
        if r >= num_active:  # padding slot
            last_one.append(-1)
            blocks.append([0] * width)
            remove.append([False] * width)
            continue
        if r < num_decode:
            base = r * stride
            accepted = 0
            while accepted < num_spec and inputs[base + 1 + accepted] == outputs[base + accepted]:
                accepted += 1
            for i in range(accepted + 1):
                mask[base + i] = True
            last = base + accepted
            drafts[r] = [inputs[base + 1 + s] if s < accepted else -1 for s in range(num_spec)]
            counts[r] = accepted
            rewind = num_spec - accepted
        else:
            last = num_decode * stride + (r - num_decode)
            mask[last] = True
            rewind = 0
        last_one.append(last)
        sampled[r] = outputs[last]
        last_seq[r] = required[last]
        # KV: the request now holds `length - rewind` tokens in ceil(new_length / block_size) blocks
        old_count = block_counts[r]
        new_length = lengths[r] - rewind
        new_count = (new_length - 1) // block_size + 1
        freed = list(reversed(table[r][new_count:old_count]))  # the old last block first
        blocks.append([last_ids[r]] + [freed[j] if j < len(freed) else 0 for j in range(1, width)])
        remove.append([j < len(freed) for j in range(width)])
        for column in range(new_count, old_count):
            table[r][column] = -1
        lengths[r] = new_length
        offsets[r] = (new_length - 1) % block_size
        block_counts[r] = new_count
        last_ids[r] = table[r][new_count - 1]
    return Expected(last_one, mask, blocks, remove, sampled, last_seq, drafts, counts,
                    [offsets, lengths, block_counts, last_ids, table])


@st.composite
def step_cases(draw):
    num_spec = draw(st.integers(0, 4))
    block_size = draw(st.integers(1, 4))
    num_decode = draw(st.integers(0, 3))
    num_prefill = draw(st.integers(0, 2))
    num_requests = num_decode + num_prefill
    num_rows = num_decode * (num_spec + 1) + num_prefill + draw(st.integers(0, 2))
    vocab = st.integers(0, 2)  # three tokens: drafts match the target often
    inputs = draw(st.lists(vocab, min_size=num_rows, max_size=num_rows))
    outputs = draw(st.lists(vocab, min_size=num_rows, max_size=num_rows))
    lengths = [draw(st.integers(num_spec + 1 if r < num_decode else 1, num_spec + 1 + 2 * block_size))
               for r in range(num_requests)]
    block_counts = [(length - 1) // block_size + 1 for length in lengths]
    max_blocks = max(block_counts, default=1) + draw(st.integers(0, 1))
    first_ids = draw(st.permutations(range(max(sum(block_counts), 1))))
    table, used = [], 0
    for count in block_counts:
        table.append([1000 + first_ids[used + j] for j in range(count)] + [-1] * (max_blocks - count))
        used += count
    kv = [[(length - 1) % block_size for length in lengths], lengths, block_counts,
          [row[count - 1] for row, count in zip(table, block_counts)], table]
    active_kind = draw(st.sampled_from(["none", "int", "tensor"]))
    active = None if active_kind == "none" else draw(st.integers(0, num_requests))
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    return dict(inputs=inputs, outputs=outputs, kv=kv, num_decode=num_decode, num_prefill=num_prefill,
                num_spec=num_spec, block_size=block_size, max_blocks=max_blocks, active_kind=active_kind,
                active=active, dtype=dtype)


def _check_against_model(op, case) -> None:
    num_requests = case["num_decode"] + case["num_prefill"]
    dtype, max_blocks = case["dtype"], case["max_blocks"]
    buffers = _buffers(num_requests + 1, case["num_spec"], dtype)
    kv = [torch.tensor(x, dtype=dtype) for x in case["kv"][:4]]
    kv.append(torch.tensor(case["kv"][4], dtype=dtype).reshape(num_requests, max_blocks))
    active = case["active"]
    active_arg = torch.tensor([active]) if case["active_kind"] == "tensor" else active
    required = [100 + 3 * k for k in range(len(case["inputs"]))]
    want = model_step(case["inputs"], case["outputs"], required, [b.tolist() for b in buffers], case["kv"],
                      case["num_decode"], case["num_prefill"], case["num_spec"], case["block_size"],
                      num_requests if active is None else active)
    got = op(torch.tensor(case["inputs"], dtype=dtype), torch.tensor(case["outputs"], dtype=dtype),
             torch.tensor(required, dtype=dtype), *buffers, *kv, case["num_decode"], case["num_prefill"],
             case["num_spec"], case["block_size"], active_arg)
    width = len(want.blocks[0]) if want.blocks else 1
    as_rows = (lambda t: t.tolist()) if width > 1 else (lambda t: [[v] for v in t.tolist()])
    assert got.last_one_indices.tolist() == want.last_one
    assert got.accepted_tokens_mask.tolist() == want.mask
    assert as_rows(got.blocks_to_release) == want.blocks
    assert as_rows(got.remove_mask) == want.remove
    assert buffers[0].tolist() == want.sampled and buffers[1].tolist() == want.last_seq
    assert buffers[2].tolist() == want.drafts and buffers[3].tolist() == want.counts
    assert [t.tolist() for t in kv] == want.kv


_FEW = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_FEW
@given(case=step_cases())
def test_kernel_equals_the_python_model(case):
    """The Triton kernel (interpreter) == the plain-Python model on random steps.

    Planted bugs that failed it (each on its own, then reverted): the kernel's `released` without
    the `+ BLOCK_SIZE_TOKENS - 1` round-up, `position = old_offset - rewind - 1`, and the padding
    test `is_real = request <= count` in `_verify_and_commit_kernel`."""
    _check_against_model(verify_and_commit, case)


@settings(_FEW, max_examples=60)
@given(case=step_cases())
def test_reference_equals_the_python_model(case):
    """The torch reference == the plain-Python model on random steps.

    Planted bugs that failed it: `cumprod` dropped from verify (non-consecutive accepts), the
    released-block round-up `+ bs` instead of `+ bs - 1`, clearing one block-table column only,
    and `<=` in `_real_requests` (one padding slot treated as real)."""
    _check_against_model(reference.verify_and_commit, case)
