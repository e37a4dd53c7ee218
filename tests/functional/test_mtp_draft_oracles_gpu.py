"""MTP drafts of both modes on CUDA: eager drafts == their dense oracles (tests/unit/mtp_draft_oracles.py),
and a run with padded CUDA-graph buckets (3 requests in a bucket of 4) gives the same outputs and the
same per-request acceptance as the eager run. (The recording proposer reads device values, so it
cannot run inside a captured step: the graph run is compared through its results.)"""

import pytest

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from tests.unit.controller_fixtures import PROMPTS, build_models, dense_greedy
from tests.unit.megatron_fixtures import ensure_single_process_groups
from tests.unit.mtp_draft_oracles import RecordingProposer, check_drafts_against_oracle

S = 2
MAX_NEW_TOKENS = 9
REQUEST_PROMPTS = list(PROMPTS[:3])  # 3 real requests: a bucket of 4 pads one


@pytest.fixture(scope="module")
def models():
    ensure_single_process_groups()
    model, dense = build_models()
    return model.cuda(), dense  # the dense oracle runs on the CPU (its helpers build CPU tensors)


def _config(mode, graphs):
    return InferenceConfig(num_speculative_tokens=S, max_requests=4, block_size_tokens=4, max_model_len=32,
                           max_tokens_per_step=64, mtp_attention=mode, cuda_graph_batch_sizes=(4,) if graphs else ())


@pytest.mark.parametrize("mode", ["paged", "single_position"])
def test_drafts_equal_the_oracle_and_padded_graph_buckets_match_eager(models, mode):
    model, dense = models
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
    sequences = {rid: list(p) + dense_greedy(dense, p, MAX_NEW_TOKENS + S + 1) for rid, p in enumerate(REQUEST_PROMPTS)}
    proposer = RecordingProposer(mode)
    eager = TextGenerationController(model, _config(mode, False), proposer=proposer).generate(REQUEST_PROMPTS, params)
    check_drafts_against_oracle(dense, proposer, sequences, mode)
    graphed = TextGenerationController(model, _config(mode, True)).generate(REQUEST_PROMPTS, params)
    for rid, (want, got) in enumerate(zip(eager, graphed)):
        assert list(want.output_tokens) == sequences[rid][len(REQUEST_PROMPTS[rid]):][:MAX_NEW_TOKENS]
        assert got.output_tokens == want.output_tokens
        assert (got.decode_steps, got.accepted_drafts) == (want.decode_steps, want.accepted_drafts)
