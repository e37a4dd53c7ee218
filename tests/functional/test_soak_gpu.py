"""A long-running server: 100,000 short requests through the step API on CUDA, with the results
taken as they finish. Host memory (RSS) and device memory stay flat, no block or row leaks, and
the controller keeps no record of a request whose result was taken."""

import resource

import pytest
import torch

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from tests.unit.megatron_fixtures import VOCAB_SIZE, build_tiny_model, ensure_single_process_groups, tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOTAL_REQUESTS = 100_000


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def test_hundred_thousand_requests_keep_memory_flat():
    ensure_single_process_groups()
    model = build_tiny_model(tiny_config(mtp_num_layers=1)).cuda()
    config = InferenceConfig(num_speculative_tokens=1, max_requests=64, block_size_tokens=8, max_model_len=32,
                             max_tokens_per_step=512, cuda_graph_batch_sizes=(64,), finished_results_kept=0)
    controller = TextGenerationController(model, config)
    generator = torch.Generator().manual_seed(0)
    added = taken = 0
    samples = []
    while taken < TOTAL_REQUESTS:
        while added < TOTAL_REQUESTS and controller.debug_view().num_waiting < 64:
            prompt = torch.randint(0, VOCAB_SIZE, (int(torch.randint(1, 9, (1,), generator=generator)),),
                                   generator=generator).tolist()
            controller.add_request(prompt, SamplingParams(max_new_tokens=int(added % 3) + 1, seed=added))
            added += 1
        for request_id, _, finished in controller.step():
            if finished:
                taken += 1
        if taken and taken % 20_000 < 64:
            samples.append((_rss_mib(), torch.cuda.memory_allocated()))
    assert not controller.has_unfinished_requests()
    context = controller.context
    assert context.table.num_live == 0 and context.allocator.num_free_blocks == context.allocator.num_blocks
    assert controller.debug_view().num_records == 0  # finished_results_kept=0: nothing kept once streamed out
    first_rss, first_device = samples[1]
    last_rss, last_device = samples[-1]
    assert last_device - first_device < 2**20, samples  # bytes: no growth (it may shrink as caches settle)
    assert last_rss - first_rss < 64, samples  # MiB: flat, allowing allocator noise
    controller.close()
