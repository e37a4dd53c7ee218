"""Mamba kernels on CUDA: the varlen prefill kernels and mamba_decode_rows == their torch twins at a
hybrid layer's sizes (32 heads of 64, 8 groups of state 128, 4096 conv channels) on mixed, long and
empty layouts; captured in a CUDA graph with no host sync and replayed with other segment lengths
(same T, n), other slots and other values."""

import pytest
import torch
import torch.nn.functional as F

from mtp_ctrl.triton_ops import (causal_conv_varlen, mamba_decode_rows, mamba_varlen, reference, segment_of_rows,
                                 ssm_varlen_scan)
from tests.functional.sync_checks import no_host_sync

HEADS, HEAD_DIM, STATE_SIZE, GROUPS, WIDTH = 32, 64, 128, 8, 4
CHANNELS = HEADS * HEAD_DIM + 2 * GROUPS * STATE_SIZE  # 4096
TOLERANCE = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(autouse=True)
def full_fp32_matmuls():
    """The twins' einsums in true fp32 (another test of the session may have turned TF32 on)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _segments(pieces):
    """``pieces``: (rows, is_prefill) -> (row_start [n], row_count [n] int64 on CUDA, T); rows that
    are not prefill lie behind a 0-row segment, as the controller lays out decode rows and padding."""
    starts, counts, row = [], [], 0
    for rows, is_prefill in pieces:
        starts.append(row)
        counts.append(rows if is_prefill else 0)
        row += rows
    return (torch.tensor(starts, dtype=torch.int64, device="cuda"),
            torch.tensor(counts, dtype=torch.int64, device="cuda"), row)


LAYOUTS = {
    "mixed: 8 decodes x 3 + 40": [(3, False)] * 8 + [(40, True), (0, False)],
    "one prompt of 700": [(700, True), (12, False)],
    "8 chunks of 33 and 1-row ones": [(33, True)] * 8 + [(1, True)] * 4 + [(7, False)],
    "no prefill": [(3, False)] * 4,
}


def _inputs(num_segments, num_rows, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator, device="cuda") * scale
    conv = (rand(num_segments, CHANNELS, WIDTH - 1), rand(num_rows, CHANNELS), None, None,
            rand(CHANNELS, WIDTH, scale=0.5), rand(CHANNELS))
    scan = (rand(num_segments, HEADS, HEAD_DIM, STATE_SIZE, scale=0.1), rand(num_rows, HEADS, HEAD_DIM),
            F.softplus(rand(num_rows, HEADS) - 2), -torch.rand(HEADS, generator=generator, device="cuda") * 4 - 0.1,
            rand(num_rows, HEADS, STATE_SIZE, scale=0.1), rand(num_rows, HEADS, STATE_SIZE, scale=0.1), rand(HEADS))
    return conv, scan


def _run(conv_op, scan_op, conv, scan, row_start, row_count, num_rows):
    windows, inputs, _, _, weight, bias = conv
    out, new_windows = conv_op(windows, inputs, row_start, row_count, weight, bias)
    y, states = scan_op(*scan, row_start, row_count, 64)
    return out, new_windows, y, states


def _assert_equal_to_twins(got, want, inside):
    out, windows, y, states = got
    want_out, want_windows, want_y, want_states = want
    torch.testing.assert_close(out[inside], want_out[inside], **TOLERANCE)
    assert torch.isfinite(out).all()
    assert torch.equal(windows, want_windows)
    torch.testing.assert_close(y, want_y, **TOLERANCE)
    assert not y[~inside].any()
    torch.testing.assert_close(states, want_states, **TOLERANCE)


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_kernels_equal_twins(layout):
    row_start, row_count, num_rows = _segments(LAYOUTS[layout])
    conv, scan = _inputs(row_start.shape[0], num_rows, seed=len(layout))
    inside = reference.segment_of_rows(row_start, row_count, num_rows)[2]
    for got, want in zip(segment_of_rows(row_start, row_count, num_rows),
                         reference.segment_of_rows(row_start, row_count, num_rows)):
        assert torch.equal(got, want)
    got = _run(causal_conv_varlen, ssm_varlen_scan, conv, scan, row_start, row_count, num_rows)
    want = _run(reference.causal_conv_varlen, reference.ssm_varlen_scan, conv, scan, row_start, row_count, num_rows)
    _assert_equal_to_twins(got, want, inside)
    empty = row_count == 0
    assert torch.equal(got[3][empty], scan[0][empty])


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_every_scan_tiling_rounds_alike(monkeypatch, layout):
    """A step's shape picks the scan's tiling (``_scan_tiling``), and a speculative run and a plain
    one cut the same prompt into steps of other shapes: each tiling, pipelined or not, must give
    the same bits, or a near-tie token could differ between them."""
    row_start, row_count, num_rows = _segments(LAYOUTS[layout])
    _, scan = _inputs(row_start.shape[0], num_rows, seed=7 + len(layout))
    results = []
    for tiling in ((4, 1, 4), (4, 1, 1), (4, 1, 2), (8, 2, 4), (16, 4, 1), (32, 4, 1)):
        monkeypatch.setattr(mamba_varlen, "_scan_tiling", lambda *args, tiling=tiling: tiling)
        results.append(ssm_varlen_scan(*scan, row_start, row_count, 64))
    for y, states in results[1:]:
        assert torch.equal(y, results[0][0]) and torch.equal(states, results[0][1])


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_slot_pools_in_place_under_a_graph(layout):
    """With slot_ids (pools, 0-row segments on one scratch slot), captured and replayed: the scan's
    pool == the out-of-place twin's final states at the real slots, untouched elsewhere."""
    row_start, row_count, num_rows = _segments(LAYOUTS[layout])
    num_segments = row_start.shape[0]
    conv, scan = _inputs(num_segments, num_rows, seed=3 + len(layout))
    slot_ids = torch.where(row_count > 0, torch.randperm(num_segments, device="cuda") + 1, 0)  # 0: scratch
    window_pool = torch.randn(num_segments + 1, CHANNELS, WIDTH - 1, device="cuda")
    state_pool = torch.randn(num_segments + 1, HEADS, HEAD_DIM, STATE_SIZE, device="cuda") * 0.1
    windows, inputs, _, _, weight, bias = conv
    want_out, want_windows = reference.causal_conv_varlen(window_pool[slot_ids], inputs, row_start, row_count,
                                                          weight, bias)
    inside = reference.segment_of_rows(row_start, row_count, num_rows)[2]

    pool = state_pool.clone()
    x, dt, A, B, C, D = scan[1:]
    heads_per_group = HEADS // GROUPS  # B and C as the mixer passes them: one [N] row per group, read in place
    B, C = B[:, ::heads_per_group].contiguous(), C[:, ::heads_per_group].contiguous()  # [T, G, N]
    want_y, want_final = reference.ssm_varlen_scan(state_pool[slot_ids], x, dt, A,
                                                   B.repeat_interleave(heads_per_group, dim=1),
                                                   C.repeat_interleave(heads_per_group, dim=1), D,
                                                   row_start, row_count, 64)
    expected = state_pool.clone()
    expected[slot_ids[row_count > 0]] = want_final[row_count > 0]

    def step():
        out, new_windows = causal_conv_varlen(window_pool, inputs, row_start, row_count, weight, bias,
                                              slot_ids=slot_ids)
        y, _ = ssm_varlen_scan(pool, x, dt, A, B, C, D, row_start, row_count, 64, slot_ids=slot_ids,
                               heads_per_group=heads_per_group)
        return out, new_windows, y
    step()  # compile
    pool.copy_(state_pool)
    graph = torch.cuda.CUDAGraph()
    with no_host_sync(), torch.cuda.graph(graph):
        out, new_windows, y = step()
    pool.copy_(state_pool)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out[inside], want_out[inside], **TOLERANCE)
    assert torch.equal(new_windows, want_windows)
    torch.testing.assert_close(y, want_y, **TOLERANCE)
    torch.testing.assert_close(pool, expected, **TOLERANCE)


