"""Shared set-up of the drafters' GPU tests: the shipped demo target in fp32 and the controller
configuration their graph-vs-eager-vs-plain checks run."""

import os
import sys

from mtp_ctrl.controllers import InferenceConfig
from tests.unit.megatron_fixtures import ensure_single_process_groups

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CHECKPOINTS = os.path.join(ROOT, "mtp_ctrl", "checkpoints")
sys.path.insert(0, os.path.join(ROOT, "examples"))


def load_demo_target():
    """The demo model on CUDA in fp32: padded (graph) and exact (eager) shapes then round alike,
    so tokens compare exactly."""
    from demo_model import load_demo_model

    ensure_single_process_groups()
    return load_demo_model(os.path.join(CHECKPOINTS, "mtp_demo.pt"), device="cuda").float()


def drafter_config(S, graphs):
    return InferenceConfig(num_speculative_tokens=S, max_requests=4, block_size_tokens=16, max_model_len=160,
                           max_tokens_per_step=64, cuda_graph_batch_sizes=(1, 2, 4) if graphs else ())
