"""The Mamba varlen kernels (conv, scan, segment search) through Triton's interpreter == their torch
twins (mtp_ctrl.triton_ops.reference) on seeded random packed layouts: 0-row segments, an empty
step (n = 0, T = 0), rows before/after every segment, 1-row segments (their conv history from the
window), segments longer than a scan chunk, strided inputs; every validation error names its
argument. (tests/unit/test_mamba_ops.py holds the twins to the per-request functions.)"""

import random

import pytest
import torch
import torch.nn.functional as F

from mtp_ctrl.triton_ops import causal_conv_varlen, reference, segment_of_rows, ssm_varlen_scan
from tests.unit.test_mamba_ops import _packed_layout as _layout  # one layout helper for both files

WIDTH, CHANNELS, HEADS, HEAD_DIM, STATE_SIZE = 4, 5, 2, 3, 6


def _random_pieces(rng):
    pieces = [("other", rng.choice([0, 2, 3])) for _ in range(rng.randint(0, 2))]
    pieces += [rng.choice([("prefill", rng.randint(1, 10)), ("other", rng.randint(0, 2))])
               for _ in range(rng.randint(1, 4))]
    return pieces + [("other", rng.randint(0, 4))]


LAYOUTS = {
    "empty_step": [],  # n = 0, T = 0
    "one_row": [("prefill", 1)],
    "decodes_then_short_segments": [("other", 3), ("prefill", 1), ("prefill", 2), ("other", 2)],
    "longer_than_chunks": [("prefill", 9), ("other", 0), ("prefill", 6), ("other", 3)],
    "no_prefill": [("other", 3), ("other", 3), ("other", 1)],
    **{f"random{seed}": _random_pieces(random.Random(seed)) for seed in range(6)},
}


def _inputs(num_segments, num_rows, seed):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator)
    conv = dict(windows=rand(num_segments, CHANNELS, WIDTH - 1), inputs=rand(num_rows, CHANNELS),
                weight=rand(CHANNELS, WIDTH), bias=rand(CHANNELS))
    scan = dict(states=rand(num_segments, HEADS, HEAD_DIM, STATE_SIZE), x=rand(num_rows, HEADS, HEAD_DIM),
                dt=F.softplus(rand(num_rows, HEADS)), A=-torch.rand(HEADS, generator=generator) * 2 - 0.1,
                B=rand(num_rows, HEADS, STATE_SIZE), C=rand(num_rows, HEADS, STATE_SIZE), D=rand(HEADS))
    return conv, scan


def _call_conv(op, conv, row_start, row_count):
    return op(conv["windows"], conv["inputs"], row_start, row_count, conv["weight"], conv["bias"])


def _call_scan(op, scan, row_start, row_count, chunk_size):
    return op(scan["states"], scan["x"], scan["dt"], scan["A"], scan["B"], scan["C"], scan["D"], row_start, row_count,
              chunk_size)


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_kernels_equal_their_twins(layout):
    row_start, row_count, num_rows = _layout(LAYOUTS[layout])
    conv, scan = _inputs(row_start.shape[0], num_rows, seed=len(layout) * 31 + num_rows)
    inside = reference.segment_of_rows(row_start, row_count, num_rows)[2]  # [T] bool

    for got, want in zip(segment_of_rows(row_start, row_count, num_rows),
                         reference.segment_of_rows(row_start, row_count, num_rows)):
        assert got.dtype == want.dtype and torch.equal(got, want)

    out, windows = _call_conv(causal_conv_varlen, conv, row_start, row_count)
    want_out, want_windows = _call_conv(reference.causal_conv_varlen, conv, row_start, row_count)
    assert out.shape == want_out.shape and windows.shape == want_windows.shape
    torch.testing.assert_close(out[inside], want_out[inside], rtol=1e-5, atol=1e-6)
    assert torch.isfinite(out).all()  # rows in no segment: unspecified, but finite
    assert torch.equal(windows, want_windows)  # copies only

    for chunk_size in (4, 64):  # the twin's chunks; segments above cross chunk boundaries at 4
        y, states = _call_scan(ssm_varlen_scan, scan, row_start, row_count, chunk_size)
        want_y, want_states = _call_scan(reference.ssm_varlen_scan, scan, row_start, row_count, chunk_size)
        torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states, want_states, rtol=1e-5, atol=1e-5)
        assert not y[~inside].any()  # exactly 0 on rows in no segment
        empty = row_count == 0
        assert torch.equal(states[empty], scan["states"][empty])  # a 0-row segment keeps its state bit for bit