def test_empty_step():
    row_start = torch.zeros(0, dtype=torch.int64, device="cuda")
    conv, scan = _inputs(0, 0, seed=0)
    out, windows, y, states = _run(causal_conv_varlen, ssm_varlen_scan, conv, scan, row_start, row_start, 0)
    assert out.shape == (0, CHANNELS) and windows.shape == (0, CHANNELS, WIDTH - 1)
    assert y.shape == (0, HEADS, HEAD_DIM) and states.shape == (0, HEADS, HEAD_DIM, STATE_SIZE)


def test_graph_replay_with_new_segments_and_values_without_host_sync():
    """Capture once at (T, n) = (96, 10); replay with other chunk lengths written into the static
    row_start / row_count and new values in every input: equal to the twins each time."""
    pieces = [(3, False)] * 8 + [(72, True), (0, False)]
    row_start, row_count, num_rows = _segments(pieces)
    conv, scan = _inputs(row_start.shape[0], num_rows, seed=1)
    static = [t for t in conv + scan if t is not None]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile off the capture
        _run(causal_conv_varlen, ssm_varlen_scan, conv, scan, row_start, row_count, num_rows)
        segment_of_rows(row_start, row_count, num_rows)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with no_host_sync():
        with torch.cuda.graph(graph):
            outputs = _run(causal_conv_varlen, ssm_varlen_scan, conv, scan, row_start, row_count, num_rows)
            inside_out = segment_of_rows(row_start, row_count, num_rows)[2]
    new_layouts = [[(3, False)] * 2 + [(1, True)] * 6 + [(40, True), (44, False)],
                   [(96, True)] + [(0, False)] * 9,
                   pieces]
    for seed, layout in enumerate(new_layouts, start=2):
        new_start, new_count, rows = _segments(layout)
        assert rows == num_rows and new_start.shape == row_start.shape
        row_start.copy_(new_start)
        row_count.copy_(new_count)
        new_conv, new_scan = _inputs(row_start.shape[0], num_rows, seed=seed)
        for target, source in zip(static, [t for t in new_conv + new_scan if t is not None]):
            target.copy_(source)
        graph.replay()
        want = _run(reference.causal_conv_varlen, reference.ssm_varlen_scan, conv, scan, row_start, row_count,
                    num_rows)
        inside = reference.segment_of_rows(row_start, row_count, num_rows)[2]
        assert torch.equal(inside_out, inside)
        _assert_equal_to_twins(outputs, want, inside)


