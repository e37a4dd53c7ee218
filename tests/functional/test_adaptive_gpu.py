"""GPU: per-request draft lengths (issue 34) replay the warmed-up CUDA graphs (one per verify
tier and draft depth, and per plan of skipped MTP windows) with no host sync, and the output
equals plain decoding; skipped MTP windows caught up draft what run windows draft; ragged rows (a
decode request runs 1 + s_r rows) replay their token counts' graphs with no host sync, == eager == plain."""

import collections
import dataclasses

import pytest
import torch

from mtp_ctrl.controllers import (GoodputPolicy, InferenceConfig, PerRequestGoodputPolicy, RandomDraftLengths,
                                  SamplingParams, TextGenerationController)
from mtp_ctrl.controllers.graph_warmup import NO_DRAFT_PHASE
from tests.functional.sync_checks import no_host_sync
from tests.functional.test_controller_gpu import DeviceOracleProposer, plain_sequences
from tests.unit.draft_length_fixtures import BurstyLengths, RandomDepths, RetiringDepths
from tests.unit.megatron_fixtures import build_tiny_model, ensure_single_process_groups, tiny_config

PROMPTS = [[5, 17, 3, 88, 41], [9, 9, 2], [60, 1, 33, 70, 12, 8, 45], [4] * 11, [30, 31], [7, 7, 7, 1]]
S = 3


@pytest.fixture(scope="module")
def model():
    ensure_single_process_groups()
    return build_tiny_model(tiny_config(mtp_num_layers=S)).cuda()


def make_config(num_speculative_tokens, **overrides):
    fields = dict(num_speculative_tokens=num_speculative_tokens, max_requests=8, block_size_tokens=4,
                  max_model_len=96, max_tokens_per_step=128, cuda_graph_batch_sizes=(1, 2, 4, 8))
    fields.update(overrides)
    return InferenceConfig(**fields)


class SyncChecked(TextGenerationController):
    """Launches every decode-only step under ``set_sync_debug_mode("error")``."""

    decode_launches = 0

    def _launch_step(self, step):
        if step.num_prefill:
            return super()._launch_step(step)
        with no_host_sync():
            launched = super()._launch_step(step)
        self.decode_launches += 1
        return launched


