"""TextGenerationController under pressure and misuse (CPU, TP = 1): queueing beyond
max_requests, KV exhaustion (pausing and preemption) with unchanged outputs and no leaked
blocks, and bad input rejected before any state changes, naming the argument."""

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from mtp_ctrl.state.request_table import RowGroup
from tests.unit.controller_fixtures import MTP_DEPTH, PROMPTS, build_models, dense_greedy, make_controller
from tests.unit.megatron_fixtures import MAX_SEQUENCE_LENGTH, VOCAB_SIZE, ensure_single_process_groups, tiny_config
from tests.unit.megatron_fixtures import torch_twins as twin_ops

MAX_NEW_TOKENS = 9
S = 2
# Greedy requests 0 and 2, seeded sampled requests 1 and 3 (their output must survive
# preemption too: sampling noise depends on position only).
REQUEST_PARAMS = [
    SamplingParams(max_new_tokens=MAX_NEW_TOKENS),
    SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.8, top_k=10, seed=3),
    SamplingParams(max_new_tokens=MAX_NEW_TOKENS),
    SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.8, top_p=0.9, seed=4),
]
GREEDY_REQUESTS = (0, 2)


@pytest.fixture(scope="module")
def models():
    ensure_single_process_groups()
    return build_models()


@pytest.fixture(scope="module")
def unconstrained_outputs(models):
    """Outputs of the four requests with room for all of them (S = 2); the greedy ones are
    checked against the dense reference loop here. Torch twins: a module fixture starts before the
    function-scoped torch_twins of the tests that use it."""
    model, dense = models
    with twin_ops():
        results = make_controller(model, S, max_model_len=22).generate(list(PROMPTS), REQUEST_PARAMS)
    outputs = [result.output_tokens for result in results]
    for index in GREEDY_REQUESTS:
        assert list(outputs[index]) == dense_greedy(dense, PROMPTS[index], MAX_NEW_TOKENS)
    return outputs


def _run_observing(controller):
    """Add the four requests, step to the end; returns (outputs, saw a paused request, saw a
    preempted one: a request that left the context without having finished)."""
    request_ids = [controller.add_request(prompt, params) for prompt, params in zip(PROMPTS, REQUEST_PARAMS)]
    finished, live_before, saw_paused, saw_preempted = set(), set(), False, False
    while controller.has_unfinished_requests():
        finished.update(request_id for request_id, _, done in controller.step() if done)
        live = {request_id for request_id in request_ids if request_id in controller.context}
        saw_preempted |= bool(live_before - live - finished)
        saw_paused |= controller.context.table.group_size(RowGroup.PAUSED) > 0
        live_before = live
    return [controller.result(rid).output_tokens for rid in request_ids], saw_paused, saw_preempted


def _assert_state_released(controller):
    context = controller.context
    assert context.table.num_live == 0
    assert context.allocator.num_free_blocks == context.allocator.num_blocks
    assert not controller.has_unfinished_requests()


# ----- queueing and KV exhaustion ----------------------------------------------------------


def test_more_prompts_than_max_requests(models, unconstrained_outputs, torch_twins):
    """Four requests through two rows, with prompts prefilled in chunks (6 query rows per step
    hold only the two decodes' 1 + S rows): every request waits its turn and gets the same
    tokens as with room for all."""
    model, _ = models
    controller = make_controller(model, S, max_model_len=22, max_requests=2, max_tokens_per_step=2 * (1 + S))
    outputs, _, _ = _run_observing(controller)
    assert outputs == unconstrained_outputs
    _assert_state_released(controller)


@pytest.mark.parametrize("num_kv_blocks", [12, 14])
def test_kv_exhaustion_keeps_outputs_and_frees_every_block(models, unconstrained_outputs, num_kv_blocks, torch_twins):
    """A full-length request takes ceil((22 + S) / 4) = 6 blocks. Pools of 12 and 14 blocks run
    out with every live decode paused, so the newest request is preempted and recomputed. The
    outputs are those of an unconstrained run, no request is evicted twice (prefill leaves the
    running decodes' next blocks, and an evicted request returns only when it fits), and at the
    end every block is free and no row is live. (Pausing without preemption is covered at the
    context level in test_context.py.)"""
    model, _ = models
    controller = make_controller(model, S, max_model_len=22, num_kv_blocks=num_kv_blocks)
    outputs, saw_paused, saw_preempted = _run_observing(controller)
    assert outputs == unconstrained_outputs
    assert saw_paused and saw_preempted
    assert max(controller.result(request_id).preemptions for request_id in range(len(PROMPTS))) == 1
    _assert_state_released(controller)


# ----- bad input -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def controller(models):
    """One controller shared by the bad-input tests (each leaves it untouched)."""
    model, _ = models
    return make_controller(model, S, max_model_len=16)


