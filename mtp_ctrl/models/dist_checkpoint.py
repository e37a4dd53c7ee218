"""Megatron distributed checkpoints (``megatron.core.dist_checkpointing``, torch_dist format) in and out.

A Megatron user's checkpoint is a directory written by
``dist_checkpointing.save(model.sharded_state_dict(), dir)`` at some tensor-parallel size.
Every tensor in it is stored once, under a *checkpoint key* with its global (unsharded) shape;
decoder layers are stacked on a leading layer dimension (``decoder.layers.mlp.linear_fc1.weight``
is ``[num_layers, ffn, hidden]``). :func:`load_distributed_checkpoint` asks our model for its own
sharded state dict (which names this rank's shard of each tensor under those keys), so
dist_checkpointing reads exactly this rank's slices whatever TP size wrote the file.

Steps of a load (nothing in ``model`` changes unless every step succeeds):
1. The directory must be a dist checkpoint: ``metadata.json``, torch's ``.metadata`` and ``common.pt``
   are each read here first, so a damaged one is a ValueError naming it and the checkpoint.
2. Our sharded state dict is built; each key is mapped to the checkpoint's spelling
   (:data:`CHECKPOINT_KEY_ALIASES`, the one place where names are mapped); extra state is dropped.
3. Every requested key must be in the checkpoint with the same global shape, and every tensor of
   the checkpoint must be requested (optimizer state aside): else ValueError naming the keys.
4. dist_checkpointing loads into fresh tensors (not the model's parameters).
4a. Before that, a checkpoint we saved is checked against its record (``checkpoint_record.py``):
   the architecture fields that shapes do not show, and the sha256 of every file.
5. The loaded state dict is checked against ``model.state_dict()`` and copied in strictly.

Saving: :func:`save_distributed_checkpoint` writes the same format. megatron-core 0.16.1's
default torch_dist writer calls CUDA unconditionally (``torch.cuda.synchronize`` after its
asynchronous copy to the host, ``torch.cuda.current_device()`` in its finalisation), so a model on
the CPU is written by :class:`SynchronousTorchDistSaveStrategy` instead: the same translation of
megatron's sharded tensors and megatron's own save planner, through
``torch.distributed.checkpoint.save`` (synchronous, any process group). Either output loads
with ``dist_checkpointing.load``.
"""

import argparse
import contextlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint.api import CheckpointException
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingConfig
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)

from mtp_ctrl.models.checkpoint_record import check_megatron_args, check_record, read_record, write_record

# The one place where parameter names differ between layer specs. Each pair is two spellings of
# one checkpoint-key fragment: Transformer Engine fuses the layer norms into the next linear
# layer (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``);
# megatron's local spec keeps them apart (``input_layernorm.weight``, ``pre_mlp_layernorm.weight``).
# The local spec already writes the fused names (its ``sharded_state_dict_keys_map``), so most
# checkpoints match as they are; a key of ours that is absent is looked up under the other
# spelling of each pair (both directions), e.g. the separate ``pre_mlp_layernorm`` of TE's MoE
# layers, or checkpoints written before megatron mapped the names.
CHECKPOINT_KEY_ALIASES: Tuple[Tuple[str, str], ...] = (
    ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
    ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
    ("self_attention.in_proj.layer_norm_", "input_layernorm."),  # Gated DeltaNet layers (megatron's GDN spec)
)
# Checkpoint tensors that are not the model's and are ignored (not "unexpected"): optimizer state
# written next to the model by Megatron-LM's training loop.
IGNORED_CHECKPOINT_PREFIXES: Tuple[str, ...] = ("optimizer.",)
_EXTRA_STATE = "_extra_state"  # Transformer Engine's FP8 metadata objects; local layers hold none
_MAX_LISTED = 8  # problems listed by name in one error message
_CONFIG_FILE, _COMMON_FILE = "metadata.json", "common.pt"  # megatron's; torch's own is ".metadata"
# torch.distributed.checkpoint's deprecation notices on megatron-core 0.16's torch_dist path (not actionable here)
_TORCH_DCP_NOTICES = (r"`load_state_dict` is deprecated", r"Please use DTensor instead and we are deprecating ShardedTensor")


@contextlib.contextmanager
def _quiet_torch_dcp_notices():
    with warnings.catch_warnings():
        for message in _TORCH_DCP_NOTICES:
            warnings.filterwarnings("ignore", message=message, category=FutureWarning)
        yield


