"""A Gated DeltaNet token mixer (Qwen3-Next / Qwen3.5 class) for megatron-core layers that keeps its
state in mtp_ctrl's recurrent state slots.

It fills the ``self_attention`` slot of a megatron ``TransformerLayer``, with the parameters of
megatron-core's ``GatedDeltaNet`` (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``out_norm``,
``out_proj``; same names, shapes and meaning, so its checkpoints load). megatron's layer needs
flash-linear-attention and refuses inference; this one runs the rule through
:mod:`mtp_ctrl.triton_ops.gdn_recurrent` (Triton on CUDA, the torch twins on CPU) against the
slots of :class:`mtp_ctrl.models.forward_context.MambaForward` (the same slots, intermediate
buffers and commit as Mamba-2 layers: ``conv_states`` hold the conv windows, ``ssm_states`` the
``[H, K, V]`` delta-rule states):

- decode requests (``1 + S`` rows each): the conv over their rows from the slot's window (the
  window after every row goes to the intermediate buffer), then ``gdn_verify_rows``, which reads
  the slot's state once, first applies the rows its last verify step kept (the deferred commit),
  writes that state back and stores each row as ``(k, u, g)``, u its delta
  (``MambaForward.verify_row_inputs``);
  the controller's commit records how many rows were kept (``gdn_mark_pending_rows``; the conv
  window by ``mamba_state_selective_copy``), so a rejected draft never touches the state and a
  step with no drafts or none accepted leaves plain decoding's state. Given
  ``intermediate_ssm_states`` instead, ``gdn_decode_rows`` writes the state after every row there
  and the commit copies one (the older, costlier path);
- prefill segments: ``causal_conv_varlen`` (Mamba's varlen conv: same depthwise conv + silu) and
  ``gdn_varlen_scan`` from the slot's state, written back; fixed shapes, so a mixed step is
  captured in a CUDA graph like a decode step. In eager steps on CUDA, segments of at least
  ``FLA_PREFILL_MIN_ROWS`` rows go through fla-core's ``chunk_gated_delta_rule`` instead (when it
  is installed: faster on long chunks), one call per segment from its slot's state.

Per row: ``[q, k, v, z, b, a] = in_proj(x)``; ``q, k, v = silu(conv(q, k, v))``; q and k
l2-normalised (q also scaled by ``K ** -0.5``); ``g = -exp(A_log) softplus(a + dt_bias)``,
``beta = sigmoid(b)``; ``o`` from the rule; ``out_proj(out_norm(o) * silu(z))`` (``out_norm`` per
value head).

Tensor parallelism as megatron's ``GatedDeltaNet``: each rank owns ``Hk / tp`` key heads and
``H / tp`` value heads; ``in_proj`` (column parallel) gives it its part of each of the six sections,
``conv1d``, ``dt_bias`` and ``A_log`` its channels, ``out_proj`` (row parallel) sums the ranks.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from mtp_ctrl import triton_ops
from mtp_ctrl.models.forward_context import MambaForward, current_paged_forward
from mtp_ctrl.models.mamba_mixer import TP_SECTIONS_ATTR
from mtp_ctrl.triton_ops import reference as torch_twins
from mtp_ctrl.triton_ops.reference.gdn import check_no_pending_rows

# fla-core's chunked kernel beats our recurrent one from here (bench_gdn.py on an H100: ours faster up to
# 256-row chunks, fla 2-5x faster from 1024); shorter segments, and every CUDA-graph step, use ours
FLA_PREFILL_MIN_ROWS = 1024
L2_NORM_EPS = 1e-6  # flash-linear-attention's l2norm: x / sqrt(sum(x^2) + eps), as megatron calls it


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` -> ``x / sqrt(sum(x^2) + 1e-6)`` over the last dim (fp32 in, fp32 out)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_NORM_EPS)


def _gdn_norm(config: TransformerConfig, value_head_dim: int):
    """The per-value-head output norm megatron's local spec builds (``LNImpl``: apex's fused norm,
    else torch's), so the parameter is ``out_norm.weight`` ``[V]``."""
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl

    return LNImpl(config=config, hidden_size=value_head_dim, eps=config.layernorm_epsilon)


