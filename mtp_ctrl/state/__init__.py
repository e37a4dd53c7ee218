"""Dynamic inference state: KV blocks, request table, Mamba slots, per-step metadata."""

from mtp_ctrl.state.attention_metadata import AttentionMetadata
from mtp_ctrl.state.batch_dimensions import BatchDimensions, round_up_batch_size
from mtp_ctrl.state.context import DynamicInferenceContext
from mtp_ctrl.state.engine_shape import EngineShape
from mtp_ctrl.state.kv_block_allocator import KVBlockAllocator, KVCacheFullError
from mtp_ctrl.state.kv_cache import KVCacheSpec, LatentKVCacheSpec
from mtp_ctrl.state.mamba_slots import MambaSpec, MambaStateSlots
from mtp_ctrl.state.request_table import RequestTable, RowGroup
from mtp_ctrl.state.step_metadata import StepMetadata

__all__ = [
    "AttentionMetadata",
    "BatchDimensions",
    "DynamicInferenceContext",
    "EngineShape",
    "KVBlockAllocator",
    "KVCacheFullError",
    "KVCacheSpec",
    "LatentKVCacheSpec",
    "MambaSpec",
    "MambaStateSlots",
    "RequestTable",
    "RowGroup",
    "StepMetadata",
    "round_up_batch_size",
]
