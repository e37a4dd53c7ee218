"""Helpers of the draft-length tests (``test_draft_lengths*.py``): policies that check or pin
the lengths, a controller factory and a driver that returns request ids and outputs."""

import numpy as np
import pytest

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from mtp_ctrl.controllers.draft_policy import DraftLengthPolicy, RandomDraftLengths
from tests.unit.controller_fixtures import PROMPTS, build_models
from tests.unit.megatron_fixtures import ensure_single_process_groups
from tests.unit.megatron_fixtures import torch_twins as twin_ops

# (step, prompt, params): four at once (KV pressure), two joining later; greedy and seeded sampling
ARRIVALS = (
    (0, PROMPTS[0], SamplingParams(max_new_tokens=9)),
    (0, PROMPTS[1], SamplingParams(max_new_tokens=9, temperature=0.8, top_k=10, seed=3)),
    (0, PROMPTS[2], SamplingParams(max_new_tokens=9, eos_token_ids=(7,))),
    (0, PROMPTS[3], SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=4)),
    (3, PROMPTS[1][:3], SamplingParams(max_new_tokens=6, stop_sequences=((1, 2),))),
    (5, PROMPTS[2][:4], SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)),
)
SQUEEZE = dict(num_kv_blocks=10, cuda_graph_batch_sizes=(2, 4))  # preemption and padded steps
# a queue: a request joins nearly every step (4 slots), so most steps carry a prefill chunk beside
# decode requests: the mixed steps' own verify tiers (the first chunks are longer than a step's budget)
QUEUED = tuple((step, PROMPTS[step % 4][: 3 + step % 5], SamplingParams(
    max_new_tokens=5 + step % 3, **({} if step % 2 else dict(temperature=0.8, top_k=12, seed=step))))
    for step in range(12))


class MixedTiers:
    """An ``on_launch`` hook: the verify width V of every step with prefill chunks and decode
    requests, checked against the drafts its decode requests hold (``widths``); every step with
    prefill chunks masks draft rows at V > 0 (the one variant ``warmup()`` captures of a mixed
    shape under a policy other than the fixed one), prefill only (V = S) included."""

    def __init__(self, S: int):
        self.S, self.held, self.widths = S, {}, []  # held: request id -> drafts it holds

    def __call__(self, step, graph_key):
        if step.num_prefill and graph_key is not None:
            assert graph_key[5] == (step.verify_width > 0), graph_key
        if step.num_prefill and step.num_decode:
            expected = max(self.held[request_id] for request_id in step.request_ids[: step.num_decode])
            assert step.verify_width == expected, (step.verify_width, expected)
            assert step.logits_indices.shape[0] == step.dimensions.request_count * (1 + expected)
            assert graph_key is None or graph_key[3] == expected
            self.widths.append(expected)
        sampling = step.request_ids[: step.num_sampling_requests]
        self.held.update(zip(sampling, step.host_draft_lengths[: len(sampling)]))

    def every_tier(self) -> bool:
        return set(self.widths) == set(range(self.S + 1))


class CheckedRandomLengths(RandomDraftLengths):
    """Random lengths; checks every outcome: a request accepts at most the drafts it verified; and
    that a request is forgotten once (when it is gone for good: a preempted one is not forgotten)."""

    def __init__(self, seed: int = 0, all_zero: float = 0.2):
        super().__init__(seed, all_zero)
        self.outcomes = []  # (verified, accepted) of every decode request-step
        self.forgotten = []  # request ids, in the order forget() saw them

    def observe(self, request_ids, draft_lengths, accepted_counts):
        assert (accepted_counts <= draft_lengths).all(), (draft_lengths, accepted_counts)
        self.outcomes += list(zip(draft_lengths.tolist(), accepted_counts.tolist()))

    def forget(self, request_id):
        assert request_id not in self.forgotten, f"request {request_id} forgotten twice"
        self.forgotten.append(request_id)


