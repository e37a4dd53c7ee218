"""Choose between a Triton kernel and its pure-torch reference.

CUDA tensors run the Triton kernel. CPU tensors run the torch reference, except when
``TRITON_INTERPRET=1`` is set: then the kernel runs through Triton's interpreter on the CPU
tensors (that is how CI tests kernels without a GPU). The variable must be set before Triton
is imported, because ``triton.jit`` reads it when a kernel is defined.
"""

import os

import torch


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    """True when an op over ``tensor`` should launch its Triton kernel."""
    return tensor.is_cuda or interpreter_enabled()
