"""Prefix caching through the controller: output with caching on == off (greedy and seeded
sampled, S = 0 and S = 2, MTP, EAGLE and parallel drafting), the same drafts on a hit as on a cold
start (equal acceptance counters), and bad input. Churn, preemption, eviction, the opt-outs (per
request, single-position MTP, hybrids) and the server's metrics: test_prefix_cache_churn.py."""

import pytest
import torch

from mtp_ctrl.controllers import EagleProposer, InferenceConfig, ParallelDraftingProposer, SamplingParams
from tests.unit.controller_fixtures import build_models, make_controller
from tests.unit.megatron_fixtures import ensure_single_process_groups
from tests.unit.prefix_cache_fixtures import assert_hits_and_no_leak, run_staggered, shared_prompts


@pytest.fixture(scope="module")
def models():
    ensure_single_process_groups()
    return build_models()


@pytest.mark.parametrize("num_speculative_tokens", [0, 2])
def test_greedy_on_equals_off_with_hits(models, torch_twins, num_speculative_tokens):
    """Greedy outputs, and for S = 2 the MTP drafts' acceptance (the same drafts on a hit as on a
    cold start), are identical with caching on and off; later requests hit earlier prompts."""
    model, _ = models
    prompts = shared_prompts(6)
    params = [SamplingParams(max_new_tokens=4)] * len(prompts)
    off = run_staggered(make_controller(model, num_speculative_tokens, prefix_caching=False), prompts, params)
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
    off = run_staggered(make_controller(model, 2, proposer=proposer_class(head), prefix_caching=False), prompts, params)
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
    with pytest.raises(TypeError, match="prefix_namespace"):
        controller.context.add_request(99, [1, 2, 3], None, prefix_namespace="x")
    assert 99 not in controller.context  # nothing was admitted


