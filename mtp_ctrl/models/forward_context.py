"""The one side channel through which a forward pass's paged state reaches attention and Mamba.

megatron-core calls core attention with ``(query, key, value, attention_mask, ...)`` and a
layer's token mixer with its hidden states only, so the step's :class:`AttentionMetadata`, the
KV caches, (for hybrid models) the Mamba state of each request and (for the fused rotary path)
the step's rotary tables travel through a context variable that exactly one context manager sets
and always resets::

    with paged_forward_context(metadata, kv_caches, mamba, rotary):
        hidden = model.decoder(...)   # every PagedCoreAttention and PagedMambaMixer reads them here
"""

import contextlib
import contextvars
import dataclasses
from typing import Iterator, Optional, Sequence, Tuple, Union

import torch

from mtp_ctrl.state.attention_metadata import AttentionMetadata
from mtp_ctrl.state.mamba_slots import MambaStateSlots
from mtp_ctrl.state.step_metadata import StepMetadata

KVCachePair = Tuple[torch.Tensor, torch.Tensor]  # ([num_blocks, block_size_tokens, Hkv_local, D],) * 2
LayerKVCache = Union[KVCachePair, torch.Tensor]  # a pair, or an MLA layer's [num_blocks, block_size_tokens, C + R]


@dataclasses.dataclass(frozen=True)
class MambaForward:
    """Where each request's Mamba state is read and written during one forward, as device
    tensors only (so a CUDA graph can capture a step with decode rows and prefill chunks).

    Letters: Lm Mamba layers, M state slots (the last one a scratch slot for padding requests),
    S drafts, nd decode requests (including CUDA-graph padding), n prefill segments (one per
    request of the grid; 0 rows for a request that does not prefill), C/W/H/P/N the conv and
    SSM sizes.

    Decode requests own the first ``nd * (1 + V)`` packed rows (V <= S, the step's verify width;
    rows inside a prefill segment excepted: a padded grid's decode requests past the real ones may
    overlap prefill rows, and use the scratch slot); each starts from its current state and writes the state after its
    row ``j`` to ``intermediate_*[:, slot, j]`` (the controller later commits the one after the
    last accepted row; Gated DeltaNet layers first apply the slot's ``pending_rows`` from
    ``verify_row_inputs`` and store each row's inputs there instead, and the commit only records
    the kept rows, which the slot's next step applies: :mod:`mtp_ctrl.state.mamba_slots`).
    Prefill segment ``g`` is rows ``[prefill_row_start[g], + prefill_row_count[g])`` (segments in
    row order); it continues from the current state of
    ``prefill_slot_ids[g]`` and leaves the state after its rows in it. A segment of 0 rows
    leaves its slot as it was; give it the scratch slot.
    """

    conv_states: torch.Tensor  # [Lm, M, C, W - 1] fp32, current state per slot
    ssm_states: torch.Tensor  # [Lm, M, H, P, N] fp32
    intermediate_conv_states: torch.Tensor  # [Lm, M, 1 + V, C, W - 1] fp32 (a view of the slots' 1 + S)
    intermediate_ssm_states: Optional[torch.Tensor]  # [Lm, M, 1 + V, H, P, N] fp32; None: verify_row_inputs
    decode_slot_ids: torch.Tensor  # [nd] int64 on the device: slot of each decode request
    prefill_row_start: Optional[torch.Tensor] = None  # [n] int64 on the device; None: no prefill rows
    prefill_row_count: Optional[torch.Tensor] = None  # [n] int64 on the device
    prefill_slot_ids: Optional[torch.Tensor] = None  # [n] int64 on the device
    # Gated DeltaNet slots: each verify row's (k, u, g) (u its delta) instead of its state, in two buffers, and
    # each slot's rows still to apply (gdn_verify_rows; all 1 + S stored rows: a step may apply more than it verifies)
    verify_row_inputs: Optional[torch.Tensor] = None  # [Lm, M, 2, 1 + S, F] fp32
    pending_rows: Optional[torch.Tensor] = None  # [M] int32
    input_parity: Optional[torch.Tensor] = None  # [M] int32
    # the real prefill segments as the host planned them: (segment index, first row, rows) each. Host
    # values: a layer may only use them outside CUDA-graph capture (Gated DeltaNet's long chunks)
    host_prefill_segments: Tuple[Tuple[int, int, int], ...] = ()

    def __post_init__(self):
        given = [name for name in ("prefill_row_start", "prefill_row_count", "prefill_slot_ids")
                 if getattr(self, name) is not None]
        if given and len(given) != 3:
            raise ValueError(f"give all of prefill_row_start, prefill_row_count and prefill_slot_ids, or none "
                             f"(got {given})")
        if (self.intermediate_ssm_states is None) == (self.verify_row_inputs is None):
            raise ValueError("give exactly one of intermediate_ssm_states and verify_row_inputs")
        if (self.verify_row_inputs is None) != (self.pending_rows is None) or \
                (self.pending_rows is None) != (self.input_parity is None):
            raise ValueError("give verify_row_inputs, pending_rows and input_parity together")
        if given and not (self.prefill_row_start.shape == self.prefill_row_count.shape == self.prefill_slot_ids.shape):
            raise ValueError("prefill_row_start, prefill_row_count and prefill_slot_ids must have one shape [n]")

    @property
    def has_prefill(self) -> bool:
        return self.prefill_row_start is not None

    @property
    def rows_per_decode_request(self) -> int:
        return self.intermediate_conv_states.shape[2]

    @classmethod
    def for_step(cls, slots: MambaStateSlots, slot_ids: torch.Tensor, step: StepMetadata, num_decode: int,
                 decode_limit: Optional[torch.Tensor]) -> "MambaForward":
        """A step's Mamba layout, device tensors only (a CUDA graph captures it with the step);
        ``slot_ids``: ``[R]`` int64, the slot of each request-table row.

        Decode: the first ``num_decode`` requests of the grid; those at or past ``decode_limit``
        (``[1]`` int64 on the device, or None: all decode) use the scratch slot. Prefill (a step
        with prefill chunks): one segment per request of the grid, of its rows when it is a
        prefill request and of 0 rows in the scratch slot otherwise (decode and padding requests)."""
        decode_slot_ids = slot_ids[:num_decode]  # [nd] int64
        if decode_limit is not None:
            request_index = torch.arange(num_decode, device=decode_slot_ids.device)
            decode_slot_ids = torch.where(request_index < decode_limit, decode_slot_ids, slots.scratch_slot)
        prefill = {}
        if not step.decode_only:
            starts = step.host_query_start_loc.tolist()  # host-ok: a CPU tensor
            prefill["host_prefill_segments"] = tuple(
                (index, starts[index], starts[index + 1] - starts[index])
                for index in range(step.num_decode, step.num_decode + step.num_prefill))
            grid = step.attention.batch_size  # G
            query_start_loc = step.attention.query_start_loc[: grid + 1].long()  # [G + 1] int64
            request_index = torch.arange(grid, device=query_start_loc.device)
            prefilling = (request_index >= step.device_num_decode) & (request_index < step.num_active)  # [G] bool
            prefill.update(
                prefill_row_start=query_start_loc[:-1],
                prefill_row_count=torch.where(prefilling, query_start_loc[1:] - query_start_loc[:-1], 0),
                prefill_slot_ids=torch.where(prefilling, slot_ids[:grid], slots.scratch_slot),
            )
        rows = step.verify_stride  # 1 + V rows per decode request: the first 1 + V intermediate states
        return cls(conv_states=slots.conv_states, ssm_states=slots.ssm_states,
                   intermediate_conv_states=slots.intermediate_conv_states[:, :, :rows],
                   intermediate_ssm_states=_first_rows(slots.intermediate_ssm_states, rows),
                   verify_row_inputs=slots.verify_row_inputs, pending_rows=slots.pending_rows,
                   input_parity=slots.input_parity, decode_slot_ids=decode_slot_ids,
                   **prefill)


