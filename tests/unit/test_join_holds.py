"""Held joins (``InferenceConfig.join_hold_steps``): a queue of requests of different lengths, so
finishes come one by one, with and without holds, under fixed and random draft lengths, decode runs,
overlap on and off, sampling, KV pressure with preemption, and user pauses. Outputs equal plain
decoding's; with holds fewer launches admit requests; a row stays empty while requests wait for at
most the hold (and the rest of the decode run its end falls in); without holds never."""

import numpy as np
import pytest

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from mtp_ctrl.controllers.draft_policy import RandomDraftLengths
from tests.unit.controller_fixtures import MTP_DEPTH, PROMPTS
from tests.unit.draft_length_fixtures import mtp_model  # noqa: F401 (fixture)

MAX_REQUESTS = 8  # a hold ends once a quarter of the table (2 rows) is free


class JoinsRecorded(TextGenerationController):
    """Counts the launches that admit requests (prompt chunks) and the longest streak of launched
    steps during which a row stayed free while requests waited (``on_launch``, ``debug_view``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.join_launches, self.streak, self.longest_streak = 0, 0, 0

    def on_launch(self, step, graph_key):
        view = self.debug_view()
        self.join_launches += step.num_prefill > 0
        held = view.num_waiting > 0 and view.num_live < MAX_REQUESTS
        self.streak = self.streak + step.num_steps if held else 0  # on_launch: once a launch (a run: its k steps)
        self.longest_streak = max(self.longest_streak, self.streak)


def queued_requests(seed: int, count: int = 20):
    """(prompt, params) all queued at once: lengths 2-13 tokens, a third sampled, a few with eos ids."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(count):
        prompt = PROMPTS[int(rng.integers(4))][: int(rng.integers(2, 13))]
        fields = dict(max_new_tokens=int(rng.integers(2, 14)))
        if rng.random() < 0.35:
            fields.update(temperature=0.9, top_k=12, seed=int(rng.integers(100)))
        if rng.random() < 0.15:
            fields.update(eos_token_ids=(int(rng.integers(90)),))
        requests.append((tuple(prompt), SamplingParams(**fields)))
    return requests


def drive(controller, requests, pause_at=None, pause_all=False):
    """Outputs in order. At step ``pause_at`` every decoding request but one (``pause_all``: every
    one) is paused, three steps later resumed: the rows they hold run nothing, so no hold may wait
    on them."""
    ids = [controller.add_request(prompt, params) for prompt, params in requests]
    paused, step = [], 0
    while controller.has_unfinished_requests():
        if step == pause_at:
            decoding = [i for i in ids if controller.request_status(i).name == "DECODING"]
            for request_id in decoding[0 if pause_all else 1:]:
                try:  # it may finish in the read-back the pause waits for
                    controller.pause_request(request_id)
                    paused.append(request_id)
                except ValueError:
                    pass
        elif pause_at is not None and step == pause_at + 3:
            for request_id in paused:
                if controller.request_status(request_id).name == "PAUSED":
                    controller.resume_request(request_id)
        controller.step()
        step += 1
    return [controller.result(i).output_tokens for i in ids]


def make(model, S, hold, policy=None, **fields):
    config = dict(num_speculative_tokens=S, max_requests=MAX_REQUESTS, block_size_tokens=4, max_model_len=28,
                  max_tokens_per_step=128, join_hold_steps=hold)  # room for every prompt: no backlog holds a join
    config.update(fields)
    return JoinsRecorded(model, InferenceConfig(**config), draft_policy=policy)


# (seed, policy, decode steps a launch, overlap); seed 0 random single steps also laid MTP windows
# past their buffer before steps with prefill chunks kept 1 + V rows a decode request
@pytest.mark.parametrize("seed,policy,steps_per_launch,overlap",
                         [(0, "random", 1, True), (1, "random", 4, False), (0, "fixed", 4, True), (1, "fixed", 1, False)])
def test_held_joins_equal_plain_and_come_together(mtp_model, torch_twins, seed, policy, steps_per_launch, overlap):
    requests = queued_requests(seed)
    fields = dict(decode_steps_per_launch=steps_per_launch, overlap_scheduling=overlap)
    plain = drive(make(mtp_model, 0, 0, **fields), requests)
    runs = {}
    for hold in (0, 3):
        controller = make(mtp_model, MTP_DEPTH, hold, RandomDraftLengths(seed=seed) if policy == "random" else None,
                          **fields)
        assert drive(controller, requests) == plain
        runs[hold] = controller
    assert runs[0].longest_streak == 0  # without holds a freed row is filled at the next launch
    assert runs[3].longest_streak <= 3 + steps_per_launch - 1


@pytest.mark.parametrize("S", [0, MTP_DEPTH])
def test_staggered_finishes_join_together_when_held(mtp_model, torch_twins, S):
    """Request i of 24 asks for 4 + i tokens: greedy plain decoding finishes them one a step, so
    without holds nearly every step admits one; holding for 4 steps admits them two or more at a
    time (fewer launches with prompt chunks), a row never empty for more than 4 steps."""
    requests = [(PROMPTS[i % 4][:3 + i % 5], SamplingParams(max_new_tokens=4 + i)) for i in range(24)]
    plain = drive(make(mtp_model, 0, 0), requests)
    runs = {hold: make(mtp_model, S, hold) for hold in (0, 4)}
    for controller in runs.values():
        assert drive(controller, requests) == plain
    assert runs[0].longest_streak == 0 < runs[4].longest_streak <= 4
    assert runs[4].join_launches < runs[0].join_launches


def test_held_joins_under_kv_pressure_and_pauses_equal_plain(mtp_model, torch_twins, seed=2):
    """Few KV blocks (decodes pause for KV, the newest is evicted) and user pauses (of every
    running request too): no hold hangs the loop, and outputs equal plain decoding's."""
    requests = queued_requests(seed, count=16)
    plain = drive(make(mtp_model, 0, 0), requests)
    for S, hold, pause_all in ((0, 4, False), (MTP_DEPTH, 4, True), (MTP_DEPTH, 50, False), (MTP_DEPTH, 50, True)):
        controller = make(mtp_model, S, hold, num_kv_blocks=24, decode_steps_per_launch=2)
        assert drive(controller, requests, pause_at=4, pause_all=pause_all) == plain
        assert controller.debug_view().num_live == 0
        assert controller.longest_streak > 0  # a hold was taken


def test_join_hold_steps_is_checked():
    with pytest.raises(ValueError, match="join_hold_steps"):
        InferenceConfig(join_hold_steps=-1)
    with pytest.raises(TypeError, match="join_hold_steps"):
        InferenceConfig(join_hold_steps=1.5)
