"""Which family serves a Hugging Face ``config.json``: every family we load, and the ones we refuse
with a message naming what is missing (:func:`resolve_family`)."""

from typing import Any, Mapping, Tuple

from mtp_ctrl.models.hf_families import FAMILIES as ATTENTION_FAMILIES
from mtp_ctrl.models.hf_families import HFFamily, UnsupportedCheckpointError
from mtp_ctrl.models.hf_gdn_families import GDN_FAMILIES

# Every family load_hf_checkpoint serves, in lookup order.
FAMILIES: Tuple[HFFamily, ...] = ATTENTION_FAMILIES + GDN_FAMILIES

# Families people hold whose layers this package does not build yet: model_type -> what is missing.
REFUSED_FAMILIES: Mapping[str, str] = {
    "deepseek_v2": "DeepSeek-V2 (softmax routing over MLA): its name table is not written yet (DeepSeek-V3 loads)",
    "qwen3_5_moe": ("Qwen3.5-MoE: its name table is not written yet (Qwen3-Next and dense Qwen3.5, the same "
                    "Gated DeltaNet hybrid, load)"),
    "qwen3_5_moe_text": ("Qwen3.5-MoE: its name table is not written yet (Qwen3-Next and dense Qwen3.5, the same "
                         "Gated DeltaNet hybrid, load)"),
    "mimo_v2_flash": "MiMo-V2-Flash needs sliding-window attention with attention sinks and MoE layers, "
                     "which mtp_ctrl does not build yet",
    "mistral": "Mistral checkpoints use sliding-window attention; their table is not written yet",
}


def resolve_family(config: Mapping[str, Any]) -> HFFamily:
    """The family of a ``config.json`` (by ``architectures``, else ``model_type``); refused families
    and unknown ones raise :class:`UnsupportedCheckpointError` naming what is missing."""
    model_type = config.get("model_type")
    if model_type in REFUSED_FAMILIES:
        raise UnsupportedCheckpointError(f"model_type {model_type!r}: {REFUSED_FAMILIES[model_type]}")
    architectures = tuple(config.get("architectures") or ())
    if any("eagle" in name.lower() for name in architectures):
        raise UnsupportedCheckpointError(f"architecture {list(architectures)} is an EAGLE draft head, not a target "
                                         "model: load it with mtp_ctrl.models.load_eagle3_head(path, target)")
    for family in FAMILIES:  # by architecture; by model_type only when config.json names none
        if set(architectures) & set(family.architectures) or (not architectures and model_type in family.model_types):
            return family
    supported = ", ".join(f"{family.name} ({'/'.join(family.architectures)})" for family in FAMILIES)
    raise UnsupportedCheckpointError(f"architecture {list(architectures)} (model_type {model_type!r}) is not "
                                     f"supported; supported families: {supported}")
