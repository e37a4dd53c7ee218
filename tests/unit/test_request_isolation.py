"""One request's values never harm another (CPU, TP = 1): integer fields are bounded where
SamplingParams is built; extreme but valid values of every field leave a neighbour's output as
it is; a generate() that raises leaves none of its requests behind; results taken by
pop_result are not listed any more."""

import pytest
import torch

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from mtp_ctrl.controllers.stop_rules import FinishReason
from tests.unit.controller_fixtures import build_models, make_controller
from tests.unit.megatron_fixtures import VOCAB_SIZE, ensure_single_process_groups

INT64_MAX = 2**63 - 1
NEIGHBOUR = ([1, 2, 3], SamplingParams(max_new_tokens=6))


@pytest.fixture(scope="module")
def model():
    ensure_single_process_groups()
    return build_models()[0]


@pytest.mark.parametrize("field, value", [
    ("max_new_tokens", 2**63), ("seed", 2**63), ("top_k", 2**63), ("eos_token_ids", (2**63,)),
    ("stop_sequences", ((1, 2**63),)),
])
def test_integer_fields_are_bounded(field, value):
    """Every integer field lives in an int64 row: a larger value is a ValueError naming the
    field where SamplingParams is built (max_new_tokens = 2**63 was accepted and aborted another
    request at its admission)."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


EXTREME_PARAMS = [
    SamplingParams(max_new_tokens=INT64_MAX),
    SamplingParams(max_new_tokens=4, seed=INT64_MAX, temperature=1.0, top_k=INT64_MAX),
    SamplingParams(max_new_tokens=4, temperature=3.4e38),
    SamplingParams(max_new_tokens=4, temperature=1e-30, top_p=1e-30),
    SamplingParams(max_new_tokens=4, eos_token_ids=tuple(range(VOCAB_SIZE - 1, VOCAB_SIZE - 12, -1))),
    SamplingParams(max_new_tokens=4, stop_sequences=(tuple(range(40)), (VOCAB_SIZE - 1,))),
]


def test_extreme_values_leave_a_neighbour_alone(model, torch_twins):
    """The audit: the largest or smallest valid value of every field, in one batch with an ordinary
    request, ends without ABORTED, and the ordinary request's output is its output alone."""
    alone = make_controller(model, 2).generate([NEIGHBOUR[0]], NEIGHBOUR[1])[0]
    controller = make_controller(model, 2, max_requests=len(EXTREME_PARAMS) + 1, max_tokens_per_step=64)
    results = controller.generate([NEIGHBOUR[0]] + [[4, 5, 6]] * len(EXTREME_PARAMS),
                                  [NEIGHBOUR[1]] + EXTREME_PARAMS)
    assert results[0].output_tokens == alone.output_tokens
    assert all(result.finish_reason != FinishReason.ABORTED for result in results)
    assert results[1].finish_reason == FinishReason.MAX_MODEL_LEN


def test_generate_that_raises_leaves_nothing_queued(model, torch_twins):
    """With the only row held by a paused request, generate() cannot run its requests and raises;
    afterwards none of them waits, runs or is reported: the paused request alone finishes."""
    controller = make_controller(model, 2, max_requests=1, max_tokens_per_step=8)
    paused = controller.add_request(*NEIGHBOUR)
    controller.step()  # admitted and prefilled
    controller.pause_request(paused)
    with pytest.raises(RuntimeError, match="no request can run"):
        controller.generate([[7, 8, 9], [10, 11]])
    controller.resume_request(paused)
    emitted_by = set()
    while controller.has_unfinished_requests():
        emitted_by.update(request_id for request_id, _, _ in controller.step())
    assert emitted_by == {paused}
    assert controller.finished_request_ids() == [paused]
    assert controller.pop_result(paused).finish_reason == FinishReason.LENGTH
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks


def test_popped_results_are_not_listed(model, torch_twins):
    """finished_request_ids() lists the results waiting for pop_result, oldest first; a popped
    result leaves the list at once (the list kept stale ids up to finished_results_kept)."""
    controller = make_controller(model, 0, finished_results_kept=2)
    request_ids = [controller.add_request([1 + index, 2], SamplingParams(max_new_tokens=2)) for index in range(3)]
    while controller.has_unfinished_requests():
        controller.step()
    assert controller.finished_request_ids() == request_ids[1:]  # the oldest was pushed out
    controller.pop_result(request_ids[2])
    assert controller.finished_request_ids() == [request_ids[1]]
    controller.pop_result(request_ids[1])
    assert controller.finished_request_ids() == []


def test_free_rows_point_at_the_scratch_block(model, torch_twins):
    """Slots that hold no request (never used, or released when a request finished) and the
    scratch slot padding requests use point only at the scratch KV block past the pool, with no KV,
    whenever a step launches (a freed slot is reset with the next step's row writes, or written
    as the next request's when one takes it): a captured graph replayed over them (padding, or a
    stale replay) reads and writes inside the caches, never at -1 or another request's block."""

    def assert_free_rows_point_at_scratch(table, scratch):
        free = torch.ones(table.shape.max_requests + 1, dtype=torch.bool)  # [R + 1]: the scratch slot last
        free[torch.from_numpy(table.live_slots())] = False
        rows = table.device
        assert (rows.kv_block_ids[free] == scratch).all()
        assert (rows.last_kv_block_id[free] == scratch).all()
        assert (rows.kv_length_offsets[free] == 0).all() and (rows.kv_block_counts[free] == 0).all()
        assert (rows.mamba_slot_ids[free] == -1).all()  # no Mamba layers: nothing reads it

    class Checked(TextGenerationController):
        launches = 0

        def on_launch(self, step, graph_key):  # on the CPU the launch's device work is done by now
            assert_free_rows_point_at_scratch(self.context.table, self.context.scratch_block)
            type(self).launches += 1

    controller = Checked(model, InferenceConfig(num_speculative_tokens=2, max_requests=4, block_size_tokens=4,
                                                max_model_len=32, max_tokens_per_step=64))
    context = controller.context
    table, scratch = context.table, context.scratch_block
    assert scratch == context.allocator.num_blocks and context.kv_caches[0][0].shape[0] == scratch + 1
    assert_free_rows_point_at_scratch(table, scratch)
    # a queue: finished requests' slots are taken by waiting ones in the same call, or left free
    for prompt, max_new_tokens in zip(([1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [3, 1], [7, 7, 7], [2]), (2, 9, 5, 3, 6, 4)):
        controller.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens))
    saw_released = False
    while controller.has_unfinished_requests():
        live_before = table.num_live
        controller.step()
        saw_released |= 0 < table.num_live < live_before
    assert saw_released and table.num_live == 0 and Checked.launches > 6
    table.write_inserted_rows()  # the last freed slots' reset (the next step would stage it)
    assert_free_rows_point_at_scratch(table, scratch)
