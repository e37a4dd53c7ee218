"""StepGraphs captures with Python's garbage collector off (a CPU test: torch's graph capture is
replaced by a stand-in that records nothing). A collection during a real capture may finalize an
older controller's CUDA graphs, and destroying a graph mid-capture invalidates the capture."""

import contextlib
import gc

import pytest
import torch

from mtp_ctrl.controllers.cuda_graphs import StepGraphs


class _StandInGraph:
    def __init__(self):
        self.replays = 0

    def pool(self):
        return "pool"

    def replay(self):
        self.replays += 1


@pytest.fixture
def stand_in_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    yield
    gc.enable()


def test_the_capture_runs_with_the_collector_off_and_restores_it(stand_in_capture):
    seen = []
    graphs = StepGraphs()
    graphs.run("key", lambda: seen.append(gc.isenabled()))  # eager run, then the capture
    graphs.run("key", lambda: seen.append("not called: a replay"))
    assert seen == [True, False] and gc.isenabled() and len(graphs) == 1


def test_a_failed_capture_restores_the_collector_and_a_caller_that_had_it_off_keeps_it_off(stand_in_capture):
    calls = []

    def launch():
        calls.append(gc.isenabled())
        if len(calls) == 2:
            raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        StepGraphs().run("key", launch)
    assert gc.isenabled()
    gc.disable()
    StepGraphs().run("key", lambda: None)
    assert not gc.isenabled()
