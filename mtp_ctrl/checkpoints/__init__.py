"""The trained checkpoints that ship with the package (package data; importing this imports nothing
heavy): the demo target ``mtp_demo.pt`` (``examples/train_mtp.py``; load it with
:func:`mtp_ctrl.load_demo_model`) and three draft heads trained for it, ``eagle_demo.pt``
(``examples/train_eagle.py``), ``ptd_demo.pt`` (``train_eagle.py --mode ptd``) and
``multi_layer_eagle_demo.pt`` (``examples/train_multi_layer_eagle.py``)."""

import os

SHIPPED_CHECKPOINTS_DIR = os.path.dirname(os.path.abspath(__file__))
SHIPPED_CHECKPOINTS = ("mtp_demo", "eagle_demo", "ptd_demo", "multi_layer_eagle_demo")


def shipped_checkpoint_path(name: str = "mtp_demo") -> str:
    """The path of a shipped checkpoint: ``"mtp_demo"`` (the target) or one of its draft heads,
    ``"eagle_demo"``, ``"ptd_demo"``, ``"multi_layer_eagle_demo"``."""
    if name not in SHIPPED_CHECKPOINTS:
        raise ValueError(f"name must be one of {SHIPPED_CHECKPOINTS}, got {name!r}")
    path = os.path.join(SHIPPED_CHECKPOINTS_DIR, f"{name}.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: this install of mtp_ctrl lacks its package data "
                                "(reinstall it, or pass the checkpoint's path)")
    return path
