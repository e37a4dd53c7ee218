"""Text generation controllers: the step loop, sampling, acceptance, proposers.

The names below load on first use (PEP 562), so ``from mtp_ctrl.controllers import SamplingParams``
(the server's HTTP frontend) does not import megatron-core; ``TextGenerationController`` and the
proposers do (through the model adapters).
"""

import importlib
from typing import TYPE_CHECKING

_MODULE_OF = {
    "InferenceConfig": "config", "SamplingParams": "config",
    "TextGenerationController": "controller",
    "EagleProposer": "eagle_proposer",
    "HiddenStateCapture": "hidden_state_capture",
    "MTPProposer": "mtp_proposer",
    "MultiLayerEagleProposer": "multi_layer_eagle_proposer",
    "ParallelDraftingProposer": "parallel_drafting_proposer",
    "DraftContext": "draft_context",
    "DraftLengthPolicy": "draft_policy", "DraftLengthQuery": "draft_policy", "FixedDraftLength": "draft_policy",
    "GoodputPolicy": "draft_policy", "RandomDraftLengths": "draft_policy", "StepCostModel": "draft_policy",
    "PerRequestGoodputPolicy": "per_request_policy",
    "DraftBatch": "proposers", "Proposer": "proposers",
    "GenerationResult": "requests", "Request": "requests", "RequestStatus": "requests",
    "FinishReason": "stop_rules",
}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(_MODULE_OF))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from mtp_ctrl.controllers.config import InferenceConfig, SamplingParams
    from mtp_ctrl.controllers.controller import TextGenerationController
    from mtp_ctrl.controllers.draft_context import DraftContext
    from mtp_ctrl.controllers.draft_policy import (DraftLengthPolicy, DraftLengthQuery, FixedDraftLength,
                                                   GoodputPolicy, RandomDraftLengths, StepCostModel)
    from mtp_ctrl.controllers.eagle_proposer import EagleProposer
    from mtp_ctrl.controllers.hidden_state_capture import HiddenStateCapture
    from mtp_ctrl.controllers.mtp_proposer import MTPProposer
    from mtp_ctrl.controllers.multi_layer_eagle_proposer import MultiLayerEagleProposer
    from mtp_ctrl.controllers.parallel_drafting_proposer import ParallelDraftingProposer
    from mtp_ctrl.controllers.per_request_policy import PerRequestGoodputPolicy
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
    "PerRequestGoodputPolicy",
    "Proposer",
    "RandomDraftLengths",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "StepCostModel",
    "TextGenerationController",
]
