"""mamba_decode_rows: the kernel through Triton's interpreter == its torch twin (y, every
intermediate buffer, current states untouched) on random slots, 1 or 3 rows per request, rows past
T, 1 or 2 groups, conv widths 2 and 4, bf16 states; the twin == the per-row step functions of
tests/unit/mamba_oracle.py; a shared scratch slot leaves the real slots right; errors name the
argument. And PagedMambaMixer with its kernels (decode rows + varlen prefill, interpreted) == with
its twins over a padded mixed step (the other model tests run the twins: tests/unit/conftest.py)."""

import pytest
import torch
import torch.nn.functional as F

from mtp_ctrl.models import MambaForward
from mtp_ctrl.models.forward_context import paged_forward_context
from mtp_ctrl.controllers import InferenceConfig
from tests.unit.mamba_oracle import causal_conv_step, ssm_step
from mtp_ctrl.triton_ops import mamba_decode_rows, reference
from tests.unit.megatron_fixtures import make_metadata
from tests.unit.test_mamba_reference import S, make_slots, random_mixer

LAYERS, SLOTS = 2, 6


def _case(seed, rows_per_request=3, heads=4, head_dim=5, state_size=3, groups=2, width=4, num_rows=8,
          dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator)
    channels = heads * head_dim + 2 * groups * state_size
    states = dict(conv_states=rand(LAYERS, SLOTS, channels, width - 1).to(dtype),
                  ssm_states=rand(LAYERS, SLOTS, heads, head_dim, state_size).to(dtype),
                  intermediate_conv_states=rand(LAYERS, SLOTS, rows_per_request, channels, width - 1).to(dtype),
                  intermediate_ssm_states=rand(LAYERS, SLOTS, rows_per_request, heads, head_dim, state_size).to(dtype))
    rest = dict(xbc=rand(num_rows, channels), dt=F.softplus(rand(num_rows, heads)), weight=rand(channels, width),
                bias=rand(channels), A=-torch.rand(heads, generator=generator) * 2 - 0.1, D=rand(heads))
    return states, rest


def _call(op, states, layer, slot_ids, rest):
    return op(states["conv_states"], states["ssm_states"], states["intermediate_conv_states"],
              states["intermediate_ssm_states"], layer, slot_ids, rest["xbc"], rest["dt"], rest["weight"],
              rest["bias"], rest["A"], rest["D"])


def _clone(states):
    return {name: tensor.clone() for name, tensor in states.items()}


CASES = {  # name: (slot ids, _case arguments)
    "three_requests_past_T": ([4, 1, 3], dict()),  # 9 rows of 8: the last request's last row reads zeros
    "no_request": ([], dict()),
    "one_row_each": ([0, 5, 2], dict(rows_per_request=1, num_rows=3)),
    "one_group_width_2": ([2, 3], dict(groups=1, width=2, head_dim=17, num_rows=6)),  # 2 head-dim tiles
    "bf16_states": ([1, 0], dict(dtype=torch.bfloat16)),
}


@pytest.mark.parametrize("layer", [0, LAYERS - 1])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_kernel_equals_twin(case, layer):
    slot_list, arguments = CASES[case]
    states, rest = _case(len(case), **arguments)
    slot_ids = torch.tensor(slot_list, dtype=torch.int64)
    before = _clone(states)
    want_states = _clone(states)
    y = _call(mamba_decode_rows, states, layer, slot_ids, rest)
    want_y = _call(reference.mamba_decode_rows, want_states, layer, slot_ids, rest)
    tolerance = dict(rtol=1e-5, atol=1e-5) if arguments.get("dtype") is None else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    for name in ("intermediate_conv_states", "intermediate_ssm_states"):
        torch.testing.assert_close(states[name], want_states[name], **tolerance)
        untouched = torch.ones(LAYERS, SLOTS, dtype=torch.bool)
        untouched[layer, slot_ids] = False
        assert torch.equal(states[name][untouched], before[name][untouched])
    for name in ("conv_states", "ssm_states"):
        assert torch.equal(states[name], before[name])  # the current state is only read


