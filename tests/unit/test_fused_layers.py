"""The fused layer glue (models.fused_layers) == megatron's own layer glue, through the runner and the controller.

Both runners wrap one model; ``fused_glue=True`` runs the QKV split, bias + residual + norm and
bias + activation as the layer-glue kernels (interpreter on CPU), ``False`` megatron's element-wise
ops. fp32: the same greedy tokens and logits within the reduction order of a norm; bf16: logits
within a few bf16 roundings.
"""

import pytest
import torch
import torch.nn.functional as F

from mtp_ctrl.controllers import InferenceConfig, SamplingParams
from mtp_ctrl.models import PagedGPTRunner, count_kv_layers
from mtp_ctrl.models import fused_layers, paged_core_attention
from mtp_ctrl.models.fused_layers import FusedGlueTransformerLayer, FusedQKVSelfAttention
from tests.unit.controller_fixtures import PROMPTS, make_controller, run_with_arrivals
from tests.unit.megatron_fixtures import (
    MAX_SEQUENCE_LENGTH,
    NUM_BLOCKS,
    VOCAB_SIZE,
    allocate_kv_caches,
    build_gpt_model,
    ensure_single_process_groups,
    random_sequences,
    run_paged_schedule,
    tiny_config,
    torch_twins,
)

FP32_TOL = dict(atol=1e-5, rtol=1e-5)
BF16_TOL = dict(atol=6e-2, rtol=6e-2)
CONFIGS = {  # name -> TransformerConfig overrides of the tiny GPT (4 query heads over 2 kv groups)
    "layernorm_gelu_bias": dict(),
    "rmsnorm_swiglu_no_bias": dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                                   add_bias_linear=False),
    "layernorm_geglu_qkv_bias_mha": dict(gated_linear_unit=True, num_query_groups=4, add_bias_linear=False,
                                         add_qkv_bias=True),
    "rmsnorm_relu_qk_layernorm": dict(normalization="RMSNorm", activation_func=F.relu, qk_layernorm=True),
}


@pytest.fixture(scope="module", autouse=True)
def megatron_groups():
    ensure_single_process_groups()


@pytest.fixture(autouse=True)
def attention_on_twins():
    """The subject is the glue kernels: attention and the rope + cache write (the same in both
    paths, each == its twin in its own tests) run their twins; the glue stays interpreted."""
    with torch_twins("paged_attn", "rope_kv_write"):
        yield


def _build(overrides, seed=21, **config_fields):
    torch.manual_seed(seed)
    config = tiny_config(mtp_num_layers=1, **overrides, **config_fields)  # one MTP depth keeps the test short
    return build_gpt_model(config, VOCAB_SIZE, MAX_SEQUENCE_LENGTH).eval()


def _schedule_logits(model, fused_glue, dtype=torch.float32):
    runner = PagedGPTRunner(model, fused_glue=fused_glue)
    num_kv_heads = model.config.num_query_groups
    caches = allocate_kv_caches(count_kv_layers(model), NUM_BLOCKS, num_kv_heads_local=num_kv_heads,
                                head_dim=model.config.kv_channels, dtype=dtype)
    decoder_logits, mtp_logits = run_paged_schedule(runner, random_sequences(seed=0), caches)
    return [decoder_logits] + mtp_logits


class _KernelCalls:
    """Counts the glue-kernel calls the fused layers make (through the real ops)."""

    def __init__(self, monkeypatch):
        self.counts = {}
        for module, name in ((fused_layers, "add_bias_residual_norm"), (fused_layers, "bias_activation"),
                             (fused_layers, "split_qkv_heads"), (paged_core_attention, "rope_and_write_kv_cache_mixed")):
            op = getattr(module, name)
            monkeypatch.setattr(module, name, self._counting(name, op))

    def _counting(self, name, op):
        def counted(*args, **kwargs):
            self.counts[name] = self.counts.get(name, 0) + 1
            return op(*args, **kwargs)
        return counted


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_glue_matches_megatron_glue_fp32(name, monkeypatch):
    model = _build(CONFIGS[name])
    layers = list(model.decoder.layers) + [layer.transformer_layer for layer in model.mtp.layers]
    assert all(type(layer) is FusedGlueTransformerLayer and layer.fused_glue_supported for layer in layers)
    assert all(type(layer.self_attention) is FusedQKVSelfAttention and layer.self_attention.fused_split_supported
               and layer.mlp_activation is not None for layer in layers)
    calls = _KernelCalls(monkeypatch)
    unfused = _schedule_logits(model, fused_glue=False)
    assert calls.counts == {}  # megatron's glue only
    fused = _schedule_logits(model, fused_glue=True)
    layer_calls = 5 * (2 + 1)  # SCHEDULE's 5 steps, each through 2 decoder layers and 1 MTP layer
    # the QKV bias, head split, rope and cache write: one launch from the GEMM's rows (with q/k norms
    # between the split and the rope: the split launch, then megatron's norms, then the rope)
    mixed = all(layer.self_attention.fused_mixed_supported for layer in layers)
    assert mixed == ("qk_layernorm" not in name)
    qkv_op = "rope_and_write_kv_cache_mixed" if mixed else "split_qkv_heads"
    assert calls.counts == {qkv_op: layer_calls, "add_bias_residual_norm": 2 * layer_calls,
                            "bias_activation": layer_calls}
    for fused_depth, unfused_depth in zip(fused, unfused):  # decoder, then each MTP depth
        for got, want in zip(fused_depth, unfused_depth):  # per request
            torch.testing.assert_close(got, want, **FP32_TOL)
            assert torch.equal(got.argmax(-1), want.argmax(-1))  # the same greedy tokens


