"""Decode runs (``InferenceConfig(decode_steps_per_launch=k)``): one build, one launch of up to k
decode steps back to back, one read-back applied at once. Output == plain decoding token for token
under churn, a KV pool small enough to pause and preempt, greedy and seeded sampling, S = 0..3,
stops that fall inside a run (eos, stop sequences, max_new_tokens, max_model_len), the step API,
a hybrid Mamba model; runs really happen; the device never grows a request past the blocks the
host reserved for it; no block or row is left at the end.

How these fail when the loop is wrong: with the run length ignoring the length budget
(``decode_run_steps`` returning the longest run always), requests grow past their reserved
blocks (the invariant check below fires); with the reserve sized for one step instead of the run
(``new_steps`` dropped in ``build_step``), likewise; with the steps of a run applied as one
(the read-back of step 0 only), outputs lose tokens.
"""

import pytest
import torch

from mtp_ctrl.controllers import FinishReason, InferenceConfig, Proposer, SamplingParams
from tests.unit.controller_fixtures import (MTP_DEPTH, PROMPTS, CountingAcceptTokens, build_models, make_controller,
                                           random_arrivals, run_with_arrivals)
from tests.unit.megatron_fixtures import ensure_single_process_groups
from tests.unit.megatron_fixtures import torch_twins as twin_ops


@pytest.fixture(scope="module")
def models():
    ensure_single_process_groups()
    return build_models()


def _watch_runs(controller):
    """Record every launch's step count, and check after each launch (synchronous on the CPU)
    that the device never grew a decode request past the blocks the host reserved for it: the
    last step's peak KV length (its length after the rewind, plus the rows it rejected) fits
    ``block_counts * block_size_tokens``."""
    context, launches = controller.context, []

    def check_launch(step, graph_key):
        launches.append(step.num_steps)
        table, num_decode, V = context.table, step.num_decode, step.verify_width
        accepted = controller.debug_view().last_accepted_counts[:num_decode]  # in the step's order
        slots = step.host_slot_ids[:num_decode]  # where the step's decode requests live
        peak = table.device.kv_length_offsets[slots] + V - accepted
        reserved = torch.from_numpy(table.host.block_counts[slots] * context.shape.block_size_tokens)
        assert (peak <= reserved).all(), (peak, reserved)

    controller.on_launch = check_launch  # the documented debug hook
    return launches


def _check_equal_plain(model, arrivals, cases):
    with twin_ops():  # the reference; the cases run the kernels where a test asks for them
        plain = run_with_arrivals(make_controller(model, 0, max_model_len=40, overlap_scheduling=False), arrivals)
    for S, steps, overlap, more in cases:
        controller = make_controller(model, S, max_model_len=40, overlap_scheduling=overlap,
                                     decode_steps_per_launch=steps, **more)
        launches = _watch_runs(controller)
        assert run_with_arrivals(controller, arrivals) == plain, (S, steps, overlap)
        assert max(launches) > 1, launches  # decode runs happened
        assert controller.metrics.steps >= sum(launches)  # a run counts every one of its steps
        context = controller.context
        assert context.table.num_live == 0 and not controller.has_unfinished_requests()
        assert context.allocator.num_free_blocks == context.allocator.num_blocks


@pytest.mark.parametrize("seed", range(4))
def test_decode_runs_equal_plain_under_churn_preemption_and_sampling(models, seed, torch_twins):
    model, _ = models
    cases = [(0, 4, True, {}), (2, 4, True, dict(cuda_graph_batch_sizes=(2, 4))), (3, 3, False, {}),
             (1, 2, True, dict(num_kv_blocks=18))]  # (S, steps per launch, overlap, more config)
    arrivals = random_arrivals(seed, 6, max_new_tokens=24, eos_rate=0.4, stop_rate=0.2, arrival_steps=(0, 0, 2, 9, 15))
    _check_equal_plain(model, arrivals, cases)


