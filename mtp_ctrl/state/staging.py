"""Host tensors with device twins, refreshed by one host-to-device copy.

Every section (name -> shape, dtype) is carved out of one byte buffer on the host (pinned when
the device is CUDA) and one byte buffer of the same layout on the device. The host writes its
views; :meth:`StagingBuffers.copy_to_device` moves the whole layout with a single
``copy_(non_blocking=True)``, after which the device views hold the same values.

Example::

    buffers = StagingBuffers({"lengths": ((4,), torch.int64), "starts": ((5,), torch.int32)}, device)
    buffers.host["lengths"][:2] = torch.tensor([3, 7])
    buffers.copy_to_device()          # buffers.device["lengths"][:2] == [3, 7] once the copy ran

The host must not write its views while a copy is in flight: :meth:`wait_until_host_writable`
blocks until the last copy has finished reading them (it returns at once on the CPU, or when
the copy is long done, which is the normal case one step later).
"""

from typing import Dict, Tuple

import torch

SectionSpec = Tuple[Tuple[int, ...], torch.dtype]

_ALIGN_BYTES = 64  # every section starts on a 64-byte boundary


class StagingBuffers:
    def __init__(self, sections: Dict[str, SectionSpec], device: torch.device):
        offsets = {}
        total_bytes = 0
        for name, (shape, dtype) in sections.items():
            offsets[name] = total_bytes
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            total_bytes += -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
        device = torch.device(device)
        pin = device.type == "cuda"
        self._host_bytes = torch.zeros(total_bytes, dtype=torch.uint8, pin_memory=pin)  # [bytes] uint8
        self._device_bytes = torch.zeros(total_bytes, dtype=torch.uint8, device=device)  # [bytes] uint8
        self.host = {name: _carve(self._host_bytes, offsets[name], *spec) for name, spec in sections.items()}
        self.device = {name: _carve(self._device_bytes, offsets[name], *spec) for name, spec in sections.items()}
        self._copy_done = torch.cuda.Event() if pin else None

    @property
    def nbytes(self) -> int:
        return self._host_bytes.numel()

    def copy_to_device(self) -> None:
        """Enqueue the one host-to-device copy of every section on the current stream."""
        # as int64 words: 8x fewer elements, so a CPU "device" copies without waking a thread pool
        self._device_bytes.view(torch.int64).copy_(self._host_bytes.view(torch.int64), non_blocking=True)
        if self._copy_done is not None:
            self._copy_done.record()

    def wait_until_host_writable(self) -> None:
        """Block until the last :meth:`copy_to_device` has read the host buffer."""
        if self._copy_done is not None:
            self._copy_done.synchronize()


def _numel(shape: Tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _carve(buffer: torch.Tensor, offset: int, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    return buffer[offset : offset + nbytes].view(dtype).view(shape)