class BurstyLengths(DraftLengthPolicy):
    """Runs of 1-5 decisions where nobody drafts, then runs of random lengths (deterministic)."""

    def __init__(self, seed: int):
        super().__init__()
        self._rng = np.random.default_rng(seed)
        self._left, self._zero = 0, False

    def choose(self, query):
        if self._left == 0:
            self._zero, self._left = not self._zero, int(self._rng.integers(1, 6))
        self._left -= 1
        if self._zero:
            return np.zeros_like(query.caps)
        return np.floor(self._rng.random(query.caps.shape[0]) * (query.caps + 1)).astype(np.int64)


class RandomDepths(DraftLengthPolicy):
    """Each step a depth D in [0, S] (uniform): the first request drafts D (capped), the others
    random lengths up to D."""

    def __init__(self, seed: int):
        super().__init__()
        self._rng = np.random.default_rng(seed)

    def choose(self, query):
        depth = int(self._rng.integers(0, query.num_speculative_tokens + 1))
        lengths = self._rng.integers(0, depth + 1, query.caps.shape[0])
        lengths[:1] = depth
        return np.minimum(lengths, query.caps)


class RetiringDepths(RandomDepths):
    """``RandomDepths`` that retires requests from speculation at its ``retire_at``-th choice (all of
    them, or every other one; with ``all_retired`` every request admitted later too). Its lengths
    stay random for retired requests as well: the controller holds those at 0. Records, per retired
    request, the outcomes observed after the retiring choice that verified a draft."""

    def __init__(self, seed, retire_at, all_retired):
        super().__init__(seed)
        self.retire_at, self.all_retired, self.choices = retire_at, all_retired, 0
        self._retiring, self.retired, self.drafted_after = [], set(), {}

    def choose(self, query):
        self.choices += 1
        if self.choices == self.retire_at or (self.all_retired and self.choices > self.retire_at):
            # all: also those admitted before the retiring choice that sampled only after it
            ids = query.request_ids[query.caps > 0] if self.all_retired else query.request_ids[::2]
            self._retiring = ids.tolist()
            self.retired.update(self._retiring)
        return super().choose(query)

    def retiring(self):
        retiring, self._retiring = self._retiring, []
        return retiring

    def admits_drafts(self):
        return not (self.all_retired and self.choices >= self.retire_at)

    def observe(self, request_ids, draft_lengths, accepted_counts):
        for request_id, length in zip(request_ids.tolist(), draft_lengths.tolist()):
            if request_id in self.retired and length > 0:
                self.drafted_after[request_id] = self.drafted_after.get(request_id, 0) + 1


class ZeroLengths(DraftLengthPolicy):
    def choose(self, query):
        return np.zeros_like(query.caps)


def controller_for(model, S, proposer=None, policy=None, **fields):
    config = dict(num_speculative_tokens=S, max_requests=4, block_size_tokens=4, max_model_len=24,
                  max_tokens_per_step=20)
    config.update(fields)
    return TextGenerationController(model, InferenceConfig(**config), proposer=proposer, draft_policy=policy)


def run(controller, arrivals):
    """Drive the controller through ``arrivals`` ((step, prompt, params)); returns (request ids,
    outputs) in arrival order."""
    ids = [None] * len(arrivals)
    step = 0
    while step == 0 or controller.has_unfinished_requests() or None in ids:
        for index, (arrival_step, prompt, params) in enumerate(arrivals):
            if arrival_step == step:
                ids[index] = controller.add_request(prompt, params)
        controller.step()
        step += 1
    return ids, [controller.result(request_id).output_tokens for request_id in ids]


def plain_outputs(model):
    """Plain decoding's outputs of ARRIVALS (torch twins: a module fixture starts before the tests' own)."""
    with twin_ops():
        return run(controller_for(model, 0), ARRIVALS)


@pytest.fixture(scope="module")
def mtp_model():
    """The MTP demo-shaped model (a module fixture: import it into a test module to use it)."""
    ensure_single_process_groups()
    return build_models()[0]


@pytest.fixture(scope="module")
def plain(mtp_model):
    return plain_outputs(mtp_model)  # (request ids, outputs)
