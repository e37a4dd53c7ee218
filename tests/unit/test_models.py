"""Paged megatron GPT (TP = 1, CPU): stepping through the paged cache == one dense causal forward."""

import pytest
import torch

from mtp_ctrl.models import (
    PagedCoreAttention,
    PagedGPTRunner,
    count_kv_layers,
    get_paged_gpt_layer_spec,
    paged_forward_context,
)
from tests.unit.megatron_fixtures import (
    NUM_BLOCKS,
    allocate_kv_caches,
    build_dense_twin,
    build_tiny_model,
    dense_full_sequence,
    ensure_single_process_groups,
    make_metadata,
    random_sequences,
    run_paged_schedule,
    tiny_config,
)

FP32_TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def megatron_groups():
    ensure_single_process_groups()


@pytest.fixture(scope="module")
def tiny(megatron_groups):
    config = tiny_config(mtp_num_layers=2)
    model = build_tiny_model(config)
    return config, model, PagedGPTRunner(model)


def _fresh_caches(model):
    return allocate_kv_caches(count_kv_layers(model), NUM_BLOCKS, num_kv_heads_local=2, head_dim=16)


def test_kv_layer_indices_follow_decoder_then_mtp(tiny):
    _, model, runner = tiny
    assert count_kv_layers(model) == runner.num_kv_layers == 4
    decoder = [layer.self_attention.core_attention.kv_layer_index for layer in model.decoder.layers]
    mtp = [layer.transformer_layer.self_attention.core_attention.kv_layer_index for layer in model.mtp.layers]
    assert decoder + mtp == [0, 1, 2, 3]


def test_stepping_matches_dense_forward_and_mtp(tiny):
    config, model, runner = tiny
    dense = build_dense_twin(config, model)
    sequences = random_sequences(seed=0)
    decoder_logits, mtp_logits = run_paged_schedule(runner, sequences, _fresh_caches(model))
    for b, tokens in enumerate(sequences):
        want_logits, want_mtp = dense_full_sequence(dense, tokens)
        torch.testing.assert_close(decoder_logits[b], want_logits, **FP32_TOL)
        for depth in range(config.mtp_num_layers):
            torch.testing.assert_close(mtp_logits[depth][b], want_mtp[depth], **FP32_TOL)


def test_model_without_mtp(megatron_groups):
    config = tiny_config(mtp_num_layers=None)
    model = build_tiny_model(config, seed=7)
    runner = PagedGPTRunner(model)
    assert runner.mtp_num_layers == 0 and count_kv_layers(model) == 2
    tokens = random_sequences(seed=3)[0]
    metadata = make_metadata([[4, 1, 6, 2]], [(0, tokens.shape[0])])
    caches = allocate_kv_caches(2, NUM_BLOCKS, num_kv_heads_local=2, head_dim=16)
    logits, hidden = runner.forward(tokens, metadata.positions, metadata, caches)
    want, _ = dense_full_sequence(build_dense_twin(config, model), tokens)
    torch.testing.assert_close(logits, want, **FP32_TOL)
    assert hidden.shape == (tokens.shape[0], config.hidden_size)


def test_paged_layer_spec_uses_paged_core_attention():
    spec = get_paged_gpt_layer_spec(use_transformer_engine=False)
    assert spec.submodules.self_attention.submodules.core_attention is PagedCoreAttention


def test_dense_model_is_rejected(tiny):
    config, model, _ = tiny
    with pytest.raises(TypeError, match="PagedCoreAttention"):
        PagedGPTRunner(build_dense_twin(config, model))
    with pytest.raises(TypeError, match="GPTModel"):
        PagedGPTRunner(torch.nn.Linear(2, 2))


def test_core_attention_outside_context_raises(tiny):
    _, model, _ = tiny
    core_attention = model.decoder.layers[0].self_attention.core_attention
    q = torch.zeros(3, 1, 2, 16)
    kv = torch.zeros(3, 1, 1, 16)
    with pytest.raises(RuntimeError, match="paged_forward_context"):
        core_attention(q, kv, kv, None)


