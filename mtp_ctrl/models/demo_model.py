"""The shipped demo GPT: its shape, how it is built (paged for serving, dense for training), its
one-file checkpoint format, and :func:`load_demo_model`, which serves the trained checkpoint that
ships with the package (:mod:`mtp_ctrl.checkpoints`).

A checkpoint is one ``torch.save``'d dict ``{"model_args": DEMO_MODEL_ARGS-like dict,
"state_dict": the TP = 1 model's state_dict in bf16}`` (written by ``examples/train_mtp.py``);
:func:`load_checkpoint` reads it and :func:`load_full_state_dict` loads it into a model of any
tensor-parallel size (each rank keeps its shard). The layers are megatron-core's local (non
Transformer Engine) ones, so a checkpoint loads on every machine. Distributed checkpoints
(megatron's ``dist_checkpointing``) are :mod:`mtp_ctrl.models.dist_checkpoint`'s.
"""

import os
from typing import Any, Dict, Optional, Tuple, Union

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from mtp_ctrl.checkpoints import shipped_checkpoint_path
from mtp_ctrl.models.dense_attention import build_dense_gpt_model
from mtp_ctrl.models.gpt_builder import build_gpt_model
from mtp_ctrl.models.mamba_mixer import shard_full_tensor

DEMO_MODEL_ARGS: Dict[str, int] = dict(
    num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8, num_query_groups=4,
    mtp_num_layers=2, vocab_size=512, max_sequence_length=1024,
)
_SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "mtp_num_layers")
CHECKPOINT_DTYPE = torch.bfloat16


def build_demo_model(model_args: Dict[str, int], tensor_parallel_size: int = 1, dense: bool = False,
                     **config_overrides: Any) -> GPTModel:
    """The GPT of ``model_args`` in fp32 without dropout: paged attention (serving) or dense (training).

    Weights are drawn on the CPU from torch's global generator, so every TP rank seeded alike
    draws the same master weights and keeps its shard. ``config_overrides`` are extra
    TransformerConfig fields (e.g. ``mtp_loss_scaling_factor``).
    """
    missing = [name for name in (*_SHAPE_FIELDS, "vocab_size", "max_sequence_length") if name not in model_args]
    if missing:
        raise ValueError(f"model_args lacks {missing}")
    config = TransformerConfig(
        **{name: model_args[name] for name in _SHAPE_FIELDS},
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        tensor_model_parallel_size=tensor_parallel_size, **config_overrides,
    )
    build = build_dense_gpt_model if dense else build_gpt_model
    return build(config, model_args["vocab_size"], model_args["max_sequence_length"], use_transformer_engine=False)


def config_overrides(model_args: Dict[str, Any]) -> Dict[str, Any]:
    """The entries of ``model_args`` that are not shape fields: extra TransformerConfig fields
    (e.g. ``{"normalization": "RMSNorm", "gated_linear_unit": True}``) for :func:`build_demo_model`."""
    return {name: value for name, value in model_args.items()
            if name not in (*_SHAPE_FIELDS, "vocab_size", "max_sequence_length")}


def save_checkpoint(path: str, model_args: Dict[str, int], model: GPTModel) -> None:
    """Save ``{"model_args", "state_dict"}`` with floating-point tensors in bf16 (half the size of fp32)."""
    state_dict = {name: value.detach().to("cpu", CHECKPOINT_DTYPE) if torch.is_tensor(value) and value.is_floating_point()
                  else value for name, value in model.state_dict().items()}
    torch.save({"model_args": dict(model_args), "state_dict": state_dict}, path)


def load_checkpoint(path: str) -> Tuple[Dict[str, int], Dict[str, Any]]:
    """``(model_args, state_dict)`` of a file written by :func:`save_checkpoint` (tensors on the CPU).

    A file that is not one (another format, truncated, not a torch file) raises a ValueError
    naming the path; a missing file a FileNotFoundError."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises RuntimeError, pickle's errors, EOFError, ... for bad files
        raise ValueError(f"{path} is not a readable torch checkpoint ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else 'no detail'})") from error
    if not isinstance(checkpoint, dict) or set(checkpoint) != {"model_args", "state_dict"}:
        raise ValueError(f"{path} is not a demo checkpoint (a dict with model_args and state_dict)")
    return checkpoint["model_args"], checkpoint["state_dict"]


def load_full_state_dict(model: torch.nn.Module, state_dict: Dict[str, Any]) -> None:
    """Strictly load a TP = 1 state_dict into ``model`` built at any tensor-parallel size.

    A tensor-parallel parameter keeps this rank's contiguous chunk along its ``partition_dim``,
    as megatron's CPU initialisation shards master weights. Example at TP = 2: a column-parallel
    ``linear_qkv.weight`` [512, 256] gives rank 1 rows 256..511; a row-parallel ``linear_proj.weight``
    [256, 256] gives rank 1 columns 128..255; layer norms are copied whole. A Mamba mixer's
    ``in_proj`` and ``conv1d`` keep this rank's chunk of each of their sections (z, x, B, C, dt),
    megatron's layout (``mtp_ctrl.models.mamba_mixer.shard_full_tensor``). Values are cast to
    the model's dtype.
    """
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    parameters = dict(model.named_parameters())
    local = {}
    for name, value in state_dict.items():
        parameter = parameters.get(name)
        if parameter is not None:
            try:
                value = shard_full_tensor(parameter, value, tp_rank, tp_size)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
        local[name] = value
    model.load_state_dict(local)


def load_demo_model(path: Optional[str] = None, device: Union[str, torch.device, None] = None) -> GPTModel:
    """The trained demo GPT, ready to serve: paged attention, fp32, eval mode, on ``device``.

    ``path``: a checkpoint written by ``examples/train_mtp.py`` (default: the one shipped with the
    package, 4 layers, hidden 256, 2 MTP layers, byte tokens: ``vocab_size`` 512,
    ``max_sequence_length`` 1024). ``device``: ``"cpu"``, ``"cuda"`` or a ``torch.device``
    (default: CUDA when available). Each tensor-parallel rank keeps its shard, so call
    :func:`mtp_ctrl.init_single_process` first (or, under torchrun, set up ``torch.distributed``
    and megatron's ``parallel_state`` yourself).
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is cuda, but torch sees no CUDA device (use device='cpu')")
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron's parallel_state is not initialised: call mtp_ctrl.init_single_process() "
                           "first (under torchrun: torch.distributed and parallel_state.initialize_model_parallel)")
    model_args, state_dict = load_checkpoint(os.fspath(path) if path is not None else shipped_checkpoint_path())
    model = build_demo_model(model_args, parallel_state.get_tensor_model_parallel_world_size(),
                             **config_overrides(model_args))
    load_full_state_dict(model, state_dict)
    return model.to(device).eval()