class PagedGatedDeltaNet(MegatronModule):
    """Gated DeltaNet over packed rows. Letters: Hk key heads, H value heads, K key dim, V value dim,
    W conv width, C = 2 Hk K + H V conv channels; ``_local`` = this tensor-parallel rank's share.

    ``mamba_layer_index`` picks this layer's slice of the recurrent state slots; the model builder
    assigns it (:func:`mtp_ctrl.models.layer_specs.assign_mamba_layer_indices`).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: Optional[int] = None,
        pg_collection=None,
        cp_comm_type: Optional[str] = None,
        bias: bool = False,
        conv_bias: bool = False,
        conv_init: Optional[float] = None,
        use_qk_l2norm: bool = True,
        A_init_range: Tuple[float, float] = (1.0, 16.0),
    ):
        super().__init__(config=config)
        tp_group = getattr(pg_collection, "tp", None)
        tp_size = tp_group.size() if tp_group is not None else parallel_state.get_tensor_model_parallel_world_size()
        if config.context_parallel_size != 1:
            raise ValueError("PagedGatedDeltaNet does not support context parallelism")
        if config.activation_func is not F.silu:
            raise ValueError("PagedGatedDeltaNet runs its conv and output gate with silu: set "
                             f"config.activation_func=torch.nn.functional.silu (got {config.activation_func!r})")
        if not use_qk_l2norm:
            raise ValueError("PagedGatedDeltaNet needs use_qk_l2norm=True (the delta rule assumes unit-norm keys)")
        self.layer_number = layer_number
        self.conv_width = config.linear_conv_kernel_dim
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_key_heads, self.num_value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"config.linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                             f"config.linear_num_key_heads ({self.num_key_heads})")
        for name, count in (("config.linear_num_key_heads", self.num_key_heads),
                            ("config.linear_num_value_heads", self.num_value_heads)):
            if count % tp_size:
                raise ValueError(f"{name} ({count}) must be divisible by the tensor-parallel size ({tp_size})")
        if isinstance(self.conv_width, bool) or not isinstance(self.conv_width, int) or self.conv_width < 2:
            raise ValueError(f"config.linear_conv_kernel_dim must be an int >= 2, got {self.conv_width!r}")
        qk_dim, v_dim = self.key_head_dim * self.num_key_heads, self.value_head_dim * self.num_value_heads
        self.num_key_heads_local = self.num_key_heads // tp_size
        self.num_value_heads_local = self.num_value_heads // tp_size
        self.qk_dim_local, self.v_dim_local = qk_dim // tp_size, v_dim // tp_size
        self.conv_channels = 2 * self.qk_dim_local + self.v_dim_local
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        dtype = config.params_dtype

        self.in_proj = ColumnParallelLinear(  # hidden -> q, k, v, z, b, a (this rank's part of each)
            config.hidden_size, 2 * qk_dim + 2 * v_dim + 2 * self.num_value_heads, config=config,
            init_method=config.init_method, bias=bias, gather_output=False, tp_group=tp_group,
        )
        sections = (qk_dim, qk_dim, v_dim, v_dim, self.num_value_heads, self.num_value_heads)
        for parameter in (self.in_proj.weight, self.in_proj.bias):
            if parameter is not None:
                setattr(parameter, TP_SECTIONS_ATTR, sections)
        self.conv1d = torch.nn.Conv1d(self.conv_channels, self.conv_channels, self.conv_width,
                                      groups=self.conv_channels, padding=self.conv_width - 1, bias=conv_bias,
                                      device=device, dtype=dtype)
        if conv_init is not None:
            torch.nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)
        heads = self.num_value_heads_local
        self.dt_bias = torch.nn.Parameter(torch.ones(heads, device=device, dtype=dtype))  # [H_local]
        self.A_log = torch.nn.Parameter(torch.log(torch.empty(heads, device=device).uniform_(*A_init_range)).to(dtype))
        conv_parameters = [self.conv1d.weight] + ([self.conv1d.bias] if conv_bias else [])
        for parameter in conv_parameters + [self.dt_bias, self.A_log]:
            set_tensor_model_parallel_attributes(parameter, True, 0, 1)  # this rank's rows of the full tensor
        for parameter in conv_parameters:
            setattr(parameter, TP_SECTIONS_ATTR, (qk_dim, qk_dim, v_dim))
        self.out_norm = _gdn_norm(config, self.value_head_dim)
        self.out_proj = RowParallelLinear(v_dim, config.hidden_size, config=config,
                                          init_method=config.output_layer_init_method, bias=bias,
                                          input_is_parallel=True, skip_bias_add=True, tp_group=tp_group)
        # the conv ops take a bias; megatron's GDN conv has none by default
        self.register_buffer("_zero_conv_bias", torch.zeros(self.conv_channels, device=device), persistent=False)
        self.mamba_layer_index: Optional[int] = None
        # Triton kernels (True) or torch twins (False); None: kernels for CUDA rows. The runner sets it
        # (PagedGPTRunner(mamba_kernels=...), as for Mamba mixers)
        self.mamba_kernels: Optional[bool] = None
        # prefill segments this long run through fla-core's chunked kernel where it is installed (None: never)
        self.fla_prefill_min_rows: Optional[int] = FLA_PREFILL_MIN_ROWS

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None, tp_group=None):
        """megatron ``GatedDeltaNet``'s own checkpoint layout (``A_log``, ``dt_bias`` and the conv split
        over TP; ``in_proj.weight`` saved as its query, key, value, z, beta, alpha parts and the conv
        as query, key, value), by megatron's method on this module's matching attributes, so
        torch_dist checkpoints move between the two."""
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet

        tp = self.in_proj.tp_group if getattr(self.in_proj, "tp_group", None) is not None \
            else parallel_state.get_tensor_model_parallel_group()
        view = _MegatronGDNView(self, ProcessGroupCollection(tp=tp))
        return GatedDeltaNet.sharded_state_dict(view, prefix, sharded_offsets, metadata, tp_group)

    @property
    def conv_state_shape(self) -> Tuple[int, int]:
        return (self.conv_channels, self.conv_width - 1)

    @property
    def ssm_state_shape(self) -> Tuple[int, int, int]:
        """The delta-rule state of one request: ``[H_local, K, V]``."""
        return (self.num_value_heads_local, self.key_head_dim, self.value_head_dim)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **attention_kwargs):
        """``[T, 1, hidden]`` packed rows -> ``(output [T, 1, hidden], bias or None)``, the contract of
        megatron's self attention; the attention-only keyword arguments are ignored."""
        mamba = current_paged_forward().mamba
        if mamba is None:
            raise RuntimeError(f"layer {self.layer_number} is a Gated DeltaNet layer: run the forward with the "
                               "step's MambaForward (PagedGPTRunner.forward(..., mamba=...))")
        if self.mamba_layer_index is None:
            raise RuntimeError(f"layer {self.layer_number}: mamba_layer_index is unset; build the model with "
                               "mtp_ctrl.models.build_gpt_model")
        projected, _ = self.in_proj(hidden_states)  # [T, 1, in_proj_local]
        H, Hk = self.num_value_heads_local, self.num_key_heads_local
        qkv, z, b, a = torch.split(projected[:, 0], [self.conv_channels, self.v_dim_local, H, H], dim=-1)
        qkv = qkv.float()  # [T, C] fp32
        num_rows = qkv.shape[0]
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())  # [T, H] fp32 log decay
        beta = torch.sigmoid(b.float())  # [T, H] fp32
        weight = self.conv1d.weight[:, 0].float()  # [C, W]
        # fp32 (a bf16 model's conv bias, or the zero buffer model.to(bf16) cast, is cast back)
        conv_bias = (self.conv1d.bias if self.conv1d.bias is not None else self._zero_conv_bias).float()
        ops = self._ops()
        o = None
        if mamba.has_prefill:
            o, inside = self._prefill(ops, mamba, qkv, g, beta, weight, conv_bias)  # [T, H, V], [T] bool
        num_decode_rows = mamba.decode_slot_ids.shape[0] * mamba.rows_per_decode_request
        if num_decode_rows:  # a padded grid's decode rows may run past T: they then read zero rows
            decoded = self._decode(ops, mamba, qkv, g, beta, weight, conv_bias)[:num_rows]  # [<= T, H, V]
            rows = decoded.shape[0]
            if o is not None:
                o[:rows] = torch.where(inside[:rows, None, None], o[:rows], decoded)
            else:
                o = decoded if rows == num_rows else F.pad(decoded, (0, 0, 0, 0, 0, num_rows - rows))
        if o is None:
            o = qkv.new_zeros(num_rows, H, self.value_head_dim)  # no request has a row
        dtype = hidden_states.dtype
        normed = self.out_norm(o.to(dtype).reshape(num_rows * H, self.value_head_dim))  # per value head
        gated = (normed.float() * F.silu(z.float().reshape(num_rows * H, self.value_head_dim))).to(dtype)
        return self.out_proj(gated.reshape(num_rows, 1, self.v_dim_local))  # ([T, 1, hidden], bias)

    def _ops(self):
        """Where the conv and rule ops come from (``self.mamba_kernels``)."""
        use_kernels = self.mamba_kernels if self.mamba_kernels is not None else self.A_log.is_cuda
        return triton_ops if use_kernels else torch_twins

    def _heads(self, conv_out: torch.Tensor):
        """``[T, C]`` silu(conv) -> q (normalised, scaled) and k ``[T, Hk, K]``, v ``[T, H, V]``, contiguous."""
        num_rows = conv_out.shape[0]
        q, k, v = torch.split(conv_out, [self.qk_dim_local, self.qk_dim_local, self.v_dim_local], dim=-1)
        q = l2_normalize(q.reshape(num_rows, self.num_key_heads_local, self.key_head_dim)) * self.key_head_dim ** -0.5
        k = l2_normalize(k.reshape(num_rows, self.num_key_heads_local, self.key_head_dim))
        return q, k, v.reshape(num_rows, self.num_value_heads_local, self.value_head_dim).contiguous()

    def _decode(self, ops, mamba: MambaForward, qkv, g, beta, weight, conv_bias) -> torch.Tensor:
        """The ``1 + S`` rows of each of nd decode requests (the first ``nd (1 + S)`` rows, zero past T)
        -> o ``[nd (1 + S), H, V]``; the conv window after every row goes to the slot's intermediate
        buffer, and each row's inputs (or state) for the commit (module docstring)."""
        layer, slots = self.mamba_layer_index, mamba.decode_slot_ids  # slots: [nd] int64
        num_requests, stride = slots.shape[0], mamba.rows_per_decode_request
        count = num_requests * stride
        padded = qkv if qkv.shape[0] >= count else F.pad(qkv, (0, 0, 0, count - qkv.shape[0]))
        rows = padded[:count].view(num_requests, stride, self.conv_channels)  # [nd, R, C]
        window = mamba.conv_states[layer, slots].float()  # [nd, C, W - 1]
        full = torch.cat((window, rows.transpose(1, 2)), dim=2)  # [nd, C, W - 1 + R]: oldest first
        taps = full.unfold(2, self.conv_width, 1)  # [nd, C, R, W]: row j reads columns j .. j + W - 1
        conv_out = F.silu((taps * weight[:, None, :]).sum(-1) + conv_bias[:, None])  # [nd, C, R]
        # the window after row j: columns j + 1 .. j + W - 1
        mamba.intermediate_conv_states[layer, slots] = full[:, :, 1:].unfold(2, self.conv_width - 1, 1) \
            .permute(0, 2, 1, 3).to(mamba.intermediate_conv_states.dtype)  # [nd, R, C, W - 1]
        # contiguous first: with one request, reshape would keep the transpose's strides (q's last dim stride R)
        q, k, v = self._heads(conv_out.transpose(1, 2).contiguous().view(count, self.conv_channels))
        g, beta = _first_rows(g, count), _first_rows(beta, count)
        if mamba.verify_row_inputs is not None:  # pending rows applied, the rows' inputs stored (deferred commit)
            return ops.gdn_verify_rows(mamba.ssm_states, mamba.verify_row_inputs, mamba.pending_rows,
                                       mamba.input_parity, layer, slots, q, k, v, g, beta, stride)
        return ops.gdn_decode_rows(mamba.ssm_states, mamba.intermediate_ssm_states, layer, slots, q, k, v, g, beta)

    def _prefill(self, ops, mamba: MambaForward, qkv, g, beta, weight, conv_bias):
        """Every prefill segment of the packed rows at once -> (o ``[T, H, V]``, 0 outside the segments;
        inside ``[T]`` bool); each segment's slot gets its new window and state. Segments of at least
        ``fla_prefill_min_rows`` rows go through flash-linear-attention's chunked kernel instead of
        ours when it is installed, on CUDA, outside graph capture (:meth:`_long_segments`)."""
        layer, slots = self.mamba_layer_index, mamba.prefill_slot_ids  # slots: [n] int64
        start, count = mamba.prefill_row_start, mamba.prefill_row_count
        conv_pool = mamba.conv_states[layer]  # [M, C, W - 1] view
        conv_out, windows = ops.causal_conv_varlen(conv_pool, qkv, start, count, weight, conv_bias, slot_ids=slots)
        q, k, v = self._heads(conv_out)
        long_segments, chunk_rule = self._long_segments(ops, mamba, qkv)
        scan_count = count
        if long_segments:  # our scan skips them (0 rows: their slots untouched)
            scan_count = count.clone()
            for segment, _, _ in long_segments:
                scan_count[segment] = 0  # host index, no sync
        ssm_pool = mamba.ssm_states[layer]  # [M, H, K, V] view
        if ops is torch_twins and mamba.pending_rows is not None and not mamba.pending_rows.is_cuda:  # host check
            check_no_pending_rows(mamba.pending_rows, slots, count)
        o, _ = ops.gdn_varlen_scan(ssm_pool, q, k, v, g, beta, start, scan_count, slot_ids=slots)
        for segment, first_row, num_rows in long_segments:
            rows, slot = slice(first_row, first_row + num_rows), slots[segment:segment + 1]  # slot: [1] int64
            # q is normalised and scaled already; k heads shared by value heads (fla's GVA)
            o_rows, final = chunk_rule(q[None, rows], k[None, rows], v[None, rows], g[None, rows], beta[None, rows],
                                       scale=1.0, initial_state=ssm_pool.index_select(0, slot),
                                       output_final_state=True)
            o[rows] = o_rows[0].float()
            ssm_pool.index_copy_(0, slot, final.to(ssm_pool.dtype))
        conv_pool[slots] = windows.to(conv_pool.dtype)  # after the conv read the old windows
        _, _, inside = ops.segment_of_rows(start, count, qkv.shape[0])
        return o, inside

    def _long_segments(self, ops, mamba: MambaForward, rows: torch.Tensor):
        """(the real prefill segments of >= ``fla_prefill_min_rows`` rows as ``(segment, first row,
        rows)``, fla's ``chunk_gated_delta_rule``), or ``((), None)``: outside our kernels' path (the
        CPU twins), without fla, while a CUDA graph is being captured (host row offsets would be baked
        in), or with the threshold None."""
        if self.fla_prefill_min_rows is None or ops is torch_twins or not mamba.host_prefill_segments:
            return (), None
        if rows.is_cuda and torch.cuda.is_current_stream_capturing():
            return (), None
        long_segments = tuple(segment for segment in mamba.host_prefill_segments
                              if segment[2] >= self.fla_prefill_min_rows)
        chunk_rule = fla_chunk_rule() if long_segments else None
        return (long_segments, chunk_rule) if chunk_rule is not None else ((), None)


