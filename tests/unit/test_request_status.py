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
