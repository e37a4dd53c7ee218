"""The read-back of a launch: what the host learns from the GPU, one small copy per launch.

Each step of a launch stages, per request of its grid, ``[accepted count, bonus token, accepted
drafts...]`` in its own slot of a device buffer (``[K, R, S + 2]`` int64; K = the longest decode
run). After the launch one asynchronous copy moves the slots to pinned host memory, and a CUDA
event marks its arrival. Two host copies alternate, so launch N + 1's lands while the host still
reads launch N's (the overlapped loop); CUDA events around each launch time its GPU work.
"""

import dataclasses
from typing import Optional, Tuple

import numpy as np
import torch

from mtp_ctrl.state import StepMetadata


@dataclasses.dataclass
class LaunchedStep:
    """A launch on the GPU (one step, or a decode run) whose read-back the host has not applied."""

    step: StepMetadata
    readback: torch.Tensor  # [step.num_steps, n_s, S + 2] int64, pinned host copy (filled when `done` fires)
    done: Optional[torch.cuda.Event]  # None on CPU (the copy was synchronous)
    gpu_start: Optional[torch.cuda.Event]


class Readbacks:
    """Device slots, pinned host copies and events of the launches' read-backs."""

    def __init__(self, max_steps: int, max_requests: int, num_speculative_tokens: int, device: torch.device):
        shape = (max_steps, max_requests, num_speculative_tokens + 2)
        pin = device.type == "cuda"
        self.device_slots = torch.zeros(shape, dtype=torch.int64, device=device)  # [K, R, S + 2]
        self._host = [torch.zeros(shape, dtype=torch.int64, pin_memory=pin) for _ in range(2)]  # [K, R, S + 2] each
        # (start of the launch's GPU work, read-back landed) of the two launches that can be in flight
        self._events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                        for _ in range(2)] if pin else None
        self._device = device
        self._parity = 0
        self._stream = None

    def slot(self, index: int) -> torch.Tensor:
        """``[R, S + 2]`` int64 on the device: where step ``index`` of a launch stages its read-back."""
        return self.device_slots[index]

    def begin(self) -> None:
        """Mark the start of a launch's GPU work (call right before launching it)."""
        if self._events is not None:
            self._stream = torch.cuda.current_stream(self._device)  # once per launch: the lookup costs host time
            self._events[self._parity][0].record(self._stream)

    def end(self, step: StepMetadata) -> LaunchedStep:
        """Enqueue the copy of the launch's read-back to the host; returns without waiting."""
        num_steps, num_sampling = step.num_steps, step.num_sampling_requests
        host = self._host[self._parity]
        # one contiguous copy: the sampling rows of a step, or every row of a run's steps
        rows = slice(None) if num_steps > 1 else slice(0, num_sampling)
        host[:num_steps, rows].copy_(self.device_slots[:num_steps, rows], non_blocking=True)
        gpu_start = done = None
        if self._events is not None:
            gpu_start, done = self._events[self._parity]
            done.record(self._stream)
        self._parity ^= 1
        return LaunchedStep(step, host[:num_steps, :num_sampling], done, gpu_start)

    @staticmethod
    def wait(launched: LaunchedStep) -> Tuple[np.ndarray, Optional[float]]:
        """Wait for a launch's read-back: ``([k, n_s, S + 2]`` int64 host values, the launch's GPU
        seconds or None off CUDA)."""
        if launched.done is None:
            return launched.readback.numpy(), None
        launched.done.synchronize()  # host-ok: the launch's one read-back, usually long finished
        return launched.readback.numpy(), launched.gpu_start.elapsed_time(launched.done) / 1e3
