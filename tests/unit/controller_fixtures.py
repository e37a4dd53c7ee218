"""Helpers for the controller tests: a tiny MTP model, a dense greedy oracle, an oracle proposer.

The tiny model (``megatron_fixtures.tiny_config`` with 3 MTP layers) is randomly initialised, so
its own MTP heads almost never draft the greedy token: real-MTP runs exercise the reject path,
and :class:`OracleProposer` drives every acceptance count on purpose.
"""

import math
import random
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from mtp_ctrl.controllers import InferenceConfig, MTPProposer, Proposer, SamplingParams, TextGenerationController
from mtp_ctrl.controllers.proposers import DraftBatch
from mtp_ctrl.state.step_metadata import StepMetadata
from tests.unit.megatron_fixtures import VOCAB_SIZE, build_dense_twin, build_tiny_model, dense_full_sequence, tiny_config

MTP_DEPTH = 3

# Prompts of different lengths (3, 5, 8 and 12 tokens), fixed so every test sees the same ones.
PROMPTS: Tuple[Tuple[int, ...], ...] = (
    (17, 3, 58),
    (4, 4, 90, 2, 31),
    (10, 20, 30, 40, 50, 60, 70, 11),
    (5, 66, 23, 81, 9, 47, 12, 95, 38, 0, 71, 26),
)
# Greedy continuation computed per prompt by the dense oracle: enough for every test's
# max_new_tokens (at most 12) plus MTP_DEPTH drafts past the end.
CONTINUATION_LENGTH = 12 + MTP_DEPTH + 1


def build_models():
    """(paged model with MTP_DEPTH MTP layers, its dense twin holding the same weights)."""
    config = tiny_config(mtp_num_layers=MTP_DEPTH)
    model = build_tiny_model(config)
    return model, build_dense_twin(config, model)


def make_controller(model, num_speculative_tokens: int = 0, proposer: Optional[Proposer] = None,
                    **config_fields) -> TextGenerationController:
    """A controller with small defaults (4 requests, 4-token blocks, max_model_len 32)."""
    fields = dict(num_speculative_tokens=num_speculative_tokens, max_requests=4, block_size_tokens=4,
                  max_model_len=32, max_tokens_per_step=64)
    fields.update(config_fields)
    return TextGenerationController(model, InferenceConfig(**fields), proposer=proposer)


@torch.no_grad()
def dense_greedy(dense_model, prompt: Sequence[int], num_tokens: int) -> List[int]:
    """The plain reference: each token is the argmax of the last logits of a full causal forward
    of the dense twin over prompt + output so far (no cache, no batching)."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        logits, _ = dense_full_sequence(dense_model, torch.tensor(tokens, dtype=torch.int64))
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt):]


Arrival = Tuple[int, Sequence[int], SamplingParams]  # (step index at which it is added, prompt, params)


def run_with_arrivals(controller: TextGenerationController, arrivals: Sequence[Arrival]) -> List[Tuple[int, ...]]:
    """Drive ``controller.step()``, adding each request just before the step index it names;
    returns each request's output tokens, in ``arrivals`` order."""
    request_ids: List[Optional[int]] = [None] * len(arrivals)
    step_index = 0
    while step_index == 0 or controller.has_unfinished_requests() or None in request_ids:
        for index, (arrival_step, prompt, params) in enumerate(arrivals):
            if arrival_step == step_index:
                request_ids[index] = controller.add_request(prompt, params)
        controller.step()
        step_index += 1
    return [controller.result(request_id).output_tokens for request_id in request_ids]


def verified_ends(batch: DraftBatch, num_speculative_tokens: int) -> torch.Tensor:
    """``[n]`` int64 on the device: position ``e`` of the token each sampling request verified
    last (a prefill's prompt length; a decode's base position + 1 + accepted drafts)."""
    return batch.bonus_positions[: batch.step.num_sampling_requests]


class RecordingMTPProposer(MTPProposer):
    """The model's own MTP proposer, recording ``(request_id, e, drafts)`` of every proposal
    (a test-only read of device values, after the proposal is made)."""

    def __init__(self, mode: str):
        super().__init__(mode)
        self.proposals: List[Tuple[int, int, List[int]]] = []

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        drafts = super().propose(batch)
        ends = verified_ends(batch, self.draft_context.shape.num_speculative_tokens).tolist()
        for index, request_id in enumerate(batch.step.request_ids[: batch.num_requests]):
            self.proposals.append((request_id, ends[index], drafts[index].tolist()))
        return drafts


