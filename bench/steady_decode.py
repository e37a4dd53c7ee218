"""Shared by the step benchmarks: bring a controller to a steady decode state and time its steps."""

import time
from typing import List, Optional

import torch

from mtp_ctrl.controllers import SamplingParams, TextGenerationController


def timed_decode_steps(controller: TextGenerationController, batch: int, vocab_size: int, prompt_len: int,
                       max_new_tokens: int, warmup_steps: int, steps: int, seed: Optional[int] = None) -> List[float]:
    """Add ``batch`` random prompts of ``prompt_len`` tokens (seeded by ``seed``, default ``batch``), step until every
    request decodes, take ``warmup_steps`` more, then return the wall ms of ``steps`` ``controller.step()``
    calls. ``max_new_tokens`` must outlast every step taken."""
    generator = torch.Generator().manual_seed(batch if seed is None else seed)
    for _ in range(batch):
        controller.add_request(torch.randint(0, vocab_size, (prompt_len,), generator=generator).tolist(),
                               SamplingParams(max_new_tokens=max_new_tokens))
    while controller.context.table.group_size(0) < batch:  # until every request decodes
        controller.step()
    for _ in range(warmup_steps):
        controller.step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        controller.step()
        times.append((time.perf_counter() - started) * 1e3)
    return times