@contextlib.contextmanager
def _reading():
    """Reads of a checkpoint: torch's notices quiet, and ``argparse.Namespace`` (Megatron-LM's saved
    training ``args`` in ``common.pt``: plain attributes) allowed by torch's weights-only unpickler."""
    with _quiet_torch_dcp_notices(), torch.serialization.safe_globals([argparse.Namespace]):
        yield


class SynchronousTorchDistSaveStrategy(SaveShardedStrategy):
    """torch_dist save without CUDA: megatron's key translation and planner, written synchronously.

    Use it as ``dist_checkpointing.save(sharded_state_dict, dir, sharded_strategy=SynchronousTorchDistSaveStrategy())``.
    Relies on two helpers of megatron-core's torch strategy module (``_replace_state_dict_keys_with_sharded_keys``,
    ``mcore_to_pyt_state_dict``) as of 0.16.
    """

    def __init__(self, thread_count: int = 1):
        super().__init__("torch_dist", 1)
        self.thread_count = thread_count

    def save(self, sharded_state_dict, checkpoint_dir: Path) -> None:
        by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
        torch_state_dict = mcore_to_pyt_state_dict(by_key, False)
        torch_dcp.save(torch_state_dict, storage_writer=torch_dcp.FileSystemWriter(str(checkpoint_dir),
                                                                                  thread_count=self.thread_count),
                       planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))

    def can_handle_sharded_objects(self) -> bool:
        return True


def save_distributed_checkpoint(model: torch.nn.Module, checkpoint_dir: Union[str, os.PathLike],
                                content_metadata: Optional[dict] = None) -> None:
    """``dist_checkpointing.save(model.sharded_state_dict(), checkpoint_dir)`` on every rank.

    ``content_metadata`` (e.g. the model's shape) is stored with the checkpoint; read it back with
    :func:`read_content_metadata`. Global rank 0 then writes ``checkpoint_record.RECORD_FILE``: the
    architecture and a sha256 per file, checked by :func:`load_distributed_checkpoint`.

    ``checkpoint_dir`` is created if missing and must be empty. Parameters on CUDA use megatron's
    default (asynchronous-capable) torch_dist writer, on the CPU :class:`SynchronousTorchDistSaveStrategy`.
    """
    path = Path(checkpoint_dir)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"checkpoint_dir {str(path)!r} must be an empty directory or not exist")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank sees the directory empty before rank 0 creates it
    path.mkdir(parents=True, exist_ok=True)
    on_cuda = next(model.parameters()).is_cuda
    with _quiet_torch_dcp_notices():
        dist_checkpointing.save(model.sharded_state_dict(), str(path),
                                sharded_strategy=None if on_cuda else SynchronousTorchDistSaveStrategy(),
                                content_metadata=content_metadata)
    distributed = torch.distributed.is_initialized()
    if distributed:
        torch.distributed.barrier()  # every rank's files are complete before they are hashed
    if not distributed or torch.distributed.get_rank() == 0:
        write_record(model, path)
    if distributed:
        torch.distributed.barrier()  # no rank returns before the record exists


def read_content_metadata(checkpoint_dir: Union[str, os.PathLike]) -> Optional[dict]:
    """The ``content_metadata`` a checkpoint was saved with (None if none); errors as :func:`load_distributed_checkpoint`'s."""
    return _read_checkpoint_files(_check_checkpoint_dir(checkpoint_dir)).get("content_metadata")


