"""The demo GPT: its shape, how it is built (paged for serving, dense for training), its checkpoint file,
and the process-group setup megatron-core needs before building it.

Distributed checkpoints (megatron's ``dist_checkpointing``, any TP size) are written by
``examples/train_mtp.py --save-format dist`` with ``{"model_args": ...}`` as their content metadata
and read by ``examples/generate.py --load DIR`` (``mtp_ctrl.models.load_distributed_checkpoint``).

A checkpoint is one ``torch.save``'d dict ``{"model_args": DEMO_MODEL_ARGS-like dict,
"state_dict": the TP = 1 model's state_dict in bf16}``; :func:`load_checkpoint` reads it and
:func:`load_full_state_dict` loads it into a model of any tensor-parallel size (each rank keeps
its shard). The layers are megatron-core's local (non Transformer Engine) ones, so a checkpoint
loads on every machine.
"""

import os
import socket
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from mtp_ctrl.models import build_dense_gpt_model, build_gpt_model
from mtp_ctrl.models.mamba_mixer import shard_full_tensor

DEMO_MODEL_ARGS: Dict[str, int] = dict(
    num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8, num_query_groups=4,
    mtp_num_layers=2, vocab_size=512, max_sequence_length=1024,
)
_SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "mtp_num_layers")
CHECKPOINT_DTYPE = torch.bfloat16


def init_distributed(tensor_parallel_size: int, device: torch.device) -> None:
    """Process groups and megatron's parallel_state; a plain ``python`` run is one process of its own."""
    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != tensor_parallel_size:
        raise ValueError(f"--tp {tensor_parallel_size} needs {tensor_parallel_size} processes, "
                         f"got {dist.get_world_size()} (use torchrun)")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)


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
    """``(model_args, state_dict)`` of a file written by :func:`save_checkpoint` (tensors on the CPU)."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(checkpoint, dict) or set(checkpoint) != {"model_args", "state_dict"}:
        raise ValueError(f"{path} is not a demo checkpoint (a dict with model_args and state_dict)")
    return checkpoint["model_args"], checkpoint["state_dict"]


def load_demo_model(path: str, tensor_parallel_size: int = 1) -> Tuple[Dict[str, int], GPTModel]:
    """``(model_args, model)``: the paged demo model built from a :func:`save_checkpoint` file and
    loaded with its weights (on the CPU, this rank's shard)."""
    model_args, state_dict = load_checkpoint(path)
    model = build_demo_model(model_args, tensor_parallel_size)
    load_full_state_dict(model, state_dict)
    return model_args, model


def load_full_state_dict(model: GPTModel, state_dict: Dict[str, Any]) -> None:
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
