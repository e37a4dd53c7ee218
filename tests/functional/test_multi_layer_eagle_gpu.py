"""Multi-layer EAGLE on CUDA on the demo target: every step, prefill chunks included, replays a
warmed-up CUDA graph without a host sync, and the tokens equal eager drafting and plain decoding.
S = 2 runs random draft layers; S = 3 the shipped ones (mtp_ctrl/checkpoints/multi_layer_eagle_demo.pt,
whose drafts must then be accepted) when they exist, else random ones too."""

import os

import pytest
import torch

from mtp_ctrl.controllers import MultiLayerEagleProposer, SamplingParams, TextGenerationController
from tests.functional.test_controller_gpu import AllStepsSyncChecked
from tests.unit.controller_fixtures import run_with_arrivals
from tests.functional.drafter_fixtures import CHECKPOINTS, drafter_config, load_demo_target

SHIPPED = os.path.join(CHECKPOINTS, "multi_layer_eagle_demo.pt")


@pytest.fixture(scope="module")
def target():
    return load_demo_target()


_config = drafter_config


def _heads(model, S):
    """(heads, trained): the shipped layers for S = 3 when present, else random ones (fixed seed)."""
    if S == 3 and os.path.exists(SHIPPED):
        from mtp_ctrl.cli.draft_heads import load_multi_layer_eagle_heads

        return load_multi_layer_eagle_heads(model, SHIPPED).float(), True
    from mtp_ctrl.models import build_multi_layer_eagle_heads

    torch.manual_seed(S)
    return build_multi_layer_eagle_heads(model, S, use_transformer_engine=False).float().eval(), False


@pytest.mark.parametrize("S", [2, 3])
def test_multi_layer_eagle_graphs_equal_eager_and_plain_without_host_sync(target, S):
    from byte_corpus import evenly_spaced_windows, load_stdlib_corpus

    model = target
    heads, trained = _heads(model, S)
    windows = evenly_spaced_windows(load_stdlib_corpus().held_out, 6, 40)
    arrivals = [(index * 3, window[: 10 + 5 * index].tolist(),
                 SamplingParams(max_new_tokens=48, temperature=0.7 * (index % 2), seed=index))
                for index, window in enumerate(windows)]
    plain = run_with_arrivals(TextGenerationController(model, _config(0, False)), arrivals)
    eager_controller = TextGenerationController(model, _config(S, False), proposer=MultiLayerEagleProposer(heads))
    eager = run_with_arrivals(eager_controller, arrivals)
    controller = AllStepsSyncChecked(model, _config(S, True), proposer=MultiLayerEagleProposer(heads))
    graphs = controller.warmup()
    graphed = run_with_arrivals(controller, arrivals)
    assert len(controller._graphs) == graphs and controller.mixed_replays > 2
    assert graphed == eager == plain
    if trained:
        assert controller.metrics.mean_accepted_length > 1.5  # the trained layers' drafts are accepted
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks
