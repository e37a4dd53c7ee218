"""Rejection-sampling acceptance through the controller (CPU, TP = 1, the tiny MTP model).

- The first three generated tokens under ``acceptance="rejection"`` follow the dense twin's
  filtered softmax (token 1) and its marginals (tokens 2 and 3, each verified against a draft),
  for S = 1, 2, 3, with the model's own (random, so often rejected) MTP drafts, with a
  deliberately bad proposer (uniform q) and with a proposer that records no q (one-hot).
- Greedy requests and exact-match mode are unchanged: token for token equal to plain decoding.

The controller's ops run through their torch twins here (the interpreter is switched off for these tests,
so CPU tensors take the reference path): the kernels equal the twins in their own tests
(test_rejection_sampling.py, test_sampling_kernel.py, ...), and the interpreter would make
these runs minutes long.
"""

import functools

import pytest
import torch

from mtp_ctrl.controllers import InferenceConfig, Proposer, SamplingParams
from mtp_ctrl.triton_ops import _dispatch
from tests.unit.controller_fixtures import PROMPTS, build_models, chi_square_p_value, filtered_softmax, make_controller
from tests.unit.megatron_fixtures import VOCAB_SIZE, dense_full_sequence, ensure_single_process_groups

NUM_SEEDS = 64
NEW_TOKENS = 3


@pytest.fixture(scope="module")
def models():
    ensure_single_process_groups()
    return build_models()


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    # the torch twins, without touching TRITON_INTERPRET (Triton caches what it first reads of it,
    # and other tests in this process run kernels through the interpreter)
    monkeypatch.setattr(_dispatch, "interpreter_enabled", lambda: False)


class UniformProposer(Proposer):
    """A deliberately bad drafter: every draft uniform over the vocabulary (the controller's sampler
    on flat logits: the argmax of the request's own noise at the draft's position), with those flat
    logits recorded per table row (q = 1 / V: ties are all kept by top-k and top-p)."""

    def bind(self, draft_context):
        super().bind(draft_context)
        self.num_speculative_tokens = draft_context.shape.num_speculative_tokens
        self.vocab_size = draft_context.shape.vocab_size
        self._flat = draft_context.add_device_rows("uniform_logits", (self.num_speculative_tokens, self.vocab_size),
                                                   torch.float32)  # [R + 1, S, V] float32, zeros

    def draft_logits(self):
        return self._flat

    def propose(self, batch):
        n, S = batch.num_requests, self.num_speculative_tokens
        positions = batch.bonus_positions[:n, None] + 1 + torch.arange(S)[None, :]  # [n, S] int64
        table_rows = batch.write_rows[:n, None].expand(n, S)  # [n, S] int64, each request's table row
        flat = torch.zeros(n * S, self.vocab_size)  # [n * S, V]: sampled rows draw the argmax of their noise
        return self.draft_context.sample_rows(flat, table_rows.reshape(-1), positions.reshape(-1)).reshape(n, S)


class RepeatLastTokenProposer(Proposer):
    """Drafts S copies of the last verified token and records no q (treated as one-hot)."""

    def bind(self, draft_context):
        super().bind(draft_context)
        self.num_speculative_tokens = draft_context.shape.num_speculative_tokens

    def propose(self, batch):
        next_tokens = batch.next_tokens[: batch.num_requests]  # [n] int64
        return next_tokens[:, None].expand(-1, self.num_speculative_tokens).clone()


def _laws(dense, prompt, temperature, top_k, top_p):
    """Exact laws of generated tokens 1..NEW_TOKENS, [NEW_TOKENS, V] float64, from the dense twin."""

    @functools.lru_cache(maxsize=None)
    def next_probs(tokens):
        logits, _ = dense_full_sequence(dense, torch.tensor(tokens, dtype=torch.int64))
        return filtered_softmax(logits[-1], temperature, top_k, top_p)  # [V] float64

    laws, prefixes = [], {(): 1.0}  # generated prefix -> its probability
    for _ in range(NEW_TOKENS):
        law = torch.zeros(VOCAB_SIZE, dtype=torch.float64)
        grown = {}
        for prefix, weight in prefixes.items():
            probs = next_probs(tuple(prompt) + prefix)
            law += weight * probs
            for token in probs.nonzero().flatten().tolist():
                grown[prefix + (token,)] = weight * float(probs[token])
        laws.append(law)
        prefixes = grown
    return laws


def _assert_follows(law, tokens):
    """Chi-square at significance 0.1% (fixed seeds: deterministic); cells expecting < 5 pooled."""
    counts = torch.bincount(tokens, minlength=VOCAB_SIZE).double()
    assert counts[law == 0].sum() == 0  # nothing outside the top-k / top-p support
    expected = law * len(tokens)
    large = expected >= 5
    small = (law > 0) & ~large
    pooled_counts = torch.cat([counts[large], counts[small].sum().reshape(1)])
    pooled_expected = torch.cat([expected[large], expected[small].sum().reshape(1)])
    keep = pooled_expected > 0
    assert keep.sum() >= 2
    assert chi_square_p_value(pooled_counts[keep], pooled_expected[keep]) > 1e-3


def _generate(model, S, temperature, top_k, top_p, proposer=None, acceptance="rejection", seeds=range(NUM_SEEDS)):
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
              for seed in seeds]
    controller = make_controller(model, S, proposer=proposer, acceptance=acceptance, max_requests=len(params),
                                 max_model_len=16, max_tokens_per_step=(S + 1) * len(params))
    return controller.generate([list(PROMPTS[1])] * len(params), params)


