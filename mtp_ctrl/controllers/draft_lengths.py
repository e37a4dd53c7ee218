"""The controller's side of the draft-length policy (``draft_policy.py``): ask it once per step,
remember what each request drafted, and feed each step's outcome back.

Timing: the lengths chosen when step N is built are the drafts step N makes (its draft phase
runs ``D = max s_r`` depths), staged with step N's one host-to-device copy and kept beside the
drafts in a device row of the request table; step N + 1 verifies them (its draft rows past
``s_r`` are masked). So the lengths a step's decode requests *verify* are those chosen one
sampling step earlier (the context keeps them per slot: ``StepMetadata.host_verify_lengths``):
:meth:`DraftLengths.launched` records them per launched step, and
:meth:`DraftLengths.applied` hands them with the read-back's accepted counts to the policy and
the metrics. Host values only, no sync.
"""

import collections
from typing import Deque, Dict, Optional, Tuple

import numpy as np
import torch.distributed as dist

from mtp_ctrl.controllers.config import SamplingParams
from mtp_ctrl.controllers.draft_policy import DraftLengthPolicy, DraftLengthQuery, FixedDraftLength
from mtp_ctrl.state import EngineShape, StepMetadata


class DraftLengths:
    """``policy``: the draft-length policy (None: :class:`FixedDraftLength`). :meth:`add` each
    request's SamplingParams (its ``num_speculative_tokens`` caps its lengths)."""

    def __init__(self, policy: Optional[DraftLengthPolicy], shape: EngineShape):
        policy = FixedDraftLength() if policy is None else policy
        if not isinstance(policy, DraftLengthPolicy):
            raise TypeError(f"draft_policy must be a DraftLengthPolicy, got {type(policy).__name__}")
        self.policy, self.shape = policy, shape
        self._caps: Dict[int, int] = {}  # request id -> its cap, for requests capped below S
        if self.S > 0:
            policy.bind(shape)
        self._fixed = type(policy) is FixedDraftLength  # S each unless capped: no bookkeeping needed
        # some request may verify fewer than S drafts (the step masks draft rows by length); stays on
        self.masked = self.S > 0 and not self._fixed
        self._in_flight: Deque[Optional[np.ndarray]] = collections.deque()  # per launched step: [k, n_d] or None (S)

    @property
    def S(self) -> int:
        """The engine's most drafts (``EngineShape.num_speculative_tokens``)."""
        return self.shape.num_speculative_tokens

    def warmup_depths(self) -> Tuple[int, ...]:
        if self.S == 0:
            return (0,)
        return tuple(sorted({int(d) for d in self.policy.warmup_depths(self.S) if 0 <= int(d) <= self.S}))

    def warmup_tiers(self) -> Tuple[Tuple[int, int], ...]:
        """The (verify width V, draft depths D) pairs whose step graphs ``warmup()`` captures: every
        pair of the policy's warm-up depths (a decode-only step verifies what the step before
        drafted, so V follows the last D), and (S, D) (steps with prefill chunks verify S)."""
        depths = self.warmup_depths()
        return tuple(sorted({(v, d) for v in depths for d in depths} | {(self.S, d) for d in depths}))

    def choose(self, request_ids: np.ndarray, num_sampling: int, batch_size: int) -> np.ndarray:
        """``[num_sampling]`` int64 draft lengths of the step's sampling requests (row order)."""
        S = self.S
        caps = np.full(num_sampling, S, dtype=np.int64)  # [n] int64
        if self._caps:
            for i, request_id in enumerate(request_ids[:num_sampling].tolist()):  # host-ok: numpy
                caps[i] = self._caps.get(request_id, S)
        if S == 0 or (self._fixed and bool((caps == S).all())):
            return caps
        lengths = self.policy.choose(DraftLengthQuery(request_ids[:num_sampling].copy(), caps, S, batch_size))
        lengths = np.asarray(lengths)
        if lengths.shape != (num_sampling,) or not np.issubdtype(lengths.dtype, np.integer):
            raise TypeError(f"{type(self.policy).__name__}.choose must return [{num_sampling}] ints, "
                            f"got {lengths.dtype} {lengths.shape}")
        return np.clip(lengths.astype(np.int64), 0, caps)

    def launched(self, step: StepMetadata) -> None:
        """Record what ``step``'s decode requests verify (each step of a decode run after the first
        verifies the run's own lengths) and what its sampling requests drafted."""
        if self.S == 0:
            return
        num_decode, chosen, held, S = step.num_decode, step.host_draft_lengths, step.host_verify_lengths, self.S
        if held.count(S) == len(held) and chosen.count(S) == step.num_sampling_requests:
            self._in_flight.append(None)  # every request verifies and drafts S (the fixed-S path)
            return
        verified = np.empty((step.num_steps, num_decode), dtype=np.int64)  # [k, n_d] int64
        verified[0] = held  # the drafts each holds (the context's record, chosen when it last sampled)
        verified[1:] = chosen[:num_decode]
        self._in_flight.append(verified)

    def applied(self, step: StepMetadata, accepted_counts: np.ndarray) -> np.ndarray:
        """``accepted_counts``: ``[k, n_d]`` the read-back's counts of the oldest launched step (its
        decode rows, step row order). Tells the policy; returns the lengths verified, ``[k, n_d]``."""
        verified = self._in_flight.popleft() if self._in_flight else None
        if verified is None:
            verified = np.full(accepted_counts.shape, self.S, dtype=np.int64)
        if self.S > 0 and not self._fixed and accepted_counts.size:
            request_ids = np.tile(np.asarray(step.request_ids[: step.num_decode], dtype=np.int64), verified.shape[0])
            self.policy.observe(request_ids, verified.ravel(), accepted_counts.ravel())
        return verified

    def add(self, request_id: int, params: SamplingParams) -> None:
        """A request was queued: note its cap (kept until :meth:`drop`)."""
        if params.num_speculative_tokens is not None and params.num_speculative_tokens < self.S:
            self._caps[request_id] = params.num_speculative_tokens
            self.masked = True

    def forget(self, request_id: int) -> None:
        """The request left the batch (finished or evicted; an evicted one comes back)."""
        self.policy.forget(request_id)

    def drop(self, request_id: int) -> None:
        """The controller forgot the request."""
        self._caps.pop(request_id, None)

    def abandon(self) -> None:
        """The steps in flight were abandoned (a step raised): their outcomes never come."""
        self._in_flight.clear()

    def set_step_costs(self, costs: Dict[Tuple[int, int], float], group=None) -> None:
        """The warm-up's replay times by (batch size, draft depths) for the policy's cost model;
        under tensor parallelism every rank takes the first rank's (``group``: the TP ranks' gloo
        group), so that every rank's policy makes the same choices."""
        if group is not None:
            shared = [costs]
            dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
            costs = shared[0]
        if self.policy.cost_model is not None:
            self.policy.cost_model.set_measured(costs)


def step_order_lengths(verified: np.ndarray, num_requests: int) -> np.ndarray:
    """``verified`` ``[k, n_d]`` (the step's decode requests) widened to ``[k, num_requests]`` (the
    step's requests in step order; 0 for its prefill requests)."""
    out = np.zeros((verified.shape[0], num_requests), dtype=np.int64)
    width = min(verified.shape[1], num_requests)
    out[:, :width] = verified[:, :width]
    return out
