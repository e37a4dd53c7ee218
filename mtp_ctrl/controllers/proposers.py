"""Proposers: what drafts the next S tokens of every request from verified state.

A proposer is bound once (:meth:`Proposer.bind`) to a :class:`~mtp_ctrl.controllers.draft_context.DraftContext`
(the target's forward entry points, the sampler, the engine's sizes, device rows of its own by
table slot (a request keeps its slot while it lives), private KV caches), never to the controller, and is called once per
step after verification with a :class:`DraftBatch`. It returns ``[G, S]`` int64 drafts for the
step's grid (rows of requests that did not sample are ignored), without a host sync.
:meth:`Proposer.on_step_scheduled` runs right after each step is launched (host values the
scheduler knows), :meth:`Proposer.on_step_committed` once the host has the step's read-back
(with overlap scheduling, one step later). A step replayed from a CUDA graph runs no Python, so
what ``propose`` needs per request lives in device rows of the request table, not on the host.

Subclass :class:`Proposer` to plug in another drafter (see ``examples/custom_proposer.py``).
"""

import abc
import dataclasses
from typing import Hashable, Optional, Sequence, Tuple

import numpy as np
import torch

from mtp_ctrl.controllers.draft_context import DraftContext
from mtp_ctrl.state.step_metadata import StepMetadata


@dataclasses.dataclass(frozen=True)
class DraftBatch:
    """A step's verified state, as the proposer sees it.

    Requests are the step's ``[0, G)``, in the step's order (decode requests first): ``G`` is the
    step's grid, padded to a CUDA-graph batch when a graph covers the step (requests past the real
    count are padding). Request ``r`` holds the table slot ``write_rows[r]`` for its whole life.
    Which requests are real, decode or sampling is known on the device only (``samples``,
    ``write_rows``; the step may be replayed from a graph). Write per-request state through
    ``write_rows``, which sends padding requests to the table's scratch slot, so that a captured
    step never touches a request that is not running; state derived from a sampled token only
    where ``samples`` is True.
    """

    step: StepMetadata
    hidden: torch.Tensor  # [T, H] decoder output of the step's rows (after the final norm)
    num_requests: int  # G: requests of the step's grid, padding included; propose returns [G, S]
    samples: torch.Tensor  # [G] bool, the request sampled a token (a decode or a final prefill chunk)
    next_tokens: torch.Tensor  # [G] int64, the token each request sampled last (verified)
    last_accepted_rows: torch.Tensor  # [G] int64, packed row of each request's last accepted row
    accepted_counts: torch.Tensor  # [G] int64, accepted drafts (0 for prefill and padding requests)
    write_rows: torch.Tensor  # [G] int64, table slot of each request; the scratch slot for padding
    first_positions: torch.Tensor  # [G] int64, position of each request's first row this step
    bonus_positions: torch.Tensor  # [G] int64, position e of the token each request sampled last
    # (its bonus token): a decode's base position + 1 + accepted drafts, a final chunk's prompt length
    aux_hidden: Optional[torch.Tensor] = None  # [T, k * H] the target's aux layers' outputs (EAGLE), else None
    num_drafts: int = -1  # D in [1, S]: draft depths some request verifies (host; -1: S). Columns of
    # the returned drafts from D on are never verified: a proposer may skip computing them

    def depths(self, num_speculative_tokens: int) -> int:
        """D, the depths to draft: ``num_drafts``, or S (``num_speculative_tokens``) when it is -1."""
        return num_speculative_tokens if self.num_drafts < 0 else min(self.num_drafts, num_speculative_tokens)

    @property
    def decode_only(self) -> bool:
        return self.step.num_prefill == 0


