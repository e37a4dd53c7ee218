"""Which step graphs ``TextGenerationController.warmup()`` captures, and which of their replays it times.

The controller's CUDA graphs are keyed by a step's padded dimensions, sampling path, decode-run
length, verify tier V, draft depths D, draft-row masking and the proposer's plan
(``TextGenerationController._graph_key``). :func:`warmup_variants` lists every such variant a
serving loop may meet, each as a padding step (one that holds no request) with the flags its
launch needs, and says what its replay time is for:

- ``STEP_COST``: a steady decode-only single step (V = D: it verifies what the step before drafted,
  unmasked, the proposer's first plan): the draft-length policy's cost of depth D at the grid (the
  most of its shapes' replays at that grid);
- ``ROW_COST``: a ragged decode-only token count's masked graph, or a token bucket with prefill
  chunks (V = D, the proposer's first plan, the sampling path such steps take): the cost of a
  step by its rows (``RowCostModel``);
- ``UPLOAD``: any other variant: replayed once at warm-up so that its first replay (which uploads
  the graph) does not land mid-serving.

The controller captures each variant not yet held and replays or times it (``_replay_every_shape``):
this module only enumerates, so the enumeration runs without a GPU.
"""

import itertools
from typing import Hashable, Iterator, NamedTuple

from mtp_ctrl.state import StepMetadata

STEP_COST, ROW_COST, UPLOAD = "step cost", "row cost", "upload"
# the plan (in the graph key) of a decode-only step that verifies and drafts nothing and whose requests
# never draft (each capped at 0, or retired): no draft phase at all, a plain engine's step
NO_DRAFT_PHASE = "no draft phase"


class WarmupVariant(NamedTuple):
    step: StepMetadata  # a padding step of the shape (no request), num_steps / verify_width / num_drafts set
    all_greedy: bool  # the all-greedy sampling path (decode-only shapes warm both paths)
    masked: bool  # draft rows masked by length (DraftLengths.warmup_masks)
    plan: Hashable  # the proposer's plan (Proposer.warmup_plans; None without drafting), or NO_DRAFT_PHASE
    use: str  # STEP_COST, ROW_COST or UPLOAD (module docstring)


def warmup_variants(context, run_lengths, draft_lengths, proposer) -> Iterator[WarmupVariant]:
    """Every graph variant of every padded shape (``context.graph_shapes`` of each verify tier V and
    draft depth D that ``draft_lengths.warmup_tiers()`` lists), decode runs of ``run_lengths`` for
    the decode-only shapes, and each of the ``proposer``'s plans for it; for a policy that names a
    depth below S (it may retire requests), also the decode-only shapes' steps of requests that
    never draft (``NO_DRAFT_PHASE``, a proposer that need not see them); the fixed policy's engines
    capture those on first use (requests that opt out), so their warm-up stays as it was."""
    S = draft_lengths.S
    every_depth_drafts_S = min(draft_lengths.warmup_depths()) == S  # fixed S: only the steady plan occurs
    for verify_width, num_drafts in draft_lengths.warmup_tiers():
        for shape in context.graph_shapes(verify_width):
            # a ragged decode-only count below the tier's G (1 + V): single steps, some request holds < V
            ragged = shape.is_ragged(verify_width)
            for num_steps in (1,) if shape.has_prefill or ragged else run_lengths:
                if num_steps > 1 and verify_width < num_drafts:
                    continue  # a decode run's later steps verify its own lengths: its V >= its D
                step = context.build_padding_step(shape, num_steps, num_drafts, verify_width)
                masks = draft_lengths.warmup_masks(verify_width, not shape.has_prefill and not ragged)
                # the proposer's plans (skipped MTP windows: D' depths run, catch-up); the first one is
                # the steady step's (a D < S step's skips D..S-1), whose replay time is the step's cost.
                # The others follow only a step that drafted < S: warmed for a policy that chooses D < S
                plans = proposer.warmup_plans(step) if S > 0 else (None,)
                if every_depth_drafts_S:
                    plans = plans[:1]
                paths = (False,) if shape.has_prefill else (True, False)  # all greedy? (controller._launch_step)
                for plan_index, plan in enumerate(plans):
                    for all_greedy, masked in itertools.product(paths, masks):
                        first_plan_verifying_its_drafts = plan_index == 0 and verify_width == num_drafts
                        if first_plan_verifying_its_drafts and num_steps == 1 and not shape.has_prefill \
                                and not masked:
                            use = STEP_COST
                        elif first_plan_verifying_its_drafts and (ragged or shape.has_prefill) \
                                and all_greedy != shape.has_prefill:  # a ragged count's, a token bucket's
                            use = ROW_COST
                        else:
                            use = UPLOAD
                        yield WarmupVariant(step, all_greedy, masked, plan, use)
    if S > 0 and not every_depth_drafts_S and not proposer.sees_never_drafting_steps:
        for shape in context.graph_shapes(0):
            if shape.has_prefill or shape.is_ragged(0):
                continue
            for num_steps in run_lengths:
                step = context.build_padding_step(shape, num_steps, 0, 0)
                for all_greedy in (True, False):
                    yield WarmupVariant(step, all_greedy, False, NO_DRAFT_PHASE, UPLOAD)
