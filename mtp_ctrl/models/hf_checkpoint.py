"""Load a Hugging Face checkpoint (``config.json`` + safetensors shards) into our paged GPT, MTP layers included.

:func:`load_hf_checkpoint` runs in three steps; the model is returned only when all succeed, so
nothing half-loaded is ever usable:

1. ``config.json`` names the family (:mod:`mtp_ctrl.models.hf_registry`: refused families and
   unsupported fields raise :class:`~mtp_ctrl.models.hf_families.UnsupportedCheckpointError`,
   a ValueError naming the field or what is missing). Its settings become megatron's
   ``TransformerConfig`` and :func:`~mtp_ctrl.models.build_gpt_model` builds the paged model
   (weights allocated, not initialised) on the target device, at parallel_state's TP size.
2. Plan: every parameter of the model is mapped to its Hugging Face tensors through the family's
   table, from the safetensors headers alone. A parameter without a source, a tensor the table
   expects but the checkpoint lacks, a tensor of the checkpoint nothing reads, or a tensor of the
   wrong shape raises ValueError naming the tensor (and the parameter).
3. Stream: one parameter at a time, this rank's rows or columns are sliced straight out of the
   memory-mapped file (safetensors' ``get_slice``), rearranged (fused QKV, GLU, ...) and copied
   into the parameter (cast to its dtype, on its device). The full model is never held twice:
   at most one parameter's worth of extra memory.
"""

import dataclasses
import json
import os
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from mtp_ctrl.models.gpt_builder import build_gpt_model
from mtp_ctrl.models.hf_families import (
    IGNORED_SUFFIXES,
    HFFamily,
    Layout,
    ModelSettings,
    TensorRule,
)
from mtp_ctrl.models.hf_registry import resolve_family
from mtp_ctrl.models.mamba_mixer import TP_SECTIONS_ATTR

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_hf_config(path: Union[str, os.PathLike]) -> dict:
    """``config.json`` of the checkpoint directory ``path`` as a dict (ValueError naming a bad file)."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} does not exist: not a Hugging Face checkpoint directory")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_path} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} is not a JSON object")
    return config


class SafetensorsShards:
    """The checkpoint's tensors by name over its shards, memory-mapped; use as a context manager.

    Shards come from ``model.safetensors.index.json`` (its ``weight_map``), else the single
    ``model.safetensors``, else every ``*.safetensors`` of the directory. Only headers are read
    until a tensor is asked for.
    """

    def __init__(self, path: Union[str, os.PathLike]):
        from safetensors import safe_open

        self._safe_open = safe_open
        self.path = Path(path)
        index_path = self.path / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"{index_path} is not a safetensors index (a JSON object with a weight_map): "
                                 f"{error}") from None
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE_FILE).is_file():
            files = [SINGLE_FILE]
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.path} holds no safetensors files ({INDEX_FILE} or *.safetensors)")
        self._stack = ExitStack()
        self._handles = {}
        self.file_of: Dict[str, str] = {}
        for name in files:
            if not (self.path / name).is_file():
                raise FileNotFoundError(f"{index_path} names {name}, which does not exist")
            try:
                handle = self._stack.enter_context(safe_open(str(self.path / name), framework="pt", device="cpu"))
            except Exception as error:  # safetensors raises its own SafetensorError for damaged headers
                self._stack.close()
                raise ValueError(f"{self.path / name} is not a readable safetensors file ({error})") from None
            self._handles[name] = handle
            for tensor_name in handle.keys():
                if tensor_name in self.file_of:
                    self._stack.close()
                    raise ValueError(f"tensor {tensor_name!r} is stored twice ({self.file_of[tensor_name]} and {name})")
                self.file_of[tensor_name] = name

    def __enter__(self) -> "SafetensorsShards":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def names(self) -> List[str]:
        return list(self.file_of)

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._handles[self.file_of[name]].get_slice(name).get_shape())

    def read(self, name: str, dim: int = 0, start: Optional[int] = None, stop: Optional[int] = None) -> torch.Tensor:
        """Tensor ``name``, or only indices ``start:stop`` of dimension ``dim`` (read from the mapped file)."""
        tensor_slice = self._handles[self.file_of[name]].get_slice(name)
        if start is None:
            return tensor_slice[:]
        return tensor_slice[(slice(None),) * dim + (slice(start, stop),)]


# ----------------------------------------------------------------------------------------------
# Step 2: the plan (names and shapes only)
# ----------------------------------------------------------------------------------------------

class ParameterSource:
    """Where one model parameter (or loaded buffer) comes from: Hugging Face tensor names (full
    names), a layout, and the parallel group that shards it (experts: the expert-TP group)."""

    def __init__(self, parameter_name: str, rule: TensorRule, prefix: str, expert: int = -1):
        self.parameter_name = parameter_name
        self.layout = rule.layout
        self.sections_per_tensor = rule.sections_per_tensor
        self.hf_names = self.names_for_expert(rule, prefix, expert)
        self.is_expert = expert >= 0
        self._rule, self._prefix = rule, prefix

    @staticmethod
    def names_for_expert(rule: TensorRule, prefix: str, expert: int) -> Tuple[str, ...]:
        return tuple(prefix + name.format(e=expert) for name in rule.hf_names)

    def other_experts_names(self, num_experts: int) -> List[str]:
        """The same tensors of every expert (other expert-parallel ranks read theirs)."""
        return [name for expert in range(num_experts)
                for name in self.names_for_expert(self._rule, self._prefix, expert)]


@dataclasses.dataclass(frozen=True)
class ModelPlacement:
    """What maps our names to the checkpoint's beyond the table: the decoder depth (MTP numbering)
    and this rank's first global expert (``ep_rank * local experts``)."""

    num_layers: int
    first_local_expert: int = 0


_LOCAL_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")


def _split_layer_name(name: str, scope: str) -> Optional[Tuple[int, str]]:
    """``("decoder.layers.3.mlp.x", "decoder.layers.")`` -> ``(3, "mlp.x")``; None when not under scope."""
    if not name.startswith(scope):
        return None
    index, _, suffix = name[len(scope):].partition(".")
    return (int(index), suffix) if index.isdigit() else None


def _layer_rule(table, suffix: str, placement: ModelPlacement) -> Tuple[Optional[TensorRule], int]:
    """A layer table's rule for ``suffix``; a local expert's suffix names its global index ``{e}``."""
    expert = _LOCAL_EXPERT.match(suffix)
    if expert is None:
        return table.get(suffix), -1
    head, local, tail = expert.groups()
    return table.get(head + "{e}" + tail), placement.first_local_expert + int(local)


def parameter_source(family: HFFamily, name: str, placement: ModelPlacement) -> ParameterSource:
    """The table entry of parameter ``name`` of our model (ValueError when the family maps none)."""
    rule, prefix, expert = None, "", -1
    decoder = _split_layer_name(name, "decoder.layers.")
    mtp = _split_layer_name(name, "mtp.layers.")
    if decoder is not None:
        rule, expert = _layer_rule(family.layer_table, decoder[1], placement)
        prefix = family.layer_prefix.format(i=decoder[0])
    elif mtp is not None and family.mtp_prefix is not None:
        depth, suffix = mtp
        prefix = family.mtp_prefix.format(i=depth + (placement.num_layers if family.mtp_after_decoder else 0))
        if suffix.startswith("transformer_layer."):
            rule, expert = _layer_rule(family.layer_table, suffix[len("transformer_layer."):], placement)
            if family.mtp_layer_prefix is not None:
                prefix = family.mtp_layer_prefix.format(i=depth)
        else:
            rule = family.mtp_table.get(suffix)
    else:
        rule = family.top_table.get(name)
    if rule is None:
        raise ValueError(f"parameter {name} of the model has no Hugging Face tensor in the {family.name} table "
                         "(mtp_ctrl/models/hf_families.py)")
    return ParameterSource(name, rule, prefix, expert)


