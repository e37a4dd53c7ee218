"""Unit tests run on CPU tensors; kernels go through Triton's interpreter.

TRITON_INTERPRET must be set before Triton is imported (``triton.jit`` reads it when a kernel is
defined), so it is set here, before any test module imports a kernel.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# The layer-glue kernels through the interpreter would double the time of every model test. The
# rest of the suite runs megatron's own glue; tests/unit/test_fused_layers.py runs the fused glue
# through the model and the controller (fused == unfused), and the GPU tests run it by default.
os.environ.setdefault("MTP_CTRL_FUSED_GLUE", "0")
# Likewise the Mamba conv/scan/decode-row kernels: model tests' mixers run their torch twins
# (mtp_ctrl.models.mamba_mixer.MAMBA_KERNELS_ENV); tests/unit/test_mamba_varlen_kernels.py and
# test_mamba_decode_kernel.py run the kernels, the latter also through a mixer.
os.environ.setdefault("MTP_CTRL_MAMBA_KERNELS", "0")
# Under pytest-xdist every worker is a process with torch's default intra-op threads (one per
# core): 2 workers x 2 threads on CI's 2 cores oversubscribe them, and CPU-heavy tests ran 2-10x
# slower (a controller churn test: 15.8 s -> 1.7 s with one thread a worker).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported (its OpenMP pool reads it)


import pytest  # noqa: E402


@pytest.fixture
def torch_twins():
    """Run every op through its torch twin instead of the interpreted kernel (each kernel == its
    twin in its own tests). For the slow controller-level tests whose subject is the loop, not the
    kernels: at least one test of each kind still runs the kernels through the interpreter."""
    from tests.unit.megatron_fixtures import torch_twins as twins

    with twins():
        yield