def load_distributed_checkpoint(model: torch.nn.Module, checkpoint_dir: Union[str, os.PathLike],
                                verify_checksums: bool = True) -> None:
    """Load a megatron dist checkpoint into ``model`` (e.g. :func:`mtp_ctrl.models.build_gpt_model`'s), in place.

    The checkpoint comes from ``dist_checkpointing.save(gpt_model.sharded_state_dict(), dir)`` of a
    megatron GPTModel of the same architecture (local or Transformer Engine spec, MTP layers
    included), written at any tensor-parallel size; ``model`` may be built at any other. Call it on
    every rank (each reads its own shard). Values are cast to the model's dtypes.

    Raises FileNotFoundError / NotADirectoryError / ValueError naming ``checkpoint_dir`` when it is
    not a dist checkpoint; ValueError naming the file and the checkpoint when a metadata file is
    damaged; ValueError naming every missing key, unexpected key and shape mismatch; ValueError
    naming the field when a checkpoint we saved records another architecture, and the file when a
    file fails its recorded sha256 (``verify_checksums=False`` skips reading every file twice).
    All of these are found before any tensor is read. On any error ``model`` is left as it was.
    """
    path = _check_checkpoint_dir(checkpoint_dir)
    common_state = _read_checkpoint_files(path)
    record = read_record(path)
    request = model.sharded_state_dict()
    drop_extra_state(request)
    with _naming_file(path, "its metadata (metadata.json, .metadata, common.pt)"), _reading():
        tensors_metadata = dist_checkpointing.load_tensors_metadata(str(path))  # checkpoint key -> ShardedTensor
    objects_metadata = None
    problems, requested_keys = [], set()
    for name, item in _flat_items(request):
        if isinstance(item, ShardedObject):
            if objects_metadata is None:
                with _naming_file(path, "its metadata (metadata.json, .metadata, common.pt)"), _reading():
                    objects_metadata = load_sharded_metadata(str(path))
            if item.unique_key not in objects_metadata:
                problems.append(f"missing key {name!r} (checkpoint object {item.unique_key!r})")
            continue
        item_problems, keys = _resolve_key(name, item, tensors_metadata)
        problems += item_problems
        requested_keys.update(keys)
    unexpected = sorted(key for key in tensors_metadata if key not in requested_keys
                        and not key.startswith(IGNORED_CHECKPOINT_PREFIXES))
    problems += [f"unexpected key {key!r} (shape {tuple(tensors_metadata[key].global_shape)}) in the checkpoint, "
                 "not in the model" for key in unexpected]
    _raise_if(problems, path, "does not match the model")
    if record is not None:
        check_record(model, path, record, verify_checksums)
    else:  # written by megatron: no record, no checksums; Megatron-LM's args say a little
        check_megatron_args(model, common_state, path)
    requested_names = set(request)
    for item in nested_values(request):  # read into fresh tensors: the model is untouched until the end
        if isinstance(item, (ShardedTensor, ShardedTensorFactory)):
            item.data = torch.empty_like(item.data.detach())
    try:
        with _reading():
            loaded = dist_checkpointing.load(request, str(path))
    except CheckpointException as error:  # a BaseException in torch.distributed.checkpoint: make it an Exception
        raise RuntimeError(f"reading checkpoint {str(path)!r} failed (the model was not changed): {error}") from error
    # the result also holds the checkpoint's common (non-tensor) state, e.g. its content metadata
    _assign(model, {name: value for name, value in loaded.items() if name in requested_names}, path)


def drop_extra_state(sharded_state_dict: Dict[str, Any]) -> None:
    """Remove the ``*._extra_state`` entries (Transformer Engine FP8 metadata) from a nested sharded state dict."""
    for key in list(sharded_state_dict):
        value = sharded_state_dict[key]
        if isinstance(value, dict):
            drop_extra_state(value)
        elif key.endswith(_EXTRA_STATE):
            del sharded_state_dict[key]


def checkpoint_key_spellings(key: str) -> List[str]:
    """``key`` and its other spellings under :data:`CHECKPOINT_KEY_ALIASES`, ``key`` first.

    >>> checkpoint_key_spellings("decoder.layers.mlp.linear_fc1.layer_norm_weight")
    ['decoder.layers.mlp.linear_fc1.layer_norm_weight', 'decoder.layers.pre_mlp_layernorm.weight']
    """
    spellings = [key]
    for first, second in CHECKPOINT_KEY_ALIASES:
        for old, new in ((first, second), (second, first)):
            if old in key:
                spellings.append(key.replace(old, new))
    return spellings


def _check_checkpoint_dir(checkpoint_dir) -> Path:
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir must be a path, got {type(checkpoint_dir).__name__}")
    path = Path(checkpoint_dir)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint_dir {str(path)!r} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"checkpoint_dir {str(path)!r} is not a directory")
    if not (path / _CONFIG_FILE).exists():
        raise ValueError(f"checkpoint_dir {str(path)!r} is not a megatron.core.dist_checkpointing checkpoint "
                         f"(no {_CONFIG_FILE})")
    return path


@contextlib.contextmanager
def _naming_file(path: Path, file_name: str):
    """Turn any error of reading ``file_name`` into a ValueError naming it and the checkpoint. torch's
    unpickling errors advise ``weights_only=False`` (running whatever the file holds): that text is dropped."""
    try:
        yield
    except Exception as error:  # noqa: BLE001  (megatron and torch raise many kinds here)
        detail = str(error).splitlines()[0] if str(error) else ""
        detail = "" if "weights_only" in str(error) else f": {detail}"
        raise ValueError(f"checkpoint {str(path)!r}: {file_name} is damaged or unreadable "
                         f"({type(error).__name__}{detail}); the model was not changed") from None


