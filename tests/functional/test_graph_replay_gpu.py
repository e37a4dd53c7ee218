"""Replaying captured step graphs over rows that hold no request is safe (issue 28): the last
step's graph over the inputs a finished batch left behind, and every graph ``warmup()`` captured
on the empty controller, under ``set_sync_debug_mode("error")``. Free and released rows point
only at the scratch KV block and Mamba slot, so no replay reads or writes outside the pools (a
stale block id or a -1 sentinel once gave "an illegal memory access" at batch 32); the
controller then serves the same batch with the same output."""

import pytest
import torch

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from tests.functional.sync_checks import no_host_sync
from tests.unit.hybrid_fixtures import build_hybrid_model
from tests.unit.megatron_fixtures import VOCAB_SIZE, build_tiny_model, ensure_single_process_groups, tiny_config

BATCH = 32
PROMPTS = [[(7 * index + 3 * position) % VOCAB_SIZE for position in range(3 + index % 9)] for index in range(BATCH)]


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def model(request):
    ensure_single_process_groups()
    if request.param == "dense":
        return build_tiny_model(tiny_config(mtp_num_layers=2)).cuda()
    return build_hybrid_model().cuda()


def _replay_every_graph(controller, graphs):
    with no_host_sync():
        assert controller.replay_graphs() == graphs
    torch.cuda.synchronize()  # an illegal memory access would surface here


def test_replaying_every_graph_on_an_empty_controller_is_safe(model):
    config = InferenceConfig(num_speculative_tokens=2, max_requests=BATCH, block_size_tokens=4, max_model_len=64,
                             max_tokens_per_step=3 * BATCH, cuda_graph_batch_sizes=(1, 8, 16, BATCH),
                             decode_steps_per_launch=2)
    controller = TextGenerationController(model, config)
    graphs = controller.warmup()
    assert graphs > 0
    _replay_every_graph(controller, graphs)
    params = [SamplingParams(max_new_tokens=4 + index % 13, temperature=0.8 * (index % 2), seed=index)
              for index in range(BATCH)]
    first = [result.output_tokens for result in controller.generate(PROMPTS, params)]
    _replay_every_graph(controller, graphs)  # over the finished batch's step inputs
    second = [result.output_tokens for result in controller.generate(PROMPTS, params)]
    assert second == first
    context = controller.context
    assert context.allocator.num_free_blocks == context.allocator.num_blocks
    controller.close()
