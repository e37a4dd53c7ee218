"""mtp_ctrl: lossless MTP speculative decoding for megatron-core models.

Layers (imports point down only): ``controllers`` -> ``models`` -> ``state`` -> ``triton_ops``.
Nothing heavy happens at import time; submodules load when first used. Two helpers for scripts
live here: :func:`init_single_process` (the process group and megatron's ``parallel_state`` a
plain ``python`` run needs) and :func:`quiet_known_warnings` (megatron-core's import-time
notices about optional packages). :func:`load_demo_model` (the trained demo model that ships
with the package) loads :mod:`mtp_ctrl.models` on first use. See docs/design.md.
"""

import logging
import os
import re
import socket
import warnings

__version__ = "0.1.0"

# Messages megatron-core prints on a machine without Apex / Transformer Engine, or for settings
# it deprecates; they do not affect this package (it uses megatron's torch fallbacks).
KNOWN_WARNING_MESSAGES = (
    r"Apex is not installed",
    r"Transformer Engine and Apex are not installed",
    r"Transformer Engine is not installed",
    r"(Warning: )?tp_group is None, using default tp group",
    r"full scope is deprecated",
)


class _KnownMessageFilter(logging.Filter):
    """Drops log records whose message matches one of :data:`KNOWN_WARNING_MESSAGES`."""

    def __init__(self, patterns):
        super().__init__()
        self._pattern = re.compile("|".join(f"(?:{pattern})" for pattern in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return self._pattern.search(record.getMessage()) is None


_LOG_FILTER = _KnownMessageFilter(KNOWN_WARNING_MESSAGES)


def quiet_known_warnings(verbose: bool = False) -> None:
    """Hide megatron-core's known notices (each matched by its message; other warnings still show).

    Call it first thing in a script, before megatron-core is imported; ``verbose=True`` does
    nothing, so a ``--verbose`` flag shows every warning again.
    """
    if verbose:
        return
    for message in KNOWN_WARNING_MESSAGES:
        warnings.filterwarnings("ignore", message=message)
    for name in ("", "megatron", "megatron.core"):
        logger = logging.getLogger(name)
        if _LOG_FILTER not in logger.filters:
            logger.addFilter(_LOG_FILTER)


def init_single_process(device=None) -> None:
    """Make a plain ``python`` process a world of one: ``torch.distributed`` (gloo on CPU, nccl
    on CUDA) and megatron-core's ``parallel_state`` at tensor-parallel size 1.

    Building a megatron-core model and running :class:`~mtp_ctrl.controllers.TextGenerationController`
    need both. Whatever is already initialised (e.g. by torchrun and your own set-up) is kept, so
    calling it twice is harmless. ``device``: ``"cpu"``, ``"cuda"`` or a ``torch.device`` (default:
    CUDA when available). Pair it with ``torch.distributed.destroy_process_group()`` at exit.
    """
    import torch  # imported here: nothing heavy at package import time
    import torch.distributed as dist
    from megatron.core import parallel_state

    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device}")
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(sock.getsockname()[1])
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def __getattr__(name):
    # module-level attributes loaded on first use, so that ``import mtp_ctrl`` stays light
    if name == "load_demo_model":
        from mtp_ctrl.models.demo_model import load_demo_model

        return load_demo_model
    raise AttributeError(f"module 'mtp_ctrl' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), "load_demo_model"])