def test_one_row_segments_read_their_history_from_the_window():
    """Hand-checked: W = 4, a 1-row segment reads window columns 0, 1, 2 then its own row; a 2-row
    segment's second row reads window columns 1, 2, then both rows; the new windows shift."""
    row_start, row_count = torch.tensor([0, 1, 3]), torch.tensor([1, 2, 0])
    windows = torch.arange(3 * 1 * 3, dtype=torch.float32).view(3, 1, 3) + 1  # [n, C = 1, W - 1]
    inputs = torch.tensor([[10.0], [20.0], [30.0]])  # [T, 1]
    weight, bias = torch.tensor([[1.0, 100.0, 1e4, 1e6]]), torch.zeros(1)
    out, new_windows = causal_conv_varlen(windows, inputs, row_start, row_count, weight, bias)
    pre = torch.tensor([1 + 100 * 2 + 1e4 * 3 + 1e6 * 10,
                        4 + 100 * 5 + 1e4 * 6 + 1e6 * 20,
                        5 + 100 * 6 + 1e4 * 20 + 1e6 * 30])
    torch.testing.assert_close(out[:, 0], F.silu(pre))
    assert new_windows[:, 0].tolist() == [[2.0, 3.0, 10.0], [6.0, 20.0, 30.0], [7.0, 8.0, 9.0]]


def test_strided_inputs_as_the_mixer_passes_them():
    """The mixer hands the conv a column slice of the projection and the scan views of the conv
    output (row strides wider than a row): same results as contiguous copies."""
    row_start, row_count, num_rows = _layout([("other", 2), ("prefill", 7), ("prefill", 3), ("other", 1)])
    conv, scan = _inputs(row_start.shape[0], num_rows, seed=5)
    wide = torch.randn(num_rows, CHANNELS + 3)
    wide[:, 2:2 + CHANNELS] = conv["inputs"]
    strided_conv = dict(conv, inputs=wide[:, 2:2 + CHANNELS])
    for got, want in zip(_call_conv(causal_conv_varlen, strided_conv, row_start, row_count),
                         _call_conv(causal_conv_varlen, conv, row_start, row_count)):
        assert torch.equal(got, want)
    packed = torch.randn(num_rows, HEADS * HEAD_DIM + 4)
    packed[:, :HEADS * HEAD_DIM] = scan["x"].reshape(num_rows, -1)
    strided_scan = dict(scan, x=packed[:, :HEADS * HEAD_DIM].view(num_rows, HEADS, HEAD_DIM),
                        states=scan["states"].transpose(2, 3).contiguous().transpose(2, 3))
    for got, want in zip(_call_scan(ssm_varlen_scan, strided_scan, row_start, row_count, 4),
                         _call_scan(ssm_varlen_scan, scan, row_start, row_count, 4)):
        assert torch.equal(got, want)


def _bad_conv_cases(conv, row_start, row_count):
    yield "inputs", dict(conv, inputs=conv["inputs"].double()), TypeError
    yield "windows", dict(conv, windows=conv["windows"][:, :, :1]), ValueError
    yield "weight", dict(conv, weight=conv["weight"][:, :1]), ValueError
    yield "bias", dict(conv, bias=conv["bias"][:2]), ValueError


def test_bad_inputs_are_named():
    row_start, row_count, num_rows = _layout([("prefill", 3), ("other", 2)])
    conv, scan = _inputs(2, num_rows, seed=0)
    for name, bad, error in _bad_conv_cases(conv, row_start, row_count):
        with pytest.raises(error, match=f"^{name} "):
            _call_conv(causal_conv_varlen, bad, row_start, row_count)
    for name, bad, error in (("x", dict(scan, x=scan["x"].half()), TypeError),
                             ("states", dict(scan, states=scan["states"][:, :1]), ValueError),
                             ("dt", dict(scan, dt=scan["dt"][:, :1]), ValueError),
                             ("B", dict(scan, B=scan["B"][:, :, :2]), ValueError),
                             ("C", dict(scan, C=scan["C"][:-1]), ValueError),
                             ("A", dict(scan, A=scan["A"][:1]), ValueError),
                             ("D", dict(scan, D=scan["D"].double()), TypeError)):
        with pytest.raises(error, match=f"^{name} "):
            _call_scan(ssm_varlen_scan, bad, row_start, row_count, 4)
    with pytest.raises(ValueError, match="^chunk_size "):
        _call_scan(ssm_varlen_scan, scan, row_start, row_count, 0)
    for op, args in ((causal_conv_varlen, (conv,)), (ssm_varlen_scan, (scan,))):
        call = _call_conv if op is causal_conv_varlen else (lambda o, s, a, b: _call_scan(o, s, a, b, 4))
        with pytest.raises(TypeError, match="^row_start "):
            call(op, *args, row_start.int(), row_count)
        with pytest.raises(ValueError, match="^row_count "):
            call(op, *args, row_start, row_count[:1])
        with pytest.raises(ValueError, match="^row_start "):  # strided: the kernels read it with unit stride
            call(op, *args, torch.stack((row_start, row_start), 1)[:, 0], row_count)
    with pytest.raises(ValueError, match="^num_rows "):
        segment_of_rows(row_start, row_count, -1)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "empty_step"])
