"""The process groups of a script run plainly (a world of one) or under torchrun (one process per
tensor-parallel rank): ``torch.distributed`` and megatron-core's ``parallel_state``."""

import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state


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
