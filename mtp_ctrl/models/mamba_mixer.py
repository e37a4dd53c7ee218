"""A Mamba-2 token mixer for megatron-core layers that keeps its state in mtp_ctrl's state slots.

It fills the ``self_attention`` slot of a megatron ``TransformerLayer`` (so a GPTModel can mix
attention and Mamba layers and keep its MTP block), with the parameters of megatron-core's
``MambaMixer`` (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``;
same shapes, same meaning). megatron's own mixer needs the ``mamba_ssm`` CUDA kernels and its
own inference context; this one runs the math in our Triton kernels on CUDA and their torch
twins on CPU (:mod:`mtp_ctrl.triton_ops.mamba_varlen`,
:mod:`mtp_ctrl.triton_ops.mamba_decode`) and reads and writes the slots of
:class:`mtp_ctrl.models.forward_context.MambaForward`:

- decode requests (``1 + S`` rows each) step their rows one after another from the slot's
  current state and write the state after every row to the slot's intermediate buffers
  (``mamba_decode_rows``: one Triton launch on CUDA, its torch twin on CPU); the controller
  commits the one after the last accepted row (``mamba_state_selective_copy``), so a rejected
  draft never touches the current state;
- prefill requests scan their chunk from the current state and leave the new state in it: all
  of a step's chunks in one varlen conv and one segment-aware scan with fixed shapes
  (``causal_conv_varlen``, ``ssm_varlen_scan``, ``segment_of_rows``: one Triton launch each on
  CUDA, :mod:`mtp_ctrl.triton_ops.mamba_varlen`; their torch twins on CPU), so a step with
  prefill chunks is captured in a CUDA graph like a decode step.

Tensor parallelism shards it as megatron's ``MambaMixer``: each rank owns ``H / tp`` heads and
``G / tp`` groups. ``in_proj`` (column parallel) gives the rank its own ``[z, x, B, C, dt]``
rows, the conv, ``dt_bias``, ``A_log``, ``D`` and the gated norm act on the local channels only,
and ``out_proj`` (row parallel) sums the ranks' outputs. The state slots hold the local heads
(``conv_state_shape``/``ssm_state_shape`` are per rank), so the scan needs no communication.
A TP = 1 checkpoint loads into a rank with :func:`shard_full_tensor` (its sections are not
contiguous slices of the full tensors).
"""

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from mtp_ctrl import triton_ops
from mtp_ctrl.models.forward_context import MambaForward, current_paged_forward
from mtp_ctrl.triton_ops import reference as torch_twins

# Attribute of a tensor-parallel parameter whose full tensor is several sections along its
# partition_dim, each split over the ranks on its own: rank r holds its chunk of every section, in
# order. E.g. in_proj.weight, sections (z, x, B, C, dt) = (128, 128, 16, 16, 8) rows at TP = 2:
# rank 1 holds z[64:128], x[64:128], B[8:16], C[8:16], dt[4:8]. See :func:`shard_full_tensor`.
TP_SECTIONS_ATTR = "tp_shard_sections"