def _read_checkpoint_files(path: Path) -> dict:
    """Read and check ``metadata.json``, torch's ``.metadata`` and ``common.pt``, each naming itself when
    damaged (megatron reads them again, unguarded); returns the common state (a dict)."""
    with _naming_file(path, _CONFIG_FILE):
        config = json.loads((path / _CONFIG_FILE).read_text())
        if not isinstance(config, dict) or not isinstance(config.get("sharded_backend"), str):
            raise ValueError("a JSON object with a 'sharded_backend' string is expected")
        CheckpointingConfig(**config)
    if config["sharded_backend"] != "torch_dist":
        raise ValueError(f"checkpoint {str(path)!r}: {_CONFIG_FILE} names the {config['sharded_backend']!r} "
                         "format; only torch_dist is read")
    with _naming_file(path, ".metadata"):
        torch_dcp.FileSystemReader(str(path)).read_metadata()
    with _naming_file(path, _COMMON_FILE):
        if not (path / _COMMON_FILE).is_file():
            raise FileNotFoundError("the file is missing")
        with _reading():
            common_state = torch.load(path / _COMMON_FILE, map_location="cpu", weights_only=True)
        if not isinstance(common_state, dict):
            raise ValueError(f"a dict is expected, it holds a {type(common_state).__name__}")
    return common_state


def _flat_items(sharded_state_dict, prefix: str = ""):
    """``(state-dict name, sharded item)`` pairs; a factory is its own item (it builds its tensors at load)."""
    for key, value in sharded_state_dict.items():
        if isinstance(value, dict):
            yield from _flat_items(value, prefix)
        else:
            yield key, value


def _resolve_key(name: str, item, tensors_metadata) -> Tuple[List[str], List[str]]:
    """Point ``item`` at the checkpoint's spelling of its key; ``(problems found, checkpoint keys read)``."""
    original = item.key

    def stored(key: str) -> bool:  # a factory (e.g. GDN's in_proj parts) is stored as the tensors it builds
        if not isinstance(item, ShardedTensorFactory):
            return key in tensors_metadata
        item.key = key
        built = item.build()
        return all(part.key in tensors_metadata
                   for part in (nested_values(built) if isinstance(built, (dict, list)) else [built]))

    found = next((key for key in checkpoint_key_spellings(original) if stored(key)), None)
    if found is None:
        item.key = original
        return [f"missing key {name!r} (checkpoint key {item.key!r}) in the checkpoint"], []
    item.key = found
    built = item.build() if isinstance(item, ShardedTensorFactory) else item  # a factory: the tensors it reads
    problems, keys = [], []
    for tensor in nested_values(built) if isinstance(built, (dict, list)) else [built]:
        stored = tensors_metadata.get(tensor.key)
        if stored is None:
            problems.append(f"missing key {name!r} (checkpoint key {tensor.key!r}) in the checkpoint")
            continue
        keys.append(tensor.key)
        if tuple(tensor.global_shape) != tuple(stored.global_shape):
            stacked = " (dimension 0 of decoder.layers.* is the layer count)" if tensor.key.startswith(
                "decoder.layers.") else ""
            problems.append(f"shape mismatch for {name!r} (checkpoint key {tensor.key!r}): the checkpoint has "
                            f"{tuple(stored.global_shape)}, the model needs {tuple(tensor.global_shape)}{stacked}: "
                            "another architecture?")
    return problems, keys


def _assign(model: torch.nn.Module, loaded: Dict[str, Any], path: Path) -> None:
    """Copy ``loaded`` into ``model`` after checking it covers ``model.state_dict()`` with equal shapes."""
    current = model.state_dict()
    for key in current:  # the dropped extra state keeps the model's own value
        if key.endswith(_EXTRA_STATE) and key not in loaded:
            loaded[key] = current[key]
    problems = [f"missing key {key!r} after loading" for key in current if key not in loaded]
    problems += [f"unexpected key {key!r} after loading" for key in loaded if key not in current]
    problems += [f"shape mismatch for {key!r}: loaded {tuple(value.shape)}, the model needs {tuple(current[key].shape)}"
                 for key, value in loaded.items() if torch.is_tensor(value) and key in current
                 and torch.is_tensor(current[key]) and value.shape != current[key].shape]
    _raise_if(problems, path, "did not load into the model")
    model.load_state_dict(loaded, strict=True)


def _raise_if(problems: List[str], path: Path, what: str) -> None:
    if not problems:
        return
    listed = "\n  ".join(problems[:_MAX_LISTED])
    more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    raise ValueError(f"checkpoint {str(path)!r} {what} ({len(problems)} problem(s); the model was not changed):"
                     f"\n  {listed}{more}")
