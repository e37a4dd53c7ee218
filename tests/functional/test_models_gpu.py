"""Paged megatron GPT on CUDA: stepping through the paged cache == one dense causal forward; TP = 2 == TP = 1."""

import pytest
import torch
import torch.multiprocessing as mp

from mtp_ctrl.models import PagedGPTRunner, count_kv_layers
from tests.unit.megatron_fixtures import (
    NUM_BLOCKS,
    allocate_kv_caches,
    build_dense_twin,
    build_tiny_model,
    dense_full_sequence,
    ensure_single_process_groups,
    free_port,
    random_sequences,
    run_paged_schedule,
    tensor_parallel_worker,
    tiny_config,
)

GPU_FP32_TOL = dict(atol=1e-3, rtol=1e-3)


@pytest.fixture(scope="module")
def paged_gpu_run():
    ensure_single_process_groups()
    config = tiny_config(mtp_num_layers=2)
    model = build_tiny_model(config).cuda()
    caches = allocate_kv_caches(count_kv_layers(model), NUM_BLOCKS, num_kv_heads_local=2, head_dim=16, device="cuda")
    sequences = [tokens.cuda() for tokens in random_sequences(seed=0)]
    decoder_logits, mtp_logits = run_paged_schedule(PagedGPTRunner(model), sequences, caches, device="cuda")
    return config, model, sequences, decoder_logits, mtp_logits


def test_stepping_matches_dense_forward_on_gpu(paged_gpu_run):
    config, model, sequences, decoder_logits, mtp_logits = paged_gpu_run
    dense = build_dense_twin(config, model).cuda()
    for b, tokens in enumerate(sequences):
        want_logits, want_mtp = dense_full_sequence(dense, tokens)
        torch.testing.assert_close(decoder_logits[b], want_logits, **GPU_FP32_TOL)
        for depth in range(config.mtp_num_layers):
            torch.testing.assert_close(mtp_logits[depth][b], want_mtp[depth], **GPU_FP32_TOL)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_matches_tp1_on_two_gpus(paged_gpu_run, tmp_path):
    _, _, _, decoder_logits, mtp_logits = paged_gpu_run
    path = tmp_path / "tp1_logits.pt"
    torch.save({"decoder": [x.cpu() for x in decoder_logits],
                "mtp": [[x.cpu() for x in depth] for depth in mtp_logits]}, path)
    mp.spawn(tensor_parallel_worker, args=(2, free_port(), str(path), "cuda"), nprocs=2, join=True)
