"""The Mamba-2 math: chunked scan == row-by-row recurrence, chunked conv == row-by-row conv,
the gated norm per group; random shapes, initial states and chunk boundaries."""

import pytest
import torch
import torch.nn.functional as F

from mtp_ctrl.models.mamba_ops import causal_conv_chunk, causal_conv_step, gated_rms_norm, ssm_chunk_scan, ssm_step


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
