"""PagedGatedDeltaNet == megatron-core's own GatedDeltaNet forward over the full sequence (same
weights, fp32, CPU): prompts split into prefill chunks at arbitrary points, then decode/verify rows
(1 + S per request) committed after 0, some or all accepted drafts; zero-draft steps (1 row) too.

megatron's layer imports flash-linear-attention's kernels (CUDA); on the CPU the test hands it
megatron's own torch twin of the chunked rule (``torch_chunk_gated_delta_rule``, what its
deterministic mode runs) and an l2norm written here, and builds it on the CPU.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import LNImpl
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from mtp_ctrl.models import MambaForward, PagedGatedDeltaNet
from mtp_ctrl.models.forward_context import paged_forward_context
from mtp_ctrl.triton_ops import gdn_mark_pending_rows, gdn_row_input_width, mamba_state_selective_copy
from tests.unit.gdn_fixtures import gdn_config
from tests.unit.megatron_fixtures import ensure_single_process_groups, make_metadata

S = 2
TOLERANCE = dict(rtol=1e-4, atol=1e-5)
HIDDEN = 64


def _l2norm(x, eps=1e-6):  # flash-linear-attention's l2norm, from its definition
    return x / torch.sqrt((x.float() ** 2).sum(-1, keepdim=True) + eps).to(x.dtype)


@pytest.fixture(scope="module")
def layers():
    """(ours, megatron's) with the same random weights."""
    from megatron.core.ssm import gated_delta_net as megatron_gdn

    ensure_single_process_groups()
    config = gdn_config()
    torch.manual_seed(3)
    ours = PagedGatedDeltaNet(config, layer_number=1).eval()
    with torch.no_grad():
        for name, parameter in ours.named_parameters():
            parameter.copy_(torch.randn_like(parameter) * {"in_proj.weight": 0.3, "out_proj.weight": 0.2}.get(name, 0.5))
        ours.A_log.copy_(torch.rand_like(ours.A_log) * 1.5 - 0.5)
        ours.out_norm.weight.add_(1.0)
    ours.mamba_layer_index = 0
    patch = pytest.MonkeyPatch()
    patch.setattr(megatron_gdn, "HAVE_FLA", True)
    patch.setattr(megatron_gdn, "l2norm", _l2norm, raising=False)  # absent without fla
    patch.setattr(megatron_gdn, "chunk_gated_delta_rule", megatron_gdn.torch_chunk_gated_delta_rule)
    patch.setattr(torch.cuda, "current_device", lambda: "cpu")
    try:
        submodules = megatron_gdn.GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=LNImpl,
                                                           out_proj=RowParallelLinear)
        theirs = megatron_gdn.GatedDeltaNet(
            dataclasses.replace(config, perform_initialization=False), submodules, layer_number=1,
            pg_collection=ProcessGroupCollection(tp=parallel_state.get_tensor_model_parallel_group(),
                                                 cp=parallel_state.get_context_parallel_group())).eval()
        missing = theirs.load_state_dict(ours.state_dict(), strict=True)
        assert not missing.missing_keys and not missing.unexpected_keys
        yield ours, theirs
    finally:
        patch.undo()


def make_slots(mixer, num_slots, path="copy", stride=1 + S):
    """``path`` "copy": one intermediate state per verify row; "replay": each row's inputs (two
    buffers), applied by the slot's next step (the deferred commit)."""
    conv, ssm = mixer.conv_state_shape, mixer.ssm_state_shape
    slots = dict(conv_states=torch.zeros(1, num_slots, *conv), ssm_states=torch.zeros(1, num_slots, *ssm),
                 intermediate_conv_states=torch.full((1, num_slots, stride, *conv), float("nan")))
    if path == "copy":
        return dict(slots, intermediate_ssm_states=torch.full((1, num_slots, stride, *ssm), float("nan")))
    width = gdn_row_input_width(mixer.num_key_heads_local, mixer.key_head_dim, *ssm[:1], mixer.value_head_dim)
    return dict(slots, intermediate_ssm_states=None,
                verify_row_inputs=torch.full((1, num_slots, 2, stride, width), float("nan")),
                pending_rows=torch.zeros(num_slots, dtype=torch.int32),
                input_parity=torch.zeros(num_slots, dtype=torch.int32))