def test_a_layers_input_norm_comes_from_its_predecessors_last_kernel():
    """link_input_norms: decoder layer 1's input norm is computed by layer 0's fc2 bias + residual
    kernel on the fused path (its own norm module never runs); megatron's path runs both."""
    model = _build({})
    calls = {0: 0, 1: 0}
    for index, layer in enumerate(model.decoder.layers):
        layer.input_layernorm.register_forward_hook(lambda *args, index=index: calls.__setitem__(index, calls[index] + 1))
    fused = _schedule_logits(model, fused_glue=True)
    assert model.decoder.layers[0].next_input_norm is not None and model.decoder.layers[1].next_input_norm is None
    assert calls == {0: 5, 1: 0}  # SCHEDULE's 5 steps
    unfused = _schedule_logits(model, fused_glue=False)
    assert calls == {0: 10, 1: 5}
    for got, want in zip(fused[0], unfused[0]):
        torch.testing.assert_close(got, want, **FP32_TOL)


def test_fused_glue_bf16_is_within_rounding_of_megatron():
    model = _build(CONFIGS["rmsnorm_swiglu_no_bias"], params_dtype=torch.bfloat16, bf16=True)
    fused = _schedule_logits(model, fused_glue=True, dtype=torch.bfloat16)
    unfused = _schedule_logits(model, fused_glue=False, dtype=torch.bfloat16)
    for fused_depth, unfused_depth in zip(fused, unfused):
        for got, want in zip(fused_depth, unfused_depth):
            torch.testing.assert_close(got, want, **BF16_TOL)


def test_training_and_unsupported_configs_run_megatrons_forward(monkeypatch):
    """The fused classes fall back to megatron outside the fused path: in training mode, and for
    an activation the kernel does not cover (megatron's own MLP, fused bias + residual kept)."""
    model = _build(dict(activation_func=torch.tanh))
    assert all(layer.fused_glue_supported and layer.mlp_activation is None for layer in model.decoder.layers)
    calls = _KernelCalls(monkeypatch)
    fused = _schedule_logits(model, fused_glue=True)
    assert "bias_activation" not in calls.counts and calls.counts["add_bias_residual_norm"] > 0
    unfused = _schedule_logits(model, fused_glue=False)
    for fused_depth, unfused_depth in zip(fused, unfused):
        for got, want in zip(fused_depth, unfused_depth):
            torch.testing.assert_close(got, want, **FP32_TOL)
    calls.counts.clear()
    layer = model.decoder.layers[0].train()
    hidden = torch.randn(3, 1, model.config.hidden_size)
    from mtp_ctrl.models.forward_context import paged_forward_context
    from tests.unit.megatron_fixtures import make_metadata
    metadata = make_metadata([[0]], [(0, 3)])
    caches = allocate_kv_caches(count_kv_layers(model), NUM_BLOCKS, 2, model.config.kv_channels)
    with paged_forward_context(metadata, caches, fused_glue=True):
        layer(hidden_states=hidden, attention_mask=None)
    assert calls.counts == {}
    model.eval()


def test_fused_glue_switch():
    model = _build({})
    assert PagedGPTRunner(model).fused_glue is False  # None: on for a CUDA model only (CPU: interpreter)
    assert PagedGPTRunner(model, fused_glue=True).fused_glue is True
    assert PagedGPTRunner(model, fused_glue=False).fused_glue is False
    with pytest.raises(TypeError, match="fused_glue"):
        PagedGPTRunner(model, fused_glue=1)
    with pytest.raises(TypeError, match="fused_glue"):
        InferenceConfig(fused_glue="on")


def test_controller_greedy_tokens_equal_with_and_without_fused_glue(model_twins):
    """Through the controller (S = 2, real MTP drafting): the same greedy tokens either way (the
    glue kernels interpreted; the model's attention, rope and sampling on their twins)."""
    torch.manual_seed(1234)
    model = build_gpt_model(tiny_config(mtp_num_layers=2), VOCAB_SIZE, MAX_SEQUENCE_LENGTH).eval()
    arrivals = [(0, PROMPTS[1], SamplingParams(max_new_tokens=5))]
    outputs = {}
    for flag in (True, False):
        controller = make_controller(model, num_speculative_tokens=2, fused_glue=flag)  # InferenceConfig field
        assert controller.runner.fused_glue is flag
        outputs[flag] = run_with_arrivals(controller, arrivals)
        controller.close()
    assert outputs[True] == outputs[False]
    assert all(len(tokens) > 0 for tokens in outputs[True])
