"""EAGLE on CUDA with the shipped head (mtp_ctrl/checkpoints/eagle_demo.pt on the demo target):
every step, prefill chunks included, replays a warmed-up CUDA graph without a host sync, and the
tokens equal eager EAGLE and plain decoding, with drafts really accepted."""

import os
import sys

import pytest
import torch

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from tests.functional.test_controller_gpu import AllStepsSyncChecked
from tests.unit.controller_fixtures import run_with_arrivals
from tests.unit.megatron_fixtures import ensure_single_process_groups

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))


@pytest.fixture(scope="module")
def target_and_head_path():
    from demo_model import load_demo_model, shipped_checkpoint_path

    ensure_single_process_groups()
    model = load_demo_model(device="cuda")
    # fp32: padded (graph) and exact (eager) shapes then round alike, so tokens compare exactly
    return model.float(), shipped_checkpoint_path("eagle_demo")


def _config(S, graphs):
    return InferenceConfig(num_speculative_tokens=S, max_requests=4, block_size_tokens=16, max_model_len=160,
                           max_tokens_per_step=64, cuda_graph_batch_sizes=(1, 2, 4) if graphs else ())


@pytest.mark.parametrize("S", [2, 4])
def test_eagle_graphs_equal_eager_and_plain_without_host_sync(target_and_head_path, S):
    from byte_corpus import evenly_spaced_windows, load_stdlib_corpus
    from mtp_ctrl.cli.draft_heads import load_eagle_proposer

    model, head_path = target_and_head_path
    windows = evenly_spaced_windows(load_stdlib_corpus().held_out, 6, 40)
    arrivals = [(index * 3, window[: 10 + 5 * index].tolist(),
                 SamplingParams(max_new_tokens=48, temperature=0.7 * (index % 2), seed=index))
                for index, window in enumerate(windows)]
    plain = run_with_arrivals(TextGenerationController(model, _config(0, False)), arrivals)
    eager_controller = TextGenerationController(model, _config(S, False), proposer=load_eagle_proposer(model, head_path))
    eager = run_with_arrivals(eager_controller, arrivals)
    controller = AllStepsSyncChecked(model, _config(S, True), proposer=load_eagle_proposer(model, head_path))
    graphs = controller.warmup()
    graphed = run_with_arrivals(controller, arrivals)
    assert len(controller._graphs) == graphs and controller.mixed_replays > 2
    assert graphed == eager == plain
    assert controller.metrics.mean_accepted_length > 1.5  # the trained head's drafts are accepted
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks
