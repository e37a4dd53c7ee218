"""The warm-up's list of step-graph variants (``controllers/graph_warmup.py``), on the CPU: every graph
a serving step may replay is listed once, and the replays it times are the steady steps' and the
row-cost shapes'."""

import pytest

from mtp_ctrl.controllers import GoodputPolicy
from mtp_ctrl.controllers.draft_lengths import DraftLengths
from mtp_ctrl.controllers.graph_warmup import NO_DRAFT_PHASE, ROW_COST, STEP_COST, UPLOAD, warmup_variants
from mtp_ctrl.controllers.mtp_catch_up import WindowCatchUp
from tests.unit.context_fixtures import make_context

S = 2


def variants_of(policy, ragged=False, decode_steps_per_launch=1):
    ctx = make_context(num_speculative_tokens=S, max_tokens_per_step=16, decode_steps_per_launch=decode_steps_per_launch,
                       cuda_graph_batch_sizes=(2, 4))
    if ragged:
        ctx.enable_ragged_rows()
    draft_lengths = DraftLengths(policy, ctx.shape)
    proposer = WindowCatchUp(num_slots=ctx.shape.max_requests + 1, num_depths=S, capacity=8)  # warmup_plans
    proposer.sees_never_drafting_steps = False  # as the MTP proposer's (Proposer's attribute)
    return ctx, list(warmup_variants(ctx, ctx.scheduler.run_lengths, draft_lengths, proposer))


def graph_key(variant):
    step = variant.step
    return (step.dimensions, variant.all_greedy, step.num_steps, step.verify_width, step.num_drafts, variant.masked,
            variant.plan)


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("policy", [None, "goodput"])
def test_every_graph_once_and_the_timed_replays(policy, ragged):
    ctx, variants = variants_of(GoodputPolicy() if policy else None, ragged=ragged, decode_steps_per_launch=3)
    assert variants
    keys = [graph_key(variant) for variant in variants]
    assert len(keys) == len(set(keys)), "a graph listed twice"
    depths = range(S + 1) if policy else (S,)
    decode_grids = {shape.request_count for shape in ctx.graph_shapes(S) if not shape.has_prefill}
    steady = {(v.step.dimensions.request_count, v.step.num_drafts) for v in variants if v.use == STEP_COST}
    assert steady == {(grid, depth) for grid in decode_grids for depth in depths}
    for variant in variants:
        step = variant.step
        assert step.num_steps == 1 or step.verify_width >= step.num_drafts  # a run's later steps verify its lengths
        assert not (step.dimensions.has_prefill and variant.all_greedy)  # prefill chunks: the general path only
        if variant.use == STEP_COST:
            assert step.verify_width == step.num_drafts and step.num_steps == 1 and not variant.masked
            assert not step.dimensions.has_prefill
        elif variant.use == ROW_COST:
            assert step.verify_width == step.num_drafts and step.num_steps == 1
            assert step.dimensions.has_prefill or step.dimensions.is_ragged(step.verify_width)
        else:
            assert variant.use == UPLOAD
    # a policy that may retire (it names D < S): the decode-only steps of requests that never draft (capped
    # at 0 or retired), every run length, both sampling paths, no draft phase (V = D = 0, never masked),
    # uploaded only; the fixed policy's engines capture those on first use (their warm-up is as it was)
    no_draft_phase = [v for v in variants if v.plan == NO_DRAFT_PHASE]
    decode_shapes = [shape for shape in ctx.graph_shapes(0) if not shape.has_prefill and not shape.is_ragged(0)] \
        if policy else []
    assert {(v.step.dimensions, v.step.num_steps, v.all_greedy) for v in no_draft_phase} == \
        {(shape, k, greedy) for shape in decode_shapes for k in ctx.scheduler.run_lengths for greedy in (True, False)}
    assert all(v.step.verify_width == v.step.num_drafts == 0 and not v.masked and v.use == UPLOAD
               for v in no_draft_phase)
    variants = [v for v in variants if v.plan != NO_DRAFT_PHASE]
    if policy is None:  # fixed S: the steady plan only, S drafts verified and drafted, never masked
        assert {(v.step.verify_width, v.step.num_drafts, v.masked) for v in variants} == {(S, S, False)}
        assert all(v.plan == ((S, 0),) * v.step.num_steps for v in variants)
    else:  # every depth's D < S plans (skips, catch-ups), decode runs, both masking variants
        assert {v.step.num_drafts for v in variants} == set(depths)
        assert any(v.plan and v.plan[0] == (0, 0) for v in variants)  # D = 0: the windows skipped
        assert any(v.masked for v in variants) and any(v.step.num_steps == 3 for v in variants)
    prefill_buckets = {v.step.dimensions.token_count for v in variants if v.step.dimensions.has_prefill}
    assert {v.step.dimensions.token_count for v in variants if v.use == ROW_COST and v.step.dimensions.has_prefill} \
        == prefill_buckets  # every token bucket's replay priced
