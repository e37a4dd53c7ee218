"""ParallelDraftingProposer (CPU, TP = 1): output == plain decoding for S = 1..3, greedy and
seeded sampling, under churn, pausing and preemption, overlap on and off; every greedy draft
equals the dense head's one-pass drafts over the verified sequence; the multi-anchor training
layout equals one causal forward per anchor; bad heads and checkpoints raise."""

import os
import sys

import pytest
import torch

from mtp_ctrl.controllers import EagleProposer, ParallelDraftingProposer, SamplingParams
from mtp_ctrl.models import build_eagle_head
from mtp_ctrl.models.eagle_head import default_mask_token_id, eagle_logits
from mtp_ctrl.models.ptd_layout import dense_ptd_forward, ptd_draft_rows, ptd_training_layout
from tests.unit.controller_fixtures import PROMPTS, make_controller, random_arrivals, run_with_arrivals
from tests.unit.eagle_fixtures import (AUX_LAYERS, assert_drafts_equal_dense, build_eagle_models, dense_aux,
                                      outputs_with_a_pause, plain_greedy_outputs, recording)
from tests.unit.megatron_fixtures import ensure_single_process_groups


RecordingPTDProposer = recording(ParallelDraftingProposer)


@pytest.fixture(scope="module")
def models():
    """(paged target, dense target, paged PTD head, dense PTD head), same weights."""
    ensure_single_process_groups()
    model, dense, _, _ = build_eagle_models()
    torch.manual_seed(21)
    head = build_eagle_head(model, AUX_LAYERS, parallel_drafting=True).eval()
    dense_head = build_eagle_head(dense, AUX_LAYERS, dense=True, parallel_drafting=True).eval()
    dense_head.load_state_dict(head.state_dict())
    return model, dense, head, dense_head


@pytest.fixture(scope="module")
def plain_greedy(models):
    return plain_greedy_outputs(models[0])


@torch.no_grad()
def dense_ptd_drafts(dense, dense_head, tokens, num_drafts):
    """Greedy one-pass drafts after ``tokens`` = ``t_0 .. t_e``: ``e`` verified rows and
    ``num_drafts - 1`` mask rows, one plain causal forward (no layout mask)."""
    tokens = torch.tensor(tokens, dtype=torch.int64)
    e, m = tokens.shape[0] - 1, num_drafts - 1
    features = dense_head.project_aux(dense_aux(dense, tokens[:-1]))  # [e, H]
    features = torch.cat([features, dense_head.mask_hidden[None].expand(m, -1)])[:, None]  # [e + m, 1, H]
    next_tokens = torch.cat([tokens[1:], torch.full((m,), dense_head.mask_token_id)])[None]  # [1, e + m]
    positions = torch.arange(e + m)
    embedded = dense.embedding(input_ids=next_tokens, position_ids=positions[None] + 1)
    out = dense_head(embedded, features, rotary_pos_emb=dense.rotary_pos_emb(e + m))  # [e + m, 1, H]
    return eagle_logits(dense, out[e - 1:, 0]).argmax(-1).tolist()


def test_greedy_equals_plain_interpreted_kernels(models, plain_greedy, model_twins):
    """The proposer's and the step's Triton kernels through the interpreter (the model's attention,
    rope and sampling, and the other tests' every op, on their torch twins)."""
    controller = make_controller(models[0], 3, proposer=ParallelDraftingProposer(models[2]))
    results = controller.generate([list(p) for p in PROMPTS[:2]], SamplingParams(max_new_tokens=6))
    assert [list(r.output_tokens) for r in results] == [tokens[:6] for tokens in plain_greedy[:2]]


@pytest.mark.parametrize("S", [1, 2, 3])
def test_greedy_and_sampled_equal_plain(models, torch_twins, S):
    """Greedy and seeded sampled requests in one batch."""
    model, _, head, _ = models
    prompts = [list(p) for p in PROMPTS]
    params = [SamplingParams(max_new_tokens=10, temperature=0.8 * (seed % 2), seed=seed) for seed in range(len(prompts))]
    plain = make_controller(model, 0).generate(prompts, params)
    spec = make_controller(model, S, proposer=ParallelDraftingProposer(head)).generate(prompts, params)
    assert [r.output_tokens for r in spec] == [r.output_tokens for r in plain]


def test_drafts_equal_the_dense_head_across_chunks_and_tail_blocks(models, plain_greedy, torch_twins):
    """S = 4 with 4-token blocks: mask rows cross into the head's tail blocks; the 12-token
    prompt is prefilled in two chunks (max_tokens_per_step 10)."""
    model, dense, head, dense_head = models
    assert_drafts_equal_dense(model, RecordingPTDProposer(head), 4, plain_greedy,
                              lambda tokens: dense_ptd_drafts(dense, dense_head, tokens, 4))