def fla_chunk_rule():
    """flash-linear-attention's ``chunk_gated_delta_rule`` (``fla-core``, the ``gdn`` extra), or None
    when it is not installed; imported on first use."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def _first_rows(values: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` rows of ``values`` (``[T, ...]``), zero rows appended past ``T``."""
    if values.shape[0] >= count:
        return values[:count]
    return F.pad(values, (0, 0) * (values.dim() - 1) + (0, count - values.shape[0]))


class _MegatronGDNView:
    """The attributes megatron's ``GatedDeltaNet.sharded_state_dict`` reads, over a
    :class:`PagedGatedDeltaNet` (its parameters and children are the mixer's own)."""

    def __init__(self, mixer: PagedGatedDeltaNet, pg_collection):
        self._mixer, self.pg_collection = mixer, pg_collection
        self.tp_size = pg_collection.tp.size()
        self.qk_dim = mixer.key_head_dim * mixer.num_key_heads
        self.v_dim = mixer.value_head_dim * mixer.num_value_heads
        self.num_value_heads = mixer.num_value_heads
        self.in_proj_dim = 2 * self.qk_dim + 2 * self.v_dim + 2 * mixer.num_value_heads
        self.conv_dim_local_tp = mixer.conv_channels
        self.conv_bias = mixer.conv1d.bias is not None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self._mixer._save_to_state_dict(destination, prefix, keep_vars)

    def named_children(self):
        return self._mixer.named_children()
