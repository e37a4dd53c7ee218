"""A Mamba-2 token mixer for megatron-core layers that keeps its state in mtp_ctrl's state slots.

It fills the ``self_attention`` slot of a megatron ``TransformerLayer`` (so a GPTModel can mix
attention and Mamba layers and keep its MTP block), with the parameters of megatron-core's
``MambaMixer`` (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``;
same shapes, same meaning). megatron's own mixer needs the ``mamba_ssm`` CUDA kernels and its
own inference context; this one runs the math in torch (:mod:`mtp_ctrl.models.mamba_ops`) on
CPU or GPU and reads and writes the slots of :class:`mtp_ctrl.models.forward_context.MambaForward`:

- decode requests (``1 + S`` rows each) step their rows one after another from the slot's
  current state and write the state after every row to the slot's intermediate buffers; the
  controller commits the one after the last accepted row (``mamba_state_selective_copy``),
  so a rejected draft never touches the current state;
- prefill requests scan their chunk from the current state and leave the new state in it.
"""

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from mtp_ctrl.models.forward_context import MambaForward, current_paged_forward
from mtp_ctrl.models.mamba_ops import causal_conv_chunk, causal_conv_step, gated_rms_norm, ssm_chunk_scan, ssm_step


class GatedRMSNorm(torch.nn.Module):
    """``rmsnorm(y * silu(z))`` per group of channels (megatron's ``norm`` of the mixer)."""

    def __init__(self, num_channels: int, group_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(num_channels, device=device, dtype=dtype))  # [d]
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(y, gate, self.weight, self.group_size, self.eps)


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
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        if tp_size != 1:
            raise ValueError("PagedMambaMixer supports tensor_model_parallel_size 1 only (the in_proj shards "
                             "of megatron's MambaMixer need a resharding this package does not do yet)")
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
        self.conv_channels = self.d_inner + 2 * self.num_groups * self.d_state  # x, B, C go through the conv
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        tp_group = getattr(pg_collection, "tp", None)
        dtype = config.params_dtype

        self.in_proj = ColumnParallelLinear(  # hidden -> z, x, B, C, dt
            config.hidden_size, 2 * self.d_inner + 2 * self.num_groups * self.d_state + self.num_heads,
            config=config, init_method=config.init_method, bias=False, gather_output=False, tp_group=tp_group,
        )
        self.conv1d = torch.nn.Conv1d(self.conv_channels, self.conv_channels, d_conv, groups=self.conv_channels,
                                      padding=d_conv - 1, bias=True, device=device, dtype=dtype)
        # dt_bias: softplus(dt_bias) log-uniform in [dt_min, dt_max]; A = -exp(A_log) uniform in A_init_range
        dt = torch.exp(torch.rand(self.num_heads, device=device) * (math.log(dt_max) - math.log(dt_min))
                       + math.log(dt_min)).clamp(min=dt_init_floor)
        self.dt_bias = torch.nn.Parameter((dt + torch.log(-torch.expm1(-dt))).to(dtype))  # [H]
        self.A_log = torch.nn.Parameter(torch.log(torch.empty(self.num_heads, device=device).uniform_(*A_init_range)))
        self.D = torch.nn.Parameter(torch.ones(self.num_heads, device=device))  # [H] fp32, the skip connection
        self.norm = GatedRMSNorm(self.d_inner, self.d_inner // self.num_groups, device=device, dtype=dtype)
        self.out_proj = RowParallelLinear(self.d_inner, config.hidden_size, config=config,
                                          init_method=config.output_layer_init_method, bias=False,
                                          input_is_parallel=True, skip_bias_add=True, tp_group=tp_group)
        self.mamba_layer_index: Optional[int] = None

    @property
    def conv_state_shape(self) -> Tuple[int, int]:
        return (self.conv_channels, self.d_conv - 1)

    @property
    def ssm_state_shape(self) -> Tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.d_state)

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
        projected, _ = self.in_proj(hidden_states)  # [T, 1, 2 d_inner + 2 G N + H]
        z, xbc, dt = torch.split(projected[:, 0].float(), [self.d_inner, self.conv_channels, self.num_heads], dim=-1)
        y = torch.zeros_like(z)  # [T, d_inner] fp32; rows of no request (none today) stay 0
        stride = mamba.rows_per_decode_request
        num_decode_rows = mamba.decode_slot_ids.shape[0] * stride
        if num_decode_rows:
            y[:num_decode_rows] = self._decode(mamba, xbc[:num_decode_rows], dt[:num_decode_rows], stride)
        for (start, end), slot in zip(mamba.prefill_row_ranges, mamba.prefill_slot_ids):
            y[start:end] = self._prefill(mamba, xbc[start:end], dt[start:end], slot)
        normed = self.norm(y, z).to(hidden_states.dtype)  # [T, d_inner]
        out, _ = self.out_proj(normed[:, None])  # [T, 1, hidden]
        return out, None

    def _parameters_fp32(self):
        weight = self.conv1d.weight[:, 0].float()  # [C, W]
        return weight, self.conv1d.bias.float(), -torch.exp(self.A_log.float()), self.D.float()

    def _split_conv_output(self, conv_out: torch.Tensor):
        """``[..., C]`` -> x ``[..., H, P]``, B and C ``[..., H, N]`` (each head reads its group's B, C)."""
        lead = conv_out.shape[:-1]
        x, B, C = torch.split(conv_out, [self.d_inner, self.num_groups * self.d_state,
                                         self.num_groups * self.d_state], dim=-1)
        heads_per_group = self.num_heads // self.num_groups
        B = B.reshape(*lead, self.num_groups, self.d_state).repeat_interleave(heads_per_group, dim=-2)
        C = C.reshape(*lead, self.num_groups, self.d_state).repeat_interleave(heads_per_group, dim=-2)
        return x.reshape(*lead, self.num_heads, self.head_dim), B, C

    def _decode(self, mamba: MambaForward, xbc: torch.Tensor, dt_raw: torch.Tensor, stride: int) -> torch.Tensor:
        """Rows of nd decode requests (``[nd * stride, ...]``) -> y ``[nd * stride, d_inner]``."""
        layer, slots = self.mamba_layer_index, mamba.decode_slot_ids  # slots: [nd] int64
        num_requests = slots.shape[0]
        xbc = xbc.view(num_requests, stride, -1)  # [nd, 1 + S, C]
        dt = F.softplus(dt_raw.view(num_requests, stride, -1) + self.dt_bias.float())  # [nd, 1 + S, H]
        weight, bias, A, D = self._parameters_fp32()
        window = mamba.conv_states[layer, slots]  # [nd, C, W - 1]
        state = mamba.ssm_states[layer, slots]  # [nd, H, P, N]
        outputs = []
        for row in range(stride):
            conv_out, window = causal_conv_step(window, xbc[:, row], weight, bias)
            x, B, C = self._split_conv_output(conv_out)
            y, state = ssm_step(state, x, dt[:, row], A, B, C, D)
            mamba.intermediate_conv_states[layer, slots, row] = window
            mamba.intermediate_ssm_states[layer, slots, row] = state
            outputs.append(y.reshape(num_requests, self.d_inner))
        return torch.stack(outputs, dim=1).view(num_requests * stride, self.d_inner)

    def _prefill(self, mamba: MambaForward, xbc: torch.Tensor, dt_raw: torch.Tensor, slot: int) -> torch.Tensor:
        """The chunk of one prefill request (``[q, ...]``) -> y ``[q, d_inner]``; updates its slot."""
        layer = self.mamba_layer_index
        weight, bias, A, D = self._parameters_fp32()
        conv_out, window = causal_conv_chunk(mamba.conv_states[layer, slot], xbc, weight, bias)
        x, B, C = self._split_conv_output(conv_out)
        dt = F.softplus(dt_raw + self.dt_bias.float())  # [q, H]
        y, state = ssm_chunk_scan(mamba.ssm_states[layer, slot], x, dt, A, B, C, D, self.chunk_size)
        mamba.conv_states[layer, slot] = window
        mamba.ssm_states[layer, slot] = state
        return y.reshape(y.shape[0], self.d_inner)
