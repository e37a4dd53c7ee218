"""A GPT with MLA decoder layers and MLA MTP layers (latent caches) under the controller, CPU:

- plain greedy tokens == megatron's own MLA GPT over the whole sequence;
- speculative (S = 2) == plain (S = 0), greedy and seeded sampling, with the real MTP heads, with
  an oracle proposer that gets drafts accepted (verify rows through the absorbed path), and under
  churn and preemption with steps padded to CUDA-graph shapes;
- TP = 2 == TP = 1 over gloo (heads split, the latent cache replicated).
Ops run their torch twins here; each kernel == its twin in tests/unit/test_mla_attention.py.
"""

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from mtp_ctrl.state import LatentKVCacheSpec
from tests.unit.controller_fixtures import OracleProposer, dense_greedy, random_arrivals, run_with_arrivals
from tests.unit.megatron_fixtures import (
    build_tiny_model,
    ensure_single_process_groups,
    free_port,
    init_process_groups,
    spawn_ranks,
    torch_twins,
)
from tests.unit.mla_fixtures import YARN, build_megatron_mla_gpt, megatron_on_cpu, tiny_mla_config
from tests.unit.moe_fixtures import MOE_PROMPTS as PROMPTS
from tests.unit.moe_fixtures import generate_cases

GREEDY, SAMPLED = dict(temperature=0.0), dict(temperature=0.9, top_k=20, seed=7)
CASES = ((0, GREEDY), (2, GREEDY), (0, SAMPLED), (2, SAMPLED))


@pytest.fixture(scope="module")
def megatron_groups():
    ensure_single_process_groups()


@pytest.fixture(scope="module")
def mla_model(megatron_groups):
    return build_tiny_model(tiny_mla_config(**YARN))


@pytest.fixture(scope="module")
def tp1_outputs(mla_model):
    with torch_twins():
        return generate_cases(mla_model, CASES, prompts=PROMPTS)


def test_the_context_holds_one_latent_cache_per_layer(mla_model):
    controller = TextGenerationController(mla_model, InferenceConfig(num_speculative_tokens=2, max_requests=2,
                                                                     block_size_tokens=4, max_model_len=32))
    caches = controller.context.kv_caches
    assert len(caches) == 4 and all(cache.shape[1:] == (4, 24 + 8) for cache in caches)
    spec = controller.runner.kv_cache_spec(torch.float32)
    assert isinstance(spec, LatentKVCacheSpec) and spec.bytes_per_block(4) == 4 * 4 * 32 * 4


def test_plain_greedy_equals_megatron_full_sequence_forward(mla_model, tp1_outputs):
    megatron_model = build_megatron_mla_gpt(tiny_mla_config(**YARN), mla_model)
    with megatron_on_cpu():
        for prompt, output in zip(PROMPTS, tp1_outputs[0]):
            assert output == dense_greedy(megatron_model, prompt, len(output))


def test_speculative_equals_plain_greedy_and_sampled(tp1_outputs):
    plain_greedy, spec_greedy, plain_sampled, spec_sampled = tp1_outputs
    assert spec_greedy == plain_greedy
    assert spec_sampled == plain_sampled
    assert plain_sampled != plain_greedy


def test_accepted_drafts_through_mla_verify_rows(mla_model, tp1_outputs):
    sequences = {rid: list(prompt) + output + [0] * 3 for rid, (prompt, output) in enumerate(zip(PROMPTS, tp1_outputs[0]))}
    proposer = OracleProposer(sequences, lambda rid, index: (rid + index) % 3)
    config = InferenceConfig(num_speculative_tokens=2, max_requests=3, block_size_tokens=4, max_model_len=32,
                             max_tokens_per_step=64)
    with torch_twins():
        controller = TextGenerationController(mla_model, config, proposer=proposer)
        results = controller.generate([list(p) for p in PROMPTS], SamplingParams(max_new_tokens=6))
    assert [list(result.output_tokens) for result in results] == tp1_outputs[0]
    assert sum(result.accepted_drafts for result in results) > 0


def test_speculative_equals_plain_under_churn_and_preemption(mla_model):
    """Random arrivals (greedy and seeded sampled, stop rules), a pool small enough to pause and
    preempt, steps padded to graph shapes: S = 2 == S = 0 token for token; nothing leaks."""
    arrivals = random_arrivals(0, 6)
    outputs = []
    with torch_twins():
        for S, padded in ((0, ()), (2, (2, 4))):
            config = InferenceConfig(num_speculative_tokens=S, max_requests=4, block_size_tokens=4, max_model_len=24,
                                     max_tokens_per_step=64, num_kv_blocks=14, cuda_graph_batch_sizes=padded)
            controller = TextGenerationController(mla_model, config)
            outputs.append(run_with_arrivals(controller, arrivals))
            assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks
    assert outputs[1] == outputs[0]
    assert sum(len(tokens) for tokens in outputs[0]) >= len(arrivals)


def _tp_worker(rank: int, world_size: int, port: int, expected_path: str) -> None:
    init_process_groups(rank, world_size, port, world_size)
    try:
        expected = torch.load(expected_path)
        model = build_tiny_model(tiny_mla_config(tensor_parallel_size=world_size, **YARN))
        attention = model.decoder.layers[0].self_attention
        assert attention.num_heads_local == 4 // world_size
        with torch_twins():
            got = generate_cases(model, [CASES[3]], prompts=PROMPTS[:2], max_new_tokens=4)  # seeded, S = 2
        assert got == [[tokens[:4] for tokens in expected[3][:2]]], f"rank {rank}: {got}"
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_tp2_equals_tp1(tp1_outputs, tmp_path):
    path = tmp_path / "tp1.pt"
    torch.save(tp1_outputs, path)
    spawn_ranks(_tp_worker, (2, free_port(), str(path)))
