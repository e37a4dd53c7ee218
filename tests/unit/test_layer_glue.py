"""Layer-glue kernels (interpreter) == their torch twins == megatron-core's unfused modules (the
Mamba mixer's gated norm: == the per-group formula)."""

import pytest
import torch
import torch.nn.functional as F

from mtp_ctrl.triton_ops import add_bias_residual_norm, bias_activation, gated_rms_norm, reference, split_qkv_heads

# fp32: reduction order and libm-vs-Triton transcendentals; bf16: one rounding of the norm / activation
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _randn(generator, *shape, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(*shape, generator=generator)).to(dtype)


def _rows(generator, num_tokens, width, dtype, padding_rows=2):
    """[T, width] rows whose last ``padding_rows`` rows are zeros (a CUDA-graph bucket's padding),
    as a view with a row stride wider than the width (the kernels must take strided rows)."""
    storage = _randn(generator, num_tokens, width + 3, dtype=dtype, scale=2.0)
    if padding_rows:
        storage[num_tokens - padding_rows:] = 0
    return storage[:, :width]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rms_norm", [False, True])
@pytest.mark.parametrize("num_tokens,width", [(0, 8), (1, 1), (5, 37), (7, 64), (3, 300)])
def test_add_bias_residual_norm_matches_twin_and_torch(dtype, rms_norm, num_tokens, width):
    generator = torch.Generator().manual_seed(num_tokens * 1000 + width)
    x = _rows(generator, num_tokens, width, dtype, padding_rows=min(2, num_tokens))
    residual = _rows(generator, num_tokens, width, dtype, padding_rows=min(2, num_tokens))
    bias = _randn(generator, width, dtype=dtype)
    weight = _randn(generator, width, dtype=dtype) + 1
    norm_bias = None if rms_norm else _randn(generator, width, dtype=dtype)
    for case_bias in (bias, None):
        got_residual, got_normed = add_bias_residual_norm(x, case_bias, residual, weight, norm_bias, 1e-5, rms_norm)
        want_residual, want_normed = reference.add_bias_residual_norm(x, case_bias, residual, weight, norm_bias,
                                                                      1e-5, rms_norm)
        assert torch.equal(got_residual, want_residual)  # same roundings: bitwise
        torch.testing.assert_close(got_normed, want_normed, **TOLERANCE[dtype])
        # megatron's unfused path: in-place bias add, residual add, then torch's norm module
        megatron_residual = residual + (x if case_bias is None else x + case_bias)
        assert torch.equal(want_residual, megatron_residual)
        if rms_norm:
            torch_norm = F.rms_norm(megatron_residual.float(), (width,), weight.float(), 1e-5)
        else:
            torch_norm = F.layer_norm(megatron_residual.float(), (width,), weight.float(), norm_bias.float(), 1e-5)
        torch.testing.assert_close(want_normed, torch_norm.to(dtype), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_bias_residual_without_norm(dtype):
    generator = torch.Generator().manual_seed(3)
    x, residual = _rows(generator, 6, 33, dtype), _rows(generator, 6, 33, dtype)
    bias = _randn(generator, 33, dtype=dtype)
    got, normed = add_bias_residual_norm(x, bias, residual)
    assert normed is None
    assert torch.equal(got, residual + (x + bias))
    assert torch.equal(got, reference.add_bias_residual_norm(x, bias, residual)[0])


def test_add_bias_residual_norm_known_answer():
    x, residual = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.0]])
    new_residual, normed = reference.add_bias_residual_norm(x, None, residual, torch.ones(2), None, 1e-6)
    assert new_residual.tolist() == [[2.0, 2.0]] and normed.tolist() == [[0.0, 0.0]]
    new_residual, normed = add_bias_residual_norm(x, torch.tensor([1.0, -2.0]), residual, torch.ones(2), None, 0.0,
                                                  rms_norm=True)
    assert new_residual.tolist() == [[3.0, 0.0]]
    torch.testing.assert_close(normed, torch.tensor([[2 ** 0.5, 0.0]]))  # 3 / sqrt(9 / 2)


_TORCH_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
                      "relu": F.relu}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", sorted(_TORCH_ACTIVATIONS))
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("num_tokens,width", [(0, 4), (1, 3), (6, 50), (2, 1500)])
def test_bias_activation_matches_twin_and_megatron(dtype, activation, gated, num_tokens, width):
    generator = torch.Generator().manual_seed(num_tokens * 100 + width + gated)
    full = 2 * width if gated else width
    x = _rows(generator, num_tokens, full, dtype, padding_rows=min(1, num_tokens))
    bias = _randn(generator, full, dtype=dtype)
    for case_bias in (bias, None):
        got = bias_activation(x, case_bias, activation, gated)
        want = reference.bias_activation(x, case_bias, activation, gated)
        assert got.shape == (num_tokens, width) and got.dtype == dtype
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])
        hidden = x if case_bias is None else x + case_bias  # megatron's MLP: bias add, then act / glu
        act = _TORCH_ACTIVATIONS[activation]
        if gated:
            first, second = torch.chunk(hidden, 2, dim=-1)
            megatron = act(first) * second
        else:
            megatron = act(hidden)
        assert torch.equal(want, megatron)


def test_bias_activation_known_answer():
    assert bias_activation(torch.tensor([[-1.0, 2.0]]), None, "relu").tolist() == [[0.0, 2.0]]
    gated = bias_activation(torch.tensor([[-1.0, 2.0]]), torch.tensor([3.0, 0.0]), "relu", gated=True)
    assert gated.tolist() == [[4.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,groups,per_group,head_dim", [(0, 2, 2, 8), (1, 1, 1, 4), (5, 2, 3, 6),
                                                                  (4, 4, 4, 16), (3, 3, 1, 5)])
