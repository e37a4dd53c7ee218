"""Prefix caching through the controller: output with caching on == off (greedy and seeded
sampled, S = 0 and S = 2, MTP and EAGLE), the same drafts on a hit as on a cold start (equal
acceptance counters), and bad input. Churn, preemption, eviction and the opt-outs (per request, single-position MTP,
hybrids): test_prefix_cache_churn.py."""

import random

import pytest
import torch

from mtp_ctrl.controllers import EagleProposer, InferenceConfig, ParallelDraftingProposer, SamplingParams
from tests.unit.controller_fixtures import build_models, make_controller
from tests.unit.megatron_fixtures import VOCAB_SIZE, ensure_single_process_groups

SYSTEM = [7, 21, 3, 88, 45, 12, 9, 60, 33, 2, 71, 14, 5, 90, 27, 41, 18, 66]  # 18 tokens: 4 full blocks of 4


@pytest.fixture(scope="module")
def models():
    ensure_single_process_groups()
    return build_models()


def shared_prompts(count: int, seed: int = 0, vocab_size: int = VOCAB_SIZE):
    """Prompts sharing partial prefixes of SYSTEM (some the whole of it), with distinct tails."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        shared = [token % vocab_size for token in SYSTEM[: rng.choice([0, 5, 9, 13, 18, 18])]]
        prompts.append(shared + [rng.randrange(vocab_size) for _ in range(rng.randint(1, 5))])
    return prompts


def run_staggered(controller, prompts, params, stagger: int = 2):
    """Add a request every ``stagger`` steps (so later ones find earlier ones' blocks cached);
    returns [(output tokens, decode steps, accepted drafts)] in prompt order."""
    ids, pending, step = [], list(zip(prompts, params)), 0
    while pending or controller.has_unfinished_requests():
        if pending and step % stagger == 0:
            prompt, param = pending.pop(0)
            ids.append(controller.add_request(prompt, param))
        controller.step()
        step += 1
    results = [controller.result(request_id) for request_id in ids]
    return [(r.output_tokens, r.decode_steps, r.accepted_drafts) for r in results]


def assert_hits_and_no_leak(controller):
    stats = controller.metrics.as_dict()["prefix_cache"]
    assert stats["hit_tokens"] > 0 and 0 < stats["hit_rate"] < 1 and stats["cached_blocks"] > 0
    pool = controller.context.allocator
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("num_speculative_tokens", [0, 2])
def test_greedy_on_equals_off_with_hits(models, torch_twins, num_speculative_tokens):
    """Greedy outputs, and for S = 2 the MTP drafts' acceptance (the same drafts on a hit as on a
    cold start), are identical with caching on and off; later requests hit earlier prompts."""
    model, _ = models
    prompts = shared_prompts(6)
    params = [SamplingParams(max_new_tokens=4)] * len(prompts)
    off = run_staggered(make_controller(model, num_speculative_tokens), prompts, params)
    controller = make_controller(model, num_speculative_tokens, prefix_caching=True)
    assert run_staggered(controller, prompts, params) == off
    assert_hits_and_no_leak(controller)


@pytest.mark.parametrize("parallel_drafting", [False, True])
def test_eagle_sampled_on_equals_off_with_hits(torch_twins, parallel_drafting):
    """EAGLE's (and parallel drafting's) head cache lives in the target's blocks (lookahead 1):
    seeded sampled outputs and acceptance equal with caching on and off."""
    from mtp_ctrl.models import build_eagle_head
    from tests.unit.eagle_fixtures import AUX_LAYERS, build_eagle_models

    ensure_single_process_groups()
    model, _, head, _ = build_eagle_models()
    proposer_class = EagleProposer
    if parallel_drafting:
        torch.manual_seed(78)
        head, proposer_class = build_eagle_head(model, AUX_LAYERS, parallel_drafting=True).eval(), ParallelDraftingProposer
    prompts = shared_prompts(5, seed=3)
    params = [SamplingParams(max_new_tokens=4, temperature=0.7, seed=5 + i) for i in range(len(prompts))]
    off = run_staggered(make_controller(model, 2, proposer=proposer_class(head)), prompts, params)
    controller = make_controller(model, 2, proposer=proposer_class(head), prefix_caching=True)
    assert run_staggered(controller, prompts, params) == off
    assert_hits_and_no_leak(controller)


def test_bad_input(models):
    model, _ = models
    with pytest.raises(TypeError, match="prefix_caching"):
        InferenceConfig(prefix_caching=1)
    controller = make_controller(model, 0, prefix_caching=True)
    with pytest.raises(TypeError, match="prefix_caching"):
        controller.add_request([1, 2, 3], prefix_caching="no")
    with pytest.raises(TypeError, match="use_prefix_cache"):
        controller.context.add_request(99, [1, 2, 3], None, use_prefix_cache=1)



def test_server_metrics_show_the_prefix_cache(models, torch_twins):
    from mtp_ctrl.serve.metrics import ServerMetrics

    model, _ = models
    controller = make_controller(model, 0, prefix_caching=True)
    controller.generate([SYSTEM + [1]], SamplingParams(max_new_tokens=1))
    controller.generate([SYSTEM + [2]], SamplingParams(max_new_tokens=1))
    text = ServerMetrics(controller).render()
    assert "mtp_ctrl_prefix_cache_hit_tokens_total 16\n" in text and "mtp_ctrl_kv_block_evictions_total 0\n" in text
    assert "mtp_ctrl_kv_blocks_cached 4\n" in text and "mtp_ctrl_prefix_cache_hit_rate 0.4210" in text