def test_decode_runs_through_the_kernels_equal_plain(models, model_twins):
    """The same through the step's Triton kernels (interpreter; the model's attention, rope and
    sampling on their twins), graph-padded: one short case (16-row steps: the padded prefill step
    runs 16 rows, not 64)."""
    model, _ = models
    arrivals = [(0, list(PROMPTS[1]), SamplingParams(max_new_tokens=9)),
                (0, list(PROMPTS[2]), SamplingParams(max_new_tokens=7, temperature=0.9, seed=4))]
    _check_equal_plain(model, arrivals, [(2, 4, True, dict(cuda_graph_batch_sizes=(2,), max_tokens_per_step=16))])


def test_a_tight_kv_pool_pauses_preempts_and_falls_back_to_single_steps(models, torch_twins):
    model, _ = models
    prompts = [list(prompt) for prompt in PROMPTS]
    params = SamplingParams(max_new_tokens=20)
    plain = [r.output_tokens for r in make_controller(model, 0, max_model_len=40).generate(prompts, params)]
    controller = make_controller(model, 2, max_model_len=40, num_kv_blocks=16, decode_steps_per_launch=4)
    launches = _watch_runs(controller)
    assert [r.output_tokens for r in controller.generate(prompts, params)] == plain
    assert max(launches) > 1
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks


@pytest.mark.parametrize("S", [0, MTP_DEPTH])
def test_stops_inside_a_run_cut_the_output_exactly(models, torch_twins, S):
    """An oracle drafts the greedy continuation (every draft accepted at S > 0), so stops fall
    inside runs and inside accepted drafts: output is cut exactly at an eos id, a stop sequence,
    max_new_tokens and max_model_len."""
    model, _ = models
    prompt = list(PROMPTS[3])
    max_model_len = 40
    plain = make_controller(model, 0, max_model_len=max_model_len).generate([prompt], SamplingParams(max_new_tokens=40))[0]
    continuation = list(plain.output_tokens)
    known = torch.tensor(prompt + continuation + [0] * 8)

    class Oracle(Proposer):
        def propose(self, batch):
            positions = batch.bonus_positions[: batch.num_requests, None] + 1 + torch.arange(S)
            return known[positions.clamp(max=known.shape[0] - 1)]

    eos, stop = continuation[13], tuple(continuation[10:12])
    stop_end = next(end for end in range(2, len(continuation) + 1) if tuple(continuation[end - 2 : end]) == stop)
    cases = [
        (SamplingParams(max_new_tokens=30, eos_token_ids=(eos,)), continuation[: continuation.index(eos) + 1],
         FinishReason.EOS),
        (SamplingParams(max_new_tokens=30, stop_sequences=(stop,)), continuation[:stop_end], FinishReason.STOP_SEQUENCE),
        (SamplingParams(max_new_tokens=17), continuation[:17], FinishReason.LENGTH),
        (SamplingParams(max_new_tokens=40), continuation[: max_model_len - len(prompt)], FinishReason.MAX_MODEL_LEN),
    ]
    for params, want, reason in cases:
        for overlap in (False, True):
            controller = make_controller(model, S, proposer=Oracle() if S else None, max_model_len=max_model_len,
                                         overlap_scheduling=overlap, decode_steps_per_launch=4)
            launches = _watch_runs(controller)
            result = controller.generate([prompt], params)[0]
            assert list(result.output_tokens) == want and result.finish_reason == reason, (params, overlap)
            assert max(launches) > 1, launches
            assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks


def test_step_api_returns_every_step_of_a_run_and_streams_the_whole_output(models, torch_twins):
    model, _ = models
    params = SamplingParams(max_new_tokens=20, temperature=0.8, seed=5)
    want = make_controller(model, 0).generate([list(PROMPTS[1]), list(PROMPTS[2])], params)
    for overlap in (False, True):
        controller = make_controller(model, 0, overlap_scheduling=overlap, decode_steps_per_launch=4)
        ids = [controller.add_request(list(prompt), params) for prompt in PROMPTS[1:3]]
        streamed = {request_id: [] for request_id in ids}
        most_per_call = 0
        while controller.has_unfinished_requests():
            for request_id, tokens, _ in controller.step():
                streamed[request_id] += tokens
                most_per_call = max(most_per_call, len(tokens))
        assert [tuple(streamed[request_id]) for request_id in ids] == [r.output_tokens for r in want]
        assert most_per_call == 4  # S = 0: a call that applied a run of 4 returns 4 tokens a request