def _eagle_family_proposer(model, kind: str, S: int):
    """A random-weight EAGLE (serial), PTD or multi-layer EAGLE drafter for ``model``: their q rows
    come from the shared DraftLogits recorder."""
    from mtp_ctrl.controllers import EagleProposer, MultiLayerEagleProposer, ParallelDraftingProposer
    from mtp_ctrl.models import build_eagle_head, build_multi_layer_eagle_heads, default_aux_layer_ids

    torch.manual_seed(3)
    aux_layer_ids = default_aux_layer_ids(model.config.num_layers)
    if kind == "multi_layer_eagle":
        return MultiLayerEagleProposer(build_multi_layer_eagle_heads(model, S, aux_layer_ids).eval())
    head = build_eagle_head(model, aux_layer_ids, parallel_drafting=kind == "ptd").eval()
    return ParallelDraftingProposer(head) if kind == "ptd" else EagleProposer(head)


@pytest.mark.parametrize("S,temperature,top_k,top_p,proposer", [
    (1, 0.7, 4, 1.0, "mtp"), (2, 1.0, 3, 0.9, "mtp"), (3, 0.8, 4, 0.95, "mtp"),
    (2, 0.8, 4, 1.0, "uniform"), (2, 1.0, 4, 0.95, "none"), (2, 0.9, 4, 1.0, "eagle"), (2, 1.0, 3, 0.95, "ptd"),
    (2, 0.8, 4, 1.0, "multi_layer_eagle")])
def test_rejection_output_follows_the_dense_distribution(models, S, temperature, top_k, top_p, proposer):
    model, dense = models
    if proposer in ("eagle", "ptd", "multi_layer_eagle"):
        drafter = _eagle_family_proposer(model, proposer, S)
    else:
        drafter = {"mtp": None, "uniform": UniformProposer(), "none": RepeatLastTokenProposer()}[proposer]
    results = _generate(model, S, temperature, top_k, top_p, proposer=drafter)
    outputs = torch.tensor([result.output_tokens for result in results])  # [NUM_SEEDS, NEW_TOKENS]
    for law, tokens in zip(_laws(dense, PROMPTS[1], temperature, top_k, top_p), outputs.T):
        _assert_follows(law, tokens)
    accepted = sum(result.accepted_drafts for result in results)
    drafted = sum(result.decode_steps for result in results) * S
    if proposer != "uniform":  # uniform drafts over 96 tokens against a top-k of 4 are rarely kept
        assert 0 < accepted
    assert accepted < drafted  # the residual path ran


def test_rejection_is_reproducible_and_keeps_greedy_requests_exact(models):
    model, _ = models
    sampled = [SamplingParams(max_new_tokens=6, temperature=0.9, top_k=8, seed=seed) for seed in (3, 4)]
    greedy = [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=6, temperature=1e-6, seed=5)]
    prompts = [list(PROMPTS[0]), list(PROMPTS[2]), list(PROMPTS[1]), list(PROMPTS[3])]
    params = sampled + greedy
    plain = [r.output_tokens for r in make_controller(model, 0).generate(prompts, params)]
    first = [r.output_tokens for r in make_controller(model, 2, acceptance="rejection").generate(prompts, params)]
    again = [r.output_tokens for r in make_controller(model, 2, acceptance="rejection").generate(prompts, params)]
    assert first == again  # counter-based noise: a run is reproducible for its seeds
    assert first[2:] == plain[2:]  # greedy requests (also in a batch with sampled ones): exact match
    all_greedy = [r.output_tokens for r in make_controller(model, 3, acceptance="rejection").generate(prompts, greedy * 2)]
    assert all_greedy == [r.output_tokens for r in make_controller(model, 0).generate(prompts, greedy * 2)]


def test_exact_match_mode_is_token_for_token_plain_decoding(models):
    model, _ = models
    params = [SamplingParams(max_new_tokens=8, temperature=temperature, top_k=20, top_p=0.9, seed=seed)
              for seed, temperature in ((11, 0.8), (12, 1.0), (13, 0.0))]
    prompts = [list(PROMPTS[0]), list(PROMPTS[2]), list(PROMPTS[3])]
    plain = [r.output_tokens for r in make_controller(model, 0).generate(prompts, params)]
    for S in (1, 3):
        results = make_controller(model, S, acceptance="exact_match").generate(prompts, params)
        assert [r.output_tokens for r in results] == plain


def test_a_proposer_with_the_old_q_hook_is_refused(models):
    class OldHook(RepeatLastTokenProposer):
        def draft_probs(self):
            return None

    with pytest.raises(TypeError, match="draft_logits"):
        make_controller(models[0], 2, proposer=OldHook(), acceptance="rejection")


def test_acceptance_is_validated():
    assert InferenceConfig().acceptance == "exact_match"
    with pytest.raises(ValueError, match="acceptance"):
        InferenceConfig(acceptance="typical")
    with pytest.raises(TypeError, match="acceptance"):
        InferenceConfig(acceptance=1)


@pytest.mark.parametrize("proposer", ["mtp", "eagle", "ptd", "multi_layer_eagle"])
def test_draft_logits_are_allocated_only_for_rejection(models, proposer):
    model, _ = models

    def drafter():
        return None if proposer == "mtp" else _eagle_family_proposer(model, proposer, 2)

    assert make_controller(model, 2, proposer=drafter()).proposer.draft_logits() is None
    rows = make_controller(model, 2, proposer=drafter(), acceptance="rejection").proposer.draft_logits()
    assert rows.shape == (4 + 1, 2, VOCAB_SIZE) and rows.dtype == torch.float32  # [R + 1, S, V]