def test_context_resets_and_does_not_nest(tiny):
    _, model, _ = tiny
    metadata = make_metadata([[0]], [(0, 1)])
    caches = _fresh_caches(model)
    with pytest.raises(ValueError, match="boom"):
        with paged_forward_context(metadata, caches):
            with pytest.raises(RuntimeError, match="nest"):
                with paged_forward_context(metadata, caches):
                    pass
            raise ValueError("boom")
    with pytest.raises(RuntimeError, match="outside"):
        model.decoder.layers[0].self_attention.core_attention(
            torch.zeros(1, 1, 2, 16), torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1, 16), None)
    with pytest.raises(TypeError, match="metadata"):
        with paged_forward_context("not metadata", caches):
            pass


def test_bad_runner_inputs(tiny):
    config, model, runner = tiny
    tokens = torch.arange(3)
    metadata = make_metadata([[0]], [(0, 3)])
    caches = _fresh_caches(model)
    with pytest.raises(TypeError, match="input_ids"):
        runner.forward(tokens.int(), metadata.positions, metadata, caches)
    with pytest.raises(ValueError, match="same number of rows"):
        runner.forward(tokens[:2], metadata.positions[:2], metadata, caches)
    with pytest.raises(ValueError, match="kv_caches has 3 pairs"):
        runner.forward(tokens, metadata.positions, metadata, caches[:3])
    with pytest.raises(ValueError, match="kv_caches\\[0\\]"):
        bad = [(k[..., :8], v[..., :8]) for k, v in caches]
        runner.forward(tokens, metadata.positions, metadata, bad)
    hidden = torch.zeros(3, config.hidden_size)
    with pytest.raises(ValueError, match="depth"):
        runner.mtp_forward(2, hidden, tokens, metadata.positions, metadata, caches)
    with pytest.raises(ValueError, match="hidden"):
        runner.mtp_forward(0, hidden[:, :8], tokens, metadata.positions, metadata, caches)


def test_half_precision_model_has_one_dtype(megatron_groups):
    """megatron builds layer norms in fp32 (its Float16Module casts them in training): the builder
    casts the whole model, so a bf16 forward never mixes dtypes (CUDA's layer_norm rejects that)."""
    torch.manual_seed(0)
    model = build_tiny_model(tiny_config(mtp_num_layers=1, params_dtype=torch.bfloat16, bf16=True))
    assert {parameter.dtype for parameter in model.parameters()} == {torch.bfloat16}


def test_logits_rows_project_only_the_rows_asked_for(megatron_groups):
    config = tiny_config(mtp_num_layers=None)
    model = build_tiny_model(config, seed=7)
    runner = PagedGPTRunner(model)
    tokens = random_sequences(seed=3)[0]
    metadata = make_metadata([[4, 1, 6, 2]], [(0, tokens.shape[0])])
    caches = allocate_kv_caches(2, NUM_BLOCKS, num_kv_heads_local=2, head_dim=16)
    all_logits, _ = runner.forward(tokens, metadata.positions, metadata, caches)
    rows = torch.tensor([tokens.shape[0] - 1, 0], dtype=torch.int64)
    some_logits, hidden = runner.forward(tokens, metadata.positions, metadata, caches, logits_rows=rows)
    assert some_logits.shape == (2, all_logits.shape[1]) and hidden.shape[0] == tokens.shape[0]
    torch.testing.assert_close(some_logits, all_logits[rows], **FP32_TOL)
    with pytest.raises(TypeError, match="logits_rows"):
        runner.forward(tokens, metadata.positions, metadata, caches, logits_rows=rows.int())


def test_mtp_forward_projects_only_the_logits_rows(tiny):
    """logits_rows picks rows of the full projection (bitwise: the same GEMM per row), the hidden
    output still covers every row, and a bad logits_rows is a TypeError."""
    config, model, runner = tiny
    tokens = torch.arange(5)
    metadata = make_metadata([[0, 1]], [(0, 5)])
    hidden = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([4, 1])
    full_logits, full_hidden = runner.mtp_forward(0, hidden, tokens, metadata.positions, metadata, _fresh_caches(model))
    logits, out = runner.mtp_forward(0, hidden, tokens, metadata.positions, metadata, _fresh_caches(model),
                                     logits_rows=rows)
    assert logits.shape == (2, full_logits.shape[1]) and out.shape == full_hidden.shape
    torch.testing.assert_close(logits, full_logits[rows])
    torch.testing.assert_close(out, full_hidden)
    with pytest.raises(TypeError, match="logits_rows"):
        runner.mtp_forward(0, hidden, tokens, metadata.positions, metadata, _fresh_caches(model), logits_rows=[4])
