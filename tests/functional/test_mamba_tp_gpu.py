"""Hybrid (Mamba-2 + attention) model at TP = 2 on two GPUs (NCCL), loaded from the TP = 1
state_dict: TP = 1's logits and greedy tokens (the CUDA twin of tests/unit/test_mamba_tp.py)."""

import pytest
import torch
import torch.multiprocessing as mp

from tests.unit.megatron_fixtures import ensure_single_process_groups, free_port
from tests.unit.test_mamba_tp import save_tp1_expected, tp_worker


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_hybrid_tp2_matches_tp1_on_two_gpus(tmp_path):
    ensure_single_process_groups()
    path = save_tp1_expected(str(tmp_path / "tp1.pt"), torch.device("cuda", 0))
    mp.spawn(tp_worker, args=(2, free_port(), path, "cuda"), nprocs=2, join=True)
