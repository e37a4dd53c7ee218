"""Rejection-sampling acceptance (``InferenceConfig(acceptance="rejection")``): speculative sampling.

Exact match (the default) keeps draft ``d_{k+1}`` while it equals the target's own sample at its
position; the output is then plain decoding's, token for token. Rejection keeps it with
probability ``min(1, p(d) / q(d))`` and replaces the first rejected draft by a draw from the
normalised residual ``max(0, p - q)``: the output has plain decoding's distribution, and a draft
is accepted with probability ``1 - TV(p, q)``, the most any lossless rule reaches.

Both modes share one verify kernel. In a decode request's rows ``[b, b + S]`` (row ``b`` holds the
last verified token, rows ``b + 1 .. b + S`` the drafts), ``verify_and_commit`` accepts draft
``d_{k+1}`` (row ``b + k + 1``) while ``out[b + j] == d_{j+1}`` for every ``j <= k``. Rejection
mode only changes ``out`` at the draft rows ``b + k``, ``k < S``, through
:func:`mtp_ctrl.triton_ops.rejection_sample`: ``d_{k+1}`` where it is accepted, the residual draw
(never ``d_{k+1}``) where it is rejected. So the verify kernel keeps the accepted prefix and the
residual token after it, the bonus row ``b + S`` keeps the target's ordinary sample from ``p``,
and the KV rewind gets the accepted counts as before. Worked example, S = 2, drafts ``(7, 9)``:
row ``b`` accepts 7 (``out[b] = 7``), row ``b + 1`` rejects 9 (``out[b + 1] = 4``, from the
residual): the request gains ``7, 4``, one accepted draft.

``p`` and ``q`` are the filtered softmax of the request's sampling rule (temperature, top-k, top-p:
the sampler's kept set found by a threshold search, no vocabulary sort) over the target's logits
and the drafter's recorded logits (:meth:`Proposer.draft_logits`), so the filters apply to both
alike and ``q`` is by construction what the drafter's sampler drew from. The one kernel
:func:`mtp_ctrl.triton_ops.rejection_sample` does it all, reading the step's rows, the per-slot
parameters and the recorded logits where they lie, and computing ``p`` and ``q`` only at draft
rows. A proposer that records no logits (``draft_logits`` returns None) has its drafts treated as
deterministic, ``q`` one-hot at the draft: still lossless (a draft is kept with probability
``p(d)``, else the token is drawn from ``p`` without ``d``), with fewer acceptances than a real
``q`` gives. Greedy requests keep exact match (``p`` and ``q`` are one-hot at their argmax). Randomness is counter-based, keyed by
(seed, position, draft index): a run is reproducible for a seed, but unlike exact match its tokens
depend on the drafts, so they differ from plain decoding's (and between S values).

Everything runs on the device with no host sync, inside the step's CUDA graph.
"""

from typing import Optional

import torch

from mtp_ctrl import triton_ops

_PARAM_ROWS = ("temperature", "top_k", "top_p", "seed")  # per-request device rows (RequestSampling.add_rows)


class RequestSampling:
    """The sampling parameters of every table row (the controller's device rows, read by name, so
    they follow their requests)."""

    @staticmethod
    def add_rows(table) -> None:
        """Register the rows in ``table`` (once, before any request joins; ``insert`` writes them)."""
        table.add_device_rows("temperature", (), torch.float32, set_on_insert=True)
        table.add_device_rows("top_k", (), torch.int64, set_on_insert=True)
        table.add_device_rows("top_p", (), torch.float32, fill=1.0, set_on_insert=True)
        table.add_device_rows("seed", (), torch.int64, set_on_insert=True)

    @staticmethod
    def row_values(params, seed: int) -> dict:
        """A joining request's values of the rows (``table.insert``'s ``row_values``)."""
        return {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "seed": seed}

    def __init__(self, table):
        # with the scratch row R: padding requests (DraftBatch.write_rows) sample with its values
        rows = {name: table.device_rows_with_scratch(name) for name in _PARAM_ROWS}
        self.temperature = rows["temperature"]  # [R + 1] float32
        self.top_k = rows["top_k"]  # [R + 1] int64
        self.top_p = rows["top_p"]  # [R + 1] float32
        self.seeds = rows["seed"]  # [R + 1] int64


class DraftLogits:
    """The drafter's logits of every draft it samples, for rejection acceptance (which filters them
    into ``q`` with the request's own rule): ``rows``, ``[R + 1, S, V]`` float32 by table slot (the
    last row is the scratch slot). Get one from ``DraftContext.draft_logits_rows`` in
    ``Proposer.bind``, :meth:`record` each depth's logits where its drafts are sampled, and return
    :attr:`rows` from ``Proposer.draft_logits``."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows  # [R + 1, S, V] float32

    def record(self, logits: torch.Tensor, write_rows: torch.Tensor, depth: Optional[int] = None) -> None:
        """``logits`` ``[G, V]`` of draft ``depth`` (or ``[G * D, V]``, the first D depths of each
        request in order, when ``depth`` is None), stored at table rows ``write_rows`` ``[G]`` int64 (the
        scratch row for requests that did not sample). One copy kernel (and a cast for half logits)."""
        logits = logits.to(self.rows.dtype)
        if depth is None:
            by_request = logits.view(write_rows.shape[0], -1, logits.shape[-1])  # [G, D, V]
            self.rows[:, : by_request.shape[1]].index_copy_(0, write_rows, by_request)
        else:
            self.rows[:, depth].index_copy_(0, write_rows, logits)


class RejectionAcceptance:
    """Rewrites a step's sampled tokens at the draft rows (module docstring). Built by the
    controller when ``acceptance == "rejection"`` and ``S > 0``, after the proposer is bound."""

    def __init__(self, table, proposer):
        if hasattr(proposer, "draft_probs"):  # the hook before 2026-11-26: its q would be ignored silently
            raise TypeError(f"{type(proposer).__name__} defines draft_probs(), which rejection acceptance no longer "
                            "reads: return the logits the drafts were sampled from in draft_logits() instead")
        self.params = RequestSampling(table)
        self.proposer = proposer

    def resample(self, logits: torch.Tensor, target_tokens: torch.Tensor, input_tokens: torch.Tensor,
                 table_rows: torch.Tensor, positions: torch.Tensor, num_decode: torch.Tensor,
                 verify_width: int) -> torch.Tensor:
        """The tokens exact-match verification should see, [K] int64: ``target_tokens`` rewritten in
        place at the draft rows (one kernel launch).

        logits: [K, V] the target's logits of the step's sampling rows; target_tokens: [K] int64 its
        ordinary samples; input_tokens: [K] int64 the rows' input tokens (a decode's row ``b + k + 1``
        holds its draft ``d_{k+1}``, -1 where masked); table_rows: [K] int64 each row's request;
        positions: [K] int64 the position each row's token will occupy; num_decode: ``[1]`` int64 on
        the device, the decode requests, whose ``1 + verify_width`` rows come first (read on the
        device: the step may be a graph replay); verify_width: the step's drafts per decode request
        (``StepMetadata.verify_width``, ``1 <= V <= S``).
        """
        params = self.params
        draft_logits = self.proposer.draft_logits()  # [R + 1, S, V] or None; the step's V depths are read
        return triton_ops.rejection_sample(
            logits, None if draft_logits is None else draft_logits[:, :verify_width], input_tokens, target_tokens,
            table_rows, positions, num_decode, verify_width, params.temperature, params.top_k, params.top_p,
            params.seeds, out=target_tokens)
