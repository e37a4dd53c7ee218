"""The draft heads' checkpoints that ``examples/train_eagle.py`` (EAGLE and parallel-drafting
heads) and ``examples/train_multi_layer_eagle.py`` (multi-layer EAGLE) write, read back as
proposers for a target model (each tensor-parallel rank keeps its shard). A file of another kind
raises a ValueError naming the path and what it is instead."""

import torch

from mtp_ctrl.models.demo_model import load_full_state_dict


def _load_head(model, path: str):
    """The head saved by examples/train_eagle.py (sharded for this TP rank); a parallel-drafting
    checkpoint (``mask_token_id`` saved, ``mask_hidden`` in its state_dict) builds a PTD head."""
    from mtp_ctrl.models import build_eagle_head

    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or "aux_layer_ids" not in saved or "state_dict" not in saved:
        raise ValueError(f"{path} is not an EAGLE head checkpoint (examples/train_eagle.py writes one)")
    mask_token_id = saved.get("mask_token_id")
    if (mask_token_id is None) != ("mask_hidden" not in saved["state_dict"]):
        raise ValueError(f"{path} has {'no ' if mask_token_id is None else ''}mask_token_id but "
                         f"{'a' if mask_token_id is None else 'no'} mask_hidden: a parallel-drafting head needs both "
                         "(examples/train_eagle.py --mode ptd saves both)")
    head = build_eagle_head(model, saved["aux_layer_ids"], use_transformer_engine=False,
                            parallel_drafting=mask_token_id is not None, mask_token_id=mask_token_id)
    load_full_state_dict(head, saved["state_dict"])
    return head.to(next(model.parameters()).device)


def load_eagle_proposer(model, path: str):
    """An EagleProposer (serial drafting) with the head saved by examples/train_eagle.py (either mode)."""
    from mtp_ctrl.controllers import EagleProposer

    return EagleProposer(_load_head(model, path))


def load_ptd_proposer(model, path: str):
    """A ParallelDraftingProposer with the head saved by ``examples/train_eagle.py --mode ptd``;
    a checkpoint without ``mask_token_id`` / ``mask_hidden`` raises a ValueError."""
    from mtp_ctrl.controllers import ParallelDraftingProposer

    head = _load_head(model, path)
    if not head.parallel_drafting:
        raise ValueError(f"{path} has no mask_token_id / mask_hidden: it is a serial EAGLE head; parallel drafting "
                         "needs a head trained with examples/train_eagle.py --mode ptd (or use --proposer eagle)")
    return ParallelDraftingProposer(head)


def load_draft_proposer(kind: str, model, path: str, num_speculative_tokens: int):
    """The proposer of ``--proposer kind`` ("eagle", "ptd" or "multi_layer_eagle") with its weights at ``path``."""
    if kind == "eagle":
        return load_eagle_proposer(model, path)
    if kind == "ptd":
        return load_ptd_proposer(model, path)
    if kind == "multi_layer_eagle":
        return load_multi_layer_eagle_proposer(model, path, num_speculative_tokens)
    raise ValueError(f"kind must be 'eagle', 'ptd' or 'multi_layer_eagle', got {kind!r}")


def load_multi_layer_eagle_proposer(model, path: str, num_speculative_tokens: int):
    """A MultiLayerEagleProposer with the layers saved by examples/train_multi_layer_eagle.py."""
    from mtp_ctrl.controllers import MultiLayerEagleProposer

    heads = load_multi_layer_eagle_heads(model, path)
    if heads.num_layers != num_speculative_tokens:
        raise ValueError(f"{path} has {heads.num_layers} draft layers: use --num-speculative-tokens {heads.num_layers}")
    return MultiLayerEagleProposer(heads)


def load_multi_layer_eagle_heads(model, path: str):
    """The draft layers saved by examples/train_multi_layer_eagle.py, built for ``model`` (this TP
    rank's shard), on its device."""
    from mtp_ctrl.models import build_multi_layer_eagle_heads

    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or not {"aux_layer_ids", "state_dict"} <= set(saved):
        raise ValueError(f"{path} is not a multi-layer EAGLE checkpoint (examples/train_multi_layer_eagle.py "
                         "writes one: num_layers, aux_layer_ids, state_dict)")
    num_layers = saved.get("num_layers")
    if num_layers is None:
        raise ValueError(f"{path} has no num_layers: a single EAGLE head (examples/train_eagle.py) is served "
                         "with --proposer eagle, not multi_layer_eagle")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"{path}: num_layers must be an int >= 1, got {num_layers!r}")
    state_dict = saved["state_dict"]
    layers_saved = {name.split(".")[1] for name in state_dict if name.startswith("layers.")}
    if len(layers_saved) != num_layers:
        raise ValueError(f"{path}: num_layers is {num_layers} but the state_dict holds "
                         f"{len(layers_saved)} draft layers")
    heads = build_multi_layer_eagle_heads(model, num_layers, saved["aux_layer_ids"], use_transformer_engine=False)
    try:
        load_full_state_dict(heads, state_dict)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"{path} does not fit this target: {error}") from None
    return heads.to(next(model.parameters()).device)


def load_eagle3_proposer(model, path: str):
    """An EagleProposer with the public EAGLE-3 head in directory ``path`` (``--draft-hf``)."""
    from mtp_ctrl.controllers import EagleProposer
    from mtp_ctrl.models import load_eagle3_head

    return EagleProposer(load_eagle3_head(path, model))


def load_cli_proposer(args, model, num_speculative_tokens: int):
    """``--proposer``'s drafter for generate.py and the server: the EAGLE-3 head of ``--draft-hf``,
    else the head of ``--draft-checkpoint``; a bad file ends the script in one line."""
    from mtp_ctrl.cli.model_source import checkpoint_or_exit

    if getattr(args, "draft_hf", None) is not None:
        return checkpoint_or_exit("--draft-hf", args.draft_hf, lambda path: load_eagle3_proposer(model, path))
    return checkpoint_or_exit("--draft-checkpoint", args.draft_checkpoint, lambda path: load_draft_proposer(
        args.proposer, model, path, num_speculative_tokens))
