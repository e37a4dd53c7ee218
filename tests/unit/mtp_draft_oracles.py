"""Dense oracles for the MTP drafts of both ``mtp_attention`` modes, and a recording proposer.

Both oracles run the dense twin (megatron's own modules, SDPA causal attention, no cache) on the
verified tokens ``t_0 .. t_e`` of a proposal (``t_e`` the bonus token) and return the greedy
drafts ``d_1 .. d_S``:

- paged (as trained): depth k at position ``e - 1`` is row ``e - 1`` of megatron's MTP block
  over the whole sequence ``t_0 .. t_e, d_1 .. d_S`` (full causal attention per depth);
- single_position (Megatron-LM's inference): depth k at position ``e - 1`` attends only to its
  own row. The oracle runs megatron's MTP layer k on a sequence whose row 0 is that row: the
  layer rolls its input ids left by one, so ids ``[_, token]`` give row 0 the embedding of
  ``token``; causal attention lets row 0 see nothing but itself; its output row feeds depth
  k + 1 and the output layer, whose argmax is ``d_{k+1}``.
"""

from typing import Dict, List, Sequence, Tuple

import torch

from mtp_ctrl.controllers import MTPProposer, Proposer
from mtp_ctrl.controllers.proposers import DraftBatch
from mtp_ctrl.models import dense_full_sequence
from tests.unit.controller_fixtures import verified_ends


@torch.no_grad()
def paged_oracle_drafts(dense, verified: Sequence[int], drafts: Sequence[int]) -> List[int]:
    """Greedy drafts of megatron's MTP block over the full sequence; ``drafts`` (the proposal
    under test) only feed later depths, which causal attention keeps from earlier rows."""
    end = len(verified) - 1
    device = dense.embedding.word_embeddings.weight.device
    _, mtp_logits = dense_full_sequence(dense, torch.tensor(list(verified) + list(drafts), device=device))
    return [int(logits[end - 1].argmax()) for logits in mtp_logits[: len(drafts)]]


@torch.no_grad()
def single_position_oracle_drafts(dense, verified: Sequence[int], num_speculative_tokens: int) -> List[int]:
    """Greedy drafts of megatron's MTP layers chained over depths, each on one row, no cache."""
    end = len(verified) - 1
    device = dense.embedding.word_embeddings.weight.device
    tokens = torch.tensor(list(verified[:end]), device=device)[None]  # [1, e]
    positions = torch.arange(end, device=device)[None]  # [1, e]
    embedded = dense.embedding(input_ids=tokens, position_ids=positions)  # [e, 1, H]
    decoded = dense.decoder(hidden_states=embedded, attention_mask=None, rotary_pos_emb=dense.rotary_pos_emb(end))
    hidden = decoded[end - 1 : end]  # [1, 1, H] decoder output at position e - 1
    weight = dense.shared_embedding_or_output_weight() if dense.share_embeddings_and_output_weights else None
    token, drafts = verified[end], []
    for depth in range(num_speculative_tokens):
        ids = torch.tensor([[0, token]], device=device)  # rolled left by the layer: row 0 reads `token`
        ids_positions = torch.tensor([[end + depth - 1, end + depth]], device=device)
        rows = torch.cat([hidden, torch.zeros_like(hidden)])  # [2, 1, H]; row 1 is never read
        out, _, _ = dense.mtp.layers[depth](input_ids=ids, position_ids=ids_positions, hidden_states=rows,
                                            attention_mask=None, rotary_pos_emb=dense.rotary_pos_emb(2),
                                            embedding=dense.embedding)
        hidden = out[:1]  # [1, 1, H]
        token = int(dense.output_layer(hidden, weight=weight)[0][0, 0].argmax())
        drafts.append(token)
    return drafts


class RecordingProposer(Proposer):
    """Delegates to an :class:`MTPProposer` and records ``(request_id, e, drafts)`` of every
    real request's proposal, and when each request was proposed for or forgotten."""

    def __init__(self, mode: str):
        self.inner = MTPProposer(mode)
        self.proposals: List[Tuple[int, int, List[int]]] = []
        self.events: List[Tuple[str, int]] = []  # ("propose" | "forget", request_id), in call order

    def bind(self, draft_context) -> None:
        super().bind(draft_context)
        self.inner.bind(draft_context)
        self.num_speculative_tokens = draft_context.shape.num_speculative_tokens

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        drafts = self.inner.propose(batch)
        num_real = batch.step.num_sampling_requests  # the rest pads a CUDA-graph batch
        ends = verified_ends(batch, self.num_speculative_tokens).tolist()  # test-only read of device values
        for index, request_id in enumerate(batch.step.request_ids[:num_real]):
            self.proposals.append((request_id, ends[index], drafts[index].tolist()))
            self.events.append(("propose", request_id))
        return drafts

    def on_step_committed(self, step, accepted_counts) -> None:
        self.inner.on_step_committed(step, accepted_counts)

    def forget(self, request_id: int) -> None:
        self.events.append(("forget", request_id))
        self.inner.forget(request_id)

    def preempted_requests(self) -> set:
        """Requests that proposed again after being forgotten: evicted for KV space, then
        recomputed (a finished request is forgotten once and never proposes again)."""
        forgotten, preempted = set(), set()
        for kind, request_id in self.events:
            if kind == "forget":
                forgotten.add(request_id)
            elif request_id in forgotten:
                preempted.add(request_id)
        return preempted

def check_drafts_against_oracle(dense, proposer: RecordingProposer, sequences: Dict[int, Sequence[int]],
                                mode: str) -> int:
    """Assert every recorded proposal equals its mode's oracle; returns how many of them the
    other mode's oracle would have got wrong (so a caller can check the modes differ)."""
    S = proposer.num_speculative_tokens
    assert proposer.proposals, "no proposal was recorded"
    differ = 0
    for request_id, end, drafts in proposer.proposals:
        verified = list(sequences[request_id][: end + 1])
        assert len(verified) == end + 1, (request_id, end)
        paged = paged_oracle_drafts(dense, verified, drafts)
        single = single_position_oracle_drafts(dense, verified, S)
        want, other = (paged, single) if mode == "paged" else (single, paged)
        assert drafts == want, (mode, request_id, end, drafts, want)
        differ += other != want
    return differ
