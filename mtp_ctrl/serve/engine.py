"""The engine loop: one thread owns the controller; HTTP handlers only submit and read.

:class:`EngineLoop` runs ``controller.step()`` while there is work and sleeps on an event while
there is none. Handlers call :meth:`EngineLoop.submit` (returns a :class:`RequestHandle`) and
:meth:`EngineLoop.abort` from the server's event loop; the engine thread takes the submissions and
aborts at the top of each iteration, so only that thread touches the controller. A handle's
events arrive on an ``asyncio.Queue`` of the event loop that submitted it: ``("tokens", ids)``
as steps land (with overlap scheduling, one step late, as ``controller.step()`` documents), then
``("finished", GenerationResult)`` or ``("error", exception)``.

Under tensor parallelism (``command_group``: a gloo group of the TP ranks, rank 0 serving HTTP),
each iteration's new and aborted requests go to the other ranks in one
``broadcast_object_list``; :func:`follow` there applies the same commands and steps alike, so
every rank builds the same steps (the controller's lockstep check verifies that each step) and
assigns the same request ids. While idle, rank 0 broadcasts an empty command every
``heartbeat_s`` so the others never wait into a process-group timeout.

A step that raises ends its running requests (the controller's rule: reason ABORTED) and their
clients get an error; with one rank the loop goes on serving, under TP it stops on every rank
(the lockstep check raises on all of them), and ``/health`` reports it.
"""

import asyncio
import dataclasses
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from mtp_ctrl.controllers import SamplingParams, TextGenerationController
from mtp_ctrl.serve.metrics import ServerMetrics


@dataclasses.dataclass(eq=False)
class RequestHandle:
    """One HTTP request's view of its generation."""

    prompt_ids: List[int]
    params: SamplingParams
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    submitted_at: float = dataclasses.field(default_factory=time.perf_counter)
    request_id: Optional[int] = None  # the controller's id, once the engine thread has added it
    aborted: bool = False  # the client went away (set under the engine's lock)
    done: bool = False  # the engine will post nothing more

    def post(self, kind: str, value) -> None:
        """From the engine thread: hand an event to the handler's event loop."""
        post_events([(self, kind, value)])


def post_events(events: List[Tuple[RequestHandle, str, object]]) -> None:
    """From the engine thread: hand a step's events to their handlers' event loops, one wake-up
    of each loop per call (a wake-up per request and step would take the GIL from the engine
    thread ``batch`` times a step)."""
    by_loop: Dict[asyncio.AbstractEventLoop, List[Tuple[RequestHandle, str, object]]] = {}
    for event in events:
        by_loop.setdefault(event[0].loop, []).append(event)
    for loop, loop_events in by_loop.items():
        loop.call_soon_threadsafe(_deliver, loop_events)


def _deliver(events: List[Tuple[RequestHandle, str, object]]) -> None:
    for handle, kind, value in events:
        handle.events.put_nowait((kind, value))


@dataclasses.dataclass
class Command:
    """What every rank does before one step: abort these request ids, add these requests."""

    abort: List[int]
    add: List[Tuple[List[int], SamplingParams]]
    stop: bool = False


