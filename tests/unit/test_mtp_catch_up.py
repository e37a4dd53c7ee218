"""Skipped MTP windows caught up exactly (``InferenceConfig(mtp_idle_windows="skip")``,
``controllers/mtp_catch_up.py``): with a policy that gives runs of no-draft steps, the MTP proposer
drafts the same tokens with the windows skipped as with them run (greedy and seeded sampling),
under churn, preemption, padded steps, decode runs and a request paused while behind; the output
is plain decoding's; no-draft decode-only steps run no depth except a forced catch-up."""

import pytest

from mtp_ctrl.controllers import MTPProposer
from tests.unit.controller_fixtures import MTP_DEPTH
from tests.unit.draft_length_fixtures import (ARRIVALS, SQUEEZE, BurstyLengths, controller_for,  # noqa: F401
                                              mtp_model, plain)  # the module fixtures


class RecordingMTP(MTPProposer):
    """Records every draft row of a sampling request: (request id, e, drafts of the step's D depths);
    counts the decode-only steps that ran the windows while nobody drafted."""

    def __init__(self, **options):
        super().__init__("paged", **options)
        self.drafts, self.idle_windows = [], 0

    def propose(self, batch):
        drafts = super().propose(batch)
        step, depths = batch.step, batch.depths(MTP_DEPTH)
        if depths == 0:
            self.idle_windows += step.num_prefill == 0
            return drafts
        count = step.num_sampling_requests
        ends = batch.bonus_positions[:count].tolist()  # host-ok: CPU test
        self.drafts += list(zip(step.request_ids[:count], ends, drafts[:count, :depths].tolist()))
        return drafts


def pause_some(controller, ids):
    """Pause the first request that is live and not paused already (KV pressure pauses some); its id."""
    for request_id in ids:
        try:
            controller.pause_request(request_id)
            return request_id
        except ValueError:  # finished, or already paused
            continue
    return None


def drive(controller, pause_at=None):
    """ARRIVALS through ``controller``; with ``pause_at``, a live request is paused at that step for
    three steps (it keeps its slot, and how far its windows fell behind). Returns the outputs."""
    ids, step, paused = [None] * len(ARRIVALS), 0, None
    while step == 0 or controller.has_unfinished_requests() or None in ids:
        for index, (arrival_step, prompt, params) in enumerate(ARRIVALS):
            if arrival_step == step:
                ids[index] = controller.add_request(prompt, params)
        if step == pause_at:
            paused = pause_some(controller, ids)
        elif pause_at is not None and step == pause_at + 3 and paused is not None:
            controller.resume_request(paused)
        controller.step()
        step += 1
    return [controller.result(request_id).output_tokens for request_id in ids]


@pytest.mark.parametrize("catch_up_positions,steps_per_launch,pause_at,overlap,prefix_caching", [
    (8, 1, 4, True, False),  # the default M; a request paused while behind
    (2, 1, None, False, True),  # forced catch-ups; prefix caching (window floors, recomputed requests)
    (3, 4, None, True, False),  # decode runs: a launch plans each of its steps
])
def test_skipped_windows_draft_what_run_windows_draft(mtp_model, plain, torch_twins, catch_up_positions,
                                                      steps_per_launch, pause_at, overlap, prefix_caching):
    recorded = {}
    for skip in (False, True):
        proposer = RecordingMTP(skip_idle_windows=skip, catch_up_positions=catch_up_positions)
        controller = controller_for(mtp_model, MTP_DEPTH, proposer, BurstyLengths(seed=catch_up_positions),
                                    decode_steps_per_launch=steps_per_launch, overlap_scheduling=overlap,
                                    prefix_caching=prefix_caching, **SQUEEZE)
        launched = {}  # graph key -> a padded step launched with it
        controller.on_launch = lambda step, key: launched.setdefault(key, step) if key is not None else None
        assert drive(controller, pause_at) == plain[1]
        recorded[skip] = proposer
        plans = set()
        for key, step in launched.items():  # warm-up captures the plan of every padded step (a graph per plan)
            padding = controller.context.build_padding_step(step.dimensions, step.num_steps, step.num_drafts,
                                                            step.verify_width)
            assert key[6] in proposer.warmup_plans(padding), (key, step.num_prefill)
            plans.add(key[6])
        assert len(plans) >= (3 if skip else 1) and (None in plans) != skip, plans
        if pause_at is None:
            assert any(controller.result(rid).preemptions for rid in range(len(ARRIVALS)))  # KV pressure
    run, skipped = recorded[False], recorded[True]
    assert len(run.drafts) > 8 and run.drafts == skipped.drafts  # token for token, sampled requests too
    assert run.idle_windows > 0 and skipped.idle_windows < run.idle_windows  # forced catch-ups only


def test_catch_up_positions_is_checked(mtp_model):
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="catch_up_positions"):
            MTPProposer("paged", skip_idle_windows=True, catch_up_positions=bad)
    with pytest.raises((TypeError, ValueError), match="mtp_catch_up_positions"):
        controller_for(mtp_model, MTP_DEPTH, mtp_catch_up_positions=0)
