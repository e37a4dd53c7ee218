"""Choose between a Triton kernel and its pure-torch reference.

CUDA tensors run the Triton kernel. CPU tensors run the torch reference, except when
``TRITON_INTERPRET=1`` is set: then the kernel runs through Triton's interpreter on the CPU
tensors (that is how CI tests kernels without a GPU). The variable must be set before Triton
is imported, because ``triton.jit`` reads it when a kernel is defined.
"""

import functools
import os

import torch


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    """True when an op over ``tensor`` should launch its Triton kernel."""
    return tensor.is_cuda or interpreter_enabled()


@functools.lru_cache(maxsize=None)
def _sm_count_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the property lookup costs host time)."""
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())