def loaded_tensors(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter, and every persistent buffer that holds weights (the MoE router's expert
    bias; megatron's ``_extra_state`` entries hold none): what a checkpoint must fill."""
    tensors = dict(model.named_parameters())
    for name, buffer in model.named_buffers():
        if name.endswith("router.expert_bias"):
            tensors[name] = buffer
    return tensors


def mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """Give every tensor-parallel weight megatron's ``partition_dim`` attributes, which megatron sets
    only while drawing random weights (``perform_initialization``, skipped here): vocabulary and
    column-parallel weights split rows (dim 0), row-parallel weights split columns (dim 1)."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is None or getattr(weight, "tensor_model_parallel", False):
            continue
        if isinstance(module, (VocabParallelEmbedding, ColumnParallelLinear)):
            set_tensor_model_parallel_attributes(weight, True, 0, 1)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, 1)


def _is_tensor_parallel(parameter: torch.Tensor) -> bool:
    return bool(getattr(parameter, "tensor_model_parallel", False))


def parallel_rank_and_size(source: ParameterSource) -> Tuple[int, int]:
    """The (rank, size) of the group that shards ``source``'s parameter: the expert-TP group for
    experts, else the TP group."""
    if source.is_expert:
        return (parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size())
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def expected_full_shapes(source: ParameterSource, parameter: torch.Tensor, config: TransformerConfig,
                         tp_size: int) -> List[Tuple[int, ...]]:
    """The shape each Hugging Face tensor of ``source`` must have, from the parameter's local shape."""
    local = tuple(parameter.shape)
    full = list(local)
    if _is_tensor_parallel(parameter):
        full[parameter.partition_dim] *= tp_size
    rest = tuple(full[1:])
    if source.layout in (Layout.QKV, Layout.QKV_GATED):
        head_dim = config.kv_channels
        query_rows = config.num_attention_heads * head_dim * (2 if source.layout is Layout.QKV_GATED else 1)
        return [(query_rows, *rest), (config.num_query_groups * head_dim, *rest),
                (config.num_query_groups * head_dim, *rest)]
    if source.layout is Layout.GLU:
        return [(full[0] // 2, *rest)] * 2
    if source.layout is Layout.SECTIONS:
        sections, shapes = getattr(parameter, TP_SECTIONS_ATTR), []
        for count in source.sections_per_tensor:
            shapes.append((sum(sections[:count]), *rest))
            sections = sections[count:]
        return shapes
    if source.layout is Layout.GDN_GROUPED:
        qk_dim = config.linear_num_key_heads * config.linear_key_head_dim
        v_dim = config.linear_num_value_heads * config.linear_value_head_dim
        return [(2 * qk_dim + 2 * v_dim, *rest), (2 * config.linear_num_value_heads, *rest)]
    return [tuple(full)]


@dataclasses.dataclass(frozen=True)
class SharedCopy:
    """An MTP layer's own copy of a trunk tensor (``HFFamily.mtp_shared_copies``), to be checked equal."""

    copy_name: str
    trunk_name: str


def plan_load(model: GPTModel, family: HFFamily, settings: ModelSettings, shards: SafetensorsShards,
              placement: ModelPlacement) -> Tuple[List[ParameterSource], List[SharedCopy]]:
    """Every parameter's source, and the MTP layers' copies of trunk tensors, checked against the
    checkpoint's names and shapes (ValueError naming the first problem: missing, unexpected or
    misshapen tensors)."""
    sources, used = [], set()
    available = set(shards.names())
    for name, parameter in loaded_tensors(model).items():
        source = parameter_source(family, name, placement)
        _, group_size = parallel_rank_and_size(source)
        for hf_name, shape in zip(source.hf_names, expected_full_shapes(source, parameter, model.config, group_size)):
            if hf_name not in available:
                raise ValueError(f"the checkpoint lacks tensor {hf_name!r} (for parameter {name}; "
                                 f"{family.name} layout)")
            found = shards.shape(hf_name)
            if found != shape:
                raise ValueError(f"tensor {hf_name!r} has shape {list(found)}, expected {list(shape)} from "
                                 f"config.json (parameter {name})")
            used.add(hf_name)
        if source.is_expert:
            used.update(source.other_experts_names(model.config.num_moe_experts))
        sources.append(source)
    copies = []
    for depth in range(model.config.mtp_num_layers or 0):
        prefix = family.mtp_prefix.format(i=depth + (placement.num_layers if family.mtp_after_decoder else 0))
        for relative, trunk_name in family.mtp_shared_copies.items():
            if prefix + relative not in available:
                continue  # the copy is optional: megatron reads the trunk's
            if trunk_name not in available and settings.tied_embeddings:
                trunk_name = family.top_table["embedding.word_embeddings.weight"].hf_names[0]
            if trunk_name not in available or shards.shape(trunk_name) != shards.shape(prefix + relative):
                raise ValueError(f"tensor {prefix + relative!r} (the MTP layer's copy of {trunk_name!r}, which "
                                 "megatron's MTP layer shares) has no trunk tensor of its shape")
            copies.append(SharedCopy(prefix + relative, trunk_name))
            used.add(prefix + relative)
    ignored = {"lm_head.weight"} if settings.tied_embeddings else set()
    unexpected = sorted(name for name in available - used - ignored
                        if not name.endswith(IGNORED_SUFFIXES) and not name.startswith(family.ignored_prefixes))
    if unexpected:
        shown = ", ".join(repr(name) for name in unexpected[:5])
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise ValueError(f"the checkpoint has tensors the {family.name} model does not use: {shown}{more} "
                         "(config.json does not describe these weights)")
    return sources, copies


def check_shared_copy(copy: SharedCopy, shards: SafetensorsShards, tp_rank: int, tp_size: int,
                      rows_per_read: int = 8192) -> None:
    """ValueError unless this rank's vocabulary rows of the MTP layer's copy equal the trunk's
    (read a block of rows at a time: one block of each in memory)."""
    vocab = shards.shape(copy.trunk_name)[0]
    first, stop = vocab // tp_size * tp_rank, vocab // tp_size * (tp_rank + 1)
    for start in range(first, stop, rows_per_read):
        end = min(start + rows_per_read, stop)
        if not torch.equal(shards.read(copy.copy_name, 0, start, end), shards.read(copy.trunk_name, 0, start, end)):
            raise ValueError(f"tensor {copy.copy_name!r} differs from {copy.trunk_name!r} (rows {start}:{end}): "
                             "megatron's MTP layer shares the trunk's embedding and output layer, so a checkpoint "
                             "whose MTP layer has its own cannot be loaded")


# ----------------------------------------------------------------------------------------------
# Step 3: reading this rank's part
# ----------------------------------------------------------------------------------------------

def read_local_tensor(source: ParameterSource, parameter: torch.Tensor, shards: SafetensorsShards,
                      config: TransformerConfig) -> torch.Tensor:
    """This rank's value of ``parameter`` in megatron's layout, read from the mapped shards.
    Each slice moves to the parameter's device as read; the layout is rearranged there (on a GPU
    the host holds one slice at a time, never a rearranged copy)."""
    tp_rank, tp_size = parallel_rank_and_size(source)
    sharded = _is_tensor_parallel(parameter) and tp_size > 1
    device = parameter.device

    def read(name: str, dim: int = 0, start: Optional[int] = None, stop: Optional[int] = None) -> torch.Tensor:
        return shards.read(name, dim, start, stop).to(device)

    if source.layout in (Layout.QKV, Layout.QKV_GATED):
        # rank r holds query groups [r * G_local, (r + 1) * G_local): contiguous rows of q, k and v.
        # Gated: q_proj holds per head [q_h; gate_h], megatron per group [its q heads; their gates; k; v]
        head_dim, groups_local = config.kv_channels, config.num_query_groups // tp_size
        heads_per_group = config.num_attention_heads // config.num_query_groups
        gated = source.layout is Layout.QKV_GATED
        q_rows = heads_per_group * head_dim * (2 if gated else 1)  # q_proj rows per group
        first = tp_rank * groups_local
        q = read(source.hf_names[0], 0, first * q_rows, (first + groups_local) * q_rows)  # [G_l * q_rows, ...]
        k = read(source.hf_names[1], 0, first * head_dim, (first + groups_local) * head_dim)  # [G_l * D, ...]
        v = read(source.hf_names[2], 0, first * head_dim, (first + groups_local) * head_dim)  # [G_l * D, ...]
        rest = tuple(q.shape[1:])
        if gated:  # [G_l, heads, 2, D, ...] -> the group's queries, then their gates
            q = q.reshape(groups_local, heads_per_group, 2, head_dim, *rest).transpose(1, 2)
        grouped = torch.cat((q.reshape(groups_local, q_rows, *rest), k.reshape(groups_local, head_dim, *rest),
                             v.reshape(groups_local, head_dim, *rest)), dim=1)  # [G_l, q_rows + 2 D, ...]
        return grouped.reshape(-1, *rest)
    if source.layout is Layout.SECTIONS:  # each TP section: this rank's contiguous share
        sections, pieces = getattr(parameter, TP_SECTIONS_ATTR), []
        for name, count in zip(source.hf_names, source.sections_per_tensor):
            offset = 0
            for size in sections[:count]:
                share = size // tp_size
                pieces.append(read(name, 0, offset + tp_rank * share, offset + (tp_rank + 1) * share))
                offset += size
            sections = sections[count:]
        return torch.cat(pieces, dim=0)
    if source.layout is Layout.GDN_GROUPED:  # per key head [q, k, v, z] and [b, a] -> [q; k; v; z; b; a]
        key_dim, value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        ratio = config.linear_num_value_heads // config.linear_num_key_heads  # value heads per key head
        key_heads = config.linear_num_key_heads // tp_size
        first = tp_rank * key_heads
        block = 2 * key_dim + 2 * ratio * value_dim
        qkvz = read(source.hf_names[0], 0, first * block, (first + key_heads) * block)  # [Hk_l * block, hidden]
        ba = read(source.hf_names[1], 0, first * 2 * ratio, (first + key_heads) * 2 * ratio)  # [Hk_l * 2r, hidden]
        rest = tuple(qkvz.shape[1:])
        q, k, v, z = torch.split(qkvz.reshape(key_heads, block, *rest),
                                 [key_dim, key_dim, ratio * value_dim, ratio * value_dim], dim=1)
        b, a = torch.split(ba.reshape(key_heads, 2 * ratio, *rest), [ratio, ratio], dim=1)
        return torch.cat([part.reshape(-1, *rest) for part in (q, k, v, z, b, a)], dim=0)
    if source.layout is Layout.GLU:
        rows = parameter.shape[0] // 2  # this rank's gate rows = its up rows
        start = tp_rank * rows if sharded else 0
        return torch.cat([read(name, 0, start, start + rows) for name in source.hf_names], dim=0)
    if sharded:
        dim = parameter.partition_dim
        width = parameter.shape[dim]
        value = read(source.hf_names[0], dim, tp_rank * width, (tp_rank + 1) * width)
    else:
        value = read(source.hf_names[0])
    if source.layout is Layout.SWAP_HALVES:  # [rows, 2H]: the checkpoint's second input half comes first here
        half = value.shape[1] // 2
        value = torch.cat((value[:, half:], value[:, :half]), dim=1)
    elif source.layout is Layout.PLUS_ONE:  # the norm scales by 1 + w: added in fp32, cast once on copy
        value = value.float() + 1.0
    return value


def _apply_rope_scaling(model: GPTModel, settings: ModelSettings) -> None:
    """The checkpoint's rotary scaling on the model's ``inv_freq`` (which the runner reads)."""
    rope, rotary = settings.rope, model.rotary_pos_emb
    if rope.rope_type == "llama3":  # megatron's own Llama-3.1 frequency scaling, with the checkpoint's numbers
        rotary.inv_freq = rotary._apply_scaling(
            rotary.inv_freq, factor=rope.factor, low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings)
    elif rope.rope_type == "linear":  # positions / factor
        rotary.inv_freq = rotary.inv_freq / rope.factor


def _check_dtype(dtype) -> None:
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}")


def load_hf_checkpoint(path: Union[str, os.PathLike], tp: Optional[int] = None, *,
                       device: Union[str, torch.device, None] = None,
                       dtype: Optional[torch.dtype] = None) -> GPTModel:
    """Our paged GPT (decoder and every MTP layer the checkpoint ships) from a Hugging Face directory.

    ``path``: a directory with ``config.json`` and safetensors weights (``model.safetensors`` or
    shards with ``model.safetensors.index.json``), as ``save_pretrained`` writes them. Families:
    :data:`mtp_ctrl.models.hf_registry.FAMILIES` (Llama-3, Qwen2, Qwen3, MiMo, Qwen3-MoE, GLM-4.5,
    DeepSeek-V3, Qwen3-Next, Qwen3.5; every MTP layer the checkpoint ships).
    ``tp``: the tensor-parallel size, which must be parallel_state's (default: parallel_state's);
    each rank reads only its shard (MoE experts: parallel_state's expert-parallel rank reads its own
    experts, megatron's placement). ``device``: where the weights live (default: CUDA when
    available). ``dtype``: the parameters' dtype (default: the checkpoint's ``dtype``).

    The model is in eval mode, ready for :class:`~mtp_ctrl.models.PagedGPTRunner` and the
    controller; ``model.config.mtp_num_layers`` is the checkpoint's MTP depth (None without).
    Errors (ValueError naming the tensor, parameter or config field; FileNotFoundError for missing
    files) leave nothing behind.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if not Path(path).is_dir():
        raise FileNotFoundError(f"{path} is not a directory (a Hugging Face checkpoint directory is expected)")
    _check_dtype(dtype)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device}")
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron's parallel_state is not initialised: call mtp_ctrl.init_single_process() "
                           "first (under torchrun: torch.distributed and parallel_state.initialize_model_parallel)")
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp != tp_size):
        raise ValueError(f"tp={tp!r} differs from parallel_state's tensor-parallel size {tp_size}")
    hf_config = read_hf_config(path)
    family = resolve_family(hf_config)
    settings = family.read_config(hf_config)
    config = settings.config_class(**settings.config_fields, tensor_model_parallel_size=tp_size,
                                   expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
                                   params_dtype=dtype or settings.dtype, use_cpu_initialization=True,
                                   perform_initialization=False)  # weights come from the file: no random draw
    with SafetensorsShards(path) as shards:
        with torch.device(device):  # parameters are allocated where they will live
            model = build_gpt_model(config, settings.vocab_size, settings.max_sequence_length,
                                    use_transformer_engine=False, rotary_base=settings.rope.theta,
                                    rotary_percent=settings.rope.partial_rotary_factor,
                                    share_embeddings_and_output_weights=settings.tied_embeddings)
        mark_tensor_parallel_weights(model)
        tensors = loaded_tensors(model)
        num_local_experts = (config.num_moe_experts or 0) // parallel_state.get_expert_model_parallel_world_size()
        placement = ModelPlacement(config.num_layers,
                                   parallel_state.get_expert_model_parallel_rank() * num_local_experts)
        sources, copies = plan_load(model, family, settings, shards, placement)
        for copy in copies:
            check_shared_copy(copy, shards, parallel_state.get_tensor_model_parallel_rank(), tp_size)
        with torch.no_grad():
            for source in sources:
                target = tensors[source.parameter_name]
                value = read_local_tensor(source, target, shards, config)
                if value.shape != target.shape:  # the plan checked full shapes; this guards the layouts
                    raise ValueError(f"{source.parameter_name}: assembled {list(value.shape)} from "
                                     f"{list(source.hf_names)}, expected {list(target.shape)}")
                if isinstance(target, torch.nn.Parameter):
                    target.copy_(value)
                else:  # the router's expert bias: megatron keeps it in fp32 whatever the model's dtype
                    target.data = value.to(device=target.device, dtype=torch.float32)
    if not config.multi_latent_attention:  # MLA layers build their own (YaRN) rotary from the config
        _apply_rope_scaling(model, settings)
    return model.to(device).eval()
