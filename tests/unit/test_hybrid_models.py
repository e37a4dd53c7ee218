"""Hybrid models (Mamba-2 and attention decoder layers, attention MTP layers) on the paged state:
layer bookkeeping, megatron's parameter layout, and that decode rows, the state commit and
chunked prefill reproduce a one-shot prefill of the same tokens."""

import pytest
import torch

from mtp_ctrl.models import MambaForward, PagedGPTRunner, PagedMambaMixer, build_gpt_model
from mtp_ctrl.state import MambaStateSlots
from mtp_ctrl.triton_ops import mamba_state_selective_copy
from tests.unit.hybrid_fixtures import LAYER_PATTERN, build_hybrid_model, hybrid_config
from tests.unit.megatron_fixtures import (
    MAX_SEQUENCE_LENGTH,
    VOCAB_SIZE,
    allocate_kv_caches,
    ensure_single_process_groups,
    make_metadata,
)

BLOCKS = [3, 0, 2]  # KV blocks of the one request (4 tokens each)


@pytest.fixture(scope="module")
def runner():
    ensure_single_process_groups()
    return PagedGPTRunner(build_hybrid_model(mtp_num_layers=1, chunk_size=4))


def test_layers_are_indexed_and_keep_megatrons_parameter_layout(runner):
    mixers = [layer.self_attention for layer in runner.model.decoder.layers if layer.self_attention.__class__
              is PagedMambaMixer]
    assert [m.mamba_layer_index for m in mixers] == [0, 1] and runner.num_mamba_layers == 2
    assert runner.num_kv_layers == LAYER_PATTERN.count("*") + 1  # attention layers + the MTP layer
    mixer = mixers[0]  # hidden 64, expand 2 -> 8 heads of 16, 2 groups of state size 8, conv width 4
    shapes = {name: tuple(p.shape) for name, p in mixer.named_parameters()}
    assert shapes == {"in_proj.weight": (2 * 128 + 2 * 2 * 8 + 8, 64), "conv1d.weight": (160, 1, 4),
                      "conv1d.bias": (160,), "dt_bias": (8,), "A_log": (8,), "D": (8,), "norm.weight": (128,),
                      "out_proj.weight": (64, 128)}
    spec = runner.mamba_spec
    assert (spec.num_layers, spec.conv_state_shape, spec.ssm_state_shape) == (2, (160, 3), (8, 16, 8))


def _forward(runner, slots, tokens, start, decode_rows=0, slot=0):
    """Run tokens at positions [start, start + len) of the request: as one decode request with
    ``decode_rows`` rows, or (decode_rows == 0) as a prefill chunk."""
    metadata = make_metadata([BLOCKS], [(start, tokens.shape[0])])
    mamba = MambaForward(
        slots.conv_states, slots.ssm_states, slots.intermediate_conv_states, slots.intermediate_ssm_states,
        decode_slot_ids=torch.tensor([slot] if decode_rows else [], dtype=torch.int64),
        **({} if decode_rows else dict(prefill_row_start=torch.tensor([0]),
                                       prefill_row_count=torch.tensor([tokens.shape[0]]),
                                       prefill_slot_ids=torch.tensor([slot]))),
    )
    logits, _ = runner.forward(tokens, metadata.positions, metadata, _forward.kv_caches, mamba=mamba)
    return logits


def _fresh_state(runner, num_speculative_tokens):
    _forward.kv_caches = allocate_kv_caches(runner.num_kv_layers, 4, 2, 16)
    return MambaStateSlots(runner.mamba_spec, 2, num_speculative_tokens, torch.device("cpu"))


@pytest.mark.parametrize("accepted", [0, 1, 2])
def test_decode_rows_and_commit_continue_like_one_prefill(runner, accepted):
    """Prefill 4 tokens, verify 3 rows (base + 2 drafts) as a decode request, commit the state
    after ``accepted`` drafts, prefill the rest from there: every logit equals one prefill of
    the whole sequence, and each intermediate state equals the state of a prefill up to its row."""
    tokens = torch.randint(0, VOCAB_SIZE, (11,), generator=torch.Generator().manual_seed(accepted))
    slots = _fresh_state(runner, 2)
    reference = _forward(runner, slots, tokens, 0)  # [11, V]
    prefix_states = []
    for end in (5, 6, 7):  # states after the verify rows 4, 5, 6
        probe = _fresh_state(runner, 2)
        _forward(runner, probe, tokens[:end], 0)
        prefix_states.append(probe.ssm_states[:, 0].clone())

    slots = _fresh_state(runner, 2)
    first = _forward(runner, slots, tokens[:4], 0)
    verify = _forward(runner, slots, tokens[4:7], 4, decode_rows=3)
    for row in range(3):
        torch.testing.assert_close(slots.intermediate_ssm_states[:, 0, row], prefix_states[row], rtol=1e-4, atol=1e-5)
    counts = torch.tensor([accepted])
    for intermediate, current in ((slots.intermediate_conv_states, slots.conv_states),
                                  (slots.intermediate_ssm_states, slots.ssm_states)):
        mamba_state_selective_copy(intermediate, current, torch.zeros(1, dtype=torch.int64), torch.tensor([0]),
                                   counts, slots.num_layers)
    resume = 5 + accepted  # the next row after the last accepted one
    rest = _forward(runner, slots, tokens[resume:], resume)
    torch.testing.assert_close(first, reference[:4], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(verify, reference[4:7], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rest, reference[resume:], rtol=1e-4, atol=1e-4)


def test_bad_inputs_are_named(runner):
    slots = _fresh_state(runner, 0)
    tokens = torch.arange(3)
    metadata = make_metadata([BLOCKS], [(0, 3)])
    with pytest.raises(TypeError, match="mamba must be a MambaForward"):
        runner.forward(tokens, metadata.positions, metadata, _forward.kv_caches)
    with pytest.raises(ValueError, match="layer_pattern"):
        build_gpt_model(hybrid_config(), VOCAB_SIZE, MAX_SEQUENCE_LENGTH, layer_pattern="M*")
    with pytest.raises(ValueError, match="layer_pattern"):
        build_gpt_model(hybrid_config(), VOCAB_SIZE, MAX_SEQUENCE_LENGTH, layer_pattern="M-M*")
    with pytest.raises(ValueError, match="d_conv"):
        build_gpt_model(hybrid_config(), VOCAB_SIZE, MAX_SEQUENCE_LENGTH, layer_pattern="M***", mamba_d_conv=1)
    assert slots.num_layers == 2