def test_churn_sampling_padded_steps_equal_plain(models, torch_twins):
    """S = 3, overlap on, every step padded to a graph shape (mixed steps included): the real
    counts and the mid-prompt chunk's next token come from the device, as in a replayed graph."""
    model, _, head, _ = models
    arrivals = random_arrivals(seed=1, count=7)
    plain = run_with_arrivals(make_controller(model, 0, max_model_len=24, overlap_scheduling=False), arrivals)
    controller = make_controller(model, 3, proposer=ParallelDraftingProposer(head), max_model_len=24,
                                 num_kv_blocks=14, max_tokens_per_step=20, cuda_graph_batch_sizes=(2, 4))
    assert run_with_arrivals(controller, arrivals) == plain
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks


def test_kv_exhaustion_preemption_equals_plain(models, torch_twins):
    """A 12-block pool cannot hold the four requests: the newest is preempted and recomputed
    (its head cache rewritten from position 0); outputs, greedy and sampled, are plain's."""
    model, _, head, _ = models
    prompts = [list(p) for p in PROMPTS]
    params = [SamplingParams(max_new_tokens=9, temperature=0.8 * (index % 2), seed=index) for index in range(4)]
    plain = make_controller(model, 0, max_model_len=22).generate(prompts, params)
    controller = make_controller(model, 2, proposer=ParallelDraftingProposer(head), max_model_len=22,
                                 num_kv_blocks=12)
    results = controller.generate(prompts, params)
    assert [r.output_tokens for r in results] == [r.output_tokens for r in plain]
    assert max(result.preemptions for result in results) >= 1
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks


@pytest.mark.parametrize("overlap", [True, False])
def test_pause_and_resume_equal_plain(models, plain_greedy, torch_twins, overlap):
    model, _, head, _ = models
    controller = make_controller(model, 3, proposer=ParallelDraftingProposer(head), overlap_scheduling=overlap)
    assert outputs_with_a_pause(controller) == plain_greedy


