"""The overlapped loop on CUDA: a request arriving while others decode joins without the host
waiting for the step in flight. Its admission (table row reset, sampling
parameter rows, output rows) runs under ``torch.cuda.set_sync_debug_mode("error")`` (a sync would
raise: e.g. ``cuda_tensor[row] = python_float`` copies from pageable memory and syncs), the step
in flight is still unapplied when the new request takes its row (the host waits for a step only
in ``_apply``, which is not called early), and outputs equal plain decoding."""

import pytest
import torch

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from tests.functional.sync_checks import no_host_sync
from tests.unit.controller_fixtures import run_with_arrivals
from tests.unit.megatron_fixtures import build_tiny_model, ensure_single_process_groups, tiny_config

PROMPTS = [[5, 17, 3, 88, 41], [9, 9, 2], [60, 1, 33, 70, 12, 8, 45], [4] * 11]


@pytest.fixture(scope="module")
def model():
    ensure_single_process_groups()
    return build_tiny_model(tiny_config(mtp_num_layers=3)).cuda()


class AdmissionSyncChecked(TextGenerationController):
    """Admits under ``set_sync_debug_mode("error")`` whenever a step is in flight, and records how many steps were in flight at each admission and every early application of a
    step in flight, and how many finished requests gave up their rows with a step in flight.
    Admission and retirement are checked where they reach the state: ``context.add_request`` and
    ``context.finish_requests``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps_in_flight_at_admission = []
        self.early_applications = 0
        self.retired_with_step_in_flight = 0
        add_request, finish_requests = self.context.add_request, self.context.finish_requests

        def add_and_record(request_id, tokens, row_values, *args):
            self.steps_in_flight_at_admission.append(self.context.steps_in_flight)
            self._checked(lambda: add_request(request_id, tokens, row_values, *args))

        def finish_and_record(request_ids):
            """Freeing the rows of finished requests with a step in flight must not sync either."""
            if self.debug_view().step_in_flight:
                self.retired_with_step_in_flight += len(request_ids)
            return self._checked(lambda: finish_requests(request_ids))

        self.context.add_request, self.context.finish_requests = add_and_record, finish_and_record

    def _checked(self, function):
        if not self.debug_view().step_in_flight:
            return function()
        with no_host_sync():
            return function()

    def _apply_in_flight(self, collect=False):
        if not self.debug_view().num_retiring and self.has_unfinished_requests():
            self.early_applications += 1
        return super()._apply_in_flight(collect)


def _run_checked(model, arrivals, graphs):
    """Plain decoding, then S = 2 with overlap through AdmissionSyncChecked: outputs equal."""
    fields = dict(max_requests=8, block_size_tokens=4, max_model_len=96, max_tokens_per_step=128)
    plain = run_with_arrivals(TextGenerationController(
        model, InferenceConfig(num_speculative_tokens=0, overlap_scheduling=False, **fields)), arrivals)
    controller = AdmissionSyncChecked(model, InferenceConfig(
        num_speculative_tokens=2, cuda_graph_batch_sizes=(1, 2, 4, 8) if graphs else (), **fields))
    controller.warmup()
    assert run_with_arrivals(controller, arrivals) == plain
    return controller


@pytest.mark.parametrize("graphs", [False, True])
def test_an_arrival_during_decode_does_not_wait_for_the_step_in_flight(model, graphs):
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=0.8, seed=3)]
    arrivals = [(0, PROMPTS[0], params[0]), (3, PROMPTS[1], params[1]), (4, PROMPTS[2], params[0]),
                (6, PROMPTS[3], params[1])]
    controller = _run_checked(model, arrivals, graphs)
    assert controller.steps_in_flight_at_admission == [0, 1, 1, 1]
    assert controller.early_applications == 0
    context = controller.context
    assert context.table.num_live == 0 and context.allocator.num_free_blocks == context.allocator.num_blocks


@pytest.mark.parametrize("graphs", [False, True])
def test_finishing_requests_free_their_rows_without_waiting_for_the_step_in_flight(model, graphs):
    """Requests finish at different steps (max_new_tokens, greedy and sampled) while others keep
    decoding and one more arrives: each finished slot is freed with the next step in flight, under
    sync-debug "error", and that step's read-back skips the requests that left. == plain decoding."""
    lengths = [3, 9, 5, 14, 7]
    arrivals = [(step, PROMPTS[index % len(PROMPTS)],
                 SamplingParams(max_new_tokens=lengths[index], temperature=0.8 if index % 2 else 0.0, seed=index))
                for index, step in enumerate([0, 0, 0, 0, 5])]
    controller = _run_checked(model, arrivals, graphs)
    assert controller.retired_with_step_in_flight >= 3
    assert controller.early_applications == 0
    context = controller.context
    assert context.table.num_live == 0 and context.allocator.num_free_blocks == context.allocator.num_blocks