def one_row_slots(slots):
    """``slots`` for a step of one decode row per request (V = 0)."""
    return dict(slots, intermediate_conv_states=slots["intermediate_conv_states"][:, :, :1])


def run(mixer, slots, hidden, decode_slots=(), prefill=()):
    """``prefill``: ((row_start, row_end, slot), ...) after the ``len(decode_slots) * (1 + S)`` decode rows."""
    def column(values):
        return torch.tensor(values, dtype=torch.int64, device=hidden.device)
    segments = {} if not prefill else dict(
        prefill_row_start=column([a for a, _, _ in prefill]), prefill_row_count=column([b - a for a, b, _ in prefill]),
        prefill_slot_ids=column([slot for _, _, slot in prefill]))
    mamba = MambaForward(**slots, decode_slot_ids=column(list(decode_slots)), **segments)
    metadata = make_metadata([list(range(8))], [(0, hidden.shape[0])], device=hidden.device)
    with torch.no_grad(), paged_forward_context(metadata, [], mamba=mamba):
        out, bias = mixer(hidden[:, None])
    assert bias is None
    return out[:, 0]


def full_sequence(theirs, hidden):
    with torch.no_grad():
        out, _ = theirs(hidden[:, None], attention_mask=None)
    return out[:, 0]


def commit(slots, slot_ids, accepted, key_heads=None):
    """As ``MambaStateSlots.commit_accepted``: copy the kept conv window and state, or (replay slots)
    record the kept rows, which the slot's next step applies (an unused slot stands for the scratch
    slot)."""
    device = slots["conv_states"].device
    args = (torch.zeros(len(slot_ids), dtype=torch.int64, device=device), torch.tensor(slot_ids, device=device),
            torch.tensor(accepted, device=device))
    mamba_state_selective_copy(slots["intermediate_conv_states"], slots["conv_states"], *args, 1)
    if slots.get("intermediate_ssm_states") is not None:
        mamba_state_selective_copy(slots["intermediate_ssm_states"], slots["ssm_states"], *args, 1)
    else:
        scratch = next(slot for slot in range(slots["pending_rows"].shape[0]) if slot not in slot_ids)
        gdn_mark_pending_rows(slots["pending_rows"], slots["input_parity"], *args,
                              slots["intermediate_conv_states"].shape[2], scratch)


