"""Text generation controllers: the step loop, sampling, acceptance, proposers.

Importing this package imports megatron-core (through the model adapters).
"""

from mtp_ctrl.controllers.config import InferenceConfig, SamplingParams
from mtp_ctrl.controllers.controller import TextGenerationController
from mtp_ctrl.controllers.eagle_proposer import EagleProposer
from mtp_ctrl.controllers.hidden_state_capture import HiddenStateCapture
from mtp_ctrl.controllers.mtp_proposer import MTPProposer
from mtp_ctrl.controllers.multi_layer_eagle_proposer import MultiLayerEagleProposer
from mtp_ctrl.controllers.parallel_drafting_proposer import ParallelDraftingProposer
from mtp_ctrl.controllers.draft_context import DraftContext
from mtp_ctrl.controllers.draft_policy import (DraftLengthPolicy, DraftLengthQuery, FixedDraftLength, GoodputPolicy,
                                               RandomDraftLengths, StepCostModel)
from mtp_ctrl.controllers.proposers import DraftBatch, Proposer
from mtp_ctrl.controllers.requests import GenerationResult, Request, RequestStatus
from mtp_ctrl.controllers.stop_rules import FinishReason

__all__ = [
    "DraftBatch",
    "DraftContext",
    "DraftLengthPolicy",
    "DraftLengthQuery",
    "EagleProposer",
    "FinishReason",
    "FixedDraftLength",
    "GenerationResult",
    "GoodputPolicy",
    "HiddenStateCapture",
    "InferenceConfig",
    "MTPProposer",
    "MultiLayerEagleProposer",
    "ParallelDraftingProposer",
    "Proposer",
    "RandomDraftLengths",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "StepCostModel",
    "TextGenerationController",
]