def _decode_case(num_rows, seed, layers=3, slots=10, rows_per_request=3):
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator, device="cuda") * scale
    states = dict(conv_states=rand(layers, slots, CHANNELS, WIDTH - 1),
                  ssm_states=rand(layers, slots, HEADS, HEAD_DIM, STATE_SIZE, scale=0.1),
                  intermediate_conv_states=rand(layers, slots, rows_per_request, CHANNELS, WIDTH - 1),
                  intermediate_ssm_states=rand(layers, slots, rows_per_request, HEADS, HEAD_DIM, STATE_SIZE))
    rest = dict(xbc=rand(num_rows, CHANNELS), dt=F.softplus(rand(num_rows, HEADS) - 2),
                weight=rand(CHANNELS, WIDTH, scale=0.5), bias=rand(CHANNELS),
                A=-torch.rand(HEADS, generator=generator, device="cuda") * 4 - 0.1, D=rand(HEADS))
    return states, rest


def _decode(op, states, slot_ids, rest, layer=1):
    return op(states["conv_states"], states["ssm_states"], states["intermediate_conv_states"],
              states["intermediate_ssm_states"], layer, slot_ids, rest["xbc"], rest["dt"], rest["weight"],
              rest["bias"], rest["A"], rest["D"])


def _assert_decode_equal(y, states, want_y, want_states):
    torch.testing.assert_close(y, want_y, **TOLERANCE)
    for name in ("conv_states", "ssm_states", "intermediate_conv_states"):
        assert torch.equal(states[name], want_states[name])  # read only / copies only
    torch.testing.assert_close(states["intermediate_ssm_states"], want_states["intermediate_ssm_states"], **TOLERANCE)


@pytest.mark.parametrize("layer", ["first", "last"])
@pytest.mark.parametrize("num_rows", [24, 20], ids=["rows_fit", "rows_past_T"])
def test_decode_rows_equal_twin(num_rows, layer):
    states, rest = _decode_case(num_rows, seed=num_rows)
    layer = 0 if layer == "first" else states["ssm_states"].shape[0] - 1  # layer 1 alone is a constant to triton
    slot_ids = torch.tensor([7, 0, 3, 9, 1, 2, 5, 8], device="cuda")  # 8 requests of 3 rows
    want_states = {name: value.clone() for name, value in states.items()}
    y = _decode(mamba_decode_rows, states, slot_ids, rest, layer)
    want_y = _decode(reference.mamba_decode_rows, want_states, slot_ids, rest, layer)
    _assert_decode_equal(y, states, want_y, want_states)


def test_decode_rows_graph_replay_with_new_slots_without_host_sync():
    states, rest = _decode_case(24, seed=5)
    slot_ids = torch.tensor([7, 0, 3, 9, 1, 2, 5, 8], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile off the capture
        _decode(mamba_decode_rows, states, slot_ids, rest)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with no_host_sync():
        with torch.cuda.graph(graph):
            y = _decode(mamba_decode_rows, states, slot_ids, rest)
    for seed, slots in ((6, [1, 2, 3, 4, 5, 6, 7, 8]), (7, [9, 8, 7, 6, 5, 4, 3, 2])):
        new_states, new_rest = _decode_case(24, seed=seed)
        for name, value in new_states.items():
            states[name].copy_(value)
        for name, value in new_rest.items():
            rest[name].copy_(value)
        slot_ids.copy_(torch.tensor(slots, device="cuda"))
        want_states = {name: value.clone() for name, value in states.items()}
        graph.replay()
        want_y = _decode(reference.mamba_decode_rows, want_states, slot_ids, rest)
        _assert_decode_equal(y, states, want_y, want_states)
