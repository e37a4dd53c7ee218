"""The overlapped step loop (CPU, TP = 1): overlap on == overlap off == plain decoding, token for
token, under churn (random arrivals), a KV pool small enough to pause and preempt, stop rules
that fire inside an accepted draft run, max_model_len reached mid-draft, greedy and sampled
requests, S = 0..3, and a hybrid Mamba model; no block or row left at the end. Then the
failure and lifetime contracts: a step that raises aborts its batch and leaves the controller
usable, accept_tokens cannot drop tokens without finishing, finished results are bounded.

How these fail when the loop is wrong: with the one-step-late commit removed from stop rules
(a request's extra step not discarded), outputs run past the stop; with the worst-case block
reserve cut to one step, the device grows into a block the host has not sent, and outputs
differ from plain decoding (planted: ``stride * (1 + steps_in_flight)`` -> ``stride``).
"""

import random
import tracemalloc

import pytest
import torch

from mtp_ctrl.controllers import FinishReason, Proposer, SamplingParams, TextGenerationController
from mtp_ctrl.state.request_table import RowGroup
from tests.unit.controller_fixtures import (MTP_DEPTH, PROMPTS, CountingAcceptTokens, build_models, make_controller,
                                           random_arrivals, run_with_arrivals)
from tests.unit.megatron_fixtures import VOCAB_SIZE, ensure_single_process_groups
from tests.unit.megatron_fixtures import torch_twins as twin_ops


@pytest.fixture(scope="module")
def models():
    ensure_single_process_groups()
    return build_models()


@pytest.mark.parametrize("seed", range(3))
def test_overlap_on_equals_off_equals_plain_under_churn_and_preemption(models, seed):
    model, _ = models
    arrivals = random_arrivals(seed, 7)
    with twin_ops():
        plain = run_with_arrivals(make_controller(model, 0, max_model_len=24, overlap_scheduling=False), arrivals)
    for S in (1, 3):
        for overlap in (False, True):
            # S = 3 with overlap also pads every step to a graph shape: mixed steps to 4 requests
            # and 64 rows, with the real counts read on the device (what a replayed graph does)
            padded = dict(cuda_graph_batch_sizes=(2, 4)) if S == 3 and overlap else {}
            controller = make_controller(model, S, max_model_len=24, overlap_scheduling=overlap, num_kv_blocks=14,
                                         **padded)
            with twin_ops():  # the kernels' own run of this loop: the test below
                assert run_with_arrivals(controller, arrivals) == plain, (S, overlap)
            context = controller.context
            assert context.table.num_live == 0 and not controller.has_unfinished_requests()
            assert context.allocator.num_free_blocks == context.allocator.num_blocks


def test_padded_overlap_through_the_interpreted_kernels_equals_plain(models):
    """The churn loop above (S = 3, overlap, every step padded to a graph shape) on the
    interpreted kernels, smaller: four random requests (greedy and sampled, up to 4 tokens), 16-row
    steps (prompts split into chunks), a pool of 10 blocks. It is the interpreted run of the paged
    MTP loop, the model's rope, attention and sampler included: 5 launches at grids 2 and 4, three
    of them with prefill chunks beside decode and verify rows, a sampled request decoding (seed 4;
    seed 0's 4 requests of up to 8 tokens: 9 launches, two mixed, ~95 CPU s, the suite's slowest
    test). test_controller and test_mtp_draft_oracles run that loop on the twins."""
    model, _ = models
    arrivals = random_arrivals(4, 4, max_new_tokens=4, arrival_steps=range(2))
    fields = dict(max_model_len=24, max_tokens_per_step=16)
    with twin_ops():
        plain = run_with_arrivals(make_controller(model, 0, overlap_scheduling=False, **fields), arrivals)
    controller = make_controller(model, 3, num_kv_blocks=10, cuda_graph_batch_sizes=(2, 4), **fields)
    assert run_with_arrivals(controller, arrivals) == plain
    context = controller.context
    assert context.table.num_live == 0 and context.allocator.num_free_blocks == context.allocator.num_blocks