def test_rejection_acceptance_greedy_equals_plain_and_sampling_is_reproducible(models, plain_greedy, torch_twins):
    """acceptance="rejection" (PTD records the q of its drafts): greedy requests keep plain
    decoding's tokens; a seeded sampled request gives the same tokens run after run."""
    model, _, head, _ = models
    prompts = [list(p) for p in PROMPTS]
    params = [SamplingParams(max_new_tokens=10, temperature=0.8 * (index % 2), seed=index) for index in range(4)]
    runs = [[r.output_tokens for r in make_controller(model, 3, proposer=ParallelDraftingProposer(head),
                                                      acceptance="rejection").generate(prompts, params)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert [list(runs[0][index]) for index in (0, 2)] == [plain_greedy[0], plain_greedy[2]]


def test_hybrid_mamba_target_equals_plain(torch_twins):
    """A Mamba + attention target: the mask rows touch only the head's KV cache, never the
    target's Mamba state, and the target commits its state as with any proposer."""
    from tests.unit.hybrid_fixtures import build_hybrid_model

    ensure_single_process_groups()
    model = build_hybrid_model(mtp_num_layers=0)
    torch.manual_seed(3)
    head = build_eagle_head(model, (1, 3), parallel_drafting=True)
    prompts = [list(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=11)
    plain = make_controller(model, 0).generate(prompts, params)
    spec = make_controller(model, 3, proposer=ParallelDraftingProposer(head), num_kv_blocks=14).generate(prompts, params)
    assert [r.output_tokens for r in spec] == [r.output_tokens for r in plain]


def test_training_layout_known_answer():
    positions, blocked = ptd_training_layout(3, 2)
    assert positions.tolist() == [0, 1, 2, 1, 2, 2, 3, 3, 4]
    assert (~blocked[6]).nonzero().flatten().tolist() == [0, 1, 5, 6]  # anchor 1, j = 2
    assert (~blocked[3]).nonzero().flatten().tolist() == [0, 3]  # anchor 0, j = 1
    assert (~blocked[2]).nonzero().flatten().tolist() == [0, 1, 2]  # verified rows: causal
    assert ptd_draft_rows(3, 2).tolist() == [[0, 3, 4], [1, 5, 6], [2, 7, 8]]
    positions, blocked = ptd_training_layout(4, 0)  # S = 1: plain causal EAGLE step 1
    assert positions.tolist() == [0, 1, 2, 3] and torch.equal(blocked, torch.ones(4, 4, dtype=torch.bool).triu(1))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="num_mask_rows"):
            ptd_training_layout(3, bad)


@torch.no_grad()
def test_training_layout_equals_one_causal_forward_per_anchor(models):
    """Every anchor's drafts in the multi-anchor training forward == the inference layout for
    that anchor alone (verified rows up to it, then the mask rows, plain causal)."""
    _, dense, _, dense_head = models
    tokens = torch.tensor([3, 1, 4, 1, 0, 2, 4, 2, 3], dtype=torch.int64)
    n, m = tokens.shape[0] - 1, 2
    features = dense_head.project_aux(dense_aux(dense, tokens[:-1]))  # [n, H]
    out = dense_ptd_forward(dense, dense_head, features[:, None], tokens[None, 1:], m)  # [n * 3, 1, H]
    drafts = eagle_logits(dense, out[ptd_draft_rows(n, m).flatten()]).argmax(-1).view(n, m + 1)
    for anchor in range(n):
        assert drafts[anchor].tolist() == dense_ptd_drafts(dense, dense_head, tokens[: anchor + 2].tolist(), m + 1)
    with pytest.raises(ValueError, match="parallel_drafting"):
        dense_ptd_forward(dense, build_eagle_head(dense, AUX_LAYERS, dense=True), features[:, None], tokens[None, 1:], m)
    with pytest.raises(ValueError, match="features"):
        dense_ptd_forward(dense, dense_head, features[:-1, None], tokens[None, 1:], m)


def test_bad_heads_raise_and_the_target_stays_usable(models, plain_greedy, torch_twins):
    model, _, head, _ = models
    assert head.mask_token_id == default_mask_token_id(model.vocab_size) == model.vocab_size - 1
    assert head.parallel_drafting and head.mask_hidden.shape == (model.config.hidden_size,)
    with pytest.raises(TypeError, match="head"):
        ParallelDraftingProposer(model)
    serial = build_eagle_head(model, AUX_LAYERS)
    assert serial.mask_hidden is None and "mask_hidden" not in serial.state_dict()
    with pytest.raises(ValueError, match="mask_token_id / mask_hidden"):
        ParallelDraftingProposer(serial)
    for bad in (-1, model.vocab_size, 2.0, True):
        with pytest.raises(ValueError, match="mask_token_id"):
            build_eagle_head(model, AUX_LAYERS, parallel_drafting=True, mask_token_id=bad)
    with pytest.raises(ValueError, match="mask_token_id"):
        build_eagle_head(model, AUX_LAYERS, mask_token_id=3)  # without parallel_drafting
    with pytest.raises(TypeError, match="parallel_drafting"):
        build_eagle_head(model, AUX_LAYERS, parallel_drafting=1)
    torch.manual_seed(0)
    odd = build_eagle_head(model, AUX_LAYERS, parallel_drafting=True, mask_token_id=7)
    odd.mask_token_id = model.vocab_size + 3  # changed after the build: the proposer catches it at bind
    with pytest.raises(ValueError, match="mask_token_id"):
        make_controller(model, 2, proposer=ParallelDraftingProposer(odd))
    # a PTD head also drafts serially (EagleProposer ignores the mask parameters)
    controller = make_controller(model, 2, proposer=EagleProposer(head))
    results = controller.generate([list(p) for p in PROMPTS[:2]], SamplingParams(max_new_tokens=10))
    assert [list(r.output_tokens) for r in results] == plain_greedy[:2]


def test_generate_loader_rejects_checkpoints_without_mask(models, tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    from mtp_ctrl.cli.draft_heads import load_eagle_proposer, load_ptd_proposer

    model, _, head, _ = models
    good = tmp_path / "ptd.pt"
    torch.save({"aux_layer_ids": list(AUX_LAYERS), "mask_token_id": head.mask_token_id,
                "state_dict": head.state_dict()}, good)
    proposer = load_ptd_proposer(model, str(good))
    assert isinstance(proposer, ParallelDraftingProposer) and proposer.head.mask_token_id == head.mask_token_id
    torch.testing.assert_close(proposer.head.mask_hidden, head.mask_hidden)
    assert type(load_eagle_proposer(model, str(good))) is EagleProposer  # serial use of a PTD head
    serial = build_eagle_head(model, AUX_LAYERS)
    for name, saved in (("serial", {"aux_layer_ids": list(AUX_LAYERS), "state_dict": serial.state_dict()}),
                        ("no_id", {"aux_layer_ids": list(AUX_LAYERS), "state_dict": head.state_dict()}),
                        ("no_hidden", {"aux_layer_ids": list(AUX_LAYERS), "mask_token_id": 5,
                                       "state_dict": serial.state_dict()})):
        torch.save(saved, tmp_path / f"{name}.pt")
        with pytest.raises(ValueError, match="mask_token_id|mask_hidden"):
            load_ptd_proposer(model, str(tmp_path / f"{name}.pt"))
