"""Acceptance on a prefix-cache hit == acceptance on a cold start, for the trained demo model
(its MTP depths draft from their paged caches, which a hit reuses): same drafts, same tokens."""

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from tests.unit.megatron_fixtures import ensure_single_process_groups

SYSTEM = b"You are a helpful assistant. Answer briefly and clearly, in plain English. "  # 75 bytes
QUESTIONS = (b"The capital of France is", b"The sun rises in the", b"Water boils at a temperature of")


def _run(model, prefix_caching: bool):
    config = InferenceConfig(num_speculative_tokens=2, max_requests=2, block_size_tokens=16, max_model_len=160,
                             max_tokens_per_step=128, prefix_caching=prefix_caching)
    controller = TextGenerationController(model, config)
    results = []
    for question in QUESTIONS:  # one after another: every later request finds SYSTEM's blocks cached
        [result] = controller.generate([list(SYSTEM + question)], SamplingParams(max_new_tokens=12))
        results.append((result.output_tokens, result.decode_steps, result.accepted_drafts))
    return results, controller.metrics.as_dict()["prefix_cache"]


def test_acceptance_on_a_hit_equals_a_cold_start(torch_twins):
    import mtp_ctrl

    ensure_single_process_groups()
    model = mtp_ctrl.load_demo_model(device="cpu")
    cold, _ = _run(model, prefix_caching=False)
    warm, stats = _run(model, prefix_caching=True)
    assert warm == cold
    assert stats["hit_tokens"] == 2 * 64  # 4 blocks of SYSTEM (75 bytes, S = 2 tokens past a block) per later request
    assert sum(accepted for _, _, accepted in cold) > 0  # trained MTP heads: drafts get accepted