class Proposer(abc.ABC):
    """Drafts ``num_speculative_tokens`` tokens per request."""

    # The proposer reads the step's packed rows through ``query_start_loc``, ``first_positions`` /
    # ``bonus_positions`` and ``last_accepted_rows`` only, so a decode request may run ``1 + s_r``
    # rows (the drafts it holds) instead of ``1 + V`` (ragged rows; docs/draft_lengths.md). False
    # (the default): the controller keeps ``1 + V`` rows a decode request (the padded layout).
    takes_ragged_rows = False
    # Whether a decode-only step whose requests all never draft (``on_admitted`` with ``may_draft``
    # False, or ``on_retired``) reaches this proposer (``on_no_drafts``). False: such a step runs no
    # draft phase at all, a plain engine's step (set it where nothing kept is read for those requests
    # again: the MTP proposer, the EAGLE family). True (the default): every step reaches it, as a
    # proposer with per-step side effects needs (``HiddenStateCapture`` records every verified row).
    sees_never_drafting_steps = True

    def bind(self, draft_context: DraftContext) -> None:
        """Called once by the controller's constructor (only when S > 0): allocate buffers and
        device rows here. Keeps ``draft_context`` as :attr:`draft_context`."""
        self.draft_context = draft_context

    @abc.abstractmethod
    def propose(self, batch: DraftBatch) -> torch.Tensor:
        """Return ``[batch.num_requests, S]`` int64 drafts (device tensor, no host sync, no
        value-dependent Python: a padded step runs this inside a CUDA graph). Rows of requests
        that did not sample (``batch.samples`` False) are ignored."""

    def on_no_drafts(self, batch: DraftBatch) -> None:
        """Called instead of :meth:`propose` in a step where no request drafts (the draft-length
        policy chose 0 for all, ``batch.num_drafts == 0``): keep the proposer's own state current
        for later steps, draft nothing. Default: run :meth:`propose` and drop its drafts (always
        correct); a stateless proposer overrides it with nothing. With
        ``sees_never_drafting_steps`` False, a decode-only step whose requests all never draft
        (:meth:`on_admitted` with ``may_draft`` False, or :meth:`on_retired`) calls neither."""
        self.propose(dataclasses.replace(batch, num_drafts=self.draft_context.shape.num_speculative_tokens))

    def draft_logits(self) -> Optional[torch.Tensor]:
        """For ``InferenceConfig(acceptance="rejection")``: ``[R + 1, S, V]`` float32 rows, per
        table slot (``DraftContext.add_device_rows``), the logits each current draft ``k`` of the
        request was sampled from with ``sample_rows``, written in the same ``propose`` call as the
        drafts (padding requests write the scratch row); ``DraftContext.draft_logits_rows`` makes
        them. Rejection acceptance filters them with the request's own rule into ``q``, the
        distribution the sampler drew the draft from.
        Default: None, the drafts are treated as deterministic (``q`` one-hot at the draft), which
        stays lossless: a draft is kept with probability ``p(d)``. Drafts must be drawn
        independently of the acceptance noise (e.g. with ``gumbel_noise(seed, position)``, as the
        controller's ``sample_rows`` does)."""
        return None

    def prefix_cache_lookahead(self) -> Optional[int]:
        """Whether a request may start from cached KV blocks of a shared prompt prefix
        (``InferenceConfig(prefix_caching=True)``), and how: the number of tokens past a block
        that this proposer's state at the block's positions depends on (its own caches must live
        in the target's blocks, and device rows that depend on the request's first KV length are
        made with ``DraftContext.add_device_rows(kv_start=True)``). None (default): its state
        cannot be reused, so no request takes a hit (every prompt is computed in full)."""
        return None

    def forget(self, request_id: int) -> None:
        """The request left the running batch (finished or evicted): drop host state kept for it."""

    def on_admitted(self, slot: int, may_draft: bool) -> None:
        """A request took table slot ``slot`` (admitted, or back after a preemption). ``may_draft``
        False: it never drafts (``SamplingParams(num_speculative_tokens=0)``), so nothing need be
        kept exact for its drafts (the MTP proposer then never catches up its skipped windows).
        Default: nothing."""

    def prompt_state_complete(self, may_draft: bool) -> bool:
        """Whether this proposer's state over the prompt of a request admitted with ``may_draft``
        is computed in full. False: its prompt blocks are shared through the prefix cache only with
        requests of the same kind (the MTP proposer skips the prompt windows of a step whose
        requests never draft). Default: True."""
        return True

    def on_retired(self, slot: int) -> None:
        """The live request in table slot ``slot`` never drafts again (the draft-length policy
        retired it: ``DraftLengthPolicy.retiring``): as ``on_admitted(slot, may_draft=False)``, from
        the next step it builds on. Default: nothing."""

    def plan_launch(self, step: StepMetadata) -> Hashable:
        """Host-side, once per launch, before its graph key is made: a proposer whose per-step work
        depends on host state (a shape that changes what a graph captures) chooses it here, moves
        that state on for every step of the launch, and returns a hashable naming the choice; it
        joins the step's CUDA graph key, and ``propose`` / ``on_no_drafts`` of the launch follow
        it (a replay runs no Python). Default: None (the step's shape says everything)."""
        return None

    def warmup_plans(self, step: StepMetadata) -> Tuple[Hashable, ...]:
        """The plans (values :meth:`plan_launch` may return) whose graphs ``warmup()`` captures for
        the padding step ``step``; each is set with :meth:`use_plan` before its capture."""
        return (None,)

    def use_plan(self, plan: Hashable) -> None:
        """Follow ``plan`` (one of :meth:`warmup_plans`) in the next launch without moving host state
        (warm-up captures)."""

    def on_step_scheduled(self, step: StepMetadata) -> None:
        """Host-side bookkeeping right after ``step`` was launched, before the next one is built
        (only host values: the step's requests and its prefill chunks); once per step of a
        decode run (``step.num_steps``). Default: nothing."""

    def on_step_committed(self, step: StepMetadata, accepted_counts: Sequence[int]) -> None:
        """Host-side bookkeeping once the step's read-back arrived (``accepted_counts``: one per
        sampling request, host ints, -1 for a request that had already stopped: with overlap
        scheduling a request runs one step past its stop, and that step is discarded; this runs
        one step late). Once per step of a decode run, in order, after the host applied the
        run's tokens.
        Default: nothing."""


def check_drafts(proposer: Proposer, drafts, shape: Tuple[int, int], device: torch.device) -> None:
    """What ``proposer.propose`` returned must be a ``shape`` (``[G, S]``) int64 tensor on ``device``
    (metadata only: no host sync)."""
    name = type(proposer).__name__
    if not isinstance(drafts, torch.Tensor) or drafts.dtype != torch.int64 or tuple(drafts.shape) != shape:
        raise TypeError(f"{name}.propose must return a {list(shape)} int64 tensor, got "
                        f"{getattr(drafts, 'dtype', type(drafts).__name__)} {tuple(getattr(drafts, 'shape', ()))}")
    if drafts.device != device:
        raise ValueError(f"{name}.propose returned drafts on {drafts.device}, expected {device}")


def notify_committed(proposer: Proposer, step: StepMetadata, readbacks: np.ndarray, emitted: np.ndarray) -> None:
    """``proposer.on_step_committed`` once per step of a launch (``readbacks`` ``[k, m, S + 2]`` and
    ``emitted`` ``[k, m]``, in the step's order): the accepted counts, -1 for a request that
    emitted nothing in that step (it had stopped: the step ran past its stop; or it left)."""
    if type(proposer).on_step_committed is Proposer.on_step_committed:
        return
    for index in range(step.num_steps):
        accepted = np.where(emitted[index] > 0, readbacks[index, :, 0], -1)  # [m]
        proposer.on_step_committed(step, accepted.tolist())  # host-ok: numpy
