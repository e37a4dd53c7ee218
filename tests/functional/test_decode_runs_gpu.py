"""Decode runs on CUDA (``InferenceConfig(decode_steps_per_launch=k)``): one CUDA graph replays k
decode steps back to back. Every launch runs under ``set_sync_debug_mode("error")``; ``warmup()``
captures each run length of each decode shape and nothing is captured while serving; the tokens
equal one step per launch, eager steps and plain decoding, under arrivals and sampling; on the
trained demo checkpoint (real acceptance) a run's steps accept exactly what single steps accept;
a device-side oracle drives every accepted count 0..S inside replayed runs."""

import collections
import os
import random

import pytest
import torch

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from tests.functional.drafter_fixtures import CHECKPOINTS  # also puts examples/ on sys.path
from tests.functional.sync_checks import no_host_sync
from tests.functional.test_controller_gpu import PROMPTS, DeviceOracleProposer, generate_with_device_oracle, plain_sequences
from tests.unit.controller_fixtures import run_with_arrivals
from tests.unit.megatron_fixtures import VOCAB_SIZE, build_tiny_model, ensure_single_process_groups, tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BUCKETS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def model():
    ensure_single_process_groups()
    return build_tiny_model(tiny_config(mtp_num_layers=3)).cuda()


class RunsSyncChecked(TextGenerationController):
    """Launches every step under ``set_sync_debug_mode("error")``; records each launch's step
    count and the accepted counts of every step it applied."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.launches, self.accepted = [], []

    def _launch_step(self, step):
        with no_host_sync():
            launched = super()._launch_step(step)
        self.launches.append(step.num_steps)
        return launched

    def on_apply(self, step, readbacks, overlapped):
        self.accepted += readbacks[:, : step.num_decode, 0].tolist()  # one list per step


def _config(S, graphs, steps, **more):
    fields = dict(num_speculative_tokens=S, max_requests=8, block_size_tokens=4, max_model_len=96,
                  max_tokens_per_step=64, cuda_graph_batch_sizes=BUCKETS if graphs else (),
                  decode_steps_per_launch=steps)
    fields.update(more)
    return InferenceConfig(**fields)


@pytest.mark.parametrize("S", [0, 2])
def test_decode_runs_replay_warmed_up_graphs_without_host_sync_and_equal_single_steps(model, S):
    rng = random.Random(S)
    arrivals = [(rng.choice([0, 0, 0, 7, 20]), [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(1, 30))],
                 SamplingParams(max_new_tokens=rng.randrange(4, 40), temperature=rng.choice([0.0, 0.8]),
                                seed=rng.randrange(99))) for _ in range(10)]
    plain = run_with_arrivals(TextGenerationController(model, _config(0, False, 1)), arrivals)
    eager_runs = run_with_arrivals(TextGenerationController(model, _config(S, False, 4)), arrivals)
    single = RunsSyncChecked(model, _config(S, True, 1))
    single.warmup()
    single_steps = run_with_arrivals(single, arrivals)
    controller = RunsSyncChecked(model, _config(S, True, 4))
    graphs = controller.warmup()
    run_lengths = controller.context.scheduler.run_lengths  # (1, 2, 4)
    decode_shapes = sum(1 for shape in controller.context.graph_shapes() if not shape.has_prefill)
    mixed_shapes = len(controller.context.graph_shapes()) - decode_shapes
    # a decode-only shape: each run length, both sampling paths; a shape with prefill chunks: one
    # graph (those steps always take the general sampling path)
    assert graphs == 2 * decode_shapes * len(run_lengths) + mixed_shapes
    graphed = run_with_arrivals(controller, arrivals)
    assert controller.debug_view().num_cuda_graphs == graphs  # nothing captured while serving
    assert max(controller.launches) == 4 and controller.launches.count(4) > 3, controller.launches
    assert graphed == single_steps == eager_runs == plain
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks


def test_runs_accept_what_single_steps_accept_on_the_trained_checkpoint():
    """Same graph shapes, so a run of k steps computes what k single steps compute, bit for bit:
    the same accepted count at every step, the same tokens, with drafts really accepted."""
    from byte_corpus import evenly_spaced_windows, load_stdlib_corpus
    from demo_model import load_demo_model

    ensure_single_process_groups()
    demo = load_demo_model(os.path.join(CHECKPOINTS, "mtp_demo.pt"), device="cuda").to(torch.bfloat16)
    prompts = [w.tolist() for w in evenly_spaced_windows(load_stdlib_corpus().held_out, 4, 48)]
    runs = []
    for steps in (1, 4):
        config = InferenceConfig(num_speculative_tokens=2, max_requests=4, block_size_tokens=16, max_model_len=160,
                                 max_tokens_per_step=256, cuda_graph_batch_sizes=(4,), decode_steps_per_launch=steps)
        controller = RunsSyncChecked(demo, config)
        controller.warmup()
        results = controller.generate(prompts, SamplingParams(max_new_tokens=64))
        runs.append(([r.output_tokens for r in results], controller.accepted, controller.metrics.mean_accepted_length,
                     controller.launches))
        controller.close()
    (single_tokens, single_accepted, single_length, _), (run_tokens, run_accepted, run_length, launches) = runs
    assert max(launches) == 4
    # every step while all four requests run (steps of runs and single steps alike) accepts the same counts
    full = next((index for index, counts in enumerate(single_accepted[1:], 1) if len(counts) < 4), len(single_accepted))
    assert run_accepted[:full] == single_accepted[:full] and full > 8
    assert run_tokens == single_tokens
    assert run_length == single_length > 1.5  # drafts really were accepted


def test_every_accepted_count_inside_replayed_decode_runs(model):
    S = 3
    params = SamplingParams(max_new_tokens=40)
    plain = TextGenerationController(model, _config(0, False, 1)).generate(PROMPTS, params)
    proposer = DeviceOracleProposer(plain_sequences(PROMPTS, plain, 8 * (S + 1)).cuda())
    controller = RunsSyncChecked(model, _config(S, True, 4), proposer=proposer)
    controller.warmup()
    ids = generate_with_device_oracle(controller, proposer, PROMPTS, params)
    assert [controller.result(rid).output_tokens for rid in ids] == [r.output_tokens for r in plain]
    assert max(controller.launches) > 1
    seen = collections.Counter(count for step in controller.accepted for count in step)
    assert all(seen[count] > 0 for count in range(S + 1)), seen
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks
