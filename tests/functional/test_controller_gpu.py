"""The controller on CUDA: no host sync in the decode step, CUDA graphs == eager, TP = 2 == TP = 1,
and long request churn without leaking KV blocks or memory."""

import collections
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core import parallel_state

from mtp_ctrl.controllers import InferenceConfig, Proposer, SamplingParams, TextGenerationController
from tests.functional.sync_checks import no_host_sync
from tests.unit.controller_fixtures import OracleProposer, run_with_arrivals
from tests.unit.hybrid_fixtures import build_hybrid_model
from tests.unit.megatron_fixtures import (
    VOCAB_SIZE,
    build_tiny_model,
    ensure_single_process_groups,
    free_port,
    init_process_groups,
    tiny_config,
)

PROMPTS = [[5, 17, 3, 88, 41], [9, 9, 2], [60, 1, 33, 70, 12, 8, 45], [4] * 11, [30, 31]]
BUCKETS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def model():
    ensure_single_process_groups()
    return build_tiny_model(tiny_config(mtp_num_layers=3)).cuda()


def make_config(num_speculative_tokens, graphs=False, **overrides):
    fields = dict(num_speculative_tokens=num_speculative_tokens, max_requests=8, block_size_tokens=4,
                  max_model_len=96, max_tokens_per_step=128, cuda_graph_batch_sizes=BUCKETS if graphs else ())
    fields.update(overrides)
    return InferenceConfig(**fields)


class SyncCheckedController(TextGenerationController):
    """Launches every decode-only step (its GPU work, the read-back copy, the events) under
    ``set_sync_debug_mode("error")``: the overlapped step waits only where it applies a
    read-back, never while it launches."""

    decode_launches = 0

    def _launch_step(self, step):
        if step.num_prefill:
            return super()._launch_step(step)
        with no_host_sync():
            launched = super()._launch_step(step)
        self.decode_launches += 1
        return launched


@pytest.mark.parametrize("mode", ["paged", "single_position"])
def test_decode_step_has_no_host_sync(model, mode):
    controller = SyncCheckedController(model, make_config(3, mtp_attention=mode))
    greedy = controller.generate(PROMPTS, SamplingParams(max_new_tokens=12))
    sampled = controller.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3))
    assert controller.decode_launches > 10
    assert all(len(r.output_tokens) == 12 for r in greedy + sampled)


@pytest.mark.parametrize("mode", ["paged", "single_position"])
def test_cuda_graph_tokens_equal_eager(model, mode):
    params = [SamplingParams(max_new_tokens=10 + i, temperature=0.7 * (i % 2), seed=i) for i in range(len(PROMPTS))]
    plain = TextGenerationController(model, make_config(0)).generate(PROMPTS, params)
    eager = TextGenerationController(model, make_config(2, mtp_attention=mode)).generate(PROMPTS, params)
    graphed_controller = SyncCheckedController(model, make_config(2, graphs=True, mtp_attention=mode))
    graphed = graphed_controller.generate(PROMPTS, params)
    assert graphed_controller.debug_view().num_cuda_graphs > 0  # decode steps really replayed graphs
    tokens = [[r.output_tokens for r in results] for results in (plain, eager, graphed)]
    assert tokens[0] == tokens[1] == tokens[2]


@pytest.fixture(scope="module")
def hybrid_model():
    """Mamba-2 and attention decoder layers ("M*M*"), 2 attention MTP layers."""
    ensure_single_process_groups()
    return build_hybrid_model(mtp_num_layers=2).cuda()


def test_hybrid_graphs_equal_eager_without_host_sync(hybrid_model):
    """A hybrid model's decode step (Mamba decode rows, the Mamba commit, padding requests on the
    scratch slot) has no host sync, and its graph replays give the eager tokens, which are the
    plain ones."""
    params = [SamplingParams(max_new_tokens=10 + i, temperature=0.7 * (i % 2), seed=i) for i in range(len(PROMPTS))]
    plain = TextGenerationController(hybrid_model, make_config(0)).generate(PROMPTS, params)
    eager_controller = SyncCheckedController(hybrid_model, make_config(2))
    eager = eager_controller.generate(PROMPTS, params)
    graphed_controller = SyncCheckedController(hybrid_model, make_config(2, graphs=True))
    graphed = graphed_controller.generate(PROMPTS, params)
    assert eager_controller.decode_launches > 10 and graphed_controller.debug_view().num_cuda_graphs > 0
    tokens = [[r.output_tokens for r in results] for results in (plain, eager, graphed)]
    assert tokens[0] == tokens[1] == tokens[2]
    assert graphed_controller.context.mamba.num_free_slots == graphed_controller.context.mamba.num_slots


