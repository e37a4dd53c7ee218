"""Unit tests run on CPU tensors; kernels go through Triton's interpreter.

TRITON_INTERPRET must be set before Triton is imported (``triton.jit`` reads it when a kernel is
defined), so it is set here, before any test module imports a kernel.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# The layer-glue and Mamba conv/scan/decode-row kernels are off by default for a CPU model
# (InferenceConfig.fused_glue / mamba_kernels None), so the model tests run megatron's own glue and
# the Mamba twins; tests/unit/test_fused_layers.py and test_mamba_decode_kernel.py turn them on to
# run them through the interpreter, and the GPU tests run them by default.
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