def test_hybrid_model_decode_runs_equal_plain(models, torch_twins):
    from tests.unit.hybrid_fixtures import build_hybrid_model

    model = build_hybrid_model()
    prompts = [list(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=12)
    plain = make_controller(model, 0, overlap_scheduling=False).generate(prompts, params)
    for S in (0, 2):
        controller = make_controller(model, S, num_kv_blocks=40, decode_steps_per_launch=4,
                                     cuda_graph_batch_sizes=(2, 4))
        launches = _watch_runs(controller)
        assert [r.output_tokens for r in controller.generate(prompts, params)] == [r.output_tokens for r in plain]
        assert max(launches) > 1


def test_a_committed_hook_sees_every_step_of_a_run(models, torch_twins):
    """``on_step_committed`` runs once per step of a run, with -1 for requests that stopped
    before it; a proposer's host bookkeeping keeps step granularity."""
    model, _ = models
    committed = []

    class Counting(Proposer):
        def propose(self, batch):
            return batch.next_tokens[:, None].expand(-1, 1).clone()

        def on_step_committed(self, step, accepted_counts):
            committed.append(list(accepted_counts))

    controller = make_controller(model, 1, proposer=Counting(), decode_steps_per_launch=4)
    launches = _watch_runs(controller)
    results = controller.generate([list(PROMPTS[0]), list(PROMPTS[2])],
                                  [SamplingParams(max_new_tokens=5), SamplingParams(max_new_tokens=14)])
    assert len(committed) == sum(launches) and max(launches) > 1
    decode_entries = sum(1 for counts in committed for count in counts if count >= 0)
    assert decode_entries == sum(r.decode_steps for r in results) + 2  # + each request's prefill step
    assert all(count >= -1 for counts in committed for count in counts)


@pytest.mark.parametrize("value, error", [(0, ValueError), (65, ValueError), (2.0, TypeError), (True, TypeError)])
def test_decode_steps_per_launch_is_checked(value, error):
    with pytest.raises(error, match="decode_steps_per_launch"):
        InferenceConfig(decode_steps_per_launch=value)


def test_capture_buffer_must_hold_a_whole_run(tmp_path, models):
    from mtp_ctrl.controllers import HiddenStateCapture

    model, _ = models
    with pytest.raises(ValueError, match="one launch's rows"):
        make_controller(model, 1, proposer=HiddenStateCapture([0], str(tmp_path), capacity_tokens=64),
                        max_requests=8, decode_steps_per_launch=8)


def test_accept_tokens_override_and_rejection_acceptance_equal_single_steps(models, torch_twins):
    """The per-request ``accept_tokens`` path applies a run step by step, and rejection
    acceptance draws its noise by position: both give exactly what one step per launch gives."""
    model, _ = models
    prompts = [list(prompt) for prompt in PROMPTS]
    params = [SamplingParams(max_new_tokens=14, temperature=0.9, seed=index, eos_token_ids=(7,)) for index in range(4)]
    for acceptance in ("exact_match", "rejection"):
        single = make_controller(model, 2, acceptance=acceptance).generate(prompts, params)
        config = make_controller(model, 2, acceptance=acceptance, decode_steps_per_launch=4).config
        controller = CountingAcceptTokens(model, config)
        launches = _watch_runs(controller)
        runs = controller.generate(prompts, params)
        assert [r.output_tokens for r in runs] == [r.output_tokens for r in single], acceptance
        assert max(launches) > 1 and controller.calls > 0