def test_hybrid_commit_keeps_the_state_of_every_accepted_count(hybrid_model):
    """Oracle drafts with 0..S correct leading drafts: the CUDA Mamba commit keeps the state after
    the last accepted row, so the output stays the plain greedy one and counts match."""
    S, max_new_tokens = 2, 12
    plain = TextGenerationController(hybrid_model, make_config(0)).generate(
        PROMPTS, SamplingParams(max_new_tokens=max_new_tokens + S + 1))
    sequences = {rid: PROMPTS[rid] + list(result.output_tokens) for rid, result in enumerate(plain)}
    rng = random.Random(3)
    pattern = {(rid, index): rng.randint(0, S) for rid in range(len(PROMPTS)) for index in range(16)}
    proposer = OracleProposer(sequences, lambda rid, index: pattern[rid, index])
    controller = TextGenerationController(hybrid_model, make_config(S), proposer=proposer)
    results = controller.generate(PROMPTS, SamplingParams(max_new_tokens=max_new_tokens))
    for result in results:
        assert list(result.output_tokens) == sequences[result.request_id][len(PROMPTS[result.request_id]):][
            :max_new_tokens]
        observed = proposer.observed[result.request_id]
        assert observed == proposer.injected[result.request_id][: len(observed)]


class AllStepsSyncChecked(TextGenerationController):
    """Launches every step, prefill chunks included, under ``set_sync_debug_mode("error")``;
    counts the steps with prefill chunks that replayed a graph."""

    mixed_replays = 0

    def _launch_step(self, step):
        with no_host_sync():
            return super()._launch_step(step)

    def on_launch(self, step, graph_key):
        """A step launched through a graph (``graph_key`` not None) replayed one captured by
        ``warmup()``: the callers check that nothing was captured while serving."""
        self.mixed_replays += int(graph_key is not None and step.num_prefill > 0)


def _mixed_steps_replay_warmed_up_graphs(model, **config):
    """Requests arrive while others decode; every step replays a graph captured by ``warmup()``,
    under ``set_sync_debug_mode("error")``. Returns the controller (for its state) after checking
    graphed == eager == plain."""
    rng = random.Random(1)
    arrivals = [(rng.randrange(0, 12), [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(1, 40))],
                 SamplingParams(max_new_tokens=rng.randrange(4, 20), temperature=rng.choice([0.0, 0.8]),
                                seed=rng.randrange(99))) for _ in range(12)]
    config = dict(max_tokens_per_step=64, **config)
    plain = run_with_arrivals(TextGenerationController(model, make_config(0, **config)), arrivals)
    eager = run_with_arrivals(TextGenerationController(model, make_config(2, **config)), arrivals)
    controller = AllStepsSyncChecked(model, make_config(2, graphs=True, **config))
    graphs = controller.warmup()
    decode_shapes = sum(1 for shape in controller.context.graph_shapes() if not shape.has_prefill)
    # both sampling paths for a decode-only shape, one for a shape with prefill chunks (the general path)
    assert graphs == 2 * decode_shapes + (len(controller.context.graph_shapes()) - decode_shapes)
    graphed = run_with_arrivals(controller, arrivals)
    assert controller.debug_view().num_cuda_graphs == graphs  # nothing captured while serving
    assert controller.mixed_replays > 3
    assert graphed == eager == plain
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks
    return controller


@pytest.mark.parametrize("mode", ["paged", "single_position"])
def test_mixed_steps_replay_warmed_up_graphs_and_equal_eager(model, mode):
    """``warmup()`` captures every shape; then requests arrive while others decode, so steps mix
    decode rows and prefill chunks (some chunked across steps). Every step replays a graph, none
    syncs with the host, no graph is captured while serving, and the tokens equal eager and plain
    decoding (greedy and sampled)."""
    _mixed_steps_replay_warmed_up_graphs(model, mtp_attention=mode)


def test_hybrid_mixed_steps_replay_warmed_up_graphs_and_equal_eager(hybrid_model):
    """The same for a hybrid model: a step's Mamba prefill chunks (the varlen conv and scan) and
    decode rows are captured in one graph per (batch bucket, token bucket); every Mamba slot
    comes back."""
    controller = _mixed_steps_replay_warmed_up_graphs(hybrid_model)
    assert any(shape.has_prefill for shape in controller.context.graph_shapes())
    assert controller.context.mamba.num_free_slots == controller.context.mamba.num_slots


