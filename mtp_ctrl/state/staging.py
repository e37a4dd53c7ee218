"""Host tensors with device twins, refreshed by one host-to-device copy per step.

Every section (name -> shape, dtype) is carved out of one byte buffer on the device and out of
``num_host_buffers`` byte buffers of the same layout on the host (pinned when the device is
CUDA). The host writes the views of its current buffer; :meth:`StagingBuffers.copy_to_device`
moves the whole layout with a single ``copy_(non_blocking=True)`` and switches to the next host
buffer. With two host buffers the host fills step N + 1's buffer while step N's copy may still
wait in the stream behind the GPU work before it (the overlapped loop); it only waits, in
:meth:`wait_until_host_writable`, for the copy that last read the buffer it is about to write,
which in the normal case finished long ago.

Example::

    buffers = StagingBuffers({"lengths": ((4,), torch.int64), "starts": ((5,), torch.int32)}, device)
    buffers.wait_until_host_writable()
    buffers.host["lengths"][:2] = torch.tensor([3, 7])
    buffers.copy_to_device()          # buffers.device["lengths"][:2] == [3, 7] once the copy ran
"""

from typing import Dict, List, Tuple

import torch

SectionSpec = Tuple[Tuple[int, ...], torch.dtype]

_ALIGN_BYTES = 64  # every section starts on a 64-byte boundary


class StagingBuffers:
    def __init__(self, sections: Dict[str, SectionSpec], device: torch.device, num_host_buffers: int = 2):
        offsets = {}
        total_bytes = 0
        for name, (shape, dtype) in sections.items():
            offsets[name] = total_bytes
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            total_bytes += -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
        device = torch.device(device)
        pin = device.type == "cuda"
        self._device_bytes = torch.zeros(total_bytes, dtype=torch.uint8, device=device)  # [bytes] uint8
        self._host_bytes: List[torch.Tensor] = [  # [bytes] uint8 each
            torch.zeros(total_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(num_host_buffers)
        ]
        self._host_views = [{name: _carve(buffer, offsets[name], *spec) for name, spec in sections.items()}
                            for buffer in self._host_bytes]
        self._host_arrays = [{name: view.numpy() for name, view in views.items()} for views in self._host_views]
        self.device = {name: _carve(self._device_bytes, offsets[name], *spec) for name, spec in sections.items()}
        # the copy's source and target, made once: a view costs ~1-3 us of host a call. On a CUDA device
        # the bytes go as they are; on a CPU "device" as int64 words, 8x fewer elements, so the copy
        # does not wake a thread pool
        word = torch.uint8 if pin else torch.int64
        self._copy_source = [buffer.view(word) for buffer in self._host_bytes]
        self._copy_target = self._device_bytes.view(word)
        self._copy_done = [torch.cuda.Event() if pin else None for _ in range(num_host_buffers)]
        self._device_index = device.index if device.index is not None else (torch.cuda.current_device() if pin else None)
        self._current = 0

    @property
    def host(self) -> Dict[str, torch.Tensor]:
        """The views of the host buffer the next :meth:`copy_to_device` sends."""
        return self._host_views[self._current]

    @property
    def host_arrays(self) -> Dict[str, "numpy.ndarray"]:
        """The same views as :attr:`host`, as numpy arrays (the host's hot path writes these)."""
        return self._host_arrays[self._current]

    @property
    def num_host_buffers(self) -> int:
        return len(self._host_bytes)

    @property
    def current_buffer(self) -> int:
        """Index of the host buffer the next :meth:`copy_to_device` sends."""
        return self._current

    @property
    def nbytes(self) -> int:
        return self._device_bytes.numel()

    def copy_to_device(self) -> None:
        """Enqueue the one host-to-device copy of every section on the current stream, then switch
        to the next host buffer."""
        self._copy_target.copy_(self._copy_source[self._current], non_blocking=True)
        if self._copy_done[self._current] is not None:
            # an explicit device index skips torch's per-call device lookup (tens of us on the host)
            self._copy_done[self._current].record(torch.cuda.current_stream(self._device_index))
        self._current = (self._current + 1) % len(self._host_bytes)

    def wait_until_host_writable(self) -> None:
        """Block until the last copy that read the current host buffer has finished."""
        event = self._copy_done[self._current]
        if event is not None:
            event.synchronize()


def _numel(shape: Tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _carve(buffer: torch.Tensor, offset: int, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    return buffer[offset : offset + nbytes].view(dtype).view(shape)
