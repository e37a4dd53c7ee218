"""gdn_decode_rows and gdn_varlen_scan: the Triton kernel through the interpreter == its torch twin
on random slots (padding rows past T, 1 + S rows, a shared scratch slot, GQA key heads, value
tiles, empty batches, 0-row segments, bf16 pools); both twins == a row-by-row oracle of the rule;
accepting all or none of the drafts commits exactly the states plain decoding reaches; errors name
the argument."""

import pytest
import torch
import torch.nn.functional as F

from mtp_ctrl.triton_ops import gdn_decode_rows, gdn_varlen_scan, mamba_state_selective_copy, reference

LAYERS, SLOTS = 2, 6


def oracle(state, q, k, v, g, beta):
    """The rule row by row for one request: ``state`` [H, K, V]; -> (o [t, H, V], state)."""
    heads = v.shape[1]
    q, k = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (q, k))
    outputs = []
    for t in range(q.shape[0]):
        state = state * torch.exp(g[t])[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], state))
        state = state + k[t][:, :, None] * delta[:, None, :]
        outputs.append(torch.einsum("hk,hkv->hv", q[t], state))
    empty = v.new_zeros(0, heads, v.shape[2])
    return (torch.stack(outputs) if outputs else empty), state


def rows(seed, num_rows, key_heads=2, heads=4, key_dim=8, value_dim=6):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator)
    q = F.normalize(rand(num_rows, key_heads, key_dim), dim=-1) * key_dim ** -0.5
    k = F.normalize(rand(num_rows, key_heads, key_dim), dim=-1)
    return dict(q=q, k=k, v=rand(num_rows, heads, value_dim), g=-F.softplus(rand(num_rows, heads)),
                beta=torch.sigmoid(rand(num_rows, heads)))


def pools(seed, rows_per_request, heads=4, key_dim=8, value_dim=6, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed + 100)
    states = torch.randn(LAYERS, SLOTS, heads, key_dim, value_dim, generator=generator).to(dtype)
    inter = torch.randn(LAYERS, SLOTS, rows_per_request, heads, key_dim, value_dim, generator=generator).to(dtype)
    return states, inter


DECODE_CASES = {  # name: (slot ids, rows per request, T, rows() arguments)
    "past_T": ([4, 1, 3], 3, 8, {}),  # 9 rows of 8: the last request's last row reads zeros
    "no_request": ([], 3, 4, {}),
    "one_row_each": ([0, 5, 2], 1, 3, {}),
    "value_tiles_mha": ([2, 3], 4, 8, dict(key_heads=4, value_dim=40)),  # 2 value tiles, Hk == H
    "scratch_shared": ([1, 5, 5], 2, 6, {}),  # padding requests on scratch slot 5
}