@pytest.mark.parametrize("path", ["copy", "replay"])
@pytest.mark.parametrize("splits", [(7, 2), (1, 9)], ids=["7_2", "1_9"])
def test_mixer_equals_megatron_over_chunks_and_verify_rows(layers, splits, path):
    """Requests a (slot 2) and b (slot 0): prompts cut into two chunks at ``splits`` (a chunk may be
    shorter than the conv width), one packed prefill per chunk, then verify steps of 1 + S rows
    with a accepting 2, 0, 1 drafts and b 0, 2, 2; every output row == megatron over the tokens
    the request kept, and the committed states continue exactly (the next step's rows agree)."""
    ours, theirs = layers
    generator = torch.Generator().manual_seed(sum(splits))
    first_a, first_b = splits
    prompt_a = torch.randn(first_a + 5, HIDDEN, generator=generator)
    prompt_b = torch.randn(first_b + 3, HIDDEN, generator=generator)
    slot_a, slot_b = 2, 0
    slots = make_slots(ours, 3, path)
    out = run(ours, slots, torch.cat([prompt_a[:first_a], prompt_b[:first_b]]),
              prefill=((0, first_a, slot_a), (first_a, first_a + first_b, slot_b)))
    torch.testing.assert_close(out[:first_a], full_sequence(theirs, prompt_a[:first_a]), **TOLERANCE)
    torch.testing.assert_close(out[first_a:], full_sequence(theirs, prompt_b[:first_b]), **TOLERANCE)
    rest_a, rest_b = prompt_a[first_a:], prompt_b[first_b:]
    out = run(ours, slots, torch.cat([rest_b, rest_a]), prefill=((0, len(rest_b), slot_b),
                                                                  (len(rest_b), len(rest_b) + len(rest_a), slot_a)))
    torch.testing.assert_close(out[len(rest_b):], full_sequence(theirs, prompt_a)[first_a:], **TOLERANCE)
    torch.testing.assert_close(out[:len(rest_b)], full_sequence(theirs, prompt_b)[first_b:], **TOLERANCE)

    kept = {slot_a: prompt_a, slot_b: prompt_b}
    for accepted_a, accepted_b in ((2, 0), (0, 2), (1, 2)):
        rows = {slot: torch.randn(1 + S, HIDDEN, generator=generator) for slot in (slot_a, slot_b)}
        out = run(ours, slots, torch.cat([rows[slot_b], rows[slot_a]]), decode_slots=(slot_b, slot_a))
        for index, slot in enumerate((slot_b, slot_a)):
            want = full_sequence(theirs, torch.cat([kept[slot], rows[slot]]))[-(1 + S):]
            torch.testing.assert_close(out[index * (1 + S):(index + 1) * (1 + S)], want, **TOLERANCE)
        commit(slots, [slot_b, slot_a], [accepted_b, accepted_a], ours.num_key_heads_local)
        kept[slot_a] = torch.cat([kept[slot_a], rows[slot_a][:1 + accepted_a]])
        kept[slot_b] = torch.cat([kept[slot_b], rows[slot_b][:1 + accepted_b]])
    # a final plain row each: a zero-draft step through the prefill path (1 row per request), or for
    # deferred commits one decode row per request (it applies the pending rows first)
    last = {slot: torch.randn(1, HIDDEN, generator=generator) for slot in (slot_a, slot_b)}
    if path == "copy":
        out = run(ours, slots, torch.cat([last[slot_a], last[slot_b]]), prefill=((0, 1, slot_a), (1, 2, slot_b)))
    else:
        out = run(ours, one_row_slots(slots), torch.cat([last[slot_a], last[slot_b]]), decode_slots=(slot_a, slot_b))
    for index, slot in enumerate((slot_a, slot_b)):
        want = full_sequence(theirs, torch.cat([kept[slot], last[slot]]))[-1:]
        torch.testing.assert_close(out[index:index + 1], want, **TOLERANCE)


@pytest.mark.parametrize("path", ["copy", "replay"])
def test_verify_with_nothing_accepted_leaves_plain_decoding_state(layers, path):
    """A verify step whose drafts are all rejected commits the state one plain decode row leaves, in
    both the conv window and the rule's state (to matmul rounding: in_proj sees 3 rows, not 1)."""
    ours, _ = layers
    generator = torch.Generator().manual_seed(9)
    prompt, rows = torch.randn(6, HIDDEN, generator=generator), torch.randn(1 + S, HIDDEN, generator=generator)
    spec, plain = make_slots(ours, 2, path), make_slots(ours, 2, path, stride=1)
    for slots in (spec, plain):
        run(ours, slots, prompt, prefill=((0, 6, 1),))
    run(ours, spec, rows, decode_slots=(1,))
    commit(spec, [1], [0], ours.num_key_heads_local)
    run(ours, plain, rows[:1], decode_slots=(1,))
    commit(plain, [1], [0], ours.num_key_heads_local)
    if path == "replay":  # the kept row waits in spec's slot: one more plain row each applies it
        extra = torch.randn(1, HIDDEN, generator=generator)
        for slots in (one_row_slots(spec), plain):
            run(ours, slots, extra, decode_slots=(1,))
            commit(slots, [1], [0], ours.num_key_heads_local)
    for name in ("conv_states", "ssm_states"):
        torch.testing.assert_close(spec[name][:, 1], plain[name][:, 1], rtol=1e-6, atol=1e-6)


def test_refuses_other_activations():
    ensure_single_process_groups()
    with pytest.raises(ValueError, match="activation_func"):
        PagedGatedDeltaNet(dataclasses.replace(gdn_config(), activation_func=F.gelu))


@pytest.mark.parametrize("path", ["copy", "replay"])
def test_kernels_equal_twins_in_a_padded_mixed_bf16_step(layers, path):
    """A bf16 copy of the mixer (as build_gpt_model casts a bf16 model) over one padded mixed
    step: a decode request (slot 0), prefill chunks continuing slot 1 and starting slot 2, the
    grid's other decode requests on scratch slot 4 with their rows past T; the interpreted Triton
    ops (``mamba_kernels=True``) == the torch twins, outputs and every real slot's states."""
    ours = PagedGatedDeltaNet(gdn_config(), layer_number=1).eval()
    ours.load_state_dict(layers[0].state_dict())
    ours = ours.to(torch.bfloat16)  # the zero conv-bias buffer too, as build_gpt_model's cast does
    ours.mamba_layer_index = 0
    generator = torch.Generator().manual_seed(21)
    results = []
    for kernels in (True, False):
        ours.mamba_kernels = kernels
        slots = make_slots(ours, 5, path)
        for name in ("conv_states", "ssm_states"):
            slots[name].copy_(torch.randn(slots[name].shape, generator=torch.Generator().manual_seed(4)) * 0.3)
        hidden = torch.randn(1 + S + 8 + 2, HIDDEN, generator=generator.manual_seed(8)).to(torch.bfloat16)
        starts = [0, 1 + S, 9 + S, 11 + S]
        mamba = MambaForward(**slots, decode_slot_ids=torch.tensor([0, 4, 4, 4]),
                             prefill_row_start=torch.tensor(starts), prefill_row_count=torch.tensor([0, 8, 2, 0]),
                             prefill_slot_ids=torch.tensor([4, 1, 2, 4]))
        metadata = make_metadata([list(range(8))], [(0, hidden.shape[0])])
        with torch.no_grad(), paged_forward_context(metadata, [], mamba=mamba):
            out = ours(hidden[:, None])[0][:, 0]
        results.append((out.float(), slots))
    (out_k, slots_k), (out_t, slots_t) = results
    torch.testing.assert_close(out_k, out_t, rtol=2e-2, atol=2e-2)
    for name in ("conv_states", "ssm_states"):
        torch.testing.assert_close(slots_k[name][:, :3], slots_t[name][:, :3], rtol=1e-4, atol=1e-4)
    for name in ("intermediate_conv_states", "intermediate_ssm_states", "verify_row_inputs"):
        if slots_k.get(name) is not None:
            torch.testing.assert_close(slots_k[name][:, 0], slots_t[name][:, 0], rtol=1e-4, atol=1e-4,
                                       equal_nan=True)  # NaN: a buffer no row stored to


