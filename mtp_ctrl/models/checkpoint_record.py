"""What a dist checkpoint we save records beside megatron's files, and the checks it makes possible.

Shapes alone do not identify a model: 4 heads over 2 query groups of 16 channels and 8 heads over
4 groups of 8 channels have the same QKV and projection shapes, and so do two rotary bases, two
normalizations or two router top-k values. And torch_dist stores no checksums, so a flipped bit
in a shard loads silently. :func:`write_record` (run by ``save_distributed_checkpoint``) writes
``RECORD_FILE`` into the checkpoint directory::

    {"format": 1,
     "architecture": {"num_attention_heads": 4, "num_query_groups": 2, "rotary_base": 10000, ...},
     "sha256": {"__0_0.distcp": "9f2c...", "common.pt": "...", ".metadata": "...", ...}}

and :func:`check_record` compares both with the model and the files at load. Checkpoints that
megatron (or Megatron-LM) wrote carry no record: for those :func:`check_megatron_args` compares
the fields Megatron-LM's saved ``args`` share with the model, and nothing is checksummed.
"""

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

RECORD_FILE = "mtp_ctrl_checkpoint.json"
RECORD_FORMAT = 1
_HASH_CHUNK_BYTES = 16 << 20
# TransformerConfig fields that change what the weights mean without (always) changing their shapes
CONFIG_FIELDS = (
    "num_attention_heads", "num_query_groups", "kv_channels", "multi_latent_attention", "qk_layernorm",
    "softmax_scale", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "rotary_base", "rotary_percent", "rotary_interleaved", "rope_type", "rotary_scaling_factor",
    "normalization", "layernorm_epsilon", "layernorm_zero_centered_gamma", "activation_func", "gated_linear_unit",
    "apply_residual_connection_post_layernorm", "add_bias_linear", "add_qkv_bias",
    "num_moe_experts", "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
    "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size", "mtp_num_layers",
)
# GPTModel attributes with the same role (they are constructor arguments, not config fields)
MODEL_FIELDS = ("position_embedding_type", "rotary_base", "rotary_percent", "rotary_scaling",
                "share_embeddings_and_output_weights")
# Megatron-LM argument -> our record's field, for checkpoints Megatron-LM wrote (their common.pt holds ``args``)
MEGATRON_ARGS = {"num_attention_heads": "num_attention_heads", "kv_channels": "kv_channels",
                 "rotary_base": "rotary_base", "rotary_percent": "rotary_percent", "normalization": "normalization",
                 "norm_epsilon": "layernorm_epsilon", "swiglu": "gated_linear_unit", "num_experts": "num_moe_experts",
                 "moe_router_topk": "moe_router_topk", "qk_layernorm": "qk_layernorm",
                 "position_embedding_type": "position_embedding_type", "mtp_num_layers": "mtp_num_layers"}


def _plain(value) -> Any:
    """A JSON value standing for ``value`` (a function by its name, an enum by its name)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if callable(value) and hasattr(value, "__name__"):
        return value.__name__
    if hasattr(value, "name") and isinstance(getattr(value, "name"), str):  # an enum
        return value.name
    return repr(value)


def architecture_of(model: torch.nn.Module) -> Dict[str, Any]:
    """The model's shape-blind architecture facts (:data:`CONFIG_FIELDS`, :data:`MODEL_FIELDS`) as JSON values."""
    config = model.config
    record = {name: _plain(getattr(config, name)) for name in CONFIG_FIELDS if hasattr(config, name)}
    record.update({name: _plain(getattr(model, name)) for name in MODEL_FIELDS if hasattr(model, name)})
    return record


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(_HASH_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _checkpoint_files(checkpoint_dir: Path) -> List[str]:
    return sorted(str(p.relative_to(checkpoint_dir)) for p in checkpoint_dir.rglob("*")
                  if p.is_file() and p.name != RECORD_FILE)


def write_record(model: torch.nn.Module, checkpoint_dir: Path) -> None:
    """Write :data:`RECORD_FILE`: the model's architecture and the sha256 of every file of the checkpoint
    (call it once, after every rank has written its files)."""
    record = {"format": RECORD_FORMAT, "architecture": architecture_of(model),
              "sha256": {name: file_sha256(checkpoint_dir / name) for name in _checkpoint_files(checkpoint_dir)}}
    (checkpoint_dir / RECORD_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))


def read_record(checkpoint_dir: Path) -> Optional[dict]:
    """The checkpoint's record, None if it has none (megatron wrote it); ValueError naming the file if damaged."""
    path = checkpoint_dir / RECORD_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"checkpoint {str(checkpoint_dir)!r}: {RECORD_FILE} is damaged or unreadable "
                         f"({type(error).__name__}: {error})") from None
    if not (isinstance(record, dict) and isinstance(record.get("architecture"), dict)
            and isinstance(record.get("sha256"), dict)):
        raise ValueError(f"checkpoint {str(checkpoint_dir)!r}: {RECORD_FILE} is damaged (it needs the "
                         "'architecture' and 'sha256' objects)")
    return record


def _raise_on_mismatch(saved: Dict[str, Any], mine: Dict[str, Any], checkpoint_dir: Path, source: str) -> None:
    mismatches = [f"{name}: the checkpoint has {saved[name]!r}, the model has {mine[name]!r}"
                  for name in sorted(saved) if name in mine and saved[name] != mine[name]]
    if mismatches:
        listed = "\n  ".join(mismatches)
        raise ValueError(f"checkpoint {str(checkpoint_dir)!r} was saved from another architecture ({source}; "
                         f"the model was not changed):\n  {listed}")


def check_record(model: torch.nn.Module, checkpoint_dir: Path, record: dict, verify_checksums: bool) -> None:
    """ValueError naming the field when the record's architecture differs from the model's, or naming the
    file when a file's sha256 differs from the record (a damaged or replaced shard)."""
    _raise_on_mismatch(record["architecture"], architecture_of(model), checkpoint_dir, RECORD_FILE)
    if not verify_checksums:
        return
    for name, expected in sorted(record["sha256"].items()):
        path = checkpoint_dir / name
        if not path.is_file():
            raise ValueError(f"checkpoint {str(checkpoint_dir)!r}: {name} is missing ({RECORD_FILE} lists it)")
        if file_sha256(path) != expected:
            raise ValueError(f"checkpoint {str(checkpoint_dir)!r}: {name} fails its sha256 checksum (damaged or "
                             f"changed since it was saved; {RECORD_FILE} holds the saved checksum)")


def check_megatron_args(model: torch.nn.Module, common_state: dict, checkpoint_dir: Path) -> None:
    """For a checkpoint without a record: compare what Megatron-LM's saved ``args`` (if any) say with the model."""
    args = common_state.get("args")
    if args is None:
        return
    saved = {field: _plain(getattr(args, arg)) for arg, field in MEGATRON_ARGS.items()
             if getattr(args, arg, None) is not None}
    if getattr(args, "group_query_attention", False) and getattr(args, "num_query_groups", None) is not None:
        saved["num_query_groups"] = args.num_query_groups
    if saved.get("num_moe_experts") == 0:
        saved["num_moe_experts"] = None
    if saved.get("gated_linear_unit") is False:  # swiglu off says nothing of other gated units
        del saved["gated_linear_unit"]
    _raise_on_mismatch(saved, architecture_of(model), checkpoint_dir, "Megatron-LM's saved args")
