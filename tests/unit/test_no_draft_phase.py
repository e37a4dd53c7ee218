"""Requests that never draft (``num_speculative_tokens=0``, or retired by the draft-length policy)
churning beside drafting ones: random arrivals, KV pressure and preemption, a pause, decode runs,
overlap on and off, prefix caching, MTP windows skipped and run; the fixed policy, random lengths and
policies that retire some or all requests. Outputs equal plain decoding's, decode steps of requests
that all never draft run no draft phase (``graph_warmup.NO_DRAFT_PHASE``), and after every launch each
sampling request's draft-length row on the device equals the length the host chose for it (a step
with no draft phase writes none: the row must hold 0 already)."""

import numpy as np
import pytest

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from mtp_ctrl.controllers.draft_policy import RandomDraftLengths
from mtp_ctrl.controllers.graph_warmup import NO_DRAFT_PHASE
from tests.unit.controller_fixtures import MTP_DEPTH, PROMPTS
from tests.unit.draft_length_fixtures import RetiringDepths, mtp_model  # noqa: F401 (fixture)

POLICIES = {
    "fixed": lambda: None,
    "random": lambda: RandomDraftLengths(seed=2, all_zero=0.5),
    "retiring": lambda: RetiringDepths(seed=3, retire_at=6, all_retired=False),
    "retiring_all": lambda: RetiringDepths(seed=3, retire_at=4, all_retired=True),
}


def random_arrivals(seed: int, count: int = 14):
    """(step, prompt, params): 60 % opt out (most at 0 drafts, some capped at 1), half sampled, some with eos ids."""
    rng = np.random.default_rng(seed)
    arrivals = []
    for _ in range(count):
        prompt = PROMPTS[int(rng.integers(4))][: int(rng.integers(2, 13))]
        fields = dict(max_new_tokens=int(rng.integers(1, 10)))
        if rng.random() < 0.5:
            fields.update(temperature=0.9, top_k=12, seed=int(rng.integers(100)))
        if rng.random() < 0.2:
            fields.update(eos_token_ids=(int(rng.integers(90)),))
        if rng.random() < 0.6:
            fields.update(num_speculative_tokens=0 if rng.random() < 0.8 else 1)
        arrivals.append((int(rng.integers(0, 10)), tuple(prompt), SamplingParams(**fields)))
    return tuple(arrivals)


class LengthRowsChecked(TextGenerationController):
    """Checks each launch's draft-length rows (``on_launch``); counts the launches with no draft phase."""

    no_draft_phase_launches = 0

    def on_launch(self, step, graph_key):
        if self.shape.num_speculative_tokens == 0:
            return
        rows = self.context.table.device_rows_with_scratch("draft_lengths")  # [R + 1] int64 by slot
        count = step.num_sampling_requests
        assert rows[step.host_slot_ids[:count]].tolist() == list(step.host_draft_lengths[:count])
        self.no_draft_phase_launches += graph_key is not None and graph_key[6] == NO_DRAFT_PHASE


def drive(controller, arrivals, pause_at=None):
    """Outputs in arrival order; the first decoding request is paused at step ``pause_at`` and resumed 3 later."""
    ids, step, paused = [None] * len(arrivals), 0, None
    while step == 0 or controller.has_unfinished_requests() or None in ids:
        for index, (at, prompt, params) in enumerate(arrivals):
            if at == step:
                ids[index] = controller.add_request(prompt, params)
        if step == pause_at:
            live = [i for i in ids if i is not None and controller.request_status(i).name == "DECODING"]
            if live:
                try:  # it may finish in the read-back the pause waits for
                    controller.pause_request(live[0])
                    paused = live[0]
                except ValueError:
                    pass
        elif pause_at is not None and step == pause_at + 3 and paused is not None \
                and controller.request_status(paused).name == "PAUSED":
            controller.resume_request(paused)
        controller.step()
        step += 1
    return [controller.result(i).output_tokens for i in ids]


def make(model, S, policy, **fields):
    config = dict(num_speculative_tokens=S, max_requests=4, block_size_tokens=4, max_model_len=28,
                  max_tokens_per_step=20, num_kv_blocks=12, cuda_graph_batch_sizes=(2, 4))
    config.update(fields)
    return LengthRowsChecked(model, InferenceConfig(**config), draft_policy=policy)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("steps_per_launch,overlap,prefix_caching,idle_windows",
                         [(1, True, True, "skip"), (4, False, False, "run")])
def test_requests_that_never_draft_churn_and_equal_plain(mtp_model, torch_twins, seed, policy, steps_per_launch,
                                                          overlap, prefix_caching, idle_windows):
    arrivals = random_arrivals(seed)
    fields = dict(decode_steps_per_launch=steps_per_launch, overlap_scheduling=overlap, prefix_caching=prefix_caching)
    plain = drive(make(mtp_model, 0, None, **fields), arrivals)
    controller = make(mtp_model, MTP_DEPTH, POLICIES[policy](), mtp_idle_windows=idle_windows, **fields)
    assert drive(controller, arrivals, pause_at=5) == plain
    assert controller.no_draft_phase_launches > 0