def _first_rows(per_row: Optional[torch.Tensor], rows: int) -> Optional[torch.Tensor]:
    """``per_row[:, :, :rows]`` (a view: the step's ``1 + V`` verify rows), or None."""
    return None if per_row is None else per_row[:, :, :rows]


@dataclasses.dataclass(frozen=True)
class RotaryTables:
    """cos and sin of every row's rotary angles, computed once per forward and shared by every
    attention layer; the layers rope q and k inside their fused KV write
    (:func:`mtp_ctrl.triton_ops.rope_and_write_kv_cache`), so megatron applies no rotary itself.
    ``R`` is the rotary dim (``rotary_percent * head_dim``)."""

    cos: torch.Tensor  # [T, R / 2] fp32, cos(position_t * inv_freq_j) (times megatron's mscale)
    sin: torch.Tensor  # [T, R / 2] fp32


@dataclasses.dataclass(frozen=True)
class PagedForward:
    metadata: AttentionMetadata
    kv_caches: Sequence[LayerKVCache]  # index: decoder layer 0..L-1, then MTP depth k at L + k
    mamba: Optional[MambaForward] = None  # None for a model without Mamba layers
    rotary: Optional[RotaryTables] = None  # None: no rotary in attention (not rope, or megatron applied it)
    fused_glue: bool = False  # layers fuse their bias / residual / norm / activation glue (models.fused_layers)
    moe_backend: Optional[str] = None  # MoE layers: a sync-free backend (models.moe_inference), or None: megatron's
    # a layer's output -> the next layer's input norm of it, computed by the layer's last fused
    # kernel (models.fused_layers): id(hidden states) -> (hidden states, normed), taken once
    normed_inputs: dict = dataclasses.field(default_factory=dict)