def test_stop_inside_an_accepted_draft_run_and_max_model_len_mid_draft(models, torch_twins):
    """An oracle drafts the greedy continuation (every draft accepted), so stops fall inside
    accepted runs: output is cut exactly at an eos id, at a stop sequence, and at max_model_len."""
    model, _ = models
    prompt = list(PROMPTS[3])
    plain = make_controller(model, 0, max_model_len=24).generate([prompt], SamplingParams(max_new_tokens=30))[0]
    continuation = list(plain.output_tokens)
    sequences = {0: prompt + continuation + [0] * 8}

    class Oracle(Proposer):
        def bind(self, draft_context):
            super().bind(draft_context)

        def propose(self, batch):
            positions = batch.bonus_positions[: batch.num_requests, None] + 1 + torch.arange(MTP_DEPTH)
            known = torch.tensor(sequences[0])
            return known[positions.clamp(max=known.shape[0] - 1)]

    eos = continuation[5]
    cases = [
        (SamplingParams(max_new_tokens=11, eos_token_ids=(eos,)), continuation[: continuation.index(eos) + 1],
         FinishReason.EOS),
        (SamplingParams(max_new_tokens=11, stop_sequences=(tuple(continuation[3:5]),)), continuation[:5],
         FinishReason.STOP_SEQUENCE),
        (SamplingParams(max_new_tokens=30), continuation[: 24 - len(prompt)], FinishReason.MAX_MODEL_LEN),
    ]
    for params, want, reason in cases:
        for overlap in (False, True):
            controller = make_controller(model, MTP_DEPTH, proposer=Oracle(), max_model_len=24,
                                         overlap_scheduling=overlap)
            result = controller.generate([prompt], params)[0]
            assert list(result.output_tokens) == want and result.finish_reason == reason, (params, overlap)
            assert result.accepted_drafts > 0


def test_step_api_returns_tokens_one_call_late_with_overlap(models, torch_twins):
    model, _ = models
    for overlap in (False, True):
        controller = make_controller(model, 2, overlap_scheduling=overlap)
        request_id = controller.add_request(list(PROMPTS[1]), SamplingParams(max_new_tokens=6))
        first = controller.step()  # the prefill: with overlap its token comes with the next call
        assert (first == []) == overlap
        emitted = [token for _, tokens, _ in first for token in tokens]
        while controller.has_unfinished_requests():
            emitted += [token for rid, tokens, _ in controller.step() if rid == request_id for token in tokens]
        assert emitted == list(controller.result(request_id).output_tokens)


class _FailingProposer(Proposer):
    """Drafts of the wrong shape on the ``fail_at``-th call, zeros otherwise."""

    def __init__(self, fail_at: int):
        self.fail_at, self.calls = fail_at, 0

    def bind(self, draft_context):
        super().bind(draft_context)
        self.num_speculative_tokens = draft_context.shape.num_speculative_tokens

    def propose(self, batch):
        self.calls += 1
        rows = batch.num_requests + (1 if self.calls == self.fail_at else 0)
        return torch.zeros(rows, self.num_speculative_tokens, dtype=torch.int64)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_that_raises_aborts_its_batch_and_the_controller_stays_usable(models, torch_twins, overlap):
    """Before: every later step raised 'a step is in flight' forever, blocks leaked."""
    model, _ = models
    controller = make_controller(model, 2, proposer=_FailingProposer(fail_at=3), overlap_scheduling=overlap)
    ids = [controller.add_request(list(prompt), SamplingParams(max_new_tokens=5)) for prompt in PROMPTS[:2]]
    with pytest.raises(TypeError, match="propose must return"):
        while controller.has_unfinished_requests():
            controller.step()
    assert all(controller.result(rid).finish_reason == FinishReason.ABORTED for rid in ids)
    context = controller.context
    assert context.table.num_live == 0 and context.allocator.num_free_blocks == context.allocator.num_blocks
    plain = make_controller(model, 0).generate([list(PROMPTS[2])], SamplingParams(max_new_tokens=4))
    assert controller.generate([list(PROMPTS[2])], SamplingParams(max_new_tokens=4))[0].output_tokens == \
        plain[0].output_tokens


def test_a_raising_hook_aborts_and_accept_tokens_cannot_drop_tokens_silently(models, torch_twins):
    model, _ = models

    class Truncating(TextGenerationController):
        def accept_tokens(self, record, new_tokens):
            return new_tokens[:1], None  # drops verified tokens without finishing: refused

    controller = Truncating(model, make_controller(model, 2).config)
    with pytest.raises(ValueError, match="accept_tokens must keep"):
        controller.generate([list(PROMPTS[0])], SamplingParams(max_new_tokens=6))
    assert controller.context.table.num_live == 0

    class Exploding(TextGenerationController):
        def on_step_end(self, outputs):
            raise RuntimeError("hook failed")

    controller = Exploding(model, make_controller(model, 1).config)
    with pytest.raises(RuntimeError, match="hook failed"):
        controller.generate([list(PROMPTS[0])], SamplingParams(max_new_tokens=6))
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks


def test_accept_tokens_override_runs_per_request_and_equals_the_default(models, torch_twins):
    model, _ = models

    params = SamplingParams(max_new_tokens=7, eos_token_ids=(3,))
    want = make_controller(model, 2).generate([list(p) for p in PROMPTS], params)
    controller = CountingAcceptTokens(model, make_controller(model, 2).config)
    got = controller.generate([list(p) for p in PROMPTS], params)
    assert [r.output_tokens for r in got] == [r.output_tokens for r in want] and controller.calls > 0


def test_finished_results_are_bounded_and_popped(models, torch_twins):
    """A long-running step-API server: what the controller keeps per request does not grow
    with the requests served (before: every record was kept forever). The 100,000-request RSS
    soak is tests/functional/test_soak_gpu.py."""
    import gc

    model, _ = models
    controller = make_controller(model, 1, finished_results_kept=3)
    tracemalloc.start()
    sizes = []
    for round_index in range(6):
        ids = [controller.add_request([5 + index, 7], SamplingParams(max_new_tokens=1)) for index in range(8)]
        while controller.has_unfinished_requests():
            controller.step()
        view = controller.debug_view()
        assert view.num_records <= 3 and view.num_unclaimed_results <= 3
        assert view.num_retiring == 0 and view.num_prefills_held == 0
        assert controller.pop_result(ids[-1]).output_tokens
        with pytest.raises(ValueError, match="unknown request_id"):
            controller.result(ids[0])  # pushed out by newer results
        gc.collect()
        sizes.append(tracemalloc.get_traced_memory()[0])
    tracemalloc.stop()
    assert sizes[-1] <= sizes[1] + 256 * 1024, sizes  # flat but for interpreter and allocator noise


