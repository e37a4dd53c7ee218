"""Argument validation shared by the public ops.

Every check reads only metadata (type, dtype, shape, device) or Python scalars, never tensor
values, so it costs no host sync on the GPU path. Errors name the argument.
"""

from typing import Iterable, Optional, Sequence

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(
    name: str,
    tensor,
    *,
    dtypes: Optional[Iterable[torch.dtype]] = None,
    ndim: Optional[int] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``tensor`` fits.

    ``shape`` entries that are ``None`` are not checked; giving ``shape`` implies its ``ndim``.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if tensor.dtype not in dtypes:
            allowed = ", ".join(str(d) for d in dtypes)
            raise TypeError(f"{name} must have dtype in ({allowed}), got {tensor.dtype}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, tensor.shape)):
            if want is not None and want != got:
                raise ValueError(
                    f"{name} has size {got} on dim {axis}, expected {want} "
                    f"(shape {tuple(tensor.shape)})"
                )
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device} (all inputs must share a device)")
    return tensor


def check_int(name: str, value, *, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """Raise unless ``value`` is a Python int (not bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """Raise ``ValueError`` naming the first tensor not on the first tensor's device."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, tensor in items[1:]:
        if tensor.device != first.device:
            raise ValueError(f"{name} is on {tensor.device} but {first_name} is on {first.device}")
    return first.device
