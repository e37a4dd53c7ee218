"""Tensor parallelism on CPU: the controller at TP = 2 (two gloo ranks) emits TP = 1's tokens.

Greedy and seeded sampling, with S = 0 and S = 2 (MTP drafting), and S = 2 with an EAGLE head
and S = 3 with a parallel-drafting head (same seed at both TP sizes, so the same master weights). Both TP sizes build the same master weights
(``use_cpu_initialization=True``, same seed) and shard them; every rank runs the controller and
must produce the same tokens (sampling is a pure function of the gathered logits, seed and
position, so no broadcast is needed).
Multi-layer EAGLE (two draft layers, S = 2) has a test of its own (``-k multi_layer``).
"""

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from tests.unit.megatron_fixtures import (
    build_tiny_model,
    ensure_single_process_groups,
    free_port,
    init_process_groups,
    spawn_ranks,
    tiny_config,
    torch_twins,
)

PROMPTS = ([5, 17, 3, 88, 41], [9, 9, 2], [60, 1, 33, 70, 12, 8, 45])
CASES = (  # (num_speculative_tokens, sampling keyword arguments)
    (0, dict(temperature=0.0)),
    (2, dict(temperature=0.0)),
    (0, dict(temperature=0.9, top_k=20, seed=7)),
    (2, dict(temperature=0.9, top_k=20, seed=7)),
)


def generate_all(tensor_parallel_size: int):
    from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController

    model = build_tiny_model(tiny_config(mtp_num_layers=2, tensor_parallel_size=tensor_parallel_size))
    outputs = []
    for num_speculative_tokens, sampling in CASES:
        config = InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=3, block_size_tokens=4,
                                 max_model_len=48, max_tokens_per_step=64)
        controller = TextGenerationController(model, config)
        results = controller.generate(list(PROMPTS), SamplingParams(max_new_tokens=8, **sampling))
        outputs.append([list(result.output_tokens) for result in results])
    from mtp_ctrl.controllers import EagleProposer
    from mtp_ctrl.models import build_eagle_head

    torch.manual_seed(77)
    head = build_eagle_head(model, (0, 1)).eval()
    for _, sampling in CASES[1::2]:  # greedy and sampled
        config = InferenceConfig(num_speculative_tokens=2, max_requests=3, block_size_tokens=4, max_model_len=48,
                                 max_tokens_per_step=64)
        controller = TextGenerationController(model, config, proposer=EagleProposer(head))
        results = controller.generate(list(PROMPTS), SamplingParams(max_new_tokens=8, **sampling))
        outputs.append([list(result.output_tokens) for result in results])
    from mtp_ctrl.controllers import ParallelDraftingProposer

    torch.manual_seed(78)
    ptd_head = build_eagle_head(model, (0, 1), parallel_drafting=True).eval()  # mask_hidden replicated
    for _, sampling in CASES[1::2]:  # greedy and sampled
        config = InferenceConfig(num_speculative_tokens=3, max_requests=3, block_size_tokens=4, max_model_len=48,
                                 max_tokens_per_step=64)
        controller = TextGenerationController(model, config, proposer=ParallelDraftingProposer(ptd_head))
        results = controller.generate(list(PROMPTS), SamplingParams(max_new_tokens=8, **sampling))
        outputs.append([list(result.output_tokens) for result in results])
    return outputs


def _tp_worker(rank: int, world_size: int, port: int, expected_path: str) -> None:
    init_process_groups(rank, world_size, port, world_size)
    try:
        expected = torch.load(expected_path)
        with torch_twins():
            got = generate_all(world_size)
        for case, (want_case, got_case) in enumerate(zip(expected, got)):
            assert want_case == got_case, f"rank {rank}, case {case}: {got_case} != {want_case}"
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp1_outputs_path(tmp_path_factory):
    ensure_single_process_groups()
    with torch_twins():  # TP is the subject here, not the kernels (each == its twin in its own tests)
        outputs = generate_all(1)
    assert outputs[0] == outputs[1] == outputs[4] == outputs[6]  # MTP, EAGLE, PTD == plain (greedy)
    assert outputs[2] == outputs[3] == outputs[5] == outputs[7]  # (sampled)
    path = tmp_path_factory.mktemp("controller_tp") / "tp1_outputs.pt"
    torch.save(outputs, path)
    return str(path)


def test_controller_tp2_matches_tp1(tp1_outputs_path):
    spawn_ranks(_tp_worker, (2, free_port(), tp1_outputs_path))


def generate_multi_layer_eagle(tensor_parallel_size: int, with_plain: bool = False):
    """Multi-layer EAGLE (2 draft layers, S = 2), greedy and sampled (same seed at both TP sizes);
    ``with_plain``: each case's plain (S = 0) output first."""
    from mtp_ctrl.controllers import InferenceConfig, MultiLayerEagleProposer, SamplingParams, TextGenerationController
    from mtp_ctrl.models import build_multi_layer_eagle_heads

    model = build_tiny_model(tiny_config(mtp_num_layers=0, tensor_parallel_size=tensor_parallel_size))
    torch.manual_seed(78)
    heads = build_multi_layer_eagle_heads(model, 2, (0, 1)).eval()
    outputs = []
    for num_speculative_tokens, sampling in CASES if with_plain else CASES[1::2]:  # greedy and sampled
        config = InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=3, block_size_tokens=4,
                                 max_model_len=48, max_tokens_per_step=64)
        proposer = MultiLayerEagleProposer(heads) if num_speculative_tokens else None
        controller = TextGenerationController(model, config, proposer=proposer)
        results = controller.generate(list(PROMPTS), SamplingParams(max_new_tokens=8, **sampling))
        outputs.append([list(result.output_tokens) for result in results])
    return outputs


def _multi_layer_eagle_worker(rank: int, world_size: int, port: int, expected_path: str) -> None:
    init_process_groups(rank, world_size, port, world_size)
    try:
        expected = torch.load(expected_path)
        with torch_twins():
            got = generate_multi_layer_eagle(world_size)
        assert got == expected, f"rank {rank}: {got} != {expected}"
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_multi_layer_eagle_tp2_matches_tp1(tmp_path):
    ensure_single_process_groups()
    with torch_twins():
        outputs = generate_multi_layer_eagle(1, with_plain=True)
    assert outputs[0] == outputs[1] and outputs[2] == outputs[3]  # drafted == plain, greedy and sampled
    path = tmp_path / "multi_layer_eagle_tp1.pt"
    torch.save(outputs[1::2], path)
    spawn_ranks(_multi_layer_eagle_worker, (2, free_port(), str(path)))
