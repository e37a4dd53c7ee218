"""CUDA graphs of the GPU part of padded steps: one per (BatchDimensions, all-greedy flag).

A step padded to a graph shape (decode-only: a batch bucket; with prefill chunks: a batch bucket
and a token bucket) replays the graph of its key. The controller's ``warmup`` captures every key
at start-up from steps that hold no request; a key not warmed up is captured on first use (that
step runs eagerly first, which also compiles every kernel). A replay reads only static memory:
the staged step buffers, the request table's device rows, the KV caches and the controller's
step buffers; the real counts (requests, decode requests, sampling requests) are read on the
device, so one graph serves every step that rounds up to its shape. Eager and replayed steps run
the same kernels on the same memory.

Python's garbage collector is off while a graph captures: a collection then may finalize an
unreachable object that holds CUDA graphs (an older controller in a reference cycle), and
destroying a graph during a capture invalidates the capture (torch no longer collects before a
capture unless ``torch.compiler.config.force_cudagraph_gc``).

Under tensor parallelism the graphs hold the NCCL collectives of the step. A process group
waits for captured collectives at ``destroy_process_group`` as if they were pending work
(pytorch/pytorch#115388), so :meth:`StepGraphs.reset` must run first (the controller's ``close``).
"""

import gc
from typing import Callable, Dict, Hashable

import torch


class StepGraphs:
    def __init__(self):
        self._graphs: Dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._pool = None  # one memory pool shared by every captured graph
        self._last_key = None  # the key run() was given last

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, launch: Callable[[], None]) -> None:
        """Replay the graph of ``key``; on its first use, run ``launch`` eagerly, then capture it."""
        self._last_key = key
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        launch()
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()  # no finalizer may destroy another graph mid-capture (module docstring)
        try:
            with torch.cuda.graph(graph, pool=self._pool):  # synchronises once, at capture
                launch()
        finally:
            if collecting:
                gc.enable()
        self._pool = graph.pool()
        self._graphs[key] = graph

    def replay(self, key: Hashable) -> None:
        """Replay the graph of ``key``. The first replay of a graph also uploads it to the device,
        which can cost more than the replay itself: warmup replays each graph once, from its
        padding step (which holds no request, so the replay changes nothing), to keep that cost
        out of serving."""
        self._graphs[key].replay()

    def timed_replay(self, key: Hashable, repeats: int = 3) -> float:
        """:meth:`replay` once, then ``repeats`` times between CUDA events: the mean seconds of a
        replay (start-up only: it waits for the device)."""
        graph = self._graphs[key]
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()  # host-ok: warm-up profile
        return start.elapsed_time(end) / 1e3 / repeats

    def replay_last(self) -> None:
        """Replay the graph :meth:`run` used last, over whatever the static inputs hold now (a safety
        check: ``TextGenerationController.replay_graphs``); nothing if none ran."""
        if self._last_key in self._graphs:
            self._graphs[self._last_key].replay()

    def reset(self) -> None:
        """Free every captured graph and the memory pool; later steps capture again."""
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._pool = None
