"""Prefix caching under pressure: a pool too small for the batch, so requests sharing partial
prefixes are paused, preempted (and recomputed, hitting their own cached blocks) and cached
blocks are evicted; seeded sampled outputs stay equal to caching off, nothing leaks. And the
opt-outs, and the server's /metrics lines."""

import pytest

from mtp_ctrl.controllers import SamplingParams
from tests.unit.controller_fixtures import build_models, make_controller
from tests.unit.megatron_fixtures import ensure_single_process_groups
from tests.unit.prefix_cache_fixtures import SYSTEM, run_staggered, shared_prompts


@pytest.fixture(scope="module")
def models():
    ensure_single_process_groups()
    return build_models()


def test_sampled_on_equals_off_under_preemption_and_eviction(models, torch_twins):
    model, _ = models
    prompts = shared_prompts(9, seed=1)
    params = [SamplingParams(max_new_tokens=6, temperature=0.9, top_k=30, seed=100 + i) for i in range(len(prompts))]
    small = dict(num_kv_blocks=10, max_requests=4)  # one full-length request's worth: preemptions
    off = run_staggered(make_controller(model, 2, prefix_caching=False, **small), prompts, params, stagger=1)
    controller = make_controller(model, 2, prefix_caching=True, **small)
    on = run_staggered(controller, prompts, params, stagger=1)
    assert [tokens for tokens, _, _ in on] == [tokens for tokens, _, _ in off]  # steps differ: preemptions do
    assert sum(controller.result(request_id).preemptions for request_id in range(len(prompts))) > 0
    stats = controller.metrics.as_dict()["prefix_cache"]
    assert stats["hit_tokens"] > 0 and stats["evictions"] > 0
    pool = controller.context.allocator
    assert pool.num_free_blocks == pool.num_blocks and pool.num_cached_blocks <= pool.num_blocks


def test_opt_outs_take_no_hit(models, torch_twins):
    """Per-request opt-out and single-position MTP (it writes a request's first block): no hit,
    same output (hybrids without snapshot slots: test_prefix_cache_hybrid.py)."""
    model, _ = models
    prompts = [SYSTEM + [1, 2], SYSTEM + [3]]
    params = SamplingParams(max_new_tokens=2)
    controller = make_controller(model, 2, prefix_caching=True)
    for prompt in prompts:
        controller.add_request(prompt, params, prefix_caching=False)
        while controller.has_unfinished_requests():
            controller.step()
    assert controller.metrics.as_dict()["prefix_cache"]["hit_tokens"] == 0
    no_hits = dict(hit_rate=0.0, hit_tokens=0, queried_tokens=0, cached_blocks=0, evictions=0)
    single = make_controller(model, 2, prefix_caching=True, mtp_attention="single_position")
    single.generate(prompts[:1], params)
    single.generate(prompts[1:], params)
    assert single.metrics.as_dict()["prefix_cache"] == no_hits


def test_requests_that_never_draft_share_prompt_blocks_only_among_themselves(models, torch_twins):
    """A step whose requests never draft (``num_speculative_tokens=0``, or admitted retired) runs no
    MTP window over their prompts (mtp_catch_up.py), so their prompt blocks lack the MTP entries: a
    drafting request takes no hit from them (nor would it read entries never written), and they take
    none from a drafting request's; each kind hits its own. Outputs equal caching off."""
    model, _ = models
    prompts = [SYSTEM + [1, 2], SYSTEM + [3], SYSTEM + [4], SYSTEM + [5]]
    never, drafting = SamplingParams(max_new_tokens=3, num_speculative_tokens=0), SamplingParams(max_new_tokens=3)
    outputs = {}
    for caching in (False, True):
        controller = make_controller(model, 2, prefix_caching=caching)
        hits, outputs[caching] = [], []
        for prompt, params in zip(prompts, (never, never, drafting, drafting)):
            outputs[caching] += controller.generate([prompt], params)
            hits.append(controller.metrics.as_dict()["prefix_cache"]["hit_tokens"])
    # the second hit the first's SYSTEM (4 blocks), the third nothing of theirs, the fourth the third's
    assert hits == [0, 16, 16, 32]
    assert [o.output_tokens for o in outputs[True]] == [o.output_tokens for o in outputs[False]]


def test_server_metrics_show_the_prefix_cache(models, torch_twins):
    from mtp_ctrl.serve.metrics import ServerMetrics, controller_figures

    model, _ = models
    controller = make_controller(model, 0, prefix_caching=True)
    controller.generate([SYSTEM + [1]], SamplingParams(max_new_tokens=1))
    controller.generate([SYSTEM + [2]], SamplingParams(max_new_tokens=1))
    text = ServerMetrics().render(controller_figures(controller))
    assert "mtp_ctrl_prefix_cache_hit_tokens_total 16\n" in text and "mtp_ctrl_kv_block_evictions_total 0\n" in text
    assert "mtp_ctrl_kv_blocks_cached 4\n" in text and "mtp_ctrl_prefix_cache_hit_rate 0.4210" in text
