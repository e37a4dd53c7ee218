"""Tensor-parallel ranks out of lockstep end on every rank with a clear error (TP = 2, two gloo
ranks on the CPU): a request one rank rejected and the other accepted, a hook that raises on one
rank, a rank that stops stepping. Each worker's stepping runs under a 30 s watchdog (a guard
against the old hang, not a timing assertion): a rank still stepping then exits with code 3."""

import os
import threading

import pytest
import torch.distributed as dist
from megatron.core import parallel_state

from tests.unit.megatron_fixtures import VOCAB_SIZE, build_tiny_model, free_port, init_process_groups, \
    rank_process_context, tiny_config, torch_twins

WATCHDOG_S = 30
HOOK_FAILURE = "on_step_end failed on purpose"


def _controller(model, **fields):
    from mtp_ctrl.controllers import InferenceConfig, TextGenerationController

    class HookedController(TextGenerationController):
        steps_seen = 0

        def on_step_end(self, outputs):
            self.steps_seen += 1
            if fields.get("scenario") == "hook" and dist.get_rank() == 0 and self.steps_seen == 3:
                raise ValueError(HOOK_FAILURE)

    config = dict(num_speculative_tokens=0, max_requests=4, block_size_tokens=4, max_model_len=48,
                  max_tokens_per_step=32)
    if fields.get("scenario") == "stops":
        config["tp_check_timeout_s"] = 5.0
    return HookedController(model, InferenceConfig(**config))


def _run(controller, scenario: str) -> None:
    from mtp_ctrl.controllers import SamplingParams

    rank = dist.get_rank()
    params = SamplingParams(max_new_tokens=12)
    controller.add_request([5, 17, 3, 88], params)
    if scenario == "divergent":  # the second prompt reached rank 1 damaged: rank 1 rejects it
        try:
            controller.add_request([9, 9, VOCAB_SIZE + rank * 1000] if rank else [9, 9, 2], params)
        except ValueError:
            pass
    else:
        controller.add_request([9, 9, 2], params)
    steps = 0
    while controller.has_unfinished_requests():
        if scenario == "stops" and rank == 1 and steps == 2:
            return  # rank 1 stops stepping (its caller moved on)
        controller.step()
        steps += 1


SCENARIOS = ("divergent", "hook", "stops")  # in this order: "stops" leaves a collective unanswered


def _worker(rank: int, port: int, out_dir: str) -> None:
    """Every scenario in turn on one pair of ranks (each ends with both ranks past the same collectives)."""
    init_process_groups(rank, 2, port, 2)
    try:
        model = build_tiny_model(tiny_config(mtp_num_layers=None, tensor_parallel_size=2))
        for scenario in SCENARIOS:
            controller = _controller(model, scenario=scenario)
            outcome = "finished"
            watchdog = threading.Timer(WATCHDOG_S, lambda: os._exit(3))
            watchdog.start()
            try:
                with torch_twins():
                    _run(controller, scenario)
            except Exception as error:  # noqa: BLE001  (what each rank ended with is the result)
                outcome = f"{type(error).__name__}: {error}"
            finally:
                watchdog.cancel()
            with open(os.path.join(out_dir, f"{scenario}_rank{rank}.txt"), "w") as file:
                file.write(outcome)
        dist.barrier()  # rank 1 leaves only once rank 0 has given up waiting for it
    finally:
        parallel_state.destroy_model_parallel()
        os._exit(0)  # a group with a timed-out collective cannot be destroyed cleanly


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """``{scenario: [rank 0's outcome, rank 1's]}``: the error text each rank ended with, or "finished"."""
    out_dir = tmp_path_factory.mktemp("tp_lockstep")
    context = rank_process_context()
    port = free_port()
    processes = [context.Process(target=_worker, args=(rank, port, str(out_dir))) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=600)
    for process in processes:
        if process.is_alive():
            process.kill()
    codes = [process.exitcode for process in processes]
    assert 3 not in codes, f"a rank was still stepping after {WATCHDOG_S} s: exit codes {codes}"
    return {scenario: [(out_dir / f"{scenario}_rank{rank}.txt").read_text() for rank in range(2)]
            for scenario in SCENARIOS}


def test_a_request_only_one_rank_accepted_ends_both_ranks(outcomes):
    for rank, outcome in enumerate(outcomes["divergent"]):
        assert outcome.startswith("TPLockstepError"), (rank, outcome)
        assert f"tensor-parallel rank {rank}" in outcome and "request 1 on rank(s) [0] only" in outcome, outcome


def test_a_hook_failing_on_one_rank_ends_every_rank_with_its_cause(outcomes):
    rank0, rank1 = outcomes["hook"]
    assert rank0 == f"ValueError: {HOOK_FAILURE}"
    assert rank1.startswith("TPLockstepError") and f"rank 0 failed: ValueError: {HOOK_FAILURE}" in rank1, rank1


def test_a_rank_that_stops_stepping_ends_the_other(outcomes):
    rank0, rank1 = outcomes["stops"]
    assert rank1 == "finished"
    assert rank0.startswith("TPLockstepError") and "no answer from the other ranks" in rank0, rank0