def shard_full_tensor(parameter: torch.Tensor, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's part of ``full`` (the TP = 1 value of ``parameter``), megatron's layout.

    A parameter without megatron's ``tensor_model_parallel`` flag is replicated: ``full`` itself.
    Otherwise ``full`` is split along ``partition_dim`` into the sections named by
    ``TP_SECTIONS_ATTR`` (one section when absent), each section into ``tp_size`` equal chunks, and
    chunk ``tp_rank`` of every section is concatenated.
    """
    if tp_size == 1 or not getattr(parameter, "tensor_model_parallel", False):
        return full
    if getattr(parameter, "partition_stride", 1) != 1:
        raise ValueError("strided tensor-parallel partitions are not supported")
    dim = parameter.partition_dim
    sections = getattr(parameter, TP_SECTIONS_ATTR, None) or (full.shape[dim],)
    if sum(sections) != full.shape[dim] or any(size % tp_size for size in sections):
        raise ValueError(f"a full tensor of shape {tuple(full.shape)} does not split into sections {sections} "
                         f"along dim {dim} over {tp_size} ranks")
    pieces = torch.split(full, list(sections), dim=dim)
    return torch.cat([piece.chunk(tp_size, dim=dim)[tp_rank] for piece in pieces], dim=dim)


class GatedRMSNorm(torch.nn.Module):
    """``rmsnorm(y * silu(z))`` per group of channels (megatron's ``norm`` of the mixer)."""

    def __init__(self, num_channels: int, group_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(num_channels, device=device, dtype=dtype))  # [d]
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
                kernels: bool = True) -> torch.Tensor:
        """``[T, d]`` y and gate -> ``[T, d]`` out_dtype (default y's); ``kernels`` False: the torch twin."""
        ops = triton_ops if kernels else torch_twins
        return ops.gated_rms_norm(y, gate, self.weight, self.group_size, self.eps, out_dtype)


class PagedMambaMixer(MegatronModule):
    """Mamba-2 mixer over packed rows. Letters: d_inner = H * P channels, G groups, N state size,
    W conv width; ``_local`` = this tensor-parallel rank's share.

    ``mamba_layer_index`` picks this layer's slice of the state slots; the model builder assigns
    it (:func:`mtp_ctrl.models.layer_specs.assign_mamba_layer_indices`).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: Optional[int] = None,
        pg_collection=None,
        cp_comm_type: Optional[str] = None,
        d_conv: int = 4,
        expand: int = 2,
        A_init_range: Tuple[float, float] = (1.0, 16.0),
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        chunk_size: int = 64,
    ):
        super().__init__(config=config)
        tp_group = getattr(pg_collection, "tp", None)
        tp_size = tp_group.size() if tp_group is not None else parallel_state.get_tensor_model_parallel_world_size()
        if config.context_parallel_size != 1:
            raise ValueError("PagedMambaMixer does not support context parallelism")
        if isinstance(d_conv, bool) or not isinstance(d_conv, int) or d_conv < 2:
            raise ValueError(f"d_conv must be an int >= 2, got {d_conv!r}")
        self.layer_number = layer_number
        self.d_conv, self.chunk_size = d_conv, chunk_size
        self.d_state, self.head_dim, self.num_groups = config.mamba_state_dim, config.mamba_head_dim, config.mamba_num_groups
        self.num_heads = config.mamba_num_heads or (expand * config.hidden_size) // self.head_dim
        self.d_inner = self.num_heads * self.head_dim
        if self.num_heads % self.num_groups != 0:
            raise ValueError(f"mamba heads ({self.num_heads}) must be divisible by config.mamba_num_groups "
                             f"({self.num_groups})")
        for name, count in (("mamba heads", self.num_heads), ("config.mamba_num_groups", self.num_groups)):
            if count % tp_size != 0:
                raise ValueError(f"{name} ({count}) must be divisible by the tensor-parallel size ({tp_size})")
        # this rank's share, as megatron's MambaMixer splits it: heads and groups, with their channels
        self.num_heads_local = self.num_heads // tp_size
        self.num_groups_local = self.num_groups // tp_size
        self.d_inner_local = self.num_heads_local * self.head_dim
        group_channels = self.num_groups_local * self.d_state  # B (or C) channels of this rank
        self.conv_channels = self.d_inner_local + 2 * group_channels  # x, B, C go through the conv
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        dtype = config.params_dtype

        # in_proj's local rows are [z, x, B, C, dt] of this rank's heads and groups (not a contiguous
        # slice of the full [z, x, B, C, dt] rows); _TP_SECTIONS says how a full weight splits
        self.in_proj = ColumnParallelLinear(  # hidden -> z, x, B, C, dt
            config.hidden_size, 2 * self.d_inner + 2 * self.num_groups * self.d_state + self.num_heads,
            config=config, init_method=config.init_method, bias=False, gather_output=False, tp_group=tp_group,
        )
        full_group_channels = self.num_groups * self.d_state
        setattr(self.in_proj.weight, TP_SECTIONS_ATTR,
                (self.d_inner, self.d_inner, full_group_channels, full_group_channels, self.num_heads))
        self.conv1d = torch.nn.Conv1d(self.conv_channels, self.conv_channels, d_conv, groups=self.conv_channels,
                                      padding=d_conv - 1, bias=True, device=device, dtype=dtype)
        # dt_bias: softplus(dt_bias) log-uniform in [dt_min, dt_max]; A = -exp(A_log) uniform in A_init_range
        heads = self.num_heads_local
        dt = torch.exp(torch.rand(heads, device=device) * (math.log(dt_max) - math.log(dt_min))
                       + math.log(dt_min)).clamp(min=dt_init_floor)
        self.dt_bias = torch.nn.Parameter((dt + torch.log(-torch.expm1(-dt))).to(dtype))  # [H_local]
        self.A_log = torch.nn.Parameter(torch.log(torch.empty(heads, device=device).uniform_(*A_init_range)))
        self.D = torch.nn.Parameter(torch.ones(heads, device=device))  # [H_local] fp32, the skip connection
        self.norm = GatedRMSNorm(self.d_inner_local, self.d_inner // self.num_groups, device=device, dtype=dtype)
        for parameter in (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D, self.norm.weight):
            set_tensor_model_parallel_attributes(parameter, True, 0, 1)  # this rank's rows of the full tensor
        for parameter in (self.conv1d.weight, self.conv1d.bias):
            setattr(parameter, TP_SECTIONS_ATTR, (self.d_inner, full_group_channels, full_group_channels))
        self.out_proj = RowParallelLinear(self.d_inner, config.hidden_size, config=config,
                                          init_method=config.output_layer_init_method, bias=False,
                                          input_is_parallel=True, skip_bias_add=True, tp_group=tp_group)
        self.mamba_layer_index: Optional[int] = None
        # the conv/scan ops: the Triton kernels (True) or their torch twins (False); None: kernels
        # for CUDA rows, twins elsewhere (on the CPU the kernels would run through Triton's
        # interpreter). PagedGPTRunner(mamba_kernels=...) sets it (InferenceConfig.mamba_kernels)
        self.mamba_kernels: Optional[bool] = None

    @property
    def conv_state_shape(self) -> Tuple[int, int]:
        return (self.conv_channels, self.d_conv - 1)

    @property
    def ssm_state_shape(self) -> Tuple[int, int, int]:
        return (self.num_heads_local, self.head_dim, self.d_state)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **attention_kwargs):
        """``[T, 1, hidden]`` packed rows -> ``(output [T, 1, hidden], None)``, the contract of
        megatron's self attention; the attention-only keyword arguments are ignored."""
        mamba = current_paged_forward().mamba
        if mamba is None:
            raise RuntimeError(f"layer {self.layer_number} is a Mamba layer: run the forward with the step's "
                               "MambaForward (PagedGPTRunner.forward(..., mamba=...))")
        if self.mamba_layer_index is None:
            raise RuntimeError(f"layer {self.layer_number}: mamba_layer_index is unset; build the model with "
                               "mtp_ctrl.models.build_gpt_model")
        projected, _ = self.in_proj(hidden_states)  # [T, 1, 2 d_inner_local + 2 G_local N + H_local]
        z, xbc, dt = torch.split(projected[:, 0].float(), [self.d_inner_local, self.conv_channels,
                                                           self.num_heads_local], dim=-1)
        num_rows, stride = z.shape[0], mamba.rows_per_decode_request
        dt = F.softplus(dt + self.dt_bias)  # [T, H_local] fp32 (a bf16 bias is promoted in the add)
        parameters = self._parameters_fp32()  # once per forward: prefill and decode rows share them
        y, inside = self._prefill(mamba, xbc, dt, parameters) if mamba.has_prefill else (None, None)
        num_decode_rows = mamba.decode_slot_ids.shape[0] * stride
        if num_decode_rows:  # a padded grid's decode rows may run past T: they then read zero rows
            decoded = self._decode(mamba, xbc, dt, parameters)[:num_rows]  # [min(T, nd (1 + S)), d_inner_local]
            rows = decoded.shape[0]
            if y is not None:
                y[:rows] = torch.where(inside[:rows, None], y[:rows], decoded)
            else:  # a decode grid's rows are usually all decode rows; the rest (padding) are 0
                y = decoded if rows == num_rows else F.pad(decoded, (0, 0, 0, num_rows - rows))
        if y is None:
            y = torch.zeros_like(z)  # [T, d_inner_local] fp32: no request has a row
        normed = self.norm(y, z, hidden_states.dtype, self._use_kernels(y))  # [T, d_inner_local], one launch
        out, _ = self.out_proj(normed[:, None])  # [T, 1, hidden], summed over the TP ranks
        return out, None

    def _use_kernels(self, rows: torch.Tensor) -> bool:
        return self.mamba_kernels if self.mamba_kernels is not None else rows.is_cuda

    def _ops(self):
        """Where the conv, scan and decode-row ops come from (``self.mamba_kernels``)."""
        return triton_ops if self._use_kernels(self.D) else torch_twins

    def _parameters_fp32(self):
        """(conv weight [C, W], conv bias [C], A [H_local], D [H_local]), fp32 (a bf16 model's are cast)."""
        weight = self.conv1d.weight[:, 0].float()  # [C, W]
        return weight, self.conv1d.bias.float(), -torch.exp(self.A_log.float()), self.D.float()

    def _split_conv_output(self, conv_out: torch.Tensor):
        """``[T, C]`` -> views x ``[T, H, P]``, B and C ``[T, G, N]`` (head h reads group h // (H / G))."""
        group_channels = self.num_groups_local * self.d_state
        x, B, C = torch.split(conv_out, [self.d_inner_local, group_channels, group_channels], dim=-1)
        num_rows = conv_out.shape[0]
        return (x.reshape(num_rows, self.num_heads_local, self.head_dim),
                B.reshape(num_rows, self.num_groups_local, self.d_state),
                C.reshape(num_rows, self.num_groups_local, self.d_state))

    def _decode(self, mamba: MambaForward, xbc: torch.Tensor, dt: torch.Tensor, parameters) -> torch.Tensor:
        """The ``1 + S`` rows of each of nd decode requests (the first ``nd (1 + S)`` of the ``[T, ...]``
        rows, zero past T) -> y ``[nd (1 + S), d_inner_local]``; the state after every row goes to the
        slot's intermediate buffers (one launch on CUDA: ``mamba_decode_rows``)."""
        weight, bias, A, D = parameters
        return self._ops().mamba_decode_rows(mamba.conv_states, mamba.ssm_states, mamba.intermediate_conv_states,
                                             mamba.intermediate_ssm_states, self.mamba_layer_index,
                                             mamba.decode_slot_ids, xbc, dt, weight, bias, A, D)

    def _prefill(self, mamba: MambaForward, xbc: torch.Tensor, dt: torch.Tensor, parameters):
        """Every prefill segment of the packed rows (``[T, ...]``) at once -> (y ``[T, d_inner_local]``,
        0 outside the segments; inside ``[T]`` bool); each segment's slot gets its new state."""
        layer, slots = self.mamba_layer_index, mamba.prefill_slot_ids  # slots: [n] int64
        start, count = mamba.prefill_row_start, mamba.prefill_row_count
        weight, bias, A, D = parameters
        ops = self._ops()
        conv_pool, ssm_pool = mamba.conv_states[layer], mamba.ssm_states[layer]  # [num_slots, ...] fp32 views
        # both ops read each segment's state at its slot (no gather); the scan also writes it back in place
        conv_out, windows = ops.causal_conv_varlen(conv_pool, xbc, start, count, weight, bias, slot_ids=slots)
        x, B, C = self._split_conv_output(conv_out)
        y, _ = ops.ssm_varlen_scan(ssm_pool, x, dt, A, B, C, D, start, count, self.chunk_size, slot_ids=slots,
                                   heads_per_group=self.num_heads // self.num_groups)
        # the conv's row programs read the old windows while its window programs write the new ones,
        # so those land here, after it; a 0-row segment (scratch slot) writes back what it read
        conv_pool[slots] = windows
        _, _, inside = ops.segment_of_rows(start, count, xbc.shape[0])
        return y.reshape(y.shape[0], self.d_inner_local), inside
