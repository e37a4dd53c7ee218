"""Adapters that run megatron-core models against mtp_ctrl's inference state."""