class OracleProposer(Proposer):
    """Drafts the true greedy continuation, with errors injected at known depths.

    ``sequences[request_id]`` is the request's prompt followed by its greedy output (long enough
    to cover S drafts past its last token); ``correct_count(request_id, proposal_index)`` says how
    many leading drafts of that request's ``proposal_index``-th proposal are right (the next one
    is made wrong, ``(true + 1) % vocab``). Drafts are gathered on the device at each request's
    verified end ``e`` (drafts sit at positions ``e + 1 .. e + S``), so no device value is read.

    Records, per request id: ``injected`` (the correct count of every proposal, the first made
    after the prefill) and ``observed`` (accepted drafts of every verify step, host values).
    """

    def __init__(self, sequences: Dict[int, Sequence[int]], correct_count: Callable[[int, int], int]):
        self.sequences = sequences
        self.correct_count = correct_count
        self.injected: Dict[int, List[int]] = {}
        self.observed: Dict[int, List[int]] = {}

    def bind(self, draft_context) -> None:
        super().bind(draft_context)
        self.num_speculative_tokens = draft_context.shape.num_speculative_tokens
        self.vocab_size = draft_context.shape.vocab_size

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        step, S = batch.step, self.num_speculative_tokens
        num_sampling, device = step.num_sampling_requests, batch.hidden.device  # the real requests
        request_ids = step.request_ids[:num_sampling]
        length = max((len(self.sequences[rid]) for rid in request_ids), default=0)
        known = torch.tensor([list(self.sequences[rid]) + [0] * (length - len(self.sequences[rid]))
                              for rid in request_ids], dtype=torch.int64).reshape(num_sampling, length)  # [n, L]
        counts = []
        for rid in request_ids:
            proposals = self.injected.setdefault(rid, [])
            proposals.append(self.correct_count(rid, len(proposals)))
            counts.append(proposals[-1])
        correct = torch.arange(S)[None, :] < torch.tensor(counts, dtype=torch.int64)[:, None]  # [n, S] bool
        ends = verified_ends(batch, S)  # [n] int64
        positions = ends[:, None] + 1 + torch.arange(S, device=device)[None, :]  # [n, S] int64
        # a step run past a request's stop (overlap scheduling) drafts past its sequence: clamp, unused
        true_drafts = known.to(device).gather(1, positions.clamp(max=length - 1))  # [n, S] int64
        drafts = torch.where(correct.to(device), true_drafts, (true_drafts + 1) % self.vocab_size)  # [n, S]
        padding = batch.num_requests - num_sampling  # requests padding a CUDA-graph batch
        return torch.cat([drafts, drafts.new_zeros(padding, S)])

    def on_step_committed(self, step: StepMetadata, accepted_counts: Sequence[int]) -> None:
        for index, request_id in enumerate(step.request_ids[: step.num_decode]):
            if accepted_counts[index] >= 0:  # -1: a step run past the request's stop (discarded)
                self.observed.setdefault(request_id, []).append(accepted_counts[index])


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Upper tail of the chi-square statistic (Wilson-Hilferty normal approximation)."""
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = len(counts) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def filtered_softmax(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution a request samples from, computed independently of the controller:
    softmax(logits / T), keep the top_k most likely, then the smallest prefix of the sorted
    probabilities whose mass reaches top_p (all from the top-k distribution), renormalised."""
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True)
    kept = torch.zeros_like(probs, dtype=torch.bool)
    kept[order[: top_k if top_k > 0 else VOCAB_SIZE]] = True
    top = torch.where(kept, probs, torch.zeros_like(probs))
    top = top / top.sum()
    mass = 0.0
    nucleus = torch.zeros_like(kept)
    for token in order.tolist():
        if not kept[token] or mass >= top_p:
            break
        nucleus[token] = True
        mass += float(top[token])
    result = torch.where(nucleus, top, torch.zeros_like(top))
    return result / result.sum()


def random_arrivals(seed: int, count: int, max_new_tokens: int = 10, eos_rate: float = 0.5, stop_rate: float = 0.3,
                    arrival_steps: Sequence[int] = range(7)) -> List[Arrival]:
    """``count`` random requests (prompt prefixes of PROMPTS, greedy or sampled, optional eos id
    and stop sequence, 1..max_new_tokens new tokens), each arriving at a step drawn from
    ``arrival_steps``; fixed per seed."""
    rng = random.Random(seed)
    arrivals = []
    for _ in range(count):
        prompt = list(PROMPTS[rng.randrange(len(PROMPTS))])[: rng.randint(2, 12)]
        sampled = rng.random() < 0.5
        eos = (rng.randrange(VOCAB_SIZE),) if rng.random() < eos_rate else ()
        stops = ((rng.randrange(VOCAB_SIZE), rng.randrange(VOCAB_SIZE)),) if rng.random() < stop_rate else ()
        params = SamplingParams(max_new_tokens=rng.randint(1, max_new_tokens), temperature=0.9 if sampled else 0.0,
                                top_k=rng.choice([0, 8]), seed=rng.randrange(1000), eos_token_ids=eos,
                                stop_sequences=stops)
        arrivals.append((rng.choice(arrival_steps), prompt, params))
    return arrivals


class CountingAcceptTokens(TextGenerationController):
    """A controller whose ``accept_tokens`` override only counts its calls (``calls``, per
    instance): the per-request hook path, with the default's result."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def accept_tokens(self, record, new_tokens):
        self.calls += 1
        return super().accept_tokens(record, new_tokens)