def stash_normed_input(hidden_states: torch.Tensor, normed: torch.Tensor) -> None:
    """Record, inside a paged forward, that the next layer's input norm of ``hidden_states`` is
    ``normed``; :func:`take_normed_input` hands it to that layer."""
    forward = _CURRENT.get()
    if forward is not None:
        forward.normed_inputs[id(hidden_states)] = (hidden_states, normed)


def take_normed_input(hidden_states: torch.Tensor) -> Optional[torch.Tensor]:
    """The normed input stashed for exactly this tensor object (and forget it), else None."""
    forward = _CURRENT.get()
    if forward is None:
        return None
    stashed = forward.normed_inputs.pop(id(hidden_states), None)
    return stashed[1] if stashed is not None and stashed[0] is hidden_states else None


_CURRENT: contextvars.ContextVar[Optional[PagedForward]] = contextvars.ContextVar("mtp_ctrl_paged_forward", default=None)


@contextlib.contextmanager
def paged_forward_context(metadata: AttentionMetadata, kv_caches: Sequence[LayerKVCache],
                          mamba: Optional[MambaForward] = None,
                          rotary: Optional[RotaryTables] = None, fused_glue: bool = False,
                          moe_backend: Optional[str] = None) -> Iterator[PagedForward]:
    """Make ``metadata``, ``kv_caches``, ``mamba``, ``rotary``, ``fused_glue`` and ``moe_backend``
    visible to the paged modules inside the block."""
    if not isinstance(metadata, AttentionMetadata):
        raise TypeError(f"metadata must be an AttentionMetadata, got {type(metadata).__name__}")
    if isinstance(kv_caches, torch.Tensor) or not isinstance(kv_caches, Sequence):
        raise TypeError("kv_caches must be a sequence with one entry per attention layer: a (key_cache, "
                        "value_cache) pair, or an MLA layer's latent cache")
    if mamba is not None and not isinstance(mamba, MambaForward):
        raise TypeError(f"mamba must be a MambaForward or None, got {type(mamba).__name__}")
    if rotary is not None and not isinstance(rotary, RotaryTables):
        raise TypeError(f"rotary must be a RotaryTables or None, got {type(rotary).__name__}")
    if not isinstance(fused_glue, bool):
        raise TypeError(f"fused_glue must be a bool, got {type(fused_glue).__name__}")
    if moe_backend is not None and not isinstance(moe_backend, str):
        raise TypeError(f"moe_backend must be a str or None, got {type(moe_backend).__name__}")
    if _CURRENT.get() is not None:
        raise RuntimeError("paged_forward_context is already active; forwards do not nest")
    token = _CURRENT.set(PagedForward(metadata, kv_caches, mamba, rotary, fused_glue, moe_backend))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def current_paged_forward() -> PagedForward:
    """The active forward's inputs; raises outside :func:`paged_forward_context`."""
    forward = _CURRENT.get()
    if forward is None:
        raise RuntimeError(
            "paged core attention ran outside paged_forward_context(metadata, kv_caches); "
            "run the model through mtp_ctrl.models.PagedGPTRunner"
        )
    return forward


def in_paged_forward() -> bool:
    """True inside :func:`paged_forward_context`."""
    return _CURRENT.get() is not None


def fused_glue_enabled() -> bool:
    """True inside a paged forward that asked for the fused layer glue; False anywhere else
    (e.g. training the dense twin), so the fused layers fall back to megatron's forward."""
    forward = _CURRENT.get()
    return forward is not None and forward.fused_glue


def current_moe_backend() -> Optional[str]:
    """The active paged forward's MoE backend (``models.moe_inference``); None outside a paged
    forward or when it runs megatron's own MoE layer."""
    forward = _CURRENT.get()
    return None if forward is None else forward.moe_backend
