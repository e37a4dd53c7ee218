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


def _patch_the_language_once_per_launch():
    """Triton's interpreter re-patches ``triton.language`` (``inspect.getmembers`` over its
    modules, ~2 ms) on EVERY call of a ``@triton.jit`` helper from inside a kernel, although the
    launch already patched it and the helper's patch is never restored (the launch's own restore
    undoes all). In the controller tests that was a quarter of the interpreted time (a helper such
    as ``_round`` runs once per program). This keeps the first patch of each helper per launch and
    skips the repeats: the same patched language, so the kernels run exactly as before. Guarded:
    a Triton without these internals runs unchanged."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    helper = getattr(interpreter, "InterpretedFunction", None)
    launch = getattr(interpreter, "GridExecutor", None)
    if helper is None or launch is None or not hasattr(interpreter, "_patch_lang"):
        return
    patched_in_this_launch = set()
    launch_call, helper_call = launch.__call__, helper.__call__

    def launch_and_forget(self, *args, **kwargs):
        patched_in_this_launch.clear()
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            patched_in_this_launch.clear()

    def call_helper(self, *args, **kwargs):
        if self.fn not in patched_in_this_launch:
            patched_in_this_launch.add(self.fn)
            return helper_call(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as error:  # as the interpreter's own call reports it
            raise interpreter.InterpreterError(repr(error)) from error

    launch.__call__, helper.__call__ = launch_and_forget, call_helper


def _cache_numpy_dtypes():
    """The interpreter maps a Triton dtype to a numpy one (``_get_np_dtype``) on every op of every
    program, building a 19-entry dict each time: ~6 % of an interpreted controller loop. The map
    never changes, so each dtype's answer is kept. Guarded as above."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    to_numpy = getattr(interpreter, "_get_np_dtype", None)
    if to_numpy is None:
        return
    known = {}

    def cached(tt_dtype):
        try:
            return known[tt_dtype]
        except KeyError:
            known[tt_dtype] = answer = to_numpy(tt_dtype)
            return answer
        except TypeError:  # an unhashable type: ask every time
            return to_numpy(tt_dtype)

    interpreter._get_np_dtype = cached


def _skip_the_discarded_overflow_checks():
    """With ``sanitize_overflow`` (the interpreter's default) every int32 add, sub and mul is
    recomputed in int64 and compared with the type's range, only to feed ``device_assert``, which
    the interpreter drops: its ``InterpreterOptions.debug`` is False and nothing sets it (Triton's
    ``device_assert`` returns at once without debug). That dead work was ~25 % of an interpreted
    controller loop (test_overlap's padded churn: 36 of 145 profiled seconds). Off, the kernels
    compute and check exactly what they did. Guarded: a Triton whose interpreter checks (debug on)
    or lacks these internals runs unchanged."""
    import dataclasses

    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    options = getattr(getattr(interpreter, "interpreter_builder", None), "options", None)
    if options is None or not dataclasses.is_dataclass(options) or getattr(options, "debug", True) \
            or not getattr(options, "sanitize_overflow", False):
        return
    interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()
    _cache_numpy_dtypes()
    _skip_the_discarded_overflow_checks()


@pytest.fixture
def torch_twins():
    """Run every op through its torch twin instead of the interpreted kernel (each kernel == its
    twin in its own tests). For the slow controller-level tests whose subject is the loop, not the
    kernels: at least one test of each kind still runs the kernels through the interpreter."""
    from tests.unit.megatron_fixtures import torch_twins as twins

    with twins():
        yield


@pytest.fixture
def model_twins():
    """The model's attention, rope and sampling ops on their twins (``megatron_fixtures.MODEL_OPS``),
    every other op interpreted: for the interpreted run of a loop whose subject is its own kernels."""
    from tests.unit.megatron_fixtures import MODEL_OPS, torch_twins as twins

    with twins(*MODEL_OPS):
        yield
