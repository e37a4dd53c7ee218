"""Unit tests run on CPU tensors; kernels go through Triton's interpreter.

TRITON_INTERPRET must be set before Triton is imported (``triton.jit`` reads it when a kernel is
defined), so it is set here, before any test module imports a kernel.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
