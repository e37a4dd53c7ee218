"""TextGenerationController on a Gated DeltaNet hybrid (megatron's GDN settings: GDN, attention,
GDN, attention; gated attention with q/k norm and partial rotary; 3 attention MTP layers), CPU,
TP = 1: speculative (S = 1..3, the model's MTP proposer) == plain under arrivals (churn),
preemption and pausing, greedy and seeded sampled; every accepted count 0..S (all-rejected steps
included) commits the right state; steps where requests carry 0 drafts (the step that finishes a
prompt runs beside verify rows) leave plain decoding's state."""

import pytest

from mtp_ctrl.controllers import SamplingParams
from mtp_ctrl.models import PagedGatedDeltaNet
from tests.unit.controller_fixtures import PROMPTS, OracleProposer, make_controller, run_with_arrivals
from tests.unit.gdn_fixtures import build_gdn_model
from tests.unit.megatron_fixtures import ensure_single_process_groups
from tests.unit.megatron_fixtures import torch_twins as twin_ops

MTP_DEPTH = 3
MAX_NEW_TOKENS = (6, 4, 5, 5)
ARRIVALS = tuple(zip((0, 0, 1, 2), PROMPTS, MAX_NEW_TOKENS))  # 16 rows per step: long prompts are chunked
CONFIG = dict(max_tokens_per_step=16)


@pytest.fixture(scope="module")
def model():
    ensure_single_process_groups()
    return build_gdn_model(mtp_num_layers=MTP_DEPTH)


def _params(sampled: bool):
    return [SamplingParams(max_new_tokens=n) if not sampled or index % 2 == 0 else
            SamplingParams(max_new_tokens=n, temperature=0.8, top_k=20, seed=100 + index)
            for index, (_, _, n) in enumerate(ARRIVALS)]


def _arrivals(sampled: bool = False):
    return [(step, prompt, params) for (step, prompt, _), params in zip(ARRIVALS, _params(sampled))]


@pytest.fixture(scope="module")
def plain_outputs(model):
    with twin_ops():  # a module fixture starts before the function-scoped torch_twins
        return {sampled: run_with_arrivals(make_controller(model, 0, **CONFIG), _arrivals(sampled))
                for sampled in (False, True)}


def _assert_released(controller):
    context = controller.context
    assert context.table.num_live == 0
    assert context.allocator.num_free_blocks == context.allocator.num_blocks
    assert context.mamba.num_free_slots == context.mamba.num_slots


def test_the_model_is_megatrons_gdn_hybrid(model):
    gdn = [isinstance(layer.self_attention, PagedGatedDeltaNet) for layer in model.decoder.layers]
    assert gdn == [True, False, True, False]  # linear_attention_freq=2
    attention = model.decoder.layers[1].self_attention
    assert attention.config.attention_output_gate and attention.q_layernorm is not None


@pytest.mark.parametrize("num_speculative_tokens, sampled", [(1, False), (2, True), (3, False)],
                         ids=["greedy-1", "sampled-2", "greedy-3"])
def test_speculative_equals_plain_with_arrivals(model, plain_outputs, num_speculative_tokens, sampled, torch_twins):
    """The sampled run has greedy requests beside the sampled ones (every other one). (The kernels
    themselves run interpreted in test_gdn_kernels.py and test_gdn_mixer.py.)"""
    controller = make_controller(model, num_speculative_tokens, **CONFIG)
    assert run_with_arrivals(controller, _arrivals(sampled)) == plain_outputs[sampled]
    _assert_released(controller)


def test_every_accepted_count_commits_the_right_state(model, torch_twins):
    """Oracle drafts with a random number of correct leading drafts (0..S, 0 = all rejected) in
    padded batches (padding requests in the scratch slot): the output stays the plain one and
    every count is observed."""
    max_new_tokens, S = 8, MTP_DEPTH
    plain = make_controller(model, 0, **CONFIG).generate(list(PROMPTS), SamplingParams(max_new_tokens=max_new_tokens + S + 1))
    sequences = {rid: list(PROMPTS[rid]) + list(result.output_tokens) for rid, result in enumerate(plain)}
    proposer = OracleProposer(sequences, lambda rid, index: (rid + index) % (S + 1))  # 0 (all rejected) .. S
    controller = make_controller(model, S, proposer=proposer, cuda_graph_batch_sizes=(2, 4), **CONFIG)
    results = controller.generate(list(PROMPTS), SamplingParams(max_new_tokens=max_new_tokens))
    for result in results:
        want = sequences[result.request_id][len(PROMPTS[result.request_id]):][:max_new_tokens]
        assert list(result.output_tokens) == want
        observed = proposer.observed[result.request_id]
        assert observed == proposer.injected[result.request_id][: len(observed)]
    assert {count for counts in proposer.observed.values() for count in counts} == set(range(S + 1))
    _assert_released(controller)


