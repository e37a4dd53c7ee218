"""A request's life through the public API: ``controller.request_status`` follows it from the
queue to its result, and the scheduler's queues show in ``debug_view`` (CPU, torch twins)."""

import pytest

from mtp_ctrl.controllers import RequestStatus, SamplingParams
from tests.unit.controller_fixtures import PROMPTS, build_models, make_controller
from tests.unit.megatron_fixtures import ensure_single_process_groups


@pytest.fixture(scope="module")
def model():
    ensure_single_process_groups()
    return build_models()[0]


@pytest.mark.parametrize("overlap", [True, False])
def test_status_follows_a_request_from_queue_to_result(model, torch_twins, overlap):
    controller = make_controller(model, num_speculative_tokens=1, max_requests=1, overlap_scheduling=overlap)
    first = controller.add_request(list(PROMPTS[2]), SamplingParams(max_new_tokens=6))
    second = controller.add_request(list(PROMPTS[0]), SamplingParams(max_new_tokens=3))
    assert controller.request_status(first) == controller.request_status(second) == RequestStatus.WAITING
    assert controller.debug_view().num_waiting == 2
    controller.step()  # one row: the first joins and runs its prompt, the second waits
    assert controller.request_status(first) in (RequestStatus.PREFILLING, RequestStatus.DECODING)
    assert controller.request_status(second) == RequestStatus.WAITING
    assert controller.debug_view().num_waiting == 1
    while controller.request_status(first) != RequestStatus.DECODING:
        controller.step()
    controller.pause_request(first)
    assert controller.request_status(first) == RequestStatus.PAUSED
    controller.resume_request(first)
    assert controller.request_status(first) == RequestStatus.DECODING
    while controller.has_unfinished_requests():
        controller.step()
    assert controller.request_status(first) == controller.request_status(second) == RequestStatus.FINISHED
    assert len(controller.pop_result(first).output_tokens) == 6
    assert len(controller.pop_result(second).output_tokens) == 3
    view = controller.debug_view()
    assert (view.num_waiting, view.num_retiring, view.num_records) == (0, 0, 0)
    with pytest.raises(ValueError, match="request_id"):
        controller.request_status(first)


def test_requests_behind_a_full_prefill_backlog_wait_a_step(model, torch_twins):
    """Prompts left to prefill that fill a step's token budget: the next request would get no
    chunk in that step, so it is not admitted yet (its admission would only delay the launch)."""
    controller = make_controller(model, max_tokens_per_step=16)
    prompts = [[(7 * index + position) % 50 + 1 for position in range(12)] for index in range(4)]
    ids = [controller.add_request(prompt, SamplingParams(max_new_tokens=2)) for prompt in prompts]
    controller.step()  # the first two (12 + 12 >= 16 tokens) join; the first chunk (12) and 4 of the second run
    assert [controller.request_status(request_id) for request_id in ids[2:]] == [RequestStatus.WAITING] * 2
    assert controller.debug_view().num_waiting == 2
    while controller.has_unfinished_requests():
        controller.step()
    assert all(len(controller.pop_result(request_id).output_tokens) == 2 for request_id in ids)
