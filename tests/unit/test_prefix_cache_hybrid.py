"""Prefix caching on hybrid models (Mamba-2 and Gated DeltaNet layers): a hit restores a snapshot
of the recurrent state after the reused blocks. Caching on == off: greedy and seeded sampled,
S = 0 and 2, under churn, preemption and eviction; later requests hit, nothing leaks."""

import pytest

from mtp_ctrl.controllers import SamplingParams
from tests.unit.controller_fixtures import make_controller
from tests.unit.megatron_fixtures import ensure_single_process_groups
from tests.unit.prefix_cache_fixtures import SYSTEM, assert_hits_and_no_leak, run_staggered, shared_prompts


@pytest.fixture(scope="module")
def hybrids():
    from tests.unit.gdn_fixtures import build_gdn_model
    from tests.unit.hybrid_fixtures import build_hybrid_model

    ensure_single_process_groups()
    return {"mamba": build_hybrid_model(mtp_num_layers=2, chunk_size=8), "gdn": build_gdn_model(mtp_num_layers=2)}


@pytest.fixture(scope="module")
def long_memory_hybrids():
    from tests.unit.gdn_fixtures import build_gdn_model
    from tests.unit.hybrid_fixtures import build_hybrid_model, give_long_memory

    ensure_single_process_groups()
    models = {"mamba": build_hybrid_model(mtp_num_layers=2, chunk_size=4), "gdn": build_gdn_model(mtp_num_layers=2)}
    for model in models.values():
        give_long_memory(model)
    return models


def _snapshots(controller):
    return controller.context.prefix_cache.snapshots


@pytest.mark.parametrize("family", ["mamba", "gdn"])
@pytest.mark.parametrize("num_speculative_tokens", [0, 2])
def test_greedy_on_equals_off_with_hits(hybrids, torch_twins, family, num_speculative_tokens):
    model = hybrids[family]
    prompts = shared_prompts(6)
    params = [SamplingParams(max_new_tokens=4)] * len(prompts)
    off = run_staggered(make_controller(model, num_speculative_tokens, prefix_caching=False), prompts, params)
    controller = make_controller(model, num_speculative_tokens, prefix_caching=True)
    assert run_staggered(controller, prompts, params) == off  # tokens, steps and accepted drafts
    assert_hits_and_no_leak(controller)
    snapshots = _snapshots(controller)
    assert snapshots.num_owned > 0 and snapshots.num_owned + snapshots.num_free == snapshots.num_snapshots


def test_sampled_on_equals_off_under_preemption_and_eviction(hybrids, torch_twins):
    """A pool too small for the batch and two snapshot slots: requests are preempted (and
    recomputed, hitting their own blocks), blocks and snapshots are evicted. (Mamba-2 only: GDN
    layers keep their state in the same slots and snapshots; their hits are tested above.)"""
    model = hybrids["mamba"]
    prompts = shared_prompts(9, seed=1)
    params = [SamplingParams(max_new_tokens=8, temperature=0.9, top_k=30, seed=100 + i) for i in range(len(prompts))]
    small = dict(num_kv_blocks=10, max_requests=4)
    off = run_staggered(make_controller(model, 2, prefix_caching=False, **small), prompts, params, stagger=1)
    controller = make_controller(model, 2, prefix_caching=True, prefix_state_snapshots=2, **small)
    on = run_staggered(controller, prompts, params, stagger=1)
    assert [tokens for tokens, _, _ in on] == [tokens for tokens, _, _ in off]
    assert sum(controller.result(request_id).preemptions for request_id in range(len(prompts))) > 0
    stats = controller.metrics.as_dict()["prefix_cache"]
    assert stats["hit_tokens"] > 0 and stats["evictions"] > 0
    pool, snapshots = controller.context.allocator, _snapshots(controller)
    assert pool.num_free_blocks == pool.num_blocks
    assert set(snapshots.owned()) <= set(pool.cached_blocks().values())  # no snapshot outlives its block
    assert snapshots.num_owned + snapshots.num_free == snapshots.num_snapshots  # none pending, none leaks


