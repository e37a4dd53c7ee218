"""PagedMambaMixer against a naive Mamba-2 (SSD) reference written from the equations.

The reference shares no code with tests/unit/mamba_oracle.py: a sequential loop over rows, in
float64, over the mixer's raw parameters, in megatron-core MambaMixer's layout (checked against
megatron/core/ssm/mamba_mixer.py 0.16):

    z, x, B, C, dt = split(in_proj(u), [d_inner, d_inner, G*N, G*N, H])     # "z x B C dt"
    xBC_t = silu(sum_k w[:, k] * xBC_{t - (W-1) + k} + conv_bias)          # causal depthwise conv1d
    dt = softplus(dt + dt_bias); A = -exp(A_log)
    head h reads group g = h // (H / G) of B and C (mamba_ssm repeats "g n -> (g h) n")
    h_t = exp(dt*A) h_{t-1} + dt * outer(x_t, B_t);  y_t = h_t C_t + D x_t
    out = out_proj(rmsnorm_per_group(y * silu(z)) * norm_weight)             # RMSNormGated,
          group_size = d_inner / G, norm_before_gate=False (megatron asserts it)

The mixer runs a prefill chunk for two requests, then decode rows (1 + S per request) that
write per-row intermediate states, then the commit (mamba_state_selective_copy), then another
prefill chunk from the committed state; each step is held to the reference.
"""

import math

import pytest
import torch

from mtp_ctrl.models import MambaForward, PagedMambaMixer
from mtp_ctrl.models.forward_context import paged_forward_context
from mtp_ctrl.triton_ops import mamba_state_selective_copy
from tests.unit.hybrid_fixtures import hybrid_config
from tests.unit.megatron_fixtures import ensure_single_process_groups, make_metadata

S = 2  # drafts per decode request: 1 + S rows
TOLERANCE = dict(rtol=1e-4, atol=1e-5)


class NaiveMamba2:
    """The mixer's math from its raw parameters, one row at a time, in float64 (no torch.nn ops)."""

    def __init__(self, mixer: PagedMambaMixer):
        p = {name: t.detach().double() for name, t in mixer.named_parameters()}
        self.w_in, self.w_out = p["in_proj.weight"], p["out_proj.weight"]  # [proj, hidden], [hidden, d_inner]
        self.conv_w, self.conv_b = p["conv1d.weight"][:, 0], p["conv1d.bias"]  # [C, W], [C]
        self.dt_bias, self.A_log, self.D, self.norm_w = p["dt_bias"], p["A_log"], p["D"], p["norm.weight"]
        self.H, self.P, self.N, self.G = mixer.num_heads, mixer.head_dim, mixer.d_state, mixer.num_groups
        self.d_inner, self.W = self.H * self.P, mixer.d_conv
        self.eps = 1e-5

    def new_state(self):
        """(conv history: the last W - 1 raw xBC rows, oldest first; SSM state [H, P, N])."""
        conv_channels = self.d_inner + 2 * self.G * self.N
        return [torch.zeros(conv_channels, dtype=torch.float64) for _ in range(self.W - 1)], \
            torch.zeros(self.H, self.P, self.N, dtype=torch.float64)

    def row(self, u, state):
        """One input row ``u [hidden]`` -> (output [hidden], new state)."""
        history, h = state
        d, gn, H = self.d_inner, self.G * self.N, self.H
        proj = self.w_in @ u.double()
        z, xbc_raw, dt = proj[:d], proj[d : 2 * d + 2 * gn], proj[2 * d + 2 * gn :]
        assert dt.shape[0] == H
        taps = history + [xbc_raw]  # W rows, oldest first
        conv = self.conv_b.clone()
        for k in range(self.W):
            conv = conv + self.conv_w[:, k] * taps[k]
        xbc = conv / (1 + torch.exp(-conv))  # silu
        x, B, C = xbc[:d], xbc[d : d + gn], xbc[d + gn :]
        dt = torch.log1p(torch.exp(dt + self.dt_bias))  # softplus
        A = -torch.exp(self.A_log)
        h = h.clone()
        y = torch.zeros(d, dtype=torch.float64)
        heads_per_group = H // self.G
        for head in range(H):
            g = head // heads_per_group
            B_h, C_h = B[g * self.N : (g + 1) * self.N], C[g * self.N : (g + 1) * self.N]
            x_h = x[head * self.P : (head + 1) * self.P]
            h[head] = math.exp(dt[head] * A[head]) * h[head] + dt[head] * torch.outer(x_h, B_h)
            y[head * self.P : (head + 1) * self.P] = h[head] @ C_h + self.D[head] * x_h
        gated = y * (z / (1 + torch.exp(-z)))
        group_size = d // self.G
        normed = torch.empty_like(gated)
        for g in range(self.G):
            part = gated[g * group_size : (g + 1) * group_size]
            normed[g * group_size : (g + 1) * group_size] = part / torch.sqrt((part * part).mean() + self.eps)
        out = self.w_out @ (normed * self.norm_w)
        return out, (taps[1:], h)

    @staticmethod
    def conv_window(state):
        """The mixer's conv state layout: ``[C, W - 1]``, oldest input first."""
        return torch.stack(state[0], dim=1)