def test_preempted_requests_recompute_their_state(model, torch_twins):
    """A KV pool too small for all four requests forces the newest out; it returns with a fresh
    state slot, its GDN state recomputed from prompt + output, and ends with the unconstrained output."""
    params = [SamplingParams(max_new_tokens=9)] * len(PROMPTS)
    unconstrained = make_controller(model, 2, max_model_len=22).generate(list(PROMPTS), params)
    controller = make_controller(model, 2, max_model_len=22, num_kv_blocks=12)
    results = controller.generate(list(PROMPTS), params)
    assert [r.output_tokens for r in results] == [r.output_tokens for r in unconstrained]
    assert max(result.preemptions for result in results) >= 1
    _assert_released(controller)


def test_padded_mixed_steps_with_pausing_equal_plain(model, plain_outputs, torch_twins):
    """Batch buckets pad every step to a CUDA-graph shape, mixed steps included (their GDN prefill
    segments run beside the padded grid's decode rows); the third request is paused mid-prompt at
    step 2 and resumed at step 5; greedy and seeded sampled requests keep the plain outputs."""
    params = _params(True)
    controller = make_controller(model, 2, cuda_graph_batch_sizes=(2, 4), **CONFIG)
    launched = []
    controller.on_launch = lambda step, graph_key: launched.append(step)
    request_ids, step_index = [None] * len(ARRIVALS), 0
    while step_index == 0 or controller.has_unfinished_requests() or None in request_ids:
        for index, (arrival_step, prompt, _) in enumerate(ARRIVALS):
            if arrival_step == step_index:
                request_ids[index] = controller.add_request(prompt, params[index])
        if step_index == 2:
            controller.pause_request(request_ids[2])
        if step_index == 5:
            controller.resume_request(request_ids[2])
        controller.step()
        step_index += 1
    assert [controller.result(rid).output_tokens for rid in request_ids] == plain_outputs[True]
    assert all(step.graph_padded for step in launched)
    assert any(step.num_decode and step.num_prefill for step in launched)  # 0-draft prompt ends beside verify rows
    _assert_released(controller)


def test_builder_refuses_what_it_cannot_build():
    from mtp_ctrl.models import build_gpt_model
    from tests.unit.gdn_fixtures import gdn_config
    from tests.unit.megatron_fixtures import MAX_SEQUENCE_LENGTH, VOCAB_SIZE

    ensure_single_process_groups()
    with pytest.raises(ValueError, match="disagrees with config.linear_attention_freq"):
        build_gpt_model(gdn_config(), VOCAB_SIZE, MAX_SEQUENCE_LENGTH, layer_pattern="GGG*")
    plain = gdn_config(experimental_attention_variant=None, linear_attention_freq=None, mamba_state_dim=8,
                       mamba_head_dim=16, mamba_num_groups=2)
    with pytest.raises(ValueError, match="mixes Mamba and Gated DeltaNet"):
        build_gpt_model(plain, VOCAB_SIZE, MAX_SEQUENCE_LENGTH, layer_pattern="MG**")


def test_distributed_checkpoint_round_trip(model, tmp_path):
    """save_distributed_checkpoint -> load_distributed_checkpoint into a model with other weights
    gives back every parameter (the GDN layers through megatron GatedDeltaNet's layout)."""
    import torch

    from mtp_ctrl.models import load_distributed_checkpoint, save_distributed_checkpoint

    saved = model.sharded_state_dict()["decoder.layers.0.input_layernorm.weight"].key
    assert saved.endswith("self_attention.in_proj.layer_norm_weight"), saved  # megatron's GDN spelling
    save_distributed_checkpoint(model, tmp_path / "ckpt")
    other = build_gdn_model(mtp_num_layers=MTP_DEPTH, seed=7)
    load_distributed_checkpoint(other, tmp_path / "ckpt")
    theirs = dict(other.named_parameters())
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, theirs[name]), name
