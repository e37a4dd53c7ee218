"""mamba_state_selective_copy: Triton kernel (interpreter) == torch reference == a per-request loop."""

import pytest
import torch

from mtp_ctrl.triton_ops import mamba_state_copy, mamba_state_selective_copy, reference

OPS = [mamba_state_selective_copy, reference.mamba_state_selective_copy]


def _copy_by_hand(intermediate, current, prefill_status, state_idx, accepted_counts):
    current = current.clone()
    for prefill, slot, accepted in zip(prefill_status.tolist(), state_idx.tolist(), accepted_counts.tolist()):
        if prefill == 0:
            current[:, slot] = intermediate[:, slot, accepted]
    return current


def _case(num_layers, num_slots, num_spec, state_shape, num_requests, *, seed, dtype=torch.float32,
          index_dtype=torch.int64, layout="contiguous"):
    """Requests in distinct slots; ``layout`` picks how the first three dims are strided."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_layers, num_slots, num_spec + 1) + state_shape
    if layout == "contiguous":
        intermediate = torch.randn(shape, generator=generator).to(dtype)
    elif layout == "slot_major":  # (M, S + 1, L, *state) storage seen as (L, M, S + 1, *state)
        storage = torch.randn((num_slots, num_spec + 1, num_layers) + state_shape, generator=generator).to(dtype)
        intermediate = storage.permute(2, 0, 1, *range(3, storage.dim()))
    else:  # "slice": a window of a larger buffer on the first three dims
        storage = torch.randn((num_layers + 1, num_slots + 2, num_spec + 3) + state_shape, generator=generator)
        intermediate = storage.to(dtype)[1:, 2:, 1 : num_spec + 2]
    current_storage = torch.randn((num_slots, num_layers) + state_shape, generator=generator).to(dtype)
    current = current_storage.transpose(0, 1)  # [L, M, *state], slot-major storage
    state_idx = torch.randperm(num_slots, generator=generator)[:num_requests].to(index_dtype)
    prefill_status = (torch.rand(num_requests, generator=generator) < 0.3).to(index_dtype)
    accepted = torch.randint(0, num_spec + 1, (num_requests,), generator=generator).to(index_dtype)
    return intermediate, current, prefill_status, state_idx, accepted


@pytest.mark.parametrize("op", OPS)
def test_known_answer(op):
    # 2 layers, 3 slots, S = 2, state (2,): slot s, row k holds 100 * layer + 10 * s + k.
    values = torch.arange(2)[:, None, None] * 100 + torch.arange(3)[None, :, None] * 10 + torch.arange(3)
    intermediate = values[..., None].repeat(1, 1, 1, 2).float()
    current = torch.full((2, 3, 2), -1.0)
    # request 0: decode in slot 2 accepting 1; request 1: prefill in slot 0; request 2: decode in slot 1 accepting 2
    op(intermediate, current, torch.tensor([0, 1, 0]), torch.tensor([2, 0, 1]), torch.tensor([1, 0, 2]), 2)
    assert current[:, :, 0].tolist() == [[-1.0, 12.0, 21.0], [-1.0, 112.0, 121.0]]
    assert torch.equal(current[..., 0], current[..., 1])


@pytest.mark.parametrize("layout", ["contiguous", "slot_major", "slice"])
@pytest.mark.parametrize(
    "num_requests,state_shape,dtype,index_dtype",
    [
        (0, (4, 3), torch.float32, torch.int64),
        (1, (5,), torch.float32, torch.int32),
        (7, (3, 4, 5), torch.bfloat16, torch.int64),
        (13, (), torch.float16, torch.int32),
        (5, (2, 4500), torch.float32, torch.int64),  # more than one tile per state
    ],
)
def test_random_cases_match_the_request_loop(layout, num_requests, state_shape, dtype, index_dtype):
    args = _case(3, 16, 3, state_shape, num_requests, seed=num_requests, dtype=dtype, index_dtype=index_dtype,
                 layout=layout)
    want = _copy_by_hand(*args)
    for op in OPS:
        current = args[1].clone()
        op(args[0], current, *args[2:], 3)
        assert torch.equal(current, want)


def test_states_wider_than_the_grid_limit_use_larger_tiles(monkeypatch):
    monkeypatch.setattr(mamba_state_copy, "_MAX_GRID_Z", 2)  # forces 3 tiles' worth into 2 programs
    intermediate, current, prefill_status, state_idx, accepted = _case(2, 4, 2, (9000,), 3, seed=1)
    want = _copy_by_hand(intermediate, current, prefill_status, state_idx, accepted)
    mamba_state_selective_copy(intermediate, current, prefill_status, state_idx, accepted, 2)
    assert torch.equal(current, want)


def _column_major(states):
    """Same shape and values, but the last two state dims are stored transposed."""
    return states.transpose(-1, -2).contiguous().transpose(-1, -2)


def _valid_args():
    return list(_case(2, 4, 2, (3, 4), 3, seed=0)) + [2]


@pytest.mark.parametrize(
    "index,bad,error,match",
    [
        (0, lambda t: t.flatten(1), ValueError, "intermediate_states"),
        (0, lambda t: _column_major(t), ValueError, "intermediate_states must be contiguous"),
        (0, lambda t: "states", TypeError, "intermediate_states"),
        (0, lambda t: t[:, :, :0], ValueError, "intermediate_states needs S"),  # no state to commit
        (1, lambda t: t.double(), TypeError, "current_states"),
        (1, lambda t: t[:, :3], ValueError, "current_states"),
        (1, lambda t: _column_major(t), ValueError, "current_states must be contiguous"),
        (1, lambda t: t.to("meta"), ValueError, "current_states"),
        (2, lambda t: t.float(), TypeError, "prefill_status"),
        (2, lambda t: t[:, None], ValueError, "prefill_status"),
        (3, lambda t: t[:2], ValueError, "state_idx"),
        (3, lambda t: t.to("meta"), ValueError, "state_idx"),
        (4, lambda t: t.float(), TypeError, "accepted_counts"),
        (5, lambda n: 3, ValueError, "num_layers"),
        (5, lambda n: 2.0, TypeError, "num_layers"),
    ],
)
def test_bad_arguments(index, bad, error, match):
    args = _valid_args()
    args[index] = bad(args[index])
    with pytest.raises(error, match=match):
        mamba_state_selective_copy(*args)