def random_mixer(chunk_size: int = 3) -> PagedMambaMixer:
    """The hybrid fixtures' mixer sizes (8 heads of 16 in 2 groups, state 8, conv 4), every
    parameter random so that a swapped or ignored one shows; CPU, fp32."""
    ensure_single_process_groups()
    torch.manual_seed(11)
    module = PagedMambaMixer(hybrid_config(), layer_number=1, chunk_size=chunk_size).eval()
    with torch.no_grad():
        for name, param in module.named_parameters():
            scale = {"in_proj.weight": 0.3, "conv1d.weight": 0.5, "out_proj.weight": 0.2}.get(name, 0.5)
            param.copy_(torch.randn_like(param) * scale)
        module.A_log.copy_(torch.rand_like(module.A_log) * 1.5 - 0.5)  # A in [-2.7, -0.6]
        module.dt_bias.copy_(torch.rand_like(module.dt_bias) - 2.0)
        module.norm.weight.add_(1.0)
    module.mamba_layer_index = 0
    return module


@pytest.fixture(scope="module")
def mixer():
    return random_mixer()


def make_slots(mixer, num_slots, device="cpu"):
    """One layer's state slots; intermediate states start as NaN so an unwritten one shows."""
    conv, ssm = mixer.conv_state_shape, mixer.ssm_state_shape
    return dict(conv_states=torch.zeros(1, num_slots, *conv, device=device),
                ssm_states=torch.zeros(1, num_slots, *ssm, device=device),
                intermediate_conv_states=torch.full((1, num_slots, 1 + S, *conv), float("nan"), device=device),
                intermediate_ssm_states=torch.full((1, num_slots, 1 + S, *ssm), float("nan"), device=device))


def run_mixer(mixer, slots, hidden, decode_slots=(), prefill=()):
    """``prefill``: ((row_start, row_end, slot), ...) after ``len(decode_slots) * (1 + S)`` decode rows."""
    def column(values):
        return torch.tensor(values, dtype=torch.int64, device=hidden.device)
    segments = {} if not prefill else dict(
        prefill_row_start=column([a for a, _, _ in prefill]), prefill_row_count=column([b - a for a, b, _ in prefill]),
        prefill_slot_ids=column([slot for _, _, slot in prefill]))
    mamba = MambaForward(**slots, decode_slot_ids=column(list(decode_slots)), **segments)
    metadata = make_metadata([list(range(8))], [(0, hidden.shape[0])], device=hidden.device)  # unused by the mixer; the context needs one
    with torch.no_grad(), paged_forward_context(metadata, [], mamba=mamba):
        out, bias = mixer(hidden[:, None])
    assert bias is None
    return out[:, 0]


