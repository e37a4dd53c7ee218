"""Prefix caching through the controller: output with caching on == off (greedy and seeded
sampled, S = 0 and S = 2, under churn, preemption and eviction), the same drafts on a hit as on a
cold start, opt-outs (per request, EAGLE-style proposers, hybrids) and the metrics."""

import random

import pytest

from mtp_ctrl.controllers import InferenceConfig, SamplingParams
from tests.unit.controller_fixtures import build_models, make_controller
from tests.unit.megatron_fixtures import VOCAB_SIZE, ensure_single_process_groups

SYSTEM = [7, 21, 3, 88, 45, 12, 9, 60, 33, 2, 71, 14, 5, 90, 27, 41, 18, 66]  # 18 tokens: 4 full blocks of 4


@pytest.fixture(scope="module")
def models():
    ensure_single_process_groups()
    return build_models()


def _shared_prompts(count: int, seed: int = 0):
    """Prompts sharing partial prefixes of SYSTEM (some the whole of it), with distinct tails."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        shared = SYSTEM[: rng.choice([0, 5, 9, 13, 18, 18])]
        prompts.append(shared + [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 6))])
    return prompts


def _run(controller, prompts, params, stagger: int = 2):
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


@pytest.mark.parametrize("num_speculative_tokens", [0, 2])
def test_greedy_on_equals_off_with_hits(models, torch_twins, num_speculative_tokens):
    """Greedy outputs, and for S = 2 the MTP drafts' acceptance (the same drafts on a hit as on a
    cold start), are identical with caching on and off; later requests hit earlier prompts."""
    model, _ = models
    prompts = _shared_prompts(10)
    params = [SamplingParams(max_new_tokens=6)] * len(prompts)
    off = _run(make_controller(model, num_speculative_tokens), prompts, params)
    controller = make_controller(model, num_speculative_tokens, prefix_caching=True)
    on = _run(controller, prompts, params)
    assert on == off
    stats = controller.metrics.as_dict()["prefix_cache"]
    assert stats["hit_tokens"] > 0 and 0 < stats["hit_rate"] < 1
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks


def test_sampled_on_equals_off_under_preemption_and_eviction(models, torch_twins):
    """A pool too small for the batch: requests are preempted and recomputed (hitting their own
    blocks), cached blocks are evicted, seeded sampled outputs stay identical."""
    model, _ = models
    prompts = _shared_prompts(12, seed=1)
    params = [SamplingParams(max_new_tokens=8, temperature=0.9, top_k=30, seed=100 + i) for i in range(len(prompts))]
    small = dict(num_kv_blocks=12, max_requests=4)
    off = _run(make_controller(model, 2, **small), prompts, params, stagger=1)
    controller = make_controller(model, 2, prefix_caching=True, **small)
    on = _run(controller, prompts, params, stagger=1)
    assert [tokens for tokens, _, _ in on] == [tokens for tokens, _, _ in off]  # steps differ: preemptions do
    assert sum(controller.result(request_id).preemptions for request_id in range(len(prompts))) > 0
    stats = controller.metrics.as_dict()["prefix_cache"]
    assert stats["hit_tokens"] > 0 and stats["evictions"] > 0
    pool = controller.context.allocator
    assert pool.num_free_blocks == pool.num_blocks and pool.num_cached_blocks <= pool.num_blocks


def test_per_request_opt_out_and_single_position_take_no_hit(models, torch_twins):
    model, _ = models
    prompts = [SYSTEM + [1, 2], SYSTEM + [3]]
    controller = make_controller(model, 2, prefix_caching=True)
    for prompt in prompts:
        controller.add_request(prompt, SamplingParams(max_new_tokens=2), prefix_caching=False)
        while controller.has_unfinished_requests():
            controller.step()
    assert controller.metrics.as_dict()["prefix_cache"]["hit_tokens"] == 0
    single = make_controller(model, 2, prefix_caching=True, mtp_attention="single_position")
    single.generate(prompts, SamplingParams(max_new_tokens=2))
    single.generate(prompts, SamplingParams(max_new_tokens=2))
    assert single.metrics.as_dict()["prefix_cache"] == dict(hit_rate=0.0, hit_tokens=0, queried_tokens=0,
                                                            cached_blocks=0, evictions=0)


def test_bad_input(models):
    model, _ = models
    with pytest.raises(TypeError, match="prefix_caching"):
        InferenceConfig(prefix_caching=1)
    controller = make_controller(model, 0, prefix_caching=True)
    with pytest.raises(TypeError, match="prefix_caching"):
        controller.add_request([1, 2, 3], prefix_caching="no")
