"""What the example scripts share besides the package: the process-group set-up of a script run
plainly or under torchrun, and the demo model's checkpoint helpers, which live in
:mod:`mtp_ctrl.models.demo_model` (re-exported here for the scripts).

Distributed checkpoints (megatron's ``dist_checkpointing``, any TP size) are written by
``examples/train_mtp.py --save-format dist`` with ``{"model_args": ...}`` as their content metadata
and read by ``examples/generate.py --load DIR`` (``mtp_ctrl.models.load_distributed_checkpoint``).
"""

import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mtp_ctrl.models.demo_model import (  # noqa: F401  re-exported for the scripts
    CHECKPOINT_DTYPE,
    DEMO_MODEL_ARGS,
    build_demo_model,
    config_overrides,
    load_checkpoint,
    load_demo_model,
    load_full_state_dict,
    save_checkpoint,
    shipped_checkpoint_path,
)


def init_distributed(tensor_parallel_size: int, device: torch.device) -> None:
    """Process groups and megatron's parallel_state; a plain ``python`` run is one process of its own."""
    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != tensor_parallel_size:
        raise ValueError(f"--tp {tensor_parallel_size} needs {tensor_parallel_size} processes, "
                         f"got {dist.get_world_size()} (use torchrun)")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
