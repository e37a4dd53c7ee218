"""What the EAGLE-family drafters share (EAGLE, parallel drafting, multi-layer EAGLE): a draft
module fed the target's hidden states at some decoder layers (its "aux" layers), checked against
the target once at bind; the token after each request's last verified row; and the record of ``q``
for rejection acceptance."""

from typing import Optional

import torch

from mtp_ctrl.controllers.draft_context import DraftContext
from mtp_ctrl.controllers.proposers import DraftBatch, Proposer
from mtp_ctrl.models.runner import check_aux_layer_ids


class AuxDraftProposer(Proposer):
    """Base class: ``module`` (an EAGLE head or multi-layer heads: ``config.hidden_size``,
    ``aux_layer_ids``, parameters on the target's device) is called ``module_name`` in errors and
    keeps the drafts' logits (``q``) in device rows named ``logits_name``."""

    module_name = "head"
    logits_name = "draft_logits"
    sees_never_drafting_steps = False  # the head's cache is read only by the request's own drafts

    def __init__(self, module):
        self.module = module.eval()

    def bind(self, draft_context: DraftContext) -> None:
        """Check that the module fits the target (hidden size, device, aux layers), then make the
        target's forward expose those aux layers."""
        runner, shape, name = draft_context.runner, draft_context.shape, self.module_name
        if self.module.config.hidden_size != runner.hidden_size:
            raise ValueError(f"{name} hidden size {self.module.config.hidden_size} != the target's {runner.hidden_size}")
        parameter = next(self.module.parameters())
        if parameter.device != shape.device:
            raise ValueError(f"{name} lives on {parameter.device}, the target on {shape.device}")
        check_aux_layer_ids(self.module.aux_layer_ids, runner.num_decoder_layers)
        runner.set_aux_layers(self.module.aux_layer_ids)
        super().bind(draft_context)
        self._draft_logits = draft_context.draft_logits_rows(self.logits_name)  # q (rejection acceptance only)

    def draft_logits(self) -> Optional[torch.Tensor]:
        return None if self._draft_logits is None else self._draft_logits.rows

    def _check_aux_hidden(self, batch: DraftBatch) -> None:
        if batch.aux_hidden is None:
            raise RuntimeError(f"{type(self).__name__}: the step carries no aux hidden states "
                               "(runner.set_aux_layers was undone)")

    def _record_draft_logits(self, batch: DraftBatch, logits: torch.Tensor, depth: Optional[int] = None) -> None:
        """The ``logits`` the drafts were just sampled from (rejection acceptance only; ``depth`` None:
        every depth of each request at once, ``[G * S, V]``)."""
        if self._draft_logits is not None:
            write_rows = torch.where(batch.samples, batch.write_rows, self.draft_context.scratch_row)  # [G] int64
            self._draft_logits.record(logits, write_rows, depth)

    def _next_tokens(self, batch: DraftBatch) -> torch.Tensor:
        """``[G]`` int64: the token after each request's last verified row: the bonus token, or for
        a chunk that does not end its prompt (the only real request that does not sample) the
        next prompt token, which the step staged on the device."""
        step = batch.step
        request_index = torch.arange(batch.num_requests, device=batch.next_tokens.device)
        mid_prompt = (request_index < step.num_active) & ~batch.samples
        return torch.where(mid_prompt, step.next_prompt_token, batch.next_tokens)
