"""The step's fused glue on CUDA (prepare_step_inputs, mtp_draft_window, mtp_advance_window):
kernel == the CPU reference, no host sync, and a CUDA graph captured once replays new inputs."""

import pytest
import torch

from mtp_ctrl.triton_ops import mtp_advance_window, mtp_draft_window, prepare_step_inputs, reference
from tests.functional.sync_checks import no_host_sync
from tests.unit.test_mtp_window import ADVANCE_ARGS, mtp_window_case
from tests.unit.test_step_inputs import step_inputs_case

SHARED_ROWS = ("token_history", "hidden_ring", "window_starts")  # their padding row takes racing writes


def _to(case, device):
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in case.items()}


def _assert_equal(got, want, padding_row=None):
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            gpu = got[name].cpu()
            if padding_row is not None and name in SHARED_ROWS:
                gpu, value = gpu[:padding_row], value[:padding_row]
            assert torch.equal(gpu, value), name


def _draft_window_step(case):
    mtp_draft_window(**case)
    mtp_advance_window(**{name: case[name] for name in ADVANCE_ARGS})


def _reference_draft_window_step(case):
    reference.mtp_draft_window(**case)
    reference.mtp_advance_window(**{name: case[name] for name in ADVANCE_ARGS})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mtp_window_kernels_match_reference_without_sync_and_replay(dtype):
    def make(seed):
        return mtp_window_case(torch.Generator().manual_seed(seed), 5, (40, 9, 3), 2, 3, hidden_size=1024,
                               max_requests=32, dtype=dtype, extra_window_rows=2)

    case = make(0)
    gpu = _to(case, "cuda")
    with no_host_sync():
        _draft_window_step(gpu)
    _reference_draft_window_step(case)
    _assert_equal(gpu, case, case["padding_row"])
    graph = torch.cuda.CUDAGraph()
    gpu = _to(make(1), "cuda")
    with torch.cuda.graph(graph):
        _draft_window_step(gpu)
    fresh = make(2)  # same shapes, new values
    for name, value in fresh.items():
        if isinstance(value, torch.Tensor):
            gpu[name].copy_(value)
    graph.replay()
    _reference_draft_window_step(fresh)
    _assert_equal(gpu, fresh, fresh["padding_row"])


def test_advance_with_a_token_record_matches_reference_without_sync():
    """A step that runs no window: the advance records the tokens too (one launch), == its twin."""
    from mtp_ctrl.triton_ops import TokenRecord

    case = mtp_window_case(torch.Generator().manual_seed(4), 40, (9, 3), 2, 2, hidden_size=1024, max_requests=64,
                           dtype=torch.bfloat16, verify_width=0, catch_up=6)
    gpu = _to(case, "cuda")

    def record(step):
        return TokenRecord(step["step_positions"], step["step_input_ids"], step["next_tokens"], step["token_history"],
                           step["padding_row"])

    with no_host_sync():
        mtp_advance_window(**{name: gpu[name] for name in ADVANCE_ARGS}, move_window_start=False, record=record(gpu))
    reference.mtp_advance_window(**{name: case[name] for name in ADVANCE_ARGS}, move_window_start=False,
                                 record=record(case))
    _assert_equal(gpu, case, case["padding_row"])


def test_prepare_step_inputs_matches_reference_without_sync_and_replay():
    def make(seed):
        return step_inputs_case(torch.Generator().manual_seed(seed), 6, (70, 5), 3, 2, max_requests=16)

    case = make(0)
    gpu = _to(case, "cuda")
    with no_host_sync():
        prepare_step_inputs(**gpu)
    reference.prepare_step_inputs(**case)
    _assert_equal(gpu, case)
    graph = torch.cuda.CUDAGraph()
    gpu = _to(make(1), "cuda")
    with torch.cuda.graph(graph):
        prepare_step_inputs(**gpu)
    fresh = make(2)
    for name, value in fresh.items():
        if isinstance(value, torch.Tensor):
            gpu[name].copy_(value)
    graph.replay()
    reference.prepare_step_inputs(**fresh)
    _assert_equal(gpu, fresh)


def test_step_rows_match_reference_on_cuda():
    from mtp_ctrl.triton_ops import draft_batch_rows, logits_row_requests
    from tests.unit.test_step_rows import draft_rows_case, logits_rows_case

    with_lengths = draft_rows_case(torch.Generator().manual_seed(1), 64, (50, 30, 45), 2)
    with_lengths.update(draft_lengths=torch.randint(0, 3, (64,)), out_draft_length_rows=torch.full((1000,), -7))
    for op, twin, case in ((logits_row_requests, reference.logits_row_requests,
                            logits_rows_case(torch.Generator().manual_seed(0), 64, 40, 2)),
                           (draft_batch_rows, reference.draft_batch_rows,
                            draft_rows_case(torch.Generator().manual_seed(0), 64, (50, 30, 45), 2)),
                           (draft_batch_rows, reference.draft_batch_rows, with_lengths)):
        gpu = _to(case, "cuda")
        with no_host_sync():
            op(**gpu)
        twin(**case)
        _assert_equal(gpu, case)
