"""Per-request, per-step draft lengths (issue 34) with the EAGLE family (EAGLE, parallel drafting,
multi-layer EAGLE) on a target whose drafts often land, on hybrid Mamba and Gated DeltaNet models, and with
rejection acceptance: output == plain decoding under random lengths, churn, preemption and
padded steps, and under a queue (most steps carry a prefill chunk and verify their own tier)."""

import dataclasses

import pytest
import torch

from mtp_ctrl.controllers import EagleProposer, MultiLayerEagleProposer, ParallelDraftingProposer
from mtp_ctrl.models import build_eagle_head, build_multi_layer_eagle_heads
from tests.unit.controller_fixtures import MTP_DEPTH, build_models
from tests.unit.draft_length_fixtures import (ARRIVALS, QUEUED, SQUEEZE, CheckedRandomLengths, MixedTiers, ZeroLengths,
                                              controller_for, plain_outputs, run)
from tests.unit.eagle_fixtures import AUX_LAYERS, build_eagle_models
from tests.unit.megatron_fixtures import ensure_single_process_groups
from tests.unit.megatron_fixtures import torch_twins as twin_ops


@pytest.fixture(scope="module")
def eagle_model():
    ensure_single_process_groups()
    model = build_eagle_models()[0]
    with twin_ops():
        queued = run(controller_for(model, 0), QUEUED)[1]
    return model, {"closed": plain_outputs(model)[1], "queued": queued}


def eagle_family_proposer(model, kind):
    """(proposer, S) of ``kind``: "eagle", "parallel" (parallel drafting) or "multi_layer" (2 heads)."""
    if kind == "multi_layer":
        return MultiLayerEagleProposer(build_multi_layer_eagle_heads(model, 2, AUX_LAYERS).eval()), 2
    head = build_eagle_head(model, AUX_LAYERS, parallel_drafting=kind == "parallel").eval()
    return (ParallelDraftingProposer(head), 3) if kind == "parallel" else (EagleProposer(head), 3)


@pytest.mark.parametrize("arrivals", ["closed", "queued"])
@pytest.mark.parametrize("kind", ["eagle", "parallel", "multi_layer"])
def test_eagle_family_random_lengths_equal_plain(eagle_model, torch_twins, kind, arrivals):
    """closed: churn and preemption; queued: most steps carry a prefill chunk beside decode
    requests and verify their own tier (several tiers occur; every one in the MTP and GDN tests)."""
    model, plain = eagle_model
    torch.manual_seed(77)
    proposer, S = eagle_family_proposer(model, kind)
    policy = CheckedRandomLengths(seed=4)
    controller = controller_for(model, S, proposer, policy, **SQUEEZE)
    controller.on_launch = tiers = MixedTiers(S)
    assert run(controller, ARRIVALS if arrivals == "closed" else QUEUED)[1] == plain[arrivals]
    assert any(accepted > 0 for _, accepted in policy.outcomes)  # drafts land: the masks matter
    assert arrivals == "closed" or len(set(tiers.widths)) >= S, tiers.widths  # mixed steps at several tiers


@pytest.mark.parametrize("kind,policy,steps_per_launch", [("eagle", "fixed", 2), ("parallel", "random", 1),
                                                            ("multi_layer", "random", 2)])
def test_eagle_family_with_requests_that_never_draft_equal_plain(eagle_model, torch_twins, kind, policy,
                                                                 steps_per_launch):
    """The first four requests opt out (``num_speculative_tokens=0``): their decode steps, every live
    request opted out, run no draft phase (no proposer call); the later ones draft beside them and
    after them, under churn, preemption and decode runs: the output is plain decoding's."""
    model, plain = eagle_model
    torch.manual_seed(78)
    proposer, S = eagle_family_proposer(model, kind)
    arrivals = tuple((step, prompt, dataclasses.replace(params, num_speculative_tokens=0) if index < 4 else params)
                     for index, (step, prompt, params) in enumerate(ARRIVALS))
    controller = controller_for(model, S, proposer, CheckedRandomLengths(seed=9) if policy == "random" else None,
                                decode_steps_per_launch=steps_per_launch, **SQUEEZE)
    ids, outputs = run(controller, arrivals)
    assert outputs == plain["closed"]
    assert any(controller.result(rid).preemptions for rid in ids)  # KV pressure evicted a request


def test_rejection_acceptance_with_random_lengths(torch_twins):
    """Rejection acceptance (MTP drafting): greedy requests keep plain decoding's tokens under
    random lengths (and preemption: the policy forgets a request only when it finished); with no
    drafts at all every request, sampled too, samples as plain decoding."""
    ensure_single_process_groups()
    model = build_models()[0]
    arrivals = ARRIVALS[:4]
    plain = run(controller_for(model, 0), arrivals)[1]
    greedy = [index for index, (_, _, params) in enumerate(arrivals) if params.greedy]
    sampled = [index for index, (_, _, params) in enumerate(arrivals) if not params.greedy]
    assert greedy and sampled
    policy = CheckedRandomLengths(seed=5)
    controller = controller_for(model, MTP_DEPTH, policy=policy, acceptance="rejection", **SQUEEZE)
    ids, outputs = run(controller, arrivals)
    assert [outputs[i] for i in greedy] == [plain[i] for i in greedy]
    # the policy forgets each request once, when it finished: a preempted one keeps its evidence
    assert any(controller.result(i).preemptions for i in ids)
    assert sorted(policy.forgotten) == sorted(ids)
    assert run(controller_for(model, MTP_DEPTH, policy=ZeroLengths(), acceptance="rejection"), arrivals)[1] == plain


def test_hybrid_mamba_model_random_lengths_equal_plain(torch_twins):
    """The Mamba state kept after the last accepted row follows the masked acceptance (chunked
    prompts: steps with prefill chunks beside decode requests, at their own tier)."""
    from tests.unit.hybrid_fixtures import build_hybrid_model

    ensure_single_process_groups()
    model = build_hybrid_model()
    arrivals = ARRIVALS[:4]
    plain = run(controller_for(model, 0), arrivals)[1]
    controller = controller_for(model, 2, policy=CheckedRandomLengths(seed=8), cuda_graph_batch_sizes=(2, 4))
    controller.on_launch = tiers = MixedTiers(2)
    assert run(controller, arrivals)[1] == plain
    assert tiers.widths, "no step with prefill chunks beside decode requests"


@pytest.mark.parametrize("arrivals", ["closed", "queued"])
def test_gated_deltanet_hybrid_random_lengths_equal_plain(torch_twins, arrivals):
    """The recurrent state kept after the last accepted row follows the masked acceptance; queued:
    steps with prefill chunks verify their own tier too (the deferred commit stores ``1 + V`` rows
    a buffer and the next step, mixed or not, applies the kept ones)."""
    from tests.unit.gdn_fixtures import build_gdn_model

    ensure_single_process_groups()
    model = build_gdn_model()
    queued = arrivals == "queued"
    arrivals, seed = (QUEUED[:8], 2) if queued else (ARRIVALS[:4], 9)
    plain = run(controller_for(model, 0), arrivals)[1]
    controller = controller_for(model, 2, policy=CheckedRandomLengths(seed=seed), cuda_graph_batch_sizes=(2, 4))
    controller.on_launch = tiers = MixedTiers(2)
    assert run(controller, arrivals)[1] == plain
    assert not queued or tiers.every_tier(), tiers.widths
