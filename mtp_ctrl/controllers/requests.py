"""What the controller keeps per request on the host, and what it hands back."""

import dataclasses
from typing import List, Optional, Tuple

from mtp_ctrl.controllers.config import SamplingParams
from mtp_ctrl.controllers.stop_rules import FinishReason


@dataclasses.dataclass
class RequestRecord:
    request_id: int
    prompt_tokens: List[int]
    params: SamplingParams
    seed: int  # the request's sampling seed (its params' seed, or one drawn at admission)
    output_tokens: List[int] = dataclasses.field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    decode_steps: int = 0  # verify steps this request took part in
    accepted_drafts: int = 0  # drafts accepted over those steps
    preemptions: int = 0  # times it was evicted for KV space and recomputed


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    request_id: int
    prompt_tokens: Tuple[int, ...]
    output_tokens: Tuple[int, ...]
    finish_reason: FinishReason
    decode_steps: int
    accepted_drafts: int
    num_speculative_tokens: int
    preemptions: int = 0  # times it was evicted for KV space and recomputed

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verify step: 1 (the target's own token) + accepted drafts."""
        return 1.0 + self.accepted_drafts / self.decode_steps if self.decode_steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        drafted = self.decode_steps * self.num_speculative_tokens
        return self.accepted_drafts / drafted if drafted else 0.0

    @classmethod
    def from_record(cls, record: RequestRecord, num_speculative_tokens: int) -> "GenerationResult":
        return cls(
            request_id=record.request_id,
            prompt_tokens=tuple(record.prompt_tokens),
            output_tokens=tuple(record.output_tokens),
            finish_reason=record.finish_reason,
            decode_steps=record.decode_steps,
            accepted_drafts=record.accepted_drafts,
            num_speculative_tokens=num_speculative_tokens,
            preemptions=record.preemptions,
        )