def test_warmup_refuses_a_busy_controller(model):
    controller = TextGenerationController(model, make_config(2, graphs=True))
    controller.add_request([1, 2, 3])
    with pytest.raises(RuntimeError, match="warmup"):
        controller.warmup()
    controller.generate([[4, 5]], SamplingParams(max_new_tokens=2))


def test_request_churn_leaks_nothing(model):
    """10,000 steps of requests arriving and finishing at random: no KV block, row or memory leak."""
    rng = random.Random(0)
    controller = TextGenerationController(model, make_config(2, graphs=True, num_kv_blocks=120))
    context = controller.context
    steps, memory_after_warmup = 0, None
    while steps < 10_000:
        while controller.debug_view().num_waiting < 4:
            prompt = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(1, 24))]
            controller.add_request(prompt, SamplingParams(max_new_tokens=rng.randrange(1, 40),
                                                          temperature=rng.choice([0.0, 0.9]), seed=rng.randrange(99)))
        controller.step()
        steps += 1
        if steps == 2_000:  # every bucket's graphs are captured by now
            torch.cuda.synchronize()
            memory_after_warmup = torch.cuda.memory_allocated()
    while controller.has_unfinished_requests():  # the queued requests run out too
        controller.step()
    torch.cuda.synchronize()
    assert context.allocator.num_free_blocks == context.allocator.num_blocks
    assert context.table.num_live == 0
    assert torch.cuda.memory_allocated() <= memory_after_warmup + (1 << 20)  # allocator rounding only


def _tp_worker(rank, world_size, port, expected_path):
    torch.cuda.set_device(rank)
    init_process_groups(rank, world_size, port, world_size, backend="nccl")
    try:
        model = build_tiny_model(tiny_config(mtp_num_layers=3, tensor_parallel_size=world_size)).cuda()
        assert _tp_case_tokens(model) == torch.load(expected_path)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _tp_case_tokens(model):
    outputs = []
    for num_speculative_tokens in (0, 2):
        for sampling in (dict(), dict(temperature=0.9, top_k=20, seed=7)):
            controller = TextGenerationController(model, make_config(num_speculative_tokens, graphs=True))
            results = controller.generate(PROMPTS, SamplingParams(max_new_tokens=10, **sampling))
            assert controller.debug_view().num_cuda_graphs > 0  # decode steps replayed graphs (with TP collectives)
            controller.close()  # a process group with captured collectives cannot be destroyed
            outputs.append([list(r.output_tokens) for r in results])
    return outputs


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_tokens_equal_tp1(model, tmp_path):
    path = tmp_path / "tp1_tokens.pt"
    torch.save(_tp_case_tokens(model), path)
    mp.spawn(_tp_worker, args=(2, free_port(), str(path)), nprocs=2, join=True)