def _reference_rows(naive, hidden, state):
    outputs, states = [], []
    for u in hidden:
        out, state = naive.row(u, state)
        outputs.append(out)
        states.append(state)
    return torch.stack(outputs), states


def test_mixer_equals_the_naive_reference_through_prefill_decode_commit_prefill(mixer):
    """Slots 1 and 0 hold requests a (7 prompt rows) and b (4 prompt rows, its chunk shorter than
    the conv width); one packed prefill, one decode step of 1 + S rows each (b first: the decode
    order differs from the slot order), commit a after 2 drafts and b after 0, then one more
    prefill chunk each (5 and 1 rows) from the committed states.

    Planted bugs that failed this test (each on its own, then reverted): z and x swapped in the
    in_proj split; B and C expanded to heads with `repeat` instead of `repeat_interleave` (wrong
    group per head); the gated norm over all d_inner channels (ngroups ignored); the decode path
    without `dt_bias`; the decode conv window dropping the newest input instead of the oldest
    (`full[:, :, :-1]` in causal_conv_step)."""
    naive = NaiveMamba2(mixer)
    generator = torch.Generator().manual_seed(5)
    hidden_a = torch.randn(7 + 1 + S + 5, 64, generator=generator)
    hidden_b = torch.randn(4 + 1 + S + 1, 64, generator=generator)
    slot_a, slot_b = 1, 0
    slots = make_slots(mixer, 3)

    # 1. prefill: a's 7 rows (three scan chunks of 3), then b's 4
    out = run_mixer(mixer, slots, torch.cat([hidden_a[:7], hidden_b[:4]]), prefill=((0, 7, slot_a), (7, 11, slot_b)))
    want_a, states_a = _reference_rows(naive, hidden_a[:7], naive.new_state())
    want_b, states_b = _reference_rows(naive, hidden_b[:4], naive.new_state())
    torch.testing.assert_close(out.double(), torch.cat([want_a, want_b]), **TOLERANCE)
    for slot, state in ((slot_a, states_a[-1]), (slot_b, states_b[-1])):
        torch.testing.assert_close(slots["conv_states"][0, slot].double(), naive.conv_window(state), **TOLERANCE)
        torch.testing.assert_close(slots["ssm_states"][0, slot].double(), state[1], **TOLERANCE)

    # 2. decode: 1 + S rows each, b's rows first; the current states do not move
    current = {name: slots[name].clone() for name in ("conv_states", "ssm_states")}
    verify_a, verify_b = hidden_a[7 : 8 + S], hidden_b[4 : 5 + S]
    out = run_mixer(mixer, slots, torch.cat([verify_b, verify_a]), decode_slots=(slot_b, slot_a))
    want_a, rows_a = _reference_rows(naive, verify_a, states_a[-1])
    want_b, rows_b = _reference_rows(naive, verify_b, states_b[-1])
    torch.testing.assert_close(out.double(), torch.cat([want_b, want_a]), **TOLERANCE)
    for slot, rows in ((slot_a, rows_a), (slot_b, rows_b)):
        for j, state in enumerate(rows):  # the state after decode row j
            torch.testing.assert_close(slots["intermediate_conv_states"][0, slot, j].double(),
                                       naive.conv_window(state), **TOLERANCE)
            torch.testing.assert_close(slots["intermediate_ssm_states"][0, slot, j].double(), state[1], **TOLERANCE)
    for name, before in current.items():
        assert torch.equal(slots[name], before)

    # 3. commit: a accepted 2 drafts (state after row 2), b none (after its base row)
    accepted = {slot_a: 2, slot_b: 0}
    for intermediate, current_states in (("intermediate_conv_states", "conv_states"),
                                         ("intermediate_ssm_states", "ssm_states")):
        mamba_state_selective_copy(slots[intermediate], slots[current_states], torch.zeros(2, dtype=torch.int64),
                                   torch.tensor([slot_a, slot_b]), torch.tensor([2, 0]), 1)
    committed = {slot_a: rows_a[accepted[slot_a]], slot_b: rows_b[accepted[slot_b]]}
    for slot, state in committed.items():
        torch.testing.assert_close(slots["conv_states"][0, slot].double(), naive.conv_window(state), **TOLERANCE)
        torch.testing.assert_close(slots["ssm_states"][0, slot].double(), state[1], **TOLERANCE)

    # 4. prefill again from the committed states: a's next 5 rows, b's next 1 row
    next_a, next_b = hidden_a[8 + S :], hidden_b[5 + S :]
    out = run_mixer(mixer, slots, torch.cat([next_b, next_a]), prefill=((0, 1, slot_b), (1, 6, slot_a)))
    want_b, _ = _reference_rows(naive, next_b, committed[slot_b])
    want_a, final_a = _reference_rows(naive, next_a, committed[slot_a])
    torch.testing.assert_close(out.double(), torch.cat([want_b, want_a]), **TOLERANCE)
    torch.testing.assert_close(slots["ssm_states"][0, slot_a].double(), final_a[-1][1], **TOLERANCE)



