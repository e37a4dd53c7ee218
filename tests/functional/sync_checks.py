"""The GPU tests' one way to assert "no host sync here"."""

import contextlib

import torch


@contextlib.contextmanager
def no_host_sync():
    """Inside the block, an operation that synchronises the host with the GPU raises
    (``torch.cuda.set_sync_debug_mode("error")``); the mode is reset on the way out."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
