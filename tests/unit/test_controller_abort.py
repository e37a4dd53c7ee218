"""controller.abort_request (CPU, torch twins): a queued, a running and a paused request end
with reason ABORTED and their output so far; the other requests finish as if nothing happened;
every row and KV block is free afterwards, and the draft-length policy forgets every request
once, the queued one included; bad ids are refused by name."""

import pytest

from mtp_ctrl.controllers import FinishReason, InferenceConfig, SamplingParams, TextGenerationController
from mtp_ctrl.controllers.draft_policy import FixedDraftLength
from tests.unit.controller_fixtures import PROMPTS, build_models, make_controller
from tests.unit.megatron_fixtures import ensure_single_process_groups

PARAMS = [SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=8, temperature=0.8, top_k=10, seed=3),
          SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=4)]


@pytest.fixture(scope="module")
def model():
    ensure_single_process_groups()
    return build_models()[0]


def _released(controller):
    context = controller.context
    return context.table.num_live == 0 and context.allocator.num_free_blocks == context.allocator.num_blocks


class ForgetLog(FixedDraftLength):
    """S drafts each; records the requests the controller tells it are gone (``forget``)."""

    def __init__(self):
        super().__init__()
        self.forgotten = []

    def forget(self, request_id):
        self.forgotten.append(request_id)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_abort_running_and_queued_requests(model, torch_twins, overlap):
    alone = make_controller(model, 2, max_requests=2, overlap_scheduling=overlap).generate(list(PROMPTS), PARAMS)
    policy = ForgetLog()
    controller = TextGenerationController(model, InferenceConfig(
        num_speculative_tokens=2, max_requests=2, block_size_tokens=4, max_model_len=32, max_tokens_per_step=64,
        overlap_scheduling=overlap), draft_policy=policy)  # make_controller's settings
    ids = [controller.add_request(prompt, params) for prompt, params in zip(PROMPTS, PARAMS)]
    streamed = {request_id: [] for request_id in ids}
    for _ in range(3):  # requests 0 and 1 run, 2 and 3 wait for a row
        for request_id, tokens, _ in controller.step():
            streamed[request_id] += tokens
    controller.abort_request(ids[0])  # running
    controller.abort_request(ids[3])  # queued
    while controller.has_unfinished_requests():
        for request_id, tokens, _ in controller.step():
            streamed[request_id] += tokens
    results = [controller.pop_result(request_id) for request_id in ids]
    for index in (0, 3):
        assert results[index].finish_reason == FinishReason.ABORTED
        got = list(results[index].output_tokens)
        assert got == list(alone[index].output_tokens[:len(got)])  # the output so far, a prefix
        assert streamed[ids[index]] == got or streamed[ids[index]] == got[:len(streamed[ids[index]])]
    assert results[3].output_tokens == ()  # it never ran
    for index in (1, 2):  # the others are untouched, the sampled one included
        assert results[index].output_tokens == alone[index].output_tokens
        assert results[index].finish_reason == alone[index].finish_reason
    assert _released(controller)
    assert controller.debug_view().num_records == 0
    assert sorted(policy.forgotten) == sorted(ids)  # each once: finished, aborted running, aborted queued


def test_abort_paused_finished_and_unknown(model, torch_twins):
    controller = make_controller(model, 2)
    first, second = (controller.add_request(prompt, params) for prompt, params in zip(PROMPTS[:2], PARAMS[:2]))
    controller.step()
    controller.step()
    controller.pause_request(first)
    controller.abort_request(first)  # paused: its blocks and state go too
    while controller.has_unfinished_requests():
        controller.step()
    assert controller.result(first).finish_reason == FinishReason.ABORTED
    finished = controller.result(second)
    controller.abort_request(second)  # finished already: left as it is
    assert controller.result(second) == finished
    assert _released(controller)
    controller.pop_result(first)
    with pytest.raises(ValueError, match="request_id"):
        controller.abort_request(first)  # its result was taken
    with pytest.raises(ValueError, match="request_id"):
        controller.abort_request(12345)