def test_twin_is_the_row_by_row_step():
    """The twin == causal_conv_step + ssm_step per row, request by request (each head reads its
    group's B and C), the state after each row in the intermediate buffers."""
    heads, head_dim, state_size, groups, rows_per_request = 4, 3, 2, 2, 3
    states, rest = _case(7, rows_per_request=rows_per_request, heads=heads, head_dim=head_dim,
                         state_size=state_size, groups=groups, num_rows=6)
    slot_ids = torch.tensor([3, 0])
    y = _call(reference.mamba_decode_rows, states, 0, slot_ids, rest)
    A, D = rest["A"], rest["D"]
    x_end = heads * head_dim
    for r, slot in enumerate(slot_ids.tolist()):
        window, state = states["conv_states"][0, slot][None], states["ssm_states"][0, slot][None]
        for j in range(rows_per_request):
            row = r * rows_per_request + j
            conv_out, window = causal_conv_step(window, rest["xbc"][row][None], rest["weight"], rest["bias"])
            x = conv_out[:, :x_end].view(1, heads, head_dim)
            B, C = conv_out[:, x_end:].view(1, 2, groups, state_size).unbind(1)
            B, C = (t.repeat_interleave(heads // groups, dim=1) for t in (B, C))
            y_row, state = ssm_step(state, x, rest["dt"][row][None], A, B, C, D)
            torch.testing.assert_close(y[row], y_row.view(-1))
            torch.testing.assert_close(states["intermediate_conv_states"][0, slot, j], window[0])
            torch.testing.assert_close(states["intermediate_ssm_states"][0, slot, j], state[0])


def test_shared_scratch_slot_leaves_real_slots_right():
    """Padding requests share the scratch slot (5): the real requests' rows and slots equal the twin."""
    states, rest = _case(3, num_rows=15)
    slot_ids = torch.tensor([1, 2, 5, 5, 5])
    want_states = _clone(states)
    y = _call(mamba_decode_rows, states, 0, slot_ids, rest)
    want_y = _call(reference.mamba_decode_rows, want_states, 0, slot_ids, rest)
    torch.testing.assert_close(y[:6], want_y[:6], rtol=1e-5, atol=1e-5)
    for name in ("intermediate_conv_states", "intermediate_ssm_states"):
        torch.testing.assert_close(states[name][:, :5], want_states[name][:, :5], rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_named():
    states, rest = _case(0)
    slot_ids = torch.tensor([0, 1])
    for name, bad_states, bad_rest, error in (
            ("ssm_states", dict(states, ssm_states=states["ssm_states"][0]), rest, ValueError),
            ("xbc", states, dict(rest, xbc=rest["xbc"][:, :-1]), ValueError),
            ("xbc", states, dict(rest, xbc=rest["xbc"].double()), TypeError),
            ("weight", states, dict(rest, weight=rest["weight"][:, :1]), ValueError),
            ("conv_states", dict(states, conv_states=states["conv_states"][:, :, :, :2]), rest, ValueError),
            ("intermediate_ssm_states", dict(states, intermediate_ssm_states=states["intermediate_ssm_states"][:, 1:]),
             rest, ValueError),
            ("dt", states, dict(rest, dt=rest["dt"][:, :2]), ValueError),
            ("A", states, dict(rest, A=rest["A"].double()), TypeError)):
        with pytest.raises(error, match=f"^{name} "):
            _call(mamba_decode_rows, bad_states, 0, slot_ids, bad_rest)
    with pytest.raises(ValueError, match="^layer "):
        _call(mamba_decode_rows, states, LAYERS, slot_ids, rest)
    with pytest.raises(TypeError, match="^slot_ids "):
        _call(mamba_decode_rows, states, 0, slot_ids.int(), rest)


@pytest.mark.parametrize("padding_rows", [0, 5], ids=["decode_grid_past_T", "padding_rows"])
def test_mixer_with_kernels_equals_mixer_with_twins(padding_rows):
    """A CUDA-graph-padded mixed step (grid of 4: decode requests in slots 0 and 3, prefill chunks
    of 8 rows (3 scan chunks) and 2 rows in slots 1 and 2, the other grid requests in the scratch
    slot 4) through one mixer, with its kernels and with its twins: same output rows and slots."""
    mixer = random_mixer()
    generator = torch.Generator().manual_seed(23)
    scratch = 4
    slots = make_slots(mixer, 5)
    for name in ("conv_states", "ssm_states"):
        slots[name].normal_(generator=generator)
    hidden = torch.randn(2 * (1 + S) + 10 + padding_rows, 64, generator=generator)
    starts = [0, 2 * (1 + S), 2 * (1 + S) + 8, 2 * (1 + S) + 10]  # decode and padding requests: 0 rows
    results = []
    for kernels in (True, False):
        mixer.mamba_kernels = kernels
        state = {name: value.clone() for name, value in slots.items()}
        mamba = MambaForward(**state, decode_slot_ids=torch.tensor([0, 3, scratch, scratch]),
                             prefill_row_start=torch.tensor(starts), prefill_row_count=torch.tensor([0, 8, 2, 0]),
                             prefill_slot_ids=torch.tensor([scratch, 1, 2, scratch]))
        with torch.no_grad(), paged_forward_context(make_metadata([list(range(8))], [(0, hidden.shape[0])]), [],
                                                    mamba=mamba):
            results.append((mixer(hidden[:, None])[0][:, 0], state))
    (out, state), (want_out, want_state) = results
    torch.testing.assert_close(out[:starts[-1]], want_out[:starts[-1]], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()
    for name in ("conv_states", "ssm_states"):
        torch.testing.assert_close(state[name][:, :scratch], want_state[name][:, :scratch], rtol=1e-5, atol=1e-5)
    for name in ("intermediate_conv_states", "intermediate_ssm_states"):  # decode slots 0, 3; 1, 2 stay NaN
        torch.testing.assert_close(state[name][:, :scratch], want_state[name][:, :scratch], rtol=1e-5, atol=1e-5,
                                   equal_nan=True)


def test_kernels_flag_is_a_config_field():
    assert random_mixer().mamba_kernels is None  # the default: kernels for CUDA rows, twins elsewhere
    assert InferenceConfig(mamba_kernels=True).mamba_kernels is True
    with pytest.raises(TypeError, match="mamba_kernels"):
        InferenceConfig(mamba_kernels="on")
