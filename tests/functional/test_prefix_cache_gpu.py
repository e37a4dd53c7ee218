"""Prefix caching on CUDA: outputs with caching on == off with CUDA graphs (MTP S = 2, greedy and
seeded sampled, requests sharing partial prefixes arriving while others decode, a pool small
enough to evict), and a request that attaches cached blocks joins with a step in flight without
a host sync (its admission runs under ``torch.cuda.set_sync_debug_mode("error")``). The same for
hybrid models (Mamba-2, Gated DeltaNet), whose hits restore recurrent-state snapshots."""

import pytest
import torch

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from tests.functional.sync_checks import no_host_sync
from tests.unit.controller_fixtures import run_with_arrivals
from tests.unit.megatron_fixtures import build_tiny_model, ensure_single_process_groups, tiny_config

SYSTEM = [7, 21, 3, 88, 45, 12, 9, 60, 33, 2, 71, 14, 5, 90, 27, 41, 18, 66, 8, 30]  # 5 blocks of 4


@pytest.fixture(scope="module")
def model():
    ensure_single_process_groups()
    return build_tiny_model(tiny_config(mtp_num_layers=3)).cuda()


class AdmissionSyncChecked(TextGenerationController):
    """Admits under sync-debug "error" whenever a step is in flight (where admission reaches the
    state: ``context.add_request``, which attaches cached blocks); counts those admissions."""

    admitted_in_flight = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        add_request = self.context.add_request

        def checked_add_request(*args, **kwargs):
            if not self.debug_view().step_in_flight:
                return add_request(*args, **kwargs)
            self.admitted_in_flight += 1
            with no_host_sync():
                return add_request(*args, **kwargs)

        self.context.add_request = checked_add_request


def _arrivals():
    prompts = [SYSTEM + [1, 2, 3], SYSTEM[:9] + [4], SYSTEM + [5, 6], SYSTEM[:13] + [7, 8, 9], SYSTEM + [1, 2, 4],
               [11, 12, 13], SYSTEM[:17] + [3]]
    return [(step, prompt, SamplingParams(max_new_tokens=10, temperature=0.8 if index % 2 else 0.0, seed=index))
            for index, (step, prompt) in enumerate(zip([0, 2, 3, 4, 6, 6, 7], prompts))]


@pytest.mark.parametrize("num_kv_blocks", [None, 18])
def test_on_equals_off_in_graphs_without_host_sync(model, num_kv_blocks):
    fields = dict(num_speculative_tokens=2, max_requests=4, block_size_tokens=4, max_model_len=64,
                  max_tokens_per_step=128, cuda_graph_batch_sizes=(1, 2, 4), num_kv_blocks=num_kv_blocks)
    off = TextGenerationController(model, InferenceConfig(prefix_caching=False, **fields))
    off.warmup()
    expected = run_with_arrivals(off, _arrivals())
    on = AdmissionSyncChecked(model, InferenceConfig(prefix_caching=True, **fields))
    on.warmup()
    assert run_with_arrivals(on, _arrivals()) == expected
    stats = on.metrics.as_dict()["prefix_cache"]
    assert stats["hit_tokens"] > 0 and on.admitted_in_flight > 0
    if num_kv_blocks is not None:
        assert stats["evictions"] > 0
    pool = on.context.allocator
    assert on.context.table.num_live == 0 and pool.num_free_blocks == pool.num_blocks
    torch.cuda.synchronize()


@pytest.mark.parametrize("family", ["mamba", "gdn"])
def test_hybrid_on_equals_off_in_graphs_without_host_sync(family):
    from tests.unit.gdn_fixtures import build_gdn_model
    from tests.unit.hybrid_fixtures import build_hybrid_model

    ensure_single_process_groups()
    hybrid = (build_hybrid_model(mtp_num_layers=2) if family == "mamba" else build_gdn_model(mtp_num_layers=2)).cuda()
    fields = dict(num_speculative_tokens=2, max_requests=4, block_size_tokens=4, max_model_len=64,
                  max_tokens_per_step=128, cuda_graph_batch_sizes=(1, 2, 4), num_kv_blocks=24)
    off = TextGenerationController(hybrid, InferenceConfig(prefix_caching=False, **fields))
    off.warmup()
    expected = run_with_arrivals(off, _arrivals())
    on = AdmissionSyncChecked(hybrid, InferenceConfig(prefix_caching=True, prefix_state_snapshots=3, **fields))
    on.warmup()
    assert run_with_arrivals(on, _arrivals()) == expected
    stats = on.metrics.as_dict()["prefix_cache"]
    assert stats["hit_tokens"] > 0 and on.admitted_in_flight > 0
    snapshots = on.context.prefix_cache.snapshots
    assert snapshots.num_owned > 0 and snapshots.num_owned + snapshots.num_free == snapshots.num_snapshots
    torch.cuda.synchronize()