def test_graphs_equal_eager_on_the_trained_checkpoint_with_real_acceptance():
    """The shipped demo checkpoint accepts real drafts: replayed graphs and eager steps give the
    same accepted count at every step and the same tokens (random weights accept nothing, so
    this is the test that drafting under graphs is right)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    from byte_corpus import evenly_spaced_windows, load_stdlib_corpus
    from demo_model import build_demo_model, load_checkpoint, load_full_state_dict, shipped_checkpoint_path

    ensure_single_process_groups()
    model_args, state_dict = load_checkpoint(shipped_checkpoint_path())
    model = build_demo_model(model_args)
    load_full_state_dict(model, state_dict)
    model = model.cuda().to(torch.bfloat16).eval()
    prompts = [w.tolist() for w in evenly_spaced_windows(load_stdlib_corpus().held_out, 4, 48)]

    class Recording(TextGenerationController):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.accepted = []

        def on_apply(self, step, readbacks, overlapped):
            self.accepted += readbacks[:, : step.num_decode, 0].tolist()  # one list per step

    runs = []
    for graphs in (False, True):
        config = InferenceConfig(num_speculative_tokens=2, max_requests=4, block_size_tokens=16, max_model_len=160,
                                 max_tokens_per_step=256, cuda_graph_batch_sizes=(4,) if graphs else ())
        controller = Recording(model, config)
        results = controller.generate(prompts, SamplingParams(max_new_tokens=64))
        runs.append(([r.output_tokens for r in results], controller.accepted, controller.metrics.mean_accepted_length))
        if graphs:
            assert controller.debug_view().num_cuda_graphs > 0
        controller.close()
    (eager_tokens, eager_accepted, eager_length), (graph_tokens, graph_accepted, graph_length) = runs
    # while all four requests run, the eager and the replayed step have the same shapes, so the
    # same accepted counts; once one finishes, the graph pads to 4 and bf16 matmuls of another
    # row count may break a near-tie differently (the README's batch-variance caveat)
    full = next((index for index, counts in enumerate(eager_accepted[1:], 1) if len(counts) < 4), len(eager_accepted))
    first_difference = next((index for index, (a, b) in enumerate(zip(graph_accepted, eager_accepted)) if a != b), None)
    assert graph_accepted[:full] == eager_accepted[:full], (full, first_difference, eager_accepted[:full + 1],
                                                            graph_accepted[:full + 1])
    assert [tokens[:8] for tokens in graph_tokens] == [tokens[:8] for tokens in eager_tokens]
    assert eager_length > 1.5 and graph_length > 1.5  # drafts really were accepted


class DeviceOracleProposer(Proposer):
    """Drafts the true continuation from a device table, wrong from a depth chosen by a hash of
    (request row, bonus position): every accepted count 0..S comes up, and the proposal is pure
    device work, so it runs inside the replayed decode graphs (unlike OracleProposer)."""

    def __init__(self, sequences: torch.Tensor):
        self.sequences = sequences  # [n, L] int64 on the device: prompt + plain output, by request id

    def bind(self, draft_context):
        super().bind(draft_context)
        self.num_speculative_tokens = draft_context.shape.num_speculative_tokens
        self.vocab_size = draft_context.shape.vocab_size

    def propose(self, batch):
        S, count = self.num_speculative_tokens, batch.num_requests
        table_rows = batch.write_rows[:count]
        # request id = row of `sequences` (padding requests: id -1, any row; their drafts are ignored)
        request_ids = batch.step.device_request_ids[:count].clamp(0, self.sequences.shape[0] - 1)
        sequence = self.sequences[request_ids]  # [n, L]
        positions = batch.bonus_positions[:count, None] + 1 + torch.arange(S, device=sequence.device)  # [n, S]
        true_drafts = sequence.gather(1, positions.clamp(0, sequence.shape[1] - 1))
        bonus = batch.bonus_positions[:count]
        correct = (bonus * 5 + bonus // (S + 1) + table_rows * 3) % (S + 1)  # [n] in 0..S, varies step to step
        wrong = torch.arange(S, device=sequence.device)[None, :] >= correct[:, None]
        return torch.where(wrong, (true_drafts + 1) % self.vocab_size, true_drafts)


def plain_sequences(prompts, plain_results, padding: int) -> torch.Tensor:
    """``[n, L]`` int64 (CPU): each prompt followed by its plain output, ``padding`` zeros past the longest."""
    width = max(len(p) + len(r.output_tokens) for p, r in zip(prompts, plain_results)) + padding
    sequences = torch.zeros(len(prompts), width, dtype=torch.int64)
    for index, (prompt, result) in enumerate(zip(prompts, plain_results)):
        row = list(prompt) + list(result.output_tokens)
        sequences[index, : len(row)] = torch.tensor(row)
    return sequences


def generate_with_device_oracle(controller, proposer: DeviceOracleProposer, prompts, params):
    """Run ``prompts`` through the step API, giving each admitted request its oracle row (request
    id = index of its prompt = its row of ``proposer.sequences``); returns the request ids."""
    ids = [controller.add_request(prompt, params) for prompt in prompts]  # request id = index of its prompt
    assert ids == list(range(len(prompts)))
    while controller.has_unfinished_requests():
        controller.step()
    return ids


def test_every_accepted_count_inside_replayed_graphs(model):
    """A device-side oracle at a controlled acceptance rate drives accepted counts 0..S while the
    decode steps replay CUDA graphs; output equals plain decoding and nothing leaks."""
    S = 3
    params = SamplingParams(max_new_tokens=24)
    plain = TextGenerationController(model, make_config(0)).generate(PROMPTS, params)
    proposer = DeviceOracleProposer(plain_sequences(PROMPTS, plain, 2 * (S + 1)).cuda())
    controller = SyncCheckedController(model, make_config(S, graphs=True), proposer=proposer)
    seen = collections.Counter()

    def recording(step, readbacks, overlapped):  # the documented debug hook
        seen.update(readbacks[:, : step.num_decode, 0].flatten().tolist())

    controller.on_apply = recording
    ids = generate_with_device_oracle(controller, proposer, PROMPTS, params)
    assert [controller.result(rid).output_tokens for rid in ids] == [r.output_tokens for r in plain]
    assert controller.debug_view().num_cuda_graphs > 0 and controller.decode_launches > 10
    assert all(seen[count] > 0 for count in range(S + 1)), seen
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks
