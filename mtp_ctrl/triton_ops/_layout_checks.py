"""Layout and flag checks of the drafting ops (metadata only, like :mod:`._checks`)."""

import torch


def check_contiguous(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the first tensor that is not contiguous."""
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tuple(tensor.stride())}")


def check_unit_last_stride(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the first tensor whose last dimension is not contiguous."""
    for name, tensor in tensors.items():
        if tensor.dim() > 0 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(tensor.stride())}")


def check_bool(name: str, value) -> bool:
    """Raise ``TypeError`` unless ``value`` is a Python bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value