@pytest.mark.parametrize("padding_rows", [0, 6], ids=["decode_grid_past_T", "padding_rows"])
def test_one_mixed_padded_step_equals_its_requests_run_alone(mixer, padding_rows):
    """One forward with the layout of a CUDA-graph-padded mixed step (grid of 4: a decode request
    in slot 0, prefill chunks continuing slot 1 (3 scan chunks) and starting slot 2, a padding
    request; all 4 grid requests on the decode path, the last 3 in the scratch slot 4, so decode
    rows overlap the prefill rows; with ``padding_rows`` = 0 the 4 * (1 + S) decode rows run past
    T) == each request run alone; slot 3 (not in the step) and the other slots' unused state are
    untouched."""
    generator = torch.Generator().manual_seed(17)
    scratch = 4
    slots = make_slots(mixer, 5)
    for name in ("conv_states", "ssm_states"):
        slots[name].normal_(generator=generator)  # every slot starts from a non-zero state
    alone = {name: value.clone() for name, value in slots.items()}
    decode = torch.randn(1 + S, 64, generator=generator)
    chunk_1, chunk_2 = torch.randn(8, 64, generator=generator), torch.randn(2, 64, generator=generator)
    hidden = torch.cat([decode, chunk_1, chunk_2, torch.randn(padding_rows, 64, generator=generator)])
    starts = [0, 1 + S, 9 + S, 11 + S]  # one segment per grid request; decode and padding: 0 rows
    segments = dict(prefill_row_start=torch.tensor(starts), prefill_row_count=torch.tensor([0, 8, 2, 0]),
                    prefill_slot_ids=torch.tensor([scratch, 1, 2, scratch]))
    mamba = MambaForward(**slots, decode_slot_ids=torch.tensor([0, scratch, scratch, scratch]), **segments)
    metadata = make_metadata([list(range(8))], [(0, hidden.shape[0])])
    with torch.no_grad(), paged_forward_context(metadata, [], mamba=mamba):
        out = mixer(hidden[:, None])[0][:, 0]

    want_decode = run_mixer(mixer, alone, decode, decode_slots=(0,))
    want_1 = run_mixer(mixer, alone, chunk_1, prefill=((0, 8, 1),))
    want_2 = run_mixer(mixer, alone, chunk_2, prefill=((0, 2, 2),))
    torch.testing.assert_close(out[: 11 + S], torch.cat([want_decode, want_1, want_2]), rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()
    for name in ("conv_states", "ssm_states"):
        torch.testing.assert_close(slots[name][:, :3], alone[name][:, :3], rtol=1e-5, atol=1e-5)
        assert torch.equal(slots[name][:, 3], alone[name][:, 3])
    for name in ("intermediate_conv_states", "intermediate_ssm_states"):
        torch.testing.assert_close(slots[name][:, 0], alone[name][:, 0], rtol=1e-5, atol=1e-5)
        assert slots[name][:, 1:4].isnan().all()  # only slot 0 and the scratch slot decode