def test_shared_system_prompt_and_chat_turns(hybrids, torch_twins):
    """The two serving patterns: the third request with a shared system prompt hits it (the second
    snapshots where it leaves the first), and a chat turn resending the history hits the turn before."""
    model = hybrids["mamba"]
    params = SamplingParams(max_new_tokens=3)
    system = SYSTEM[:16]  # 4 full blocks
    prompts = [system + [1, 2, 3, 4, 5], system + [6, 7], system + [8, 9, 10]]
    plain = [r.output_tokens for r in make_controller(model, 0, prefix_caching=False).generate(prompts, params)]
    controller = make_controller(model, 0, prefix_caching=True)
    hits = []
    for prompt, expected in zip(prompts, plain):
        before = controller.metrics.as_dict()["prefix_cache"]["hit_tokens"]
        assert controller.generate([prompt], params)[0].output_tokens == expected
        hits.append(controller.metrics.as_dict()["prefix_cache"]["hit_tokens"] - before)
    assert hits == [0, 0, 16]
    turn = prompts[2] + list(plain[2]) + [11, 12, 13]  # the history resent, then the new message
    expected = make_controller(model, 0, prefix_caching=False).generate([turn], params)[0].output_tokens
    before = controller.metrics.as_dict()["prefix_cache"]["hit_tokens"]
    assert controller.generate([turn], params)[0].output_tokens == expected
    assert controller.metrics.as_dict()["prefix_cache"]["hit_tokens"] - before == 16  # [0, 16) of 22 cached


def test_no_snapshot_slots_takes_no_hit(hybrids, torch_twins):
    model = hybrids["gdn"]
    prompts = [SYSTEM + [1, 2], SYSTEM + [3]]
    params = SamplingParams(max_new_tokens=2)
    plain = [r.output_tokens for r in make_controller(model, 0, prefix_caching=False).generate(prompts, params)]
    controller = make_controller(model, 0, prefix_caching=True, prefix_state_snapshots=0)
    assert [r.output_tokens for r in controller.generate(prompts, params)] == plain
    assert controller.metrics.as_dict()["prefix_cache"]["hit_tokens"] == 0
    with pytest.raises(ValueError, match="prefix_state_snapshots"):
        make_controller(model, 0, prefix_caching=True, prefix_state_snapshots=-1)


@pytest.mark.parametrize("family", ["mamba", "gdn"])
def test_long_memory_hybrids_restore_the_state_a_hit_needs(long_memory_hybrids, torch_twins, family):
    """The fixtures' default recurrent layers forget their state within a token or two, so a hit that
    restored a wrong state would still give the same tokens. With long memory (the state decays
    0.9-0.97 a token) it would not (a hit restoring the conv window but a zero SSM state changed the
    tokens): requests one after another, each hitting the shared 16-token prefix, S = 2, caching
    on == off."""
    model = long_memory_hybrids[family]
    prefix = [64, 77, 2, 77, 45, 49, 60, 27, 94, 5, 26, 36, 54, 39, 12, 4]  # 4 blocks of 4 tokens
    tails = [[0, 4, 14], [95, 18], [62, 72, 71, 38], [1]]

    def outputs(prefix_caching):
        controller = make_controller(model, 2, prefix_caching=prefix_caching, overlap_scheduling=False, max_model_len=40,
                                     max_tokens_per_step=32)
        tokens = []
        for tail in tails:  # one after the other: each later request hits the prefix
            request_id = controller.add_request(prefix + tail, SamplingParams(max_new_tokens=12))
            while controller.has_unfinished_requests():
                controller.step()
            tokens.append(controller.result(request_id).output_tokens)
        return tokens, controller.metrics.as_dict()["prefix_cache"]["hit_tokens"]

    on, hit_tokens = outputs(True)
    assert hit_tokens > 0 and on == outputs(False)[0]