class EngineLoop:
    def __init__(self, controller: TextGenerationController, command_group=None, heartbeat_s: float = 1.0):
        self.controller = controller
        self.metrics = ServerMetrics(controller)
        self.command_group = command_group
        self.heartbeat_s = heartbeat_s
        self.error: Optional[BaseException] = None  # what stopped the loop, if anything did
        self._lock = threading.Lock()
        self._submitted: List[RequestHandle] = []
        self._aborted: List[RequestHandle] = []
        self._live: Dict[int, RequestHandle] = {}  # request id -> handle, engine thread only
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mtp_ctrl-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, prompt_ids: List[int], params: SamplingParams) -> RequestHandle:
        """Queue a request whose prompt and parameters the caller has checked; call it from the
        server's event loop."""
        handle = RequestHandle(prompt_ids, params, asyncio.Queue(), asyncio.get_running_loop())
        with self._lock:
            if self.error is not None or self._stopping:
                raise RuntimeError(f"the engine has stopped: {self.error!r}")
            self._submitted.append(handle)
        self._wake.set()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """The client went away: end its request (its row and blocks are free from the next step)."""
        with self._lock:
            if handle.done or handle.aborted:
                return
            handle.aborted = True
            self._aborted.append(handle)
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    # ----- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    submitted = [handle for handle in self._submitted if not handle.aborted]
                    aborted = [handle for handle in self._aborted if handle.request_id in self._live]
                    self._submitted, self._aborted = [], []
                    stopping = self._stopping
                if not (submitted or aborted or stopping or self.controller.has_unfinished_requests()):
                    if not self._wake.wait(self.heartbeat_s):
                        self._broadcast(Command([], []))  # heartbeat: no follower waits into a timeout
                    self._wake.clear()
                    continue
                command = Command([handle.request_id for handle in aborted],
                                  [(handle.prompt_ids, handle.params) for handle in submitted], stop=stopping)
                self._broadcast(command)
                if stopping:
                    return
                self._apply(aborted, submitted)
                if self.controller.has_unfinished_requests():
                    self._step()
        except BaseException as error:  # noqa: BLE001  the loop is over: every waiting client is told
            self.error = error
            with self._lock:
                waiting = list(self._live.values()) + self._submitted
                self._live.clear()
            for handle in waiting:
                self._end(handle, "error", error)

    def _broadcast(self, command: Command) -> None:
        if self.command_group is not None:
            dist.broadcast_object_list([command], src=dist.get_global_rank(self.command_group, 0),
                                       group=self.command_group)

    def _apply(self, aborted: List[RequestHandle], submitted: List[RequestHandle]) -> None:
        for handle in aborted:
            del self._live[handle.request_id]
            self.controller.abort_request(handle.request_id)
            self.controller.pop_result(handle.request_id)
            self._end(handle, None, None, reason="abort")
        for handle in submitted:
            handle.request_id = self.controller.add_request(handle.prompt_ids, handle.params)  # checked: no raise
            self._live[handle.request_id] = handle
            self.metrics.request_started(len(handle.prompt_ids))

    def _step(self) -> None:
        try:
            outputs = self.controller.step()
        except Exception as error:  # the controller ended the running requests (ABORTED) and stays usable
            failed = [handle for handle in self._live.values() if self._finished(handle.request_id)]
            for handle in failed:
                del self._live[handle.request_id]
                self.controller.pop_result(handle.request_id)
                self._end(handle, "error", error)
            if self.command_group is not None:
                raise  # under TP every rank stops (the lockstep check raises on the others)
            return
        now = time.perf_counter()
        events: List[Tuple[RequestHandle, str, object]] = []
        for request_id, tokens, finished in outputs:
            handle = self._live.get(request_id)
            if handle is None:  # aborted: its last tokens are dropped
                continue
            if tokens:
                self.metrics.tokens_arrived(handle, len(tokens), now)
                events.append((handle, "tokens", list(tokens)))
            if finished:
                del self._live[request_id]
                result = self.controller.pop_result(request_id)
                handle.done = True
                self.metrics.request_ended(handle, result.finish_reason.value)
                events.append((handle, "finished", result))
        post_events(events)

    def _finished(self, request_id: int) -> bool:
        """Whether the controller ended the request (a failed step leaves queued ones queued)."""
        try:
            self.controller.result(request_id)
        except ValueError:  # "has not finished"
            return False
        return True

    def _end(self, handle: RequestHandle, kind: Optional[str], value, reason: str = "error") -> None:
        handle.done = True
        self.metrics.request_ended(handle, reason)
        if kind is not None:
            handle.post(kind, value)


def follow(controller: TextGenerationController, command_group) -> None:
    """A TP rank other than 0: apply rank 0's commands and step with it, until it stops."""
    source = dist.get_global_rank(command_group, 0)
    while True:
        received = [None]
        dist.broadcast_object_list(received, src=source, group=command_group)
        command: Command = received[0]
        if command.stop:
            return
        for request_id in command.abort:
            controller.abort_request(request_id)
            controller.pop_result(request_id)
        for prompt_ids, params in command.add:
            controller.add_request(prompt_ids, params)
        if controller.has_unfinished_requests():
            for request_id, _, finished in controller.step():
                if finished:
                    controller.pop_result(request_id)
