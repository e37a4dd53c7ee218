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
:func:`mtp_ctrl.triton_ops.sampling_probs`, the sampler's kept set found by a threshold search, no
vocabulary sort) over the target's and the drafter's logits, so the filters apply to both alike. A
proposer that records no ``q`` (:meth:`Proposer.draft_probs` returns None) has its drafts treated
as deterministic, ``q`` one-hot at the draft: still lossless (a draft is kept with probability
``p(d)``, else the token is drawn from ``p`` without ``d``), with fewer acceptances than a real
``q`` gives. Greedy requests keep
exact match (``p`` and ``q`` are one-hot at their argmax). Randomness is counter-based, keyed by
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
    they follow their requests), and the distribution a row's request samples from."""

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

    def probs(self, logits: torch.Tensor, table_rows: torch.Tensor) -> torch.Tensor:
        """[K, V] float32: :func:`mtp_ctrl.triton_ops.sampling_probs` of logits ``[K, V]`` under the
        parameters of the requests at ``table_rows`` ``[K]`` int64."""
        return triton_ops.sampling_probs(logits, self.temperature[table_rows], self.top_k[table_rows],
                                         self.top_p[table_rows])


class DraftProbabilities:
    """``q`` of every draft a proposer samples, for rejection acceptance: ``rows``, ``[R + 1, S, V]``
    float32 rows by table slot (the last row is the scratch slot), written
    with the same filtered softmax the draft was drawn from. Get one from
    ``DraftContext.draft_probabilities`` in ``Proposer.bind`` and return :attr:`rows` from
    ``Proposer.draft_probs``."""

    def __init__(self, rows: torch.Tensor, table):
        self.rows = rows  # [R + 1, S, V] float32
        self._sampling = RequestSampling(table)

    def record(self, logits: torch.Tensor, sampling_rows: torch.Tensor, write_rows: torch.Tensor,
               depth: Optional[int] = None) -> None:
        """``logits`` ``[G, V]`` of draft ``depth`` (or ``[G * D, V]``, the first D depths of each
        request in order, when ``depth`` is None) under the parameters of the table rows
        ``sampling_rows`` (``[G]`` or ``[G * D]``), stored at table rows ``write_rows`` ``[G]`` (the
        scratch row for requests that did not sample)."""
        probs = self._sampling.probs(logits, sampling_rows)
        if depth is None:
            by_request = probs.view(write_rows.shape[0], -1, probs.shape[-1])  # [G, D, V]
            self.rows[write_rows, : by_request.shape[1]] = by_request
        else:
            self.rows[write_rows, depth] = probs


class RejectionAcceptance:
    """Rewrites a step's sampled tokens at the draft rows (module docstring). Built by the
    controller when ``acceptance == "rejection"`` and ``S > 0``, after the proposer is bound."""

    def __init__(self, table, proposer):
        self.params = RequestSampling(table)
        self.proposer = proposer

    def resample(self, logits: torch.Tensor, target_tokens: torch.Tensor, input_tokens: torch.Tensor,
                 table_rows: torch.Tensor, positions: torch.Tensor, num_decode: torch.Tensor,
                 verify_width: int) -> torch.Tensor:
        """The tokens exact-match verification should see, [K] int64.

        logits: [K, V] the target's logits of the step's sampling rows; target_tokens: [K] int64 its
        ordinary samples; input_tokens: [K] int64 the rows' input tokens (a decode's row ``b + k + 1``
        holds its draft ``d_{k+1}``); table_rows: [K] int64 each row's request; positions: [K] int64
        the position each row's token will occupy; num_decode: ``[1]`` int64 on the device, the decode
        requests, whose ``1 + V`` rows come first (read on the device: the step may be a graph replay);
        verify_width: V, the step's drafts per decode request (``StepMetadata.verify_width``, ``V <= S``).
        """
        S, num_rows = verify_width, logits.shape[0]
        stride = S + 1
        if num_rows == 0 or S == 0:
            return target_tokens
        row_index = torch.arange(num_rows, device=logits.device)  # [K] int64
        depth = row_index % stride  # [K] int64, k: this row's draft is d_{k+1} (decode rows)
        has_draft = (row_index < num_decode * stride) & (depth < S)  # [K] bool
        following = input_tokens[(row_index + 1).clamp(max=num_rows - 1)]  # [K] int64
        draft_tokens = torch.where(has_draft, following, torch.full_like(following, -1))  # [K] int64
        draft_depth = depth.clamp(max=S - 1)  # [K] int64
        recorded: Optional[torch.Tensor] = self.proposer.draft_probs()  # [R + 1, S, V] float32 or None
        draft_probs = None if recorded is None else recorded[table_rows, draft_depth]  # [K, V] float32
        params = self.params
        return triton_ops.rejection_sample(
            params.probs(logits, table_rows), draft_probs, draft_tokens, target_tokens,
            params.temperature[table_rows], params.seeds[table_rows], positions, draft_depth)