def _assert_untouched(controller):
    assert not controller.has_unfinished_requests()
    assert controller.context.table.num_live == 0
    assert controller.debug_view().next_request_id == 0  # no request id was taken


@pytest.mark.parametrize("prompt", [[], list(range(16)), [3, -1, 4], [3, VOCAB_SIZE, 4], torch.tensor([1, VOCAB_SIZE]),
                                    torch.tensor([[1, 2]])],
                         ids=["empty", "max_model_len", "negative", "vocab", "tensor_vocab", "2d_tensor"])
def test_bad_prompt_is_rejected_before_state_changes(controller, prompt):
    """Empty, max_model_len long (no room to generate), 2-D, or out-of-vocabulary prompts raise a
    ValueError naming prompt_tokens and queue nothing."""
    with pytest.raises(ValueError, match="prompt_tokens"):
        controller.add_request(prompt)
    _assert_untouched(controller)


@pytest.mark.parametrize("prompt", [[1, 2.0], [True, 2], torch.tensor([1.0, 2.0]), None, 5, {1, 2}],
                         ids=["float", "bool", "float_tensor", "none", "int", "set"])
def test_prompt_of_wrong_type_is_rejected(controller, prompt):
    with pytest.raises(TypeError, match="prompt_tokens"):
        controller.add_request(prompt)
    _assert_untouched(controller)


def test_bad_sampling_params_are_rejected_before_state_changes(controller):
    """A sampling_params that is not a SamplingParams raises TypeError; a stop token outside
    the vocabulary raises ValueError naming the field; nothing is queued."""
    with pytest.raises(TypeError, match="sampling_params"):
        controller.add_request([1, 2, 3], {"temperature": 0.5})
    with pytest.raises(ValueError, match="eos_token_ids"):
        controller.add_request([1, 2, 3], SamplingParams(eos_token_ids=(VOCAB_SIZE,)))
    with pytest.raises(ValueError, match="stop_sequences"):
        controller.add_request([1, 2, 3], SamplingParams(stop_sequences=((1, VOCAB_SIZE),)))
    _assert_untouched(controller)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
    ("max_new_tokens", 0), ("seed", -3),
])
def test_sampling_params_reject_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_generate_validates_every_request_before_queueing_any(controller):
    """generate raises before queueing anything when the sampling_params count differs from the
    prompt count, or when any prompt or parameter (not only the first) is bad."""
    with pytest.raises(ValueError, match="sampling_params"):
        controller.generate([[1, 2], [3, 4]], [SamplingParams(), SamplingParams(), SamplingParams()])
    _assert_untouched(controller)
    with pytest.raises(ValueError, match="prompt_tokens"):
        controller.generate([[1, 2], [3, 4], []])
    _assert_untouched(controller)
    with pytest.raises(TypeError, match="sampling_params"):
        controller.generate([[1, 2], [3, 4]], [SamplingParams(), "greedy"])
    _assert_untouched(controller)


@pytest.mark.parametrize("sampling_params", [{"temperature": 0.5, "max_new_tokens": 4}, "greedy", {SamplingParams()}],
                         ids=["dict", "str", "set"])
def test_generate_names_sampling_params_that_are_not_a_list(controller, sampling_params):
    """A dict of options (or another container) passed as sampling_params is a TypeError naming it,
    not a count mismatch against the prompts."""
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams, None, or a list"):
        controller.generate([[1, 2], [3, 4], [5, 6]], sampling_params)
    _assert_untouched(controller)


def test_result_of_unknown_or_unfinished_request(models, torch_twins):
    """result() names the request id it cannot answer for: unknown, or not finished yet; after
    the rejected calls the controller still generates normally."""
    model, dense = models
    controller = make_controller(model, S, max_model_len=16)
    with pytest.raises(ValueError, match="unknown request_id 7"):
        controller.result(7)
    request_id = controller.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match=f"request {request_id} has not finished"):
        controller.result(request_id)
    while controller.has_unfinished_requests():
        controller.step()
    assert list(controller.result(request_id).output_tokens) == dense_greedy(dense, [1, 2, 3], 2)
    _assert_state_released(controller)


def test_controller_construction_errors(models):
    """The constructor rejects a config that is not an InferenceConfig, S beyond the model's
    MTP depth, and a model built without the paged layer spec."""
    model, _ = models
    with pytest.raises(TypeError, match="config"):
        TextGenerationController(model, {"num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_controller(model, MTP_DEPTH + 1)
    torch.manual_seed(0)
    local_model = GPTModel(config=tiny_config(mtp_num_layers=None), transformer_layer_spec=get_gpt_layer_local_spec(),
                           vocab_size=VOCAB_SIZE, max_sequence_length=MAX_SEQUENCE_LENGTH)
    with pytest.raises(TypeError):
        TextGenerationController(local_model, InferenceConfig())
