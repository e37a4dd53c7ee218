"""Draft-length policies under tensor parallelism (CPU, two gloo ranks): TP = 2 emits TP = 1's
tokens with random, goodput and per-request goodput draft lengths (ragged rows), and with requests
retired from speculation mid-run, and every rank makes the same choices (the TP
lockstep check compares each step's draft lengths, so a divergence would raise)."""

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from tests.unit.megatron_fixtures import (build_tiny_model, ensure_single_process_groups, free_port,
                                          init_process_groups, spawn_ranks, tiny_config, torch_twins)

PROMPTS = ([5, 17, 3, 88, 41], [9, 9, 2], [60, 1, 33, 70, 12, 8, 45])
SAMPLING = (dict(temperature=0.0), dict(temperature=0.9, top_k=20, seed=7))


def generate_all(tensor_parallel_size: int):
    """Greedy, then sampled: plain (S = 0) and S = 2 (MTP drafting) with random lengths (greedy)
    or goodput lengths (sampled); then greedy with per-request goodput lengths; and the random
    policy's choices."""
    from mtp_ctrl.controllers import (GoodputPolicy, InferenceConfig, PerRequestGoodputPolicy, RandomDraftLengths,
                                      SamplingParams, TextGenerationController)

    model = build_tiny_model(tiny_config(mtp_num_layers=2, tensor_parallel_size=tensor_parallel_size))
    outputs, choices = [], []
    for sampling, adaptive in zip(SAMPLING, (RandomDraftLengths(seed=3), GoodputPolicy())):
        for S, policy in ((0, None), (2, adaptive)):
            config = InferenceConfig(num_speculative_tokens=S, max_requests=2, block_size_tokens=4, max_model_len=48,
                                     max_tokens_per_step=64)
            controller = TextGenerationController(model, config, draft_policy=policy)
            ragged = []  # per launch: its decode requests ran ragged rows (1 + s_r each, below the tier)
            controller.on_launch = lambda step, key: ragged.append(step.dimensions.is_ragged(step.verify_width))
            results = controller.generate(list(PROMPTS), SamplingParams(max_new_tokens=6, **sampling))
            outputs.append([list(result.output_tokens) for result in results])
            if isinstance(policy, RandomDraftLengths):
                choices.append([lengths.tolist() for lengths in policy.chosen])
                choices.append(ragged)
    # a length per request (ragged rows), greedy: its costs are the first rank's on every rank
    config = InferenceConfig(num_speculative_tokens=2, max_requests=2, block_size_tokens=4, max_model_len=48,
                             max_tokens_per_step=64)
    controller = TextGenerationController(model, config, draft_policy=PerRequestGoodputPolicy(decide_every=1))
    results = controller.generate(list(PROMPTS), SamplingParams(max_new_tokens=6, **SAMPLING[0]))
    outputs.append([list(result.output_tokens) for result in results])
    # requests retired from speculation mid-run (greedy): every rank retires the same ones
    from tests.unit.draft_length_fixtures import RetiringDepths

    retiring = RetiringDepths(seed=4, retire_at=3, all_retired=True)
    controller = TextGenerationController(model, config, draft_policy=retiring)
    results = controller.generate(list(PROMPTS), SamplingParams(max_new_tokens=6, **SAMPLING[0]))
    outputs.append([list(result.output_tokens) for result in results])
    choices.append(sorted(retiring.retired))
    return outputs, choices


def _worker(rank: int, world_size: int, port: int, expected_path: str) -> None:
    init_process_groups(rank, world_size, port, world_size)
    try:
        expected = torch.load(expected_path)
        with torch_twins():
            got = generate_all(world_size)
        assert got == expected, f"rank {rank}: {got} != {expected}"
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_draft_lengths_tp2_match_tp1(tmp_path):
    ensure_single_process_groups()
    with torch_twins():
        outputs, choices = generate_all(1)
    assert outputs[0] == outputs[1] == outputs[4] == outputs[5] and outputs[2] == outputs[3]  # == plain
    assert choices[2]  # some requests were retired
    assert any(1 in step for step in choices[0]) and any(0 in step for step in choices[0])  # lengths varied
    assert any(choices[1])  # some step ran ragged rows (on every rank: the choices are compared)
    path = tmp_path / "draft_lengths_tp1.pt"
    torch.save((outputs, choices), path)
    spawn_ranks(_worker, (2, free_port(), str(path)))
