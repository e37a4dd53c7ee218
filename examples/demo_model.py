"""What the example scripts share, from the package: the process-group set-up of a script run
plainly or under torchrun (:mod:`mtp_ctrl.cli.distributed`), and the demo model's checkpoint
helpers (:mod:`mtp_ctrl.models.demo_model`).

Distributed checkpoints (megatron's ``dist_checkpointing``, any TP size) are written by
``examples/train_mtp.py --save-format dist`` with ``{"model_args": ...}`` as their content metadata
and read by ``examples/generate.py --load DIR`` (``mtp_ctrl.models.load_distributed_checkpoint``).
"""

from mtp_ctrl.cli.distributed import init_distributed  # noqa: F401  re-exported for the scripts
from mtp_ctrl.models.demo_model import (  # noqa: F401  re-exported for the scripts
    CHECKPOINT_DTYPE,
    DEMO_MODEL_ARGS,
    build_demo_model,
    config_overrides,
    load_checkpoint,
    load_demo_model,
    load_full_state_dict,
    save_checkpoint,
    shipped_checkpoint_path,
)
