"""Parallel drafting on CUDA on the demo target: every step, prefill chunks included, replays a
warmed-up CUDA graph without a host sync, and the tokens equal eager PTD and plain decoding.
With the shipped head (mtp_ctrl/checkpoints/ptd_demo.pt, ``train_eagle.py --mode ptd``) its
drafts are really accepted; a random-weight PTD head checks the same equalities without it."""

import dataclasses
import os

import pytest
import torch

from mtp_ctrl.controllers import SamplingParams, TextGenerationController
from tests.functional.test_controller_gpu import AllStepsSyncChecked
from tests.unit.controller_fixtures import run_with_arrivals
from tests.functional.drafter_fixtures import CHECKPOINTS, drafter_config, load_demo_target

PTD_CHECKPOINT = os.path.join(CHECKPOINTS, "ptd_demo.pt")


@pytest.fixture(scope="module")
def target():
    return load_demo_target()


_config = drafter_config


def _proposer(model, source):
    from mtp_ctrl.cli.draft_heads import load_ptd_proposer

    from mtp_ctrl.controllers import ParallelDraftingProposer
    from mtp_ctrl.models import build_eagle_head, default_aux_layer_ids

    if source == "trained":
        return load_ptd_proposer(model, PTD_CHECKPOINT)
    torch.manual_seed(5)
    head = build_eagle_head(model, default_aux_layer_ids(model.config.num_layers), use_transformer_engine=False,
                            parallel_drafting=True)
    return ParallelDraftingProposer(head.eval())


@pytest.mark.parametrize("source, S", [("trained", 2), ("trained", 4), ("random", 3)])
def test_ptd_graphs_equal_eager_and_plain_without_host_sync(target, source, S):
    if source == "trained" and not os.path.exists(PTD_CHECKPOINT):
        pytest.skip("mtp_ctrl/checkpoints/ptd_demo.pt not trained yet (examples/train_eagle.py --mode ptd)")
    from byte_corpus import evenly_spaced_windows, load_stdlib_corpus

    windows = evenly_spaced_windows(load_stdlib_corpus().held_out, 6, 40)
    arrivals = [(index * 3, window[: 10 + 5 * index].tolist(),
                 SamplingParams(max_new_tokens=48, temperature=0.7 * (index % 2), seed=index))
                for index, window in enumerate(windows)]
    plain = run_with_arrivals(TextGenerationController(target, _config(0, False)), arrivals)
    eager = run_with_arrivals(TextGenerationController(target, _config(S, False), proposer=_proposer(target, source)),
                              arrivals)
    controller = AllStepsSyncChecked(target, _config(S, True), proposer=_proposer(target, source))
    graphs = controller.warmup()
    graphed = run_with_arrivals(controller, arrivals)
    assert len(controller._graphs) == graphs and controller.mixed_replays > 2
    assert graphed == eager == plain
    if source == "trained":
        assert controller.metrics.mean_accepted_length > 1.5  # the trained head's drafts are accepted
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks


def test_ptd_graph_replay_rejection_sampling_keeps_running(target):
    """acceptance="rejection" with a PTD proposer (deterministic q): graphs replay without a host
    sync and greedy requests still equal plain decoding."""
    from byte_corpus import evenly_spaced_windows, load_stdlib_corpus

    windows = evenly_spaced_windows(load_stdlib_corpus().held_out, 4, 40)
    arrivals = [(index, window[:20].tolist(), SamplingParams(max_new_tokens=32)) for index, window in enumerate(windows)]
    plain = run_with_arrivals(TextGenerationController(target, _config(0, False)), arrivals)
    config = dataclasses.replace(_config(3, True), acceptance="rejection")
    controller = AllStepsSyncChecked(target, config, proposer=_proposer(target, "random"))
    controller.warmup()
    assert run_with_arrivals(controller, arrivals) == plain
