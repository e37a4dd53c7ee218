"""Tensor-parallel ranks in lockstep: one cheap check per step, and a failure on one rank told to all.

Every TP rank runs the same controller and must build the same steps: the model's collectives
pair up only if every rank runs the same requests with the same shapes. A request one rank
rejected and another accepted (a prompt the ranks received differently), or a rank that stopped
stepping, used to end in a gloo size-mismatch abort or a collective waiting for the 30-minute
process-group timeout; a hook raising on one rank ended the others with "Connection closed by
peer" and no word of what failed.

:meth:`TPLockstep.check` runs once per ``step()`` call, before the step's first model
collective: one all-reduce (MAX) of ``[failed, h, -h, timing]`` int64 on the host over a gloo group of the
TP ranks, ``h`` a 56-bit hash of the step's layout (request ids, decode/prefill counts, query
rows, decode-run length; "no step" hashes too). The same all-reduce carries the first rank's last
step timing (``StepTiming``) to every rank, so the draft-length policy's cost model, and so its
choices, are the same on every rank. All ranks agree iff ``max h == -max(-h)``. On
disagreement every rank gathers each rank's layout and raises :class:`TPLockstepError` naming the
ranks and the requests that differ. The check is host-only (CPU tensors, no GPU sync); with NCCL
for the model it costs one gloo round trip per launch (tens of microseconds on one host).

When a step fails on one rank outside the model's collectives (a hook, the host bookkeeping),
:meth:`TPLockstep.announce_failure` joins the others' next check with ``failed = 1`` and its
message, so every rank raises within one step, naming the failed rank and its error. Every wait
is bounded by ``timeout_s``: a rank that stops stepping ends the others with a clear error.
"""

import datetime
import hashlib
from typing import List, Optional

import torch
import torch.distributed as dist

from mtp_ctrl.controllers.draft_lengths import StepTiming
from mtp_ctrl.state.step_metadata import StepMetadata

_MESSAGE_BYTES = 4096  # each rank's text in a gather (longer text is cut)


class TPLockstepError(RuntimeError):
    """Tensor-parallel ranks disagree on a step, or another rank failed or stopped answering."""


def step_layout(step: Optional[StepMetadata]) -> str:
    """What every rank must agree on about a step, as text (hashed for the check, shown on a mismatch)."""
    if step is None:
        return "no step"
    query_rows = step.host_query_lengths.tolist()  # host-ok: host tensor
    return (f"requests {list(step.request_ids)} (decode {step.num_decode}, prefill {step.num_prefill}), "
            f"query rows {query_rows}, {step.num_steps} step(s), drafts {list(step.host_draft_lengths)}")


class TPLockstep:
    def __init__(self, tp_group, timeout_s: float):
        """``tp_group``: megatron's tensor-parallel group (None or size 1: every check is free)."""
        self.size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.rank = 0 if tp_group is None else dist.get_rank(tp_group)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.group = None if self.size == 1 else _gloo_group(tp_group)
        self.steps_checked = 0
        self.in_collectives = False  # between a check and the end of the step's launch: no announcing

    def check(self, step: Optional[StepMetadata], timing: Optional[StepTiming] = None) -> Optional[StepTiming]:
        """Raise TPLockstepError on every rank unless every rank is about to run the same step.
        ``timing``: this rank's last step measurement for the draft-length cost model; returns the
        first rank's (the same on every rank; ``timing`` itself without TP)."""
        if self.group is None:
            return timing
        layout = step_layout(step)
        digest = int.from_bytes(hashlib.blake2b(layout.encode(), digest_size=7).digest(), "little")
        shared = self._exchange(failed=0, digest=digest, message=layout, timing=timing if self.rank == 0 else None)
        self.steps_checked += 1
        self.in_collectives = step is not None
        return shared

    def announce_failure(self, error: BaseException) -> None:
        """This rank's step failed: make the other ranks' next check raise with this cause (bounded wait;
        nothing if the failure came between a check and the end of its launch, where the peers may be
        inside the model's collectives). Never raises."""
        if self.group is None or self.in_collectives or isinstance(error, TPLockstepError):
            return
        try:
            self._exchange(failed=1, digest=0, message=f"{type(error).__name__}: {error}")
        except TPLockstepError:
            pass  # the exchange raises by design on the failed rank too; its own error is raised by the caller

    def _exchange(self, failed: int, digest: int, message: str,
                  timing: Optional[StepTiming] = None) -> Optional[StepTiming]:
        # [failed, h, -h, timing (rank 0's; -1 elsewhere: the MAX takes rank 0's)] int64, host
        flags = torch.tensor([failed, digest, -digest] + _encode(timing), dtype=torch.int64)  # [13] int64
        self._wait(dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True), message)
        values = flags.tolist()  # host-ok: CPU
        any_failed, digest_max, digest_min = values[0], values[1], -values[2]
        if not any_failed and digest_max == digest_min:
            return _decode(values[3:])
        texts = self._gather(f"{failed}|{message}")
        failures = [(rank, text[2:]) for rank, text in enumerate(texts) if text.startswith("1|")]
        if failures:
            listed = "; ".join(f"rank {rank} failed: {text}" for rank, text in failures)
            raise TPLockstepError(f"tensor-parallel rank {self.rank}: {listed}")
        layouts = [text[2:] for text in texts]
        listed = "\n  ".join(f"rank {rank}: {text}" for rank, text in enumerate(layouts))
        raise TPLockstepError(f"tensor-parallel rank {self.rank}: the ranks are out of lockstep at step check "
                              f"{self.steps_checked} ({_difference(layouts)}); each rank must add the same requests "
                              f"in the same order and step together:\n  {listed}")

    def _gather(self, text: str) -> List[str]:
        encoded = text.encode()[:_MESSAGE_BYTES]
        mine = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)  # [B] uint8, host: the text, zero-padded
        mine[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
        texts = [torch.zeros_like(mine) for _ in range(self.size)]
        self._wait(dist.all_gather(texts, mine, group=self.group, async_op=True), text)
        return [bytes(t.tolist()).rstrip(b"\0").decode(errors="replace") for t in texts]  # host-ok: CPU

    def _wait(self, work, what: str) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as error:
            raise TPLockstepError(
                f"tensor-parallel rank {self.rank}: no answer from the other ranks within "
                f"{self.timeout.total_seconds():g} s at step check {self.steps_checked} (here: {what}); "
                f"a rank stopped stepping, failed inside a collective, or runs other steps ({error})") from None


def _encode(timing: Optional[StepTiming]) -> List[int]:
    """``[present (1: decode-only, 2: mixed; + 2: not steady), G, D, wall ns, GPU ns, tokens,
    request-steps, steps, realised wall ns, expected tokens x 1e6]`` (all -1: none)."""
    if timing is None:
        return [-1] * 10
    return [(2 if timing.mixed else 1) + (0 if timing.steady else 2), timing.batch_size, timing.num_drafts,
            round(timing.wall_seconds * 1e9), round(timing.gpu_seconds * 1e9) if timing.gpu_seconds >= 0 else -1,
            timing.tokens, timing.request_steps, timing.steps,
            round(timing.realised_seconds * 1e9) if timing.realised_seconds >= 0 else -1,
            round(timing.expected_tokens * 1e6) if timing.expected_tokens >= 0 else -1]


def _decode(values: List[int]) -> Optional[StepTiming]:
    if values[0] < 1:
        return None
    return StepTiming(values[1], values[2], values[3] / 1e9, values[4] / 1e9 if values[4] >= 0 else -1.0,
                      values[0] in (2, 4), values[0] <= 2, values[5], values[6], values[7],
                      values[8] / 1e9 if values[8] >= 0 else -1.0, values[9] / 1e6 if values[9] >= 0 else -1.0)


def _difference(layouts: List[str]) -> str:
    """Which requests some ranks run and others do not, in words."""
    sets = []
    for layout in layouts:
        start = layout.find("[")
        ids = layout[start + 1: layout.find("]")] if layout.startswith("requests") else ""
        sets.append({int(x) for x in ids.split(",") if x.strip()})
    every = set().union(*sets)
    parts = [f"request {rid} on rank(s) {[r for r, s in enumerate(sets) if rid in s]} only"
             for rid in sorted(every) if any(rid not in s for s in sets)]
    return "; ".join(parts) if parts else "same requests, other shapes"


def _gloo_group(tp_group):
    """``tp_group`` itself if it runs on gloo, else a gloo group of the same ranks (made by every
    rank of the world together: the controller is built on every rank)."""
    if dist.get_backend(tp_group) == "gloo":
        return tp_group
    mine = dist.get_process_group_ranks(tp_group)
    every: List[Optional[List[int]]] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    groups = sorted({tuple(ranks) for ranks in every})
    found = None
    for ranks in groups:  # every rank creates every group, in the same order
        group = dist.new_group(list(ranks), backend="gloo")
        if tuple(mine) == ranks:
            found = group
    return found