@pytest.mark.parametrize("policy", ["random", "goodput"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_lengths_replay_graphs_with_no_sync_and_equal_plain(model, policy, temperature):
    params = SamplingParams(max_new_tokens=24, temperature=temperature, seed=11)
    plain = TextGenerationController(model, make_config(0)).generate(PROMPTS, params)
    proposer = DeviceOracleProposer(plain_sequences(PROMPTS, plain, 2 * (S + 1)).cuda())
    chosen = RandomDraftLengths(seed=2) if policy == "random" else GoodputPolicy()
    controller = SyncChecked(model, make_config(S, decode_steps_per_launch=2), proposer=proposer, draft_policy=chosen)
    graphs = controller.warmup()
    keys = collections.Counter()
    tiers = collections.Counter()  # verify widths V replayed
    controller.on_launch = lambda step, key: (keys.update([None if key is None else key[4]]),  # draft depths D replayed
                                              tiers.update([None if key is None else key[3]]))
    ids = [controller.add_request(prompt, params) for prompt in PROMPTS]  # request id = row of the oracle's table
    while controller.has_unfinished_requests():
        controller.step()
    assert [controller.result(rid).output_tokens for rid in ids] == [r.output_tokens for r in plain]
    assert controller.debug_view().num_cuda_graphs == graphs  # every depth was warmed up: nothing captured
    assert controller.decode_launches > 4  # launches of 2-step decode runs
    assert controller.metrics.mean_accepted_length > 1.2  # the oracle's drafts land
    if policy == "random":
        assert {0, S} <= set(keys) and len(set(keys) - {None}) >= 3, keys  # several depths replayed (0: no draft phase)
        assert S in tiers and len(set(tiers) - {None}) >= 2, tiers  # several verify tiers (V: the most held of 6)
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks
    controller.close()


class AllStepsSyncChecked(TextGenerationController):
    """Launches every step, prefill chunks included, under ``set_sync_debug_mode("error")``;
    records the verify width V of each step with prefill chunks and decode requests that replayed
    a graph."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mixed_tiers = collections.Counter()

    def _launch_step(self, step):
        with no_host_sync():
            return super()._launch_step(step)

    def on_launch(self, step, graph_key):
        if graph_key is not None and step.num_prefill and step.num_decode:
            self.mixed_tiers[graph_key[3]] += 1


def test_mixed_steps_replay_every_verify_tier_with_no_sync_and_equal_plain(model):
    """A queue (a request joins nearly every step, 4 slots): steps with prefill chunks verify their
    own tier V (the most drafts their decode requests hold, random lengths), each replaying a graph
    ``warmup()`` captured for that tier, with no host sync; the output equals plain decoding,
    greedy and sampled."""
    prompts = [[(7 * i + j) % 90 + 1 for j in range(3 + i % 9)] for i in range(16)]
    params = [SamplingParams(max_new_tokens=6 + i % 5, temperature=0.8 * (i % 2), seed=i) for i in range(16)]
    plain = TextGenerationController(model, make_config(0, max_requests=4, cuda_graph_batch_sizes=())).generate(
        prompts, params)
    proposer = DeviceOracleProposer(plain_sequences(prompts, plain, 2 * (S + 1)).cuda())
    controller = AllStepsSyncChecked(model, make_config(S, max_requests=4, cuda_graph_batch_sizes=(2, 4)),
                                     proposer=proposer, draft_policy=RandomDraftLengths(seed=3))
    graphs = controller.warmup()
    ids = []
    while len(ids) < len(prompts) or controller.has_unfinished_requests():  # one request joins per step
        if len(ids) < len(prompts):
            ids.append(controller.add_request(prompts[len(ids)], params[len(ids)]))  # id = row of the oracle's table
        controller.step()
    assert [controller.result(rid).output_tokens for rid in ids] == [r.output_tokens for r in plain]
    assert controller.debug_view().num_cuda_graphs == graphs  # every mixed tier was warmed up
    assert len(controller.mixed_tiers) >= 3, controller.mixed_tiers  # mixed steps at several verify tiers
    controller.close()


def run_bursty(model, params, steps_per_launch, graphs, depths=False, **config):
    """The MTP proposer (paged) under runs of no-draft steps (``BurstyLengths``), or a depth D in
    [0, S] every step (``depths``: ``RandomDepths``): (outputs, the metrics' accepted drafts per depth,
    warmed-up graphs, graphs at the end, decode launches, graph launches whose plan skipped the
    depths past 0 < D < S)."""
    # few shapes: each warms up every plan of every tier (random depths: one batch size, more plans)
    sizes = ((8,) if depths else (2, 8)) if graphs else ()
    controller = (SyncChecked if graphs else TextGenerationController)(
        model, make_config(S, decode_steps_per_launch=steps_per_launch, cuda_graph_batch_sizes=sizes, **config),
        draft_policy=RandomDepths(seed=3) if depths else BurstyLengths(seed=3))
    warmed = controller.warmup() if graphs else 0
    partial = []
    controller.on_launch = lambda step, key: partial.append(
        key is not None and key[6] is not None and any(0 < run < S for run, _ in key[6]))
    ids = [controller.add_request(prompt, params) for prompt in PROMPTS]
    while controller.has_unfinished_requests():
        controller.step()
    metrics = controller.metrics.as_dict()
    result = ([controller.result(rid).output_tokens for rid in ids], metrics["accepted_per_depth"],
              warmed, controller.debug_view().num_cuda_graphs, getattr(controller, "decode_launches", 0), sum(partial))
    controller.close()
    return result


@pytest.mark.parametrize("temperature,steps_per_launch,depths", [(0.0, 2, False), (0.8, 1, False), (0.8, 2, True)])
def test_skipped_mtp_windows_catch_up_in_graphs_with_no_sync(model, temperature, steps_per_launch, depths):
    """``mtp_idle_windows="skip"`` (skipped windows caught up exactly): graphs of every plan (skip,
    depths past D skipped, catch-up, forced catch-up, decode runs) are captured at warm-up and replay
    with no host sync; outputs == eager == plain decoding."""
    params = SamplingParams(max_new_tokens=40, temperature=temperature, seed=5)
    plain = [r.output_tokens for r in TextGenerationController(model, make_config(0)).generate(PROMPTS, params)]
    outputs, _, warmed, graphs, launches, partial = run_bursty(model, params, steps_per_launch, True, depths,
                                                               mtp_idle_windows="skip")
    assert outputs == plain and graphs == warmed and launches > 4
    assert partial > 0 or not depths  # graphs of D < S steps that skipped the deeper depths replayed
    assert run_bursty(model, params, steps_per_launch, False, depths, mtp_idle_windows="skip")[0] == plain


@pytest.mark.parametrize("temperature,depths", [(0.0, False), (0.8, False), (0.0, True)])
def test_skipped_mtp_windows_accept_what_run_windows_accept(model, temperature, depths):
    """Drafts with the windows skipped == with them run (the accepted drafts per depth; graphs);
    ``depths``: D changes every step, the depths past it skipped."""
    params = SamplingParams(max_new_tokens=40, temperature=temperature, seed=5)
    skipped = run_bursty(model, params, 1, True, depths, mtp_idle_windows="skip")
    run = run_bursty(model, params, 1, True, depths, mtp_idle_windows="run")
    assert skipped[0] == run[0] and sum(run[1]) > 0
    assert skipped[1] == run[1], (skipped[1], run[1])
    assert skipped[5] > 0 or not depths


@pytest.mark.parametrize("temperature,all_retired", [(0.0, False), (0.8, True)])
def test_opted_out_and_retired_requests_replay_graphs_with_no_sync_and_equal_plain(model, temperature, all_retired):
    """Requests that opt out (``num_speculative_tokens=0``) beside drafting ones, which the policy
    retires from speculation mid-run (every other one, or all and the later ones admitted retired),
    MTP windows skipped: every launch replays a graph captured at warm-up (the plans that run no
    window, prompt chunks included), decode steps with no host sync; outputs == plain decoding."""
    base = SamplingParams(max_new_tokens=40, temperature=temperature, seed=5)
    plain = [r.output_tokens for r in TextGenerationController(model, make_config(0)).generate(PROMPTS * 2, base)]
    params = [dataclasses.replace(base, num_speculative_tokens=0) if index % 3 == 1 else base
              for index in range(2 * len(PROMPTS))]  # 12 requests through 8 slots: later ones join a live batch
    policy = RetiringDepths(seed=7, retire_at=8, all_retired=all_retired)
    controller = SyncChecked(model, make_config(S, cuda_graph_batch_sizes=(8,)), draft_policy=policy)
    warmed = controller.warmup()
    plans = collections.Counter()
    controller.on_launch = lambda step, key: plans.update([None if key is None else key[6]])
    assert [r.output_tokens for r in controller.generate(PROMPTS * 2, params)] == plain
    assert policy.retired and controller.debug_view().num_cuda_graphs == warmed and None not in plans
    assert controller.decode_launches > 4 and plans[((0, 0),)] > 0  # steps that ran no MTP window
    # once every request is retired, decode steps run no draft phase at all (graphs warmed up for them)
    assert plans[NO_DRAFT_PHASE] > 0 or not all_retired
    controller.close()


class RaggedDeviceOracle(DeviceOracleProposer):
    takes_ragged_rows = True  # reads bonus_positions only


@pytest.mark.parametrize("drafter,policy_name", [("oracle", "random"), ("mtp", "random"), ("mtp", "per_request")])
def test_ragged_rows_replay_graphs_with_no_sync_and_equal_eager_and_plain(model, drafter, policy_name):
    """Ragged rows: the device oracle and paged MTP under random lengths, paged MTP under
    PerRequestGoodputPolicy; decode-only steps pad their rows to a ragged token count (some below the
    tier's G (1 + V) under random lengths), replay graphs ``warmup()`` captured (nothing captured while
    serving) with no host sync; outputs == eager == plain decoding, greedy and sampled requests
    together; every KV block freed. With the per-request policy a third of the requests are capped at
    one draft; its lengths follow its estimates (on this small model they may give every request the
    same length), so only the random lengths are required to run rows below the tier."""
    params = [SamplingParams(max_new_tokens=24, temperature=0.8 * (i % 2), seed=11 + i,
                             num_speculative_tokens=1 if policy_name == "per_request" and i % 3 == 2 else None)
              for i in range(len(PROMPTS))]
    plain = TextGenerationController(model, make_config(0)).generate(PROMPTS, params)
    outputs = []
    for graphs in (True, False):
        proposer = RaggedDeviceOracle(plain_sequences(PROMPTS, plain, 2 * (S + 1)).cuda()) if drafter == "oracle" \
            else None
        policy = RandomDraftLengths(seed=4) if policy_name == "random" else PerRequestGoodputPolicy(decide_every=2)
        controller = SyncChecked(model, make_config(S, cuda_graph_batch_sizes=(8,) if graphs else ()),
                                 proposer=proposer, draft_policy=policy)
        warmed = controller.warmup()
        below_tier = []
        controller.on_launch = lambda step, key: below_tier.append(
            not step.num_prefill and step.dimensions.is_ragged(step.verify_width))
        ids = [controller.add_request(prompt, p) for prompt, p in zip(PROMPTS, params)]  # id = the oracle's row
        while controller.has_unfinished_requests():
            controller.step()
        outputs.append([controller.result(rid).output_tokens for rid in ids])
        assert controller.debug_view().num_cuda_graphs == warmed  # nothing captured while serving
        assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks
        if graphs:
            assert warmed > 0 and controller.decode_launches > 4
            assert policy_name != "random" or any(below_tier), below_tier
        controller.close()
    assert outputs[0] == outputs[1] == [r.output_tokens for r in plain]