@pytest.mark.parametrize("layer", [0, LAYERS - 1])
@pytest.mark.parametrize("case", list(DECODE_CASES), ids=list(DECODE_CASES))
def test_decode_kernel_equals_twin(case, layer):
    slot_list, stride, num_rows, arguments = DECODE_CASES[case]
    inputs = rows(len(case), num_rows, **arguments)
    heads, value_dim = inputs["v"].shape[1:]
    states, inter = pools(len(case), stride, heads=heads, value_dim=value_dim)
    slot_ids = torch.tensor(slot_list, dtype=torch.int64)
    before_states, before_inter = states.clone(), inter.clone()
    want_inter = inter.clone()
    o = gdn_decode_rows(states, inter, layer, slot_ids, **inputs)
    want = reference.gdn_decode_rows(states, want_inter, layer, slot_ids, **inputs)
    assert o.shape == (len(slot_list) * stride, heads, value_dim)
    real = [index for index, slot in enumerate(slot_list) if slot_list.count(slot) == 1]
    for index in real:
        rows_of = slice(index * stride, (index + 1) * stride)
        torch.testing.assert_close(o[rows_of], want[rows_of], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(inter[layer, slot_list[index]], want_inter[layer, slot_list[index]],
                                   rtol=1e-5, atol=1e-5)
    assert torch.equal(states, before_states)  # the current state is only read
    untouched = torch.ones(LAYERS, SLOTS, dtype=torch.bool)
    untouched[layer, slot_ids] = False
    assert torch.equal(inter[untouched], before_inter[untouched])


def test_decode_twin_is_the_rule_row_by_row():
    inputs = rows(7, 9)
    states, inter = pools(7, 3)
    slot_list = [2, 0, 4]
    o = reference.gdn_decode_rows(states, inter, 1, torch.tensor(slot_list), **inputs)
    for index, slot in enumerate(slot_list):
        part = {name: value[index * 3:(index + 1) * 3] for name, value in inputs.items()}
        want_o, want_state = oracle(states[1, slot], **part)
        torch.testing.assert_close(o[index * 3:(index + 1) * 3], want_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(inter[1, slot, -1], want_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("accepted", ["none", "all", "mixed"])
def test_commit_after_verify_is_plain_decoding(accepted):
    """Verify rows then commit (mamba_state_selective_copy) == plain decoding of the accepted rows:
    0 accepted leaves exactly the state after the base row; all accepted the state after the last."""
    stride = 3
    inputs = rows(11, 2 * stride)
    states, inter = pools(11, stride)
    slot_list = [3, 1]
    counts = {"none": [0, 0], "all": [2, 2], "mixed": [2, 0]}[accepted]
    plain = [oracle(states[0, slot], **{n: x[i * stride: i * stride + 1 + counts[i]] for n, x in inputs.items()})[1]
             for i, slot in enumerate(slot_list)]
    gdn_decode_rows(states, inter, 0, torch.tensor(slot_list), **inputs)
    mamba_state_selective_copy(inter, states, torch.zeros(2, dtype=torch.int64), torch.tensor(slot_list),
                               torch.tensor(counts), LAYERS)
    for slot, want in zip(slot_list, plain):
        torch.testing.assert_close(states[0, slot], want, rtol=1e-5, atol=1e-5)


SCAN_CASES = {  # name: (starts, counts, T, chunk size, rows() arguments)
    "mixed_segments": ([0, 2, 2, 9, 21], [2, 0, 7, 12, 1], 23, 4, {}),
    "decode_rows_first": ([6, 6, 13], [0, 7, 5], 18, 3, {}),  # rows 0..5 in no segment
    "one_long": ([0], [20], 20, 64, dict(key_heads=4, value_dim=40)),
    "no_segment": ([], [], 5, 4, {}),
    "all_empty": ([0, 0], [0, 0], 3, 4, {}),
}


@pytest.mark.parametrize("pooled", [False, True], ids=["states", "slots"])
@pytest.mark.parametrize("case", list(SCAN_CASES), ids=list(SCAN_CASES))
def test_scan_kernel_equals_twin_and_oracle(case, pooled):
    starts, counts, num_rows, chunk, arguments = SCAN_CASES[case]
    inputs = rows(len(case), num_rows, **arguments)
    heads, value_dim = inputs["v"].shape[1:]
    row_start, row_count = torch.tensor(starts, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64)
    n = len(starts)
    generator = torch.Generator().manual_seed(5)
    initial = torch.randn(n, heads, 8, value_dim, generator=generator)
    if pooled:
        slot_list = list(range(SLOTS - 1, SLOTS - 1 - n, -1))
        pool = torch.randn(SLOTS, heads, 8, value_dim, generator=generator)
        pool[slot_list] = initial
        want_pool = pool.clone()
        slots = torch.tensor(slot_list, dtype=torch.int64)
        o, none = gdn_varlen_scan(pool, **inputs, row_start=row_start, row_count=row_count, chunk_size=chunk,
                                  slot_ids=slots)
        want_o, _ = reference.gdn_varlen_scan(want_pool, **inputs, row_start=row_start, row_count=row_count,
                                              chunk_size=chunk, slot_ids=slots)
        assert none is None
        torch.testing.assert_close(pool, want_pool, rtol=1e-4, atol=1e-4)
        final = pool[slot_list] if n else initial
    else:
        before = initial.clone()
        o, final = gdn_varlen_scan(initial, **inputs, row_start=row_start, row_count=row_count, chunk_size=chunk)
        want_o, want_final = reference.gdn_varlen_scan(initial, **inputs, row_start=row_start, row_count=row_count,
                                                       chunk_size=chunk)
        assert torch.equal(initial, before)
        torch.testing.assert_close(final, want_final, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(o, want_o, rtol=1e-4, atol=1e-4)
    inside = torch.zeros(num_rows, dtype=torch.bool)
    for segment, (start, count) in enumerate(zip(starts, counts)):
        part = {name: value[start:start + count] for name, value in inputs.items()}
        want_rows, want_state = oracle(initial[segment], **part)
        torch.testing.assert_close(o[start:start + count], want_rows, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final[segment], want_state, rtol=1e-4, atol=1e-4)
        inside[start:start + count] = True
    assert torch.equal(o[~inside], torch.zeros_like(o[~inside]))


def test_bf16_pools():
    inputs = rows(3, 6)
    states, inter = pools(3, 3, dtype=torch.bfloat16)
    want_inter = inter.clone()
    slots = torch.tensor([0, 4])
    o = gdn_decode_rows(states, inter, 1, slots, **inputs)
    want = reference.gdn_decode_rows(states, want_inter, 1, slots, **inputs)
    torch.testing.assert_close(o, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inter.float(), want_inter.float(), rtol=1e-2, atol=1e-2)


def test_errors_name_the_argument():
    inputs = rows(1, 4)
    states, inter = pools(1, 2)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="layer"):
        gdn_decode_rows(states, inter, LAYERS, slots, **inputs)
    with pytest.raises(TypeError, match="slot_ids"):
        gdn_decode_rows(states, inter, 0, slots.int(), **inputs)
    with pytest.raises(ValueError, match="intermediate_states"):
        gdn_decode_rows(states, inter[:, :, :, :2], 0, slots, **inputs)
    with pytest.raises(ValueError, match="key heads"):
        gdn_decode_rows(states, inter, 0, slots, **dict(inputs, q=inputs["q"].repeat(1, 3, 1),
                                                         k=inputs["k"].repeat(1, 3, 1)))
    with pytest.raises(ValueError, match="beta"):
        gdn_decode_rows(states, inter, 0, slots, **dict(inputs, beta=inputs["beta"][:2]))
    with pytest.raises(ValueError, match="row_count"):
        gdn_varlen_scan(states[0, :2], **inputs, row_start=torch.tensor([0, 2]), row_count=torch.tensor([2]))
    with pytest.raises(ValueError, match="chunk_size"):
        gdn_varlen_scan(states[0, :2], **inputs, row_start=torch.tensor([0, 2]), row_count=torch.tensor([2, 2]),
                        chunk_size=0)