def test_slot_pools_in_place_equal_gather_compute_scatter(layout):
    """With slot_ids the ops read each segment's state from a pool (the conv's window, the scan's
    state) and the scan writes its final state back in place: == the out-of-place op on gathered
    states, for the kernels and the twins. Slots are in random order; every 0-row segment shares one
    scratch slot, which stays untouched (as does every slot no segment names)."""
    row_start, row_count, num_rows = _layout(LAYOUTS[layout])
    num_segments = row_start.shape[0]
    conv, scan = _inputs(num_segments, num_rows, seed=7 * num_rows + num_segments)
    num_slots = num_segments + 3
    rng = random.Random(num_rows)
    real_slots = rng.sample(range(1, num_slots), num_segments)  # slot 0: the scratch slot
    slot_ids = torch.tensor([slot if count > 0 else 0 for slot, count in zip(real_slots, row_count.tolist())],
                            dtype=torch.int64)
    generator = torch.Generator().manual_seed(num_slots)
    window_pool = torch.randn(num_slots, CHANNELS, WIDTH - 1, generator=generator)
    state_pool = torch.randn(num_slots, HEADS, HEAD_DIM, STATE_SIZE, generator=generator)
    gathered_conv = dict(conv, windows=window_pool[slot_ids])
    gathered_scan = dict(scan, states=state_pool[slot_ids])
    inside = reference.segment_of_rows(row_start, row_count, num_rows)[2]

    for conv_op, scan_op in ((causal_conv_varlen, ssm_varlen_scan),
                             (reference.causal_conv_varlen, reference.ssm_varlen_scan)):
        want_out, want_windows = _call_conv(conv_op, gathered_conv, row_start, row_count)
        out, windows = conv_op(window_pool, conv["inputs"], row_start, row_count, conv["weight"], conv["bias"],
                               slot_ids=slot_ids)
        assert torch.equal(out[inside], want_out[inside]) and torch.equal(windows, want_windows)

        want_y, want_final = _call_scan(scan_op, gathered_scan, row_start, row_count, 4)
        pool = state_pool.clone()
        y, final = scan_op(pool, scan["x"], scan["dt"], scan["A"], scan["B"], scan["C"], scan["D"], row_start,
                           row_count, 4, slot_ids=slot_ids)
        assert final is None
        torch.testing.assert_close(y, want_y, rtol=0, atol=0)
        expected = state_pool.clone()
        for segment, slot in enumerate(slot_ids.tolist()):
            if row_count[segment] > 0:
                expected[slot] = want_final[segment]
        torch.testing.assert_close(pool, expected, rtol=0, atol=0)  # the scratch and unnamed slots unchanged


def test_slot_ids_are_checked():
    row_start, row_count, num_rows = _layout([("prefill", 3), ("other", 2)])
    conv, scan = _inputs(2, num_rows, seed=0)
    pool = torch.zeros(4, HEADS, HEAD_DIM, STATE_SIZE)
    for bad, error in ((torch.tensor([0, 1], dtype=torch.int32), TypeError), (torch.tensor([0]), ValueError)):
        with pytest.raises(error, match="^slot_ids "):
            ssm_varlen_scan(pool, scan["x"], scan["dt"], scan["A"], scan["B"], scan["C"], scan["D"], row_start,
                            row_count, 4, slot_ids=bad)
        with pytest.raises(error, match="^slot_ids "):
            causal_conv_varlen(torch.zeros(4, CHANNELS, WIDTH - 1), conv["inputs"], row_start, row_count,
                               conv["weight"], conv["bias"], slot_ids=bad)


def test_grouped_b_and_c_are_read_in_place():
    """heads_per_group: B and C [T, G, N] (head h reads group h // (H / G)) == the expanded [T, H, N]
    call, kernel and twin; a group count that does not divide the heads is rejected."""
    row_start, row_count, num_rows = _layout([("other", 2), ("prefill", 7), ("other", 0), ("prefill", 3)])
    _, scan = _inputs(row_start.shape[0], num_rows, seed=11)
    grouped = dict(scan, B=scan["B"][:, :1], C=scan["C"][:, 1:])  # G = 1 group of HEADS = 2 heads
    expanded = dict(scan, B=grouped["B"].expand(-1, HEADS, -1), C=grouped["C"].expand(-1, HEADS, -1))
    for op in (ssm_varlen_scan, reference.ssm_varlen_scan):
        want = _call_scan(op, expanded, row_start, row_count, 4)
        got = op(grouped["states"], grouped["x"], grouped["dt"], grouped["A"], grouped["B"], grouped["C"], grouped["D"],
                 row_start, row_count, 4, heads_per_group=HEADS)
        for got_tensor, want_tensor in zip(got, want):
            torch.testing.assert_close(got_tensor, want_tensor, rtol=0, atol=0)
    with pytest.raises(ValueError, match="^heads_per_group="):
        ssm_varlen_scan(scan["states"], scan["x"], scan["dt"], scan["A"], scan["B"], scan["C"], scan["D"], row_start,
                        row_count, 4, heads_per_group=3)
