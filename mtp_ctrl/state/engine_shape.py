"""EngineShape: the sizes every part of the engine is built for, in one frozen object.

The controller makes one from ``InferenceConfig`` and the model (``controllers/config.py``,
:func:`~mtp_ctrl.controllers.config.engine_shape`); the context, scheduler, request table, output
rows, proposers and metrics read it from there. Nobody keeps a copy of a field: a fact such as S
lives here only, so changing how S is chosen (per request, adaptive) starts in one place.

Letters used everywhere: R = ``max_requests``, S = ``num_speculative_tokens``, T =
``max_tokens_per_step``, MB = ``max_blocks_per_request``.
"""

import dataclasses
from typing import Optional, Union

import torch

from mtp_ctrl.state.scheduler import worst_case_blocks


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """max_requests: live requests (running or paused), rows of the request table and Mamba slots.
    max_model_len: prompt + generated tokens of one request. block_size_tokens: tokens per KV
    block. num_speculative_tokens: S drafts per decode step. max_tokens_per_step: query rows of one
    forward pass, at least ``R * (1 + S)`` so every decode request runs every step.
    decode_steps_per_launch: the most decode steps one launch runs (a decode run; 1 = single steps).
    join_hold_steps: how many built steps a free row may stay empty while requests wait, so that
    joins come together (``Scheduler.joins_held``; 0 = every free row is filled at once).
    device: where the state lives. kv_dtype: what K/V (and drafters' hidden rows) are computed in.
    vocab_size: the target's vocabulary (None where no model is involved, e.g. state-only tests).
    """

    max_requests: int
    max_model_len: int
    block_size_tokens: int
    num_speculative_tokens: int
    max_tokens_per_step: int
    decode_steps_per_launch: int = 1
    join_hold_steps: int = 0
    device: Union[str, torch.device] = "cpu"
    kv_dtype: torch.dtype = torch.float32
    vocab_size: Optional[int] = None

    def __post_init__(self):
        for name, low in (("max_requests", 1), ("max_model_len", 1), ("block_size_tokens", 1),
                          ("num_speculative_tokens", 0), ("max_tokens_per_step", 1),
                          ("decode_steps_per_launch", 1), ("join_hold_steps", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if self.vocab_size is not None and (isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int)
                                            or self.vocab_size < 1):
            raise ValueError(f"vocab_size must be an int >= 1 or None, got {self.vocab_size!r}")
        if not isinstance(self.kv_dtype, torch.dtype):
            raise TypeError(f"kv_dtype must be a torch.dtype, got {type(self.kv_dtype).__name__}")
        object.__setattr__(self, "device", torch.device(self.device))
        if self.max_tokens_per_step < self.max_requests * self.stride:
            raise ValueError(
                f"max_tokens_per_step ({self.max_tokens_per_step}) must hold every decode request's 1 + S rows: "
                f"max_requests * (1 + num_speculative_tokens) = {self.max_requests * self.stride}")

    @property
    def stride(self) -> int:
        """Rows of one decode request in a step: the base token and its S drafts."""
        return self.num_speculative_tokens + 1

    @property
    def max_blocks_per_request(self) -> int:
        """MB: the most blocks a request holds, its longest KV with one step run past its stop in
        flight (``scheduler.worst_case_blocks(max_model_len, 1)``; decode runs keep to it)."""
        return worst_case_blocks(self.max_model_len, 1, self.num_speculative_tokens, self.block_size_tokens)