def test_checkpoint_layout_is_megatrons(layers):
    """The mixer's sharded state dict has megatron GatedDeltaNet's keys, shapes and splits (in_proj's
    query .. alpha parts, the conv's query, key, value), so torch_dist checkpoints move between them."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    ours, theirs = layers

    def layout(module):
        described = {}
        for key, value in module.sharded_state_dict(prefix="layer.").items():
            if isinstance(value, ShardedTensorFactory):
                parts = value.build()
                described[key] = sorted((part.key, tuple(part.local_shape), tuple(part.global_offset)) for part in parts)
            else:  # a ShardedTensor, or a ShardedObject (extra state)
                described[key] = (type(value).__name__, value.key, tuple(getattr(value, "local_shape", ())),
                                  tuple(value.global_shape))
        return described

    assert layout(ours) == layout(theirs)
    assert any("in_proj.weight.alpha" in str(parts) for parts in layout(ours).values())


@pytest.mark.parametrize("path", ["copy", "replay"])
def test_kernels_equal_twins_for_one_decode_request(layers, path):
    """One request's 1 + S verify rows alone (the shape of a batch-1 decode step): the rows' q/k/v
    reach the kernel contiguous (a reshape of one request's rows would keep the conv's transposed
    strides), and kernels == twins."""
    ours = PagedGatedDeltaNet(gdn_config(), layer_number=1).eval()
    ours.load_state_dict(layers[0].state_dict())
    ours.mamba_layer_index = 0
    results = []
    for kernels in (True, False):
        ours.mamba_kernels = kernels
        slots = make_slots(ours, 2, path)
        for name in ("conv_states", "ssm_states"):
            slots[name].copy_(torch.randn(slots[name].shape, generator=torch.Generator().manual_seed(5)) * 0.3)
        hidden = torch.randn(1 + S, HIDDEN, generator=torch.Generator().manual_seed(9))
        mamba = MambaForward(**slots, decode_slot_ids=torch.tensor([0]), prefill_row_start=torch.tensor([1 + S]),
                             prefill_row_count=torch.tensor([0]), prefill_slot_ids=torch.tensor([1]))
        metadata = make_metadata([list(range(4))], [(0, hidden.shape[0])])
        with torch.no_grad(), paged_forward_context(metadata, [], mamba=mamba):
            out = ours(hidden[:, None])[0][:, 0]
        results.append((out, slots))
    (out_k, slots_k), (out_t, slots_t) = results
    torch.testing.assert_close(out_k, out_t, rtol=1e-4, atol=1e-4)
    for name in ("intermediate_conv_states", "intermediate_ssm_states", "verify_row_inputs"):
        if slots_k.get(name) is not None:
            torch.testing.assert_close(slots_k[name][:, 0], slots_t[name][:, 0], rtol=1e-4, atol=1e-4,
                                       equal_nan=True)  # NaN: a buffer no row stored to


def test_long_prefill_segments_go_to_fla_in_eager_steps(layers, monkeypatch):
    """Segments of >= fla_prefill_min_rows rows (host layout) run through fla-core's chunked rule
    (here a stand-in computing the twin's rule, as fla is CUDA-only), the rest through our scan;
    outputs and states equal the all-ours step. Without the host layout or with the threshold
    None, fla is never called."""
    from mtp_ctrl.models import gdn_mixer
    from mtp_ctrl.triton_ops import reference

    calls = []

    def stand_in(q, k, v, g, beta, scale, initial_state, output_final_state):
        assert scale == 1.0 and output_final_state and q.shape[0] == 1
        rows = torch.tensor([q.shape[1]])
        calls.append(q.shape[1])
        o, final = reference.gdn_varlen_scan(initial_state, q[0], k[0], v[0], g[0], beta[0], torch.tensor([0]), rows)
        return o[None], final

    monkeypatch.setattr(gdn_mixer, "fla_chunk_rule", lambda: stand_in)
    ours = PagedGatedDeltaNet(gdn_config(), layer_number=1).eval()
    ours.load_state_dict(layers[0].state_dict())
    ours.mamba_layer_index, ours.mamba_kernels = 0, True
    hidden = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(12))
    results = []
    for threshold, host in ((None, True), (5, False), (5, True)):
        ours.fla_prefill_min_rows = threshold
        slots = make_slots(ours, 4, "replay")
        slots["ssm_states"].copy_(torch.randn(slots["ssm_states"].shape, generator=torch.Generator().manual_seed(2)))
        mamba = MambaForward(**slots, decode_slot_ids=torch.tensor([], dtype=torch.int64),
                             prefill_row_start=torch.tensor([0, 6, 9]), prefill_row_count=torch.tensor([6, 3, 0]),
                             prefill_slot_ids=torch.tensor([2, 0, 3]),
                             host_prefill_segments=((0, 0, 6), (1, 6, 3)) if host else ())
        metadata = make_metadata([list(range(12))], [(0, hidden.shape[0])])
        with torch.no_grad(), paged_forward_context(metadata, [], mamba=mamba):
            results.append((ours(hidden[:, None])[0][:, 0], slots))
    assert calls == [6]  # the 6-row segment only, and only with the host layout
    (want, want_slots), _, (got, got_slots) = results
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for name in ("conv_states", "ssm_states"):
        torch.testing.assert_close(got_slots[name], want_slots[name], rtol=1e-4, atol=1e-4)
