"""GPU tests: skipped cleanly on machines without CUDA.

Run them in their own pytest process (``make test-gpu``), never together with tests/unit,
which turns on Triton's interpreter.
"""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        item.add_marker(skip)
