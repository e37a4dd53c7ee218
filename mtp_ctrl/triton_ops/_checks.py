"""Argument validation shared by the public ops.

Every check reads only metadata (type, dtype, shape, device) or Python scalars, never tensor
values, so it costs no host sync on the GPU path. Errors name the argument. An op called every
step can remember the argument signatures that passed (:class:`ValidatedSignatures`), so a repeated
call only builds its signature.
"""

from typing import Callable, Dict, Iterable, Optional, Sequence

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


_KEYED_SCALARS = (type(None), bool, int)  # exact types: an int subclass gets no signature


class _NoSignature(Exception):
    """Raised for a value :func:`argument_signature` cannot key."""


def argument_signature(values: Sequence) -> tuple:
    """What a metadata-only check reads from ``values``, as a hashable key.

    A tensor contributes its dtype, shape and device (not its strides or values; a subclass also
    its type); ``None``, a bool or an int its type and value (so ``True`` and ``1`` differ); a
    tuple or list (e.g. a ``StepCommit``) its type and its items' signatures. Any other value
    raises ``_NoSignature``. Example::

        argument_signature((torch.zeros(3, dtype=torch.int64), 2, None))
        -> ((torch.int64, torch.Size([3]), device(type='cpu')), (int, 2), (NoneType, None))
    """
    # the common case (a plain tensor) is inlined: this runs on every call of a step op
    return tuple([(value.dtype, value.shape, value.device) if type(value) is torch.Tensor else _other_signature(value)
                  for value in values])


def _other_signature(value) -> tuple:
    kind = type(value)
    if isinstance(value, torch.Tensor):
        return (kind, value.dtype, value.shape, value.device)
    if kind in _KEYED_SCALARS:
        return (kind, value)
    if isinstance(value, (tuple, list)):
        return (kind, argument_signature(value))
    raise _NoSignature(kind.__name__)


class ValidatedSignatures:
    """The argument signatures that passed one check, so that repeated calls skip the check.

    For a check that reads only what :func:`argument_signature` keys (tensor type, dtype, shape,
    device; values of ints, bools and None), one signature has one verdict; a check that reads
    strides or tensor values must not be cached here. Use one instance per check. Holds at most
    ``capacity`` signatures, the oldest dropped first.
    """

    def __init__(self, capacity: int = 256):
        self._capacity = capacity
        self._passed: Dict[tuple, None] = {}  # an insertion-ordered set of signatures

    def validate(self, check: Callable[..., object], *args) -> None:
        """Run ``check(*args)`` unless arguments of the same signature passed it before.

        A failing check raises as it would uncached and its signature is not remembered, so bad
        arguments raise on every call.
        """
        try:
            signature = argument_signature(args)
        except _NoSignature:  # e.g. a float where an int belongs: always checked (and rejected)
            check(*args)
            return
        if signature in self._passed:
            return
        check(*args)
        if len(self._passed) >= self._capacity:
            self._passed.pop(next(iter(self._passed)), None)  # the oldest
        self._passed[signature] = None
