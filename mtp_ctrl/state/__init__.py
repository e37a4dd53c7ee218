"""Dynamic inference state: KV blocks, request table, Mamba slots, per-step metadata."""

from mtp_ctrl.state.attention_metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