def test_split_qkv_heads_matches_twin_and_megatron(dtype, num_tokens, groups, per_group, head_dim):
    generator = torch.Generator().manual_seed(num_tokens + 10 * groups + per_group)
    width = groups * (per_group + 2) * head_dim
    mixed = _rows(generator, num_tokens, width, dtype, padding_rows=min(1, num_tokens))
    bias = _randn(generator, width, dtype=dtype)
    for case_bias in (bias, None):
        got = split_qkv_heads(mixed, case_bias, groups, head_dim)
        want = reference.split_qkv_heads(mixed, case_bias, groups, head_dim)
        # megatron's SelfAttention: bias add in the linear, view per group, split, reshape the query
        hidden = mixed if case_bias is None else mixed + case_bias
        hidden = hidden.view(num_tokens, groups, (per_group + 2) * head_dim)
        query, key, value = torch.split(hidden, [per_group * head_dim, head_dim, head_dim], dim=2)
        megatron = (query.reshape(num_tokens, groups * per_group, head_dim), key.reshape(num_tokens, groups, head_dim),
                    value.reshape(num_tokens, groups, head_dim))
        for got_part, want_part, megatron_part in zip(got, want, megatron):
            assert got_part.is_contiguous()
            assert torch.equal(got_part, want_part) and torch.equal(want_part, megatron_part)


def test_split_qkv_heads_known_answer():
    row = torch.arange(8.0)[None]  # [q0 q1 k0 v0 q2 q3 k1 v1] with D = 1, G = 2
    query, key, value = split_qkv_heads(row, None, num_kv_heads=2, head_dim=1)
    assert query.flatten().tolist() == [0, 1, 4, 5] and key.flatten().tolist() == [2, 6]
    assert value.flatten().tolist() == [3, 7]


def test_validation_errors_name_the_argument():
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="residual"):
        add_bias_residual_norm(x, None, torch.zeros(2, 5))
    with pytest.raises(TypeError, match="bias"):
        add_bias_residual_norm(x, torch.zeros(4, dtype=torch.bfloat16), x)
    with pytest.raises(ValueError, match="norm_bias"):
        add_bias_residual_norm(x, None, x, torch.ones(4), torch.ones(4), rms_norm=True)
    with pytest.raises(ValueError, match="eps"):
        add_bias_residual_norm(x, None, x, torch.ones(4), eps=-1.0)
    with pytest.raises(ValueError, match="activation"):
        bias_activation(x, None, "tanh")
    with pytest.raises(ValueError, match="gated"):
        bias_activation(torch.zeros(2, 3), None, "gelu", gated=True)
    with pytest.raises(ValueError, match="mixed_qkv"):
        split_qkv_heads(torch.zeros(2, 10), None, num_kv_heads=2, head_dim=2)
    with pytest.raises(TypeError, match="num_kv_heads"):
        split_qkv_heads(x, None, num_kv_heads=1.0, head_dim=1)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,width,group_size", [(0, 8, 4), (1, 1, 1), (5, 48, 16), (6, 40, 40), (3, 300, 75)])
def test_gated_rms_norm_matches_twin_and_formula(out_dtype, num_tokens, width, group_size):
    """Padding rows (zeros: the output is 0, not NaN), strided rows, groups that are not a power of
    two, one group and one channel; fp32 inputs as the mixer gives them, a bf16 weight as a bf16
    model holds it."""
    generator = torch.Generator().manual_seed(num_tokens * 1000 + width + group_size)
    y = _rows(generator, num_tokens, width, torch.float32, padding_rows=min(2, num_tokens))
    gate = _rows(generator, num_tokens, width, torch.float32, padding_rows=min(2, num_tokens)) * 4
    weight = (_randn(generator, width) + 1).to(torch.bfloat16)
    got = gated_rms_norm(y, gate, weight, group_size, 1e-5, out_dtype)
    want = reference.gated_rms_norm(y, gate, weight, group_size, 1e-5, out_dtype)
    assert got.dtype == out_dtype and got.shape == (num_tokens, width)
    torch.testing.assert_close(got, want, **TOLERANCE[out_dtype])
    assert torch.isfinite(got).all()
    gated = y * gate * torch.sigmoid(gate)
    for start in range(0, width, group_size):
        group = gated[:, start:start + group_size]
        formula = group / torch.sqrt(group.pow(2).mean(-1, keepdim=True) + 1e-5) * weight[start:start + group_size].float()
        torch.testing.assert_close(got[:, start:start + group_size], formula.to(out_dtype), **TOLERANCE[out_dtype])


def test_gated_rms_norm_known_answer():
    """silu(30) = 30 to fp32 precision: g = [60, 60], mean square 3600, so g / 60 = [1, 1]."""
    out = gated_rms_norm(torch.tensor([[2.0, 2.0]]), torch.tensor([[30.0, 30.0]]), torch.ones(2), 2, 0.0)
    torch.testing.assert_close(out, torch.tensor([[1.0, 1.0]]))


def test_gated_rms_norm_validation_names_the_argument():
    y = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm(y, torch.zeros(2, 4), torch.ones(8), 4, 1e-5)
    with pytest.raises(ValueError, match="weight"):
        gated_rms_norm(y, y, torch.ones(7), 4, 1e-5)
    with pytest.raises(ValueError, match="group_size"):
        gated_rms_norm(y, y, torch.ones(8), 3, 1e-5)
    with pytest.raises(ValueError, match="eps"):
        gated_rms_norm(y, y, torch.ones(8), 4, -1.0)
    with pytest.raises(TypeError, match="out_dtype"):
        gated_rms_norm(y, y, torch.ones(8), 4, 1e-5, torch.int32)
