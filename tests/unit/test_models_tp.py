"""Tensor parallelism on CPU: two gloo ranks of the paged model give TP = 1's logits for the same weights."""

import pytest
import torch

from mtp_ctrl.models import PagedGPTRunner, count_kv_layers
from tests.unit.megatron_fixtures import (
    NUM_BLOCKS,
    allocate_kv_caches,
    build_tiny_model,
    ensure_single_process_groups,
    free_port,
    random_sequences,
    run_paged_schedule,
    spawn_ranks,
    tensor_parallel_worker,
    tiny_config,
)


@pytest.fixture(scope="module")
def tp1_logits_path(tmp_path_factory):
    ensure_single_process_groups()
    model = build_tiny_model(tiny_config(mtp_num_layers=2))
    caches = allocate_kv_caches(count_kv_layers(model), NUM_BLOCKS, num_kv_heads_local=2, head_dim=16)
    decoder_logits, mtp_logits = run_paged_schedule(PagedGPTRunner(model), random_sequences(seed=0), caches)
    path = tmp_path_factory.mktemp("tp") / "tp1_logits.pt"
    torch.save({"decoder": decoder_logits, "mtp": mtp_logits}, path)
    return str(path)


def test_tp2_matches_tp1(tp1_logits_path):
    spawn_ranks(tensor_parallel_worker, (2, free_port(), tp1_logits_path, "cpu"))