def test_hybrid_model_overlap_equals_plain(models, torch_twins):
    from tests.unit.hybrid_fixtures import build_hybrid_model

    model = build_hybrid_model()
    prompts = [list(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=6)
    plain = make_controller(model, 0, overlap_scheduling=False).generate(prompts, params)
    spec = make_controller(model, 2, overlap_scheduling=True, num_kv_blocks=14).generate(prompts, params)
    assert [r.output_tokens for r in spec] == [r.output_tokens for r in plain]


def test_pause_and_resume_through_the_controller_while_overlapping(models, torch_twins):
    """Before: context.pause_request while a step was in flight moved rows under the step's
    read-back and requests swapped tokens. Now the controller applies the step first, and the
    context refuses to move rows while a step is in flight."""
    model, _ = models
    prompts = [list(PROMPTS[0]), list(PROMPTS[1])]
    params = SamplingParams(max_new_tokens=12)
    plain = [r.output_tokens for r in make_controller(model, 0, overlap_scheduling=False).generate(prompts, params)]
    controller = make_controller(model, 2)
    ids = [controller.add_request(prompt, params) for prompt in prompts]
    streamed = {rid: [] for rid in ids}

    def collect(outputs):
        for request_id, tokens, _ in outputs:
            streamed[request_id] += tokens

    for _ in range(3):
        collect(controller.step())
    with pytest.raises(RuntimeError, match="a step is in flight"):
        controller.context.pause_request(ids[0])
    controller.pause_request(ids[0])
    for _ in range(2):
        collect(controller.step())
    controller.resume_request(ids[0])
    while controller.has_unfinished_requests():
        collect(controller.step())
    assert [controller.result(rid).output_tokens for rid in ids] == plain
    assert [tuple(streamed[rid]) for rid in ids] == plain  # nothing the pause applied was lost


def test_close_applies_the_step_in_flight_and_step_still_returns_its_tokens(models, torch_twins):
    model, _ = models
    controller = make_controller(model, 2)
    request_id = controller.add_request(list(PROMPTS[2]), SamplingParams(max_new_tokens=12))
    streamed = []
    for _ in range(3):
        streamed += [t for _, tokens, _ in controller.step() for t in tokens]
    controller.close()
    while controller.has_unfinished_requests():
        streamed += [t for _, tokens, _ in controller.step() for t in tokens]
    streamed += [t for _, tokens, _ in controller.step() for t in tokens]  # anything still pending
    assert tuple(streamed) == controller.result(request_id).output_tokens


def test_generate_keeps_its_results_whatever_finished_results_kept_says(models, torch_twins):
    """Before: finished_results_kept=1 dropped generate's own records mid-run (KeyError)."""
    model, _ = models
    prompts = [list(p) for p in PROMPTS]
    want = make_controller(model, 2).generate(prompts, SamplingParams(max_new_tokens=5))
    controller = make_controller(model, 2, finished_results_kept=1)
    got = controller.generate(prompts, SamplingParams(max_new_tokens=5))
    assert [r.output_tokens for r in got] == [r.output_tokens for r in want]
    assert controller.debug_view().num_records == 0


def test_learned_position_table_is_not_indexed_past_its_end_by_the_extra_step(monkeypatch, torch_twins):
    """Before: with overlap on, a step run past a request's stop read position max_model_len + S
    of a learned position table of max_model_len + S rows (IndexError on CPU, a device assert on
    a GPU). Output equals plain decoding with every draft accepted."""
    from megatron.core.models.gpt import GPTModel

    from mtp_ctrl.models import build_gpt_model
    from tests.unit.controller_fixtures import OracleProposer
    from tests.unit.megatron_fixtures import tiny_config

    ensure_single_process_groups()
    original = GPTModel.__init__

    def learned_positions(self, *args, **kwargs):
        kwargs["position_embedding_type"] = "learned_absolute"
        original(self, *args, **kwargs)

    S, max_model_len = 2, 16
    monkeypatch.setattr(GPTModel, "__init__", learned_positions)
    torch.manual_seed(0)
    model = build_gpt_model(tiny_config(mtp_num_layers=3), VOCAB_SIZE, max_model_len + S).eval()
    monkeypatch.setattr(GPTModel, "__init__", original)
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(max_new_tokens=100)
    plain = make_controller(model, 0, max_model_len=max_model_len, overlap_scheduling=False).generate([prompt], params)
    sequence = prompt + list(plain[0].output_tokens) + [0] * 10
    controller = make_controller(model, S, proposer=OracleProposer({0: sequence}, lambda rid, index: S),
                                 max_model_len=max_model_len)
    assert controller.generate([prompt], params)[0].output_tokens == plain[0].output_tokens


def test_arrivals_while_decoding_join_without_applying_the_step_in_flight(models, torch_twins):
    """Issue 14: a request arriving while others decode takes a free slot with the step in
    flight still unapplied, and a prompt whose final chunk ran becomes a decode; the host
    applies a step in flight early only to retire finished requests. Outputs == plain decoding.
    (Before: every arrival and every prompt turning into a decode applied the step in flight.)"""
    model, _ = models
    params = SamplingParams(max_new_tokens=10)
    arrivals = [(0, PROMPTS[0], params), (2, PROMPTS[1], params), (3, PROMPTS[2], params),
                (5, PROMPTS[3], SamplingParams(max_new_tokens=8, temperature=0.9, seed=4))]
    plain = run_with_arrivals(make_controller(model, 0, overlap_scheduling=False), arrivals)
    controller = make_controller(model, 2)
    steps_in_flight_at_admission, early_applications = [], []
    add_request = controller.context.add_request

    def add_and_record(request_id, tokens, row_values, *args, **kwargs):
        steps_in_flight_at_admission.append(controller.context.steps_in_flight)
        add_request(request_id, tokens, row_values, *args, **kwargs)

    def record_apply(step, readbacks, overlapped):  # the documented debug hook
        if not overlapped and controller.has_unfinished_requests():
            early_applications.append(controller.context.steps_in_flight)

    controller.context.add_request, controller.on_apply = add_and_record, record_apply
    assert run_with_arrivals(controller, arrivals) == plain
    assert steps_in_flight_at_admission == [0, 1, 1, 1]  # the first request found nothing in flight
    assert early_applications == []
    context = controller.context
    assert context.table.num_live == 0 and context.allocator.num_free_blocks == context.allocator.num_blocks


@pytest.mark.parametrize("hook", [False, True])
def test_finishing_requests_retire_without_applying_the_step_in_flight(models, torch_twins, hook):
    """Issue 14 / 26: a request that finished (seen one step late) gives up its slot while the
    next step is in flight: no other slot changes, and that step's read-back skips the request
    that left (its extra step dropped; its slot may hold a new request by then). Requests finish
    at different steps, in every slot, greedy and sampled, with stop rules; through the
    vectorised stop rules and through an accept_tokens override. Outputs == plain decoding, and
    no step in flight is applied early."""
    model, _ = models
    rng = random.Random(11)
    arrivals = [(step, list(PROMPTS[index % len(PROMPTS)])[: rng.randint(2, 9)],
                 SamplingParams(max_new_tokens=rng.randint(1, 9), temperature=rng.choice([0.0, 0.8]), seed=index,
                                eos_token_ids=(rng.randrange(VOCAB_SIZE),) if index % 3 == 0 else ()))
                for index, step in enumerate([0, 0, 0, 0, 1, 1, 2, 4])]
    plain = run_with_arrivals(make_controller(model, 0, overlap_scheduling=False), arrivals)

    class Overridden(TextGenerationController):
        def accept_tokens(self, record, new_tokens):
            return super().accept_tokens(record, new_tokens)

    controller = make_controller(model, 2)
    if hook:
        controller.__class__ = Overridden
    early_applications, left_since = [], []

    def record_apply(step, readbacks, overlapped):  # the documented debug hook
        if not overlapped and controller.has_unfinished_requests():
            early_applications.append(controller.context.steps_in_flight)
        left_since.append(any(request_id not in controller.context for request_id in step.request_ids))

    controller.on_apply = record_apply
    assert run_with_arrivals(controller, arrivals) == plain
    assert early_applications == []
    assert sum(left_since) >= 3  # several steps were applied after one of their requests left
    context = controller.context
    assert context.table.num_live == 0 and context.allocator.num_free_blocks == context.allocator.num_blocks


def test_admission_while_a_request_is_paused_does_not_apply_the_step_in_flight(models, torch_twins):
    """Issue 14: with a request paused on the caller's word, new requests still join while a
    step is in flight (the paused request keeps its slot). Pausing and resuming themselves apply
    the step in flight. Outputs == plain."""
    model, _ = models
    params = SamplingParams(max_new_tokens=9)
    prompts = [list(PROMPTS[index]) for index in range(4)]
    plain = [r.output_tokens for r in make_controller(model, 0, overlap_scheduling=False).generate(prompts, params)]
    controller = make_controller(model, 2)
    early_applications = []

    def record_apply(step, readbacks, overlapped):  # the documented debug hook
        if not overlapped and controller.has_unfinished_requests():
            early_applications.append(controller.context.table.group_size(RowGroup.PAUSED))

    ids = [controller.add_request(prompts[0], params), controller.add_request(prompts[1], params)]
    for _ in range(2):
        controller.step()
    controller.pause_request(ids[0])  # applies the step in flight (nothing paused yet)
    controller.on_apply = record_apply
    controller.step()
    ids += [controller.add_request(prompt, params) for prompt in prompts[2:]]
    paused_slot = controller.context.table.slot_of(ids[0])
    for _ in range(3):
        controller.step()
    assert controller.context.table.slot_of(ids[0]) == paused_slot  # nothing moves
    assert early_applications == []
    del controller.on_apply  # back to the class's hook
    controller.resume_request(ids[0])
    while controller.has_unfinished_requests():
        controller.step()
    assert [controller.result(rid).output_tokens for rid in ids] == plain
    context = controller.context
    assert context.table.num_live == 0 and context.allocator.num_free_blocks == context.allocator.num_blocks


def test_a_result_taken_before_its_row_is_freed_does_not_push_out_another(models, torch_twins):
    """pop_result right after step() reported the finish (the request still holds its row until
    the next step frees it) must not count toward finished_results_kept: A's result stays while
    only A and B are unclaimed. (Before, C's taken result was counted and pushed A out.)"""
    model, _ = models
    controller = make_controller(model, 1, finished_results_kept=2)
    lengths = {"A": 2, "C": 5, "B": 9}
    ids = {name: controller.add_request(list(PROMPTS[index]), SamplingParams(max_new_tokens=length))
           for index, (name, length) in enumerate(lengths.items())}
    taken = None
    while controller.has_unfinished_requests():
        for request_id, _, finished in controller.step():
            if finished and request_id == ids["C"]:
                taken = controller.pop_result(request_id)
    assert taken is not None and len(taken.output_tokens) == lengths["C"]
    assert len(controller.result(ids["A"]).output_tokens) == lengths["A"]
    assert len(controller.result(ids["B"]).output_tokens) == lengths["B"]


def test_steady_decode_steps_reuse_their_metadata_and_stay_equal_to_plain(models, torch_twins, monkeypatch):
    """A graph-padded decode step with the same requests in the same slots as the step before
    restages only its block writes (StepBuffers._steady_step). Under churn (arrivals, requests
    ending at different steps, a pool small enough to pause and preempt) the path is taken and
    the tokens still equal plain decoding; no block leaks."""
    from mtp_ctrl.state.step_metadata import StepBuffers

    reused = []
    steady_step = StepBuffers._steady_step

    def counting(self, key, block_writes):
        step = steady_step(self, key, block_writes)
        reused.append(step is not None)
        return step

    monkeypatch.setattr(StepBuffers, "_steady_step", counting)
    model, _ = models
    arrivals = [(step, list(PROMPTS[index % len(PROMPTS)])[: 3 + index], SamplingParams(max_new_tokens=6 + 3 * index))
                for index, step in enumerate((0, 0, 1, 5, 9))]
    plain = run_with_arrivals(make_controller(model, 0, max_model_len=40, overlap_scheduling=False), arrivals)
    for S in (0, 2):
        controller = make_controller(model, S, max_model_len=40, num_kv_blocks=18, cuda_graph_batch_sizes=(2, 4))
        assert run_with_arrivals(controller, arrivals) == plain, S
        assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks
    assert sum(reused) >= 5 and not all(reused)  # taken, and refused after composition changes
