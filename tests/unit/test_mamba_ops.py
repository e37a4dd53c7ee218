"""The Mamba-2 math: chunked scan == row-by-row recurrence, chunked conv == row-by-row conv,
the gated norm per group; random shapes, initial states and chunk boundaries. The varlen conv
and scan over a whole step's packed rows == the per-request ones, segment by segment."""

import random

import pytest
import torch
import torch.nn.functional as F

from mtp_ctrl.triton_ops import causal_conv_varlen, segment_of_rows, ssm_varlen_scan
from tests.unit.mamba_oracle import causal_conv_chunk, causal_conv_step, ssm_chunk_scan, ssm_step
from mtp_ctrl.triton_ops.reference import gated_rms_norm


def _ssm_inputs(generator, rows, heads=3, head_dim=4, state_size=5):
    def rand(*shape):
        return torch.randn(*shape, generator=generator)
    dt = F.softplus(rand(rows, heads))  # [q, H] > 0
    A = -torch.rand(heads, generator=generator) * 4 - 0.1  # [H] < 0
    return (rand(heads, head_dim, state_size), rand(rows, heads, head_dim), dt, A,
            rand(rows, heads, state_size), rand(rows, heads, state_size), rand(heads))


@pytest.mark.parametrize("rows,chunk_size", [(1, 4), (4, 4), (7, 3), (13, 4), (20, 64)])
@pytest.mark.parametrize("seed", range(3))
def test_chunk_scan_equals_the_recurrence(rows, chunk_size, seed):
    generator = torch.Generator().manual_seed(seed)
    state0, x, dt, A, B, C, D = _ssm_inputs(generator, rows)
    y, final = ssm_chunk_scan(state0, x, dt, A, B, C, D, chunk_size=chunk_size)
    state, outputs = state0[None], []
    for t in range(rows):
        y_t, state = ssm_step(state, x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D)
        outputs.append(y_t[0])
    torch.testing.assert_close(y, torch.stack(outputs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, state[0], rtol=1e-5, atol=1e-5)


def test_ssm_step_is_the_documented_recurrence():
    generator = torch.Generator().manual_seed(3)
    state0, x, dt, A, B, C, D = _ssm_inputs(generator, rows=1, heads=2, head_dim=3, state_size=2)
    y, state = ssm_step(state0[None], x, dt, A, B, C, D)
    for h in range(2):
        expected_state = torch.exp(dt[0, h] * A[h]) * state0[h] + dt[0, h] * torch.outer(x[0, h], B[0, h])
        torch.testing.assert_close(state[0, h], expected_state)
        torch.testing.assert_close(y[0, h], expected_state @ C[0, h] + D[h] * x[0, h])


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("split", [1, 5, 8])
def test_conv_chunks_equal_row_steps_and_a_zero_padded_conv(width, split):
    """Two chunks (split anywhere) == row-by-row steps == torch's padded conv1d from zero state."""
    generator = torch.Generator().manual_seed(width * 10 + split)
    channels, rows = 6, 9
    weight, bias = torch.randn(channels, width, generator=generator), torch.randn(channels, generator=generator)
    inputs = torch.randn(rows, channels, generator=generator)
    window0 = torch.zeros(channels, width - 1)
    first, window = causal_conv_chunk(window0, inputs[:split], weight, bias)
    second, window = causal_conv_chunk(window, inputs[split:], weight, bias)
    chunked = torch.cat((first, second))
    step_window, stepped = window0[None], []
    for t in range(rows):
        out, step_window = causal_conv_step(step_window, inputs[t:t + 1], weight, bias)
        stepped.append(out[0])
    torch.testing.assert_close(chunked, torch.stack(stepped))
    torch.testing.assert_close(window, step_window[0])
    reference = F.conv1d(inputs.t()[None], weight[:, None], bias, padding=width - 1, groups=channels)[0, :, :rows]
    torch.testing.assert_close(chunked, F.silu(reference.t()), rtol=1e-5, atol=1e-5)


def test_gated_norm_normalises_each_group_on_its_own():
    generator = torch.Generator().manual_seed(0)
    y, gate, weight = torch.randn(3, 8, generator=generator), torch.randn(3, 8, generator=generator), torch.rand(8)
    out = gated_rms_norm(y, gate, weight, group_size=4, eps=1e-5)
    for group in (slice(0, 4), slice(4, 8)):
        gated = y[:, group] * torch.sigmoid(gate[:, group]) * gate[:, group]
        expected = gated / torch.sqrt((gated ** 2).mean(-1, keepdim=True) + 1e-5) * weight[group]
        torch.testing.assert_close(out[:, group], expected)


def _packed_layout(pieces):
    """``pieces``: ("prefill", q) a segment of q rows; ("other", q) q rows of no segment (decode
    rows) behind a 0-row segment, as the controller lays them out; ("pad", q) trailing padding
    rows behind a 0-row segment. -> (row_start [n], row_count [n], T)."""
    starts, counts, row = [], [], 0
    for kind, rows in pieces:
        starts.append(row)
        counts.append(rows if kind == "prefill" else 0)
        row += rows
    return torch.tensor(starts, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64), row


def _random_pieces(rng):
    pieces = [("other", rng.choice([0, 3])) for _ in range(rng.randint(0, 2))]
    pieces += [("prefill", rng.randint(1, 11)) for _ in range(rng.randint(0, 4))]
    return pieces + [("pad", rng.randint(0, 5))]


LAYOUTS = {
    "no_prefill": [("other", 3), ("other", 3), ("pad", 2)],
    "one_row": [("prefill", 1)],
    "crossing_chunks": [("other", 3), ("prefill", 7), ("prefill", 5), ("prefill", 9), ("pad", 3)],
    "short_after_long": [("prefill", 13), ("prefill", 1), ("prefill", 2), ("pad", 1), ("pad", 0)],
    "empty_step": [],
    **{f"random{seed}": _random_pieces(random.Random(seed)) for seed in range(4)},
}


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_varlen_conv_and_scan_equal_the_per_request_ones(layout, chunk_size):
    """Every segment's rows, final conv window and final SSM state equal causal_conv_chunk and
    ssm_chunk_scan run on that segment alone from the same (random, non-zero) initial state; a
    0-row segment keeps its window and state bit for bit; rows of no segment get y = 0."""
    row_start, row_count, num_rows = _packed_layout(LAYOUTS[layout])
    generator = torch.Generator().manual_seed(len(layout) * 7 + chunk_size)
    n, channels, width = row_start.shape[0], 6, 4
    states, x, dt, A, B, C, D = _ssm_inputs(generator, num_rows)
    states = torch.randn(n, *states.shape, generator=generator)  # [n, H, P, N]
    windows = torch.randn(n, channels, width - 1, generator=generator)
    inputs = torch.randn(num_rows, channels, generator=generator)
    weight, bias = torch.randn(channels, width, generator=generator), torch.randn(channels, generator=generator)

    y, final = ssm_varlen_scan(states, x, dt, A, B, C, D, row_start, row_count, chunk_size)
    conv_out, new_windows = causal_conv_varlen(windows, inputs, row_start, row_count, weight, bias)
    assert y.shape == x.shape and final.shape == states.shape
    assert conv_out.shape == inputs.shape and new_windows.shape == windows.shape
    inside = torch.zeros(num_rows, dtype=torch.bool)
    for g, (start, count) in enumerate(zip(row_start.tolist(), row_count.tolist())):
        if count == 0:
            assert torch.equal(final[g], states[g]) and torch.equal(new_windows[g], windows[g])
            continue
        rows = slice(start, start + count)
        inside[rows] = True
        want_y, want_state = ssm_chunk_scan(states[g], x[rows], dt[rows], A, B[rows], C[rows], D, chunk_size)
        torch.testing.assert_close(y[rows], want_y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[g], want_state, rtol=1e-5, atol=1e-5)
        want_out, want_window = causal_conv_chunk(windows[g], inputs[rows], weight, bias)
        torch.testing.assert_close(conv_out[rows], want_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new_windows[g], want_window)
    assert torch.equal(segment_of_rows(row_start, row_count, num_rows)[2], inside)
    assert not y[~inside].any()
    assert torch.isfinite(conv_out).all()


def test_segment_of_rows_worked_example():
    segment, offset, inside = segment_of_rows(torch.tensor([0, 3, 5, 7]), torch.tensor([0, 2, 1, 0]), 7)
    assert segment.tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert offset.tolist() == [0, 1, 2, 0, 1, 0, 1]
    assert inside.tolist() == [False, False, False, True, True, True, False]
