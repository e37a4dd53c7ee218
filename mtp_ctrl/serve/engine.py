"""The engine loop: the process that owns the controller. The HTTP frontend, another process
(:mod:`mtp_ctrl.serve.frontend`), only checks, submits and streams.

Why two processes: a demo-sized model steps in ~0.3 ms, so an engine thread that shared the GIL
with the server's event loop lost a third to two thirds of its steps to HTTP parsing and SSE
writes, and a new request's first token waited for the GIL. Here the engine's only per-step work
besides ``controller.step()`` is one message to the frontend; a frontend that falls behind gets
more tokens per message and per SSE chunk, and the engine never waits for it (vLLM splits its
API server from its EngineCore the same way).

``step()`` has launched the next step before it returns, so the GPU runs while the loop reads
and sends; but where the step is host-bound (the demo model at S = 2: its mixed steps, where a
request joins, take longer on the host than on the GPU) the loop's work between two ``step()``
calls comes off the tokens/s one for one. So it is kept small: one ``select.poll`` object asks
whether the frontend wrote (one syscall; ``Connection.poll`` builds a selector per check), and a
step's newly added requests, outputs and finish reasons go in ONE message, pickled straight to
bytes (``Connection.send`` builds a ``ForkingPickler`` per message).

Messages (a ``multiprocessing`` connection, pickled tuples). Frontend to engine:

- ``("add", key, prompt_ids, params)``: a checked request (``key``: the frontend's id of it);
- ``("abort", key)``: its client went away;
- ``("figures", key)``: the controller's figures for ``/metrics``.

Engine to frontend:

- ``("ready", EngineInfo)`` once, first;
- ``("step", added, outputs, finished)``: ``added``, ``[(key, request_id), ...]`` of the requests
  added before this step (the frontend maps them first); ``controller.step()``'s outputs as they
  are (``[(request_id, tokens, finished)]``); ``{request_id: FinishReason}`` of the requests that
  ended (popped here), or None;
- ``("failed", [request_id, ...], message)``: a step raised; these requests are over;
- ``("figures", key, dict)``;
- ``("fatal", message)`` when the loop stops on an error, ``("shutdown",)`` on SIGTERM / SIGINT.

The frontend closing its end stops the loop. Under tensor parallelism (``command_group``: a gloo
group of the TP ranks, rank 0 running this loop) each iteration's new and aborted requests go to
the other ranks in one ``broadcast_object_list``; :func:`follow` there applies the same commands
and steps alike, so every rank builds the same steps (the controller's lockstep check verifies
each) and assigns the same request ids. While idle, rank 0 broadcasts an empty command every
``heartbeat_s`` so the others never wait into a process-group timeout.

A step that raises ends its running requests (the controller's rule: reason ABORTED) and their
clients get an error; with one rank the loop goes on serving, under TP it stops on every rank
(the lockstep check raises on all of them), and the frontend shuts the server down.
"""

import dataclasses
import gc
import pickle
import select
import signal
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from mtp_ctrl.controllers import SamplingParams, TextGenerationController
from mtp_ctrl.serve.metrics import controller_figures


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the frontend needs to know of the engine to check requests and greet."""

    max_model_len: int
    vocab_size: int
    num_speculative_tokens: int
    description: str  # e.g. "S = 2, TP 1, cuda"


@dataclasses.dataclass(frozen=True)
class Command:
    """What every rank does before one step: abort these request ids, add these requests.
    Immutable, so one empty command serves every idle iteration."""

    abort: Tuple[int, ...]
    add: Tuple[Tuple[List[int], SamplingParams], ...]
    stop: bool = False


_NOTHING = Command((), ())  # no request came: the usual iteration under load


class FrontendGone(Exception):
    """The frontend closed its end of the connection (it exited or crashed)."""


class EngineLoop:
    def __init__(self, controller: TextGenerationController, connection, command_group=None,
                 heartbeat_s: float = 1.0):
        self.controller = controller
        self.connection = connection  # multiprocessing.connection.Connection to the frontend
        self.command_group = command_group
        self.heartbeat_s = heartbeat_s
        self._request_of: Dict[int, int] = {}  # frontend key -> request id, while running
        self._key_of: Dict[int, int] = {}  # request id -> frontend key, while running
        self._stopping = False
        self._readable = select.poll()  # whether the frontend wrote: one syscall a check
        self._readable.register(connection.fileno(), select.POLLIN)

    def run(self, description: str) -> str:
        """Serve until the frontend goes away (returns ``"frontend"``) or SIGTERM / SIGINT (tells
        the frontend to shut down; returns ``"signal"``). A step error under TP or a broken loop is
        sent to the frontend as ``fatal`` and raised."""
        shape = self.controller.shape
        previous = {number: signal.signal(number, self._on_signal) for number in (signal.SIGTERM, signal.SIGINT)}
        try:
            try:
                _freeze_startup_objects()
                self._send(("ready", EngineInfo(shape.max_model_len, shape.vocab_size, shape.num_speculative_tokens,
                                                description)))
                self._loop()
                self._tell(("shutdown",))
                ended_by = "signal"
            except FrontendGone:
                ended_by = "frontend"
        except BaseException as error:  # under TP the other ranks fail too: no stop command for them
            self._tell(("fatal", f"{type(error).__name__}: {error}"))
            raise
        finally:
            gc.unfreeze()
            for number, handler in previous.items():
                signal.signal(number, handler)
        self._broadcast(Command((), (), stop=True))  # the other ranks return from follow()
        return ended_by

    def _send(self, message) -> None:
        try:  # plain pickle: Connection.send builds a ForkingPickler (and copies its table) per message
            self.connection.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
        except OSError:  # a broken pipe: the frontend exited
            raise FrontendGone() from None

    def _tell(self, message) -> None:
        try:
            self.connection.send(message)
        except OSError:  # the frontend is gone already
            pass

    def _on_signal(self, *_) -> None:
        self._stopping = True

    def _loop(self) -> None:
        controller, readable = self.controller, self._readable.poll
        idle_ms = int(self.heartbeat_s * 1e3)
        while not self._stopping:
            busy = controller.has_unfinished_requests()
            if readable(0 if busy else idle_ms):  # also true once the frontend closed its end (EOF)
                command, keys = self._receive()
            elif busy:  # the usual case under load: nothing came, step at once
                command, keys = _NOTHING, []
            else:  # idle: a heartbeat, so no follower waits into a timeout
                self._broadcast(_NOTHING)
                continue
            self._broadcast(command)
            added = self._apply(command, keys)
            if busy if command is _NOTHING else controller.has_unfinished_requests():
                self._step(added)
            elif added:  # (never: an added request is unfinished) the frontend must learn its id
                self._send(("step", added, [], None))

    def _receive(self) -> Tuple[Command, List[int]]:
        """Every message waiting (at least one, or the end of the connection); answers ``figures``
        at once; (the adds and aborts as one command, the frontend keys of its adds)."""
        adds: Dict[int, Tuple[List[int], SamplingParams]] = {}
        aborts: List[int] = []
        try:
            while True:
                message = self.connection.recv()
                if message[0] == "add":
                    adds[message[1]] = (message[2], message[3])
                elif message[0] == "abort":
                    key = message[1]
                    if adds.pop(key, None) is None and key in self._request_of:  # else: never added, or over
                        aborts.append(self._request_of[key])
                        self._forget(aborts[-1:])
                elif message[0] == "figures":
                    self._send(("figures", message[1], controller_figures(self.controller)))
                if not self._readable.poll(0):
                    break
        except (EOFError, OSError):
            raise FrontendGone() from None
        if not adds and not aborts:
            return _NOTHING, []
        return Command(tuple(aborts), tuple(adds.values())), list(adds)

    def _broadcast(self, command: Command) -> None:
        if self.command_group is not None:
            dist.broadcast_object_list([command], src=dist.get_global_rank(self.command_group, 0),
                                       group=self.command_group)

    def _apply(self, command: Command, keys: List[int]) -> List[Tuple[int, int]]:
        """Abort and add; ``[(key, request_id)]`` of the added requests."""
        for request_id in command.abort:
            self.controller.abort_request(request_id)
            self.controller.pop_result(request_id)
        added = []
        for key, (prompt_ids, params) in zip(keys, command.add):
            request_id = self.controller.add_request(prompt_ids, params)  # checked by the frontend: no raise
            self._request_of[key], self._key_of[request_id] = request_id, key
            added.append((key, request_id))
        return added

    def _step(self, added: List[Tuple[int, int]]) -> None:
        """One ``step()``; its outputs, ``added`` and the ended requests' reasons in one message."""
        controller = self.controller
        try:
            outputs = controller.step()
        except Exception as error:  # the controller ended the running requests (ABORTED) and stays usable
            if added:
                self._send(("step", added, [], None))  # the frontend maps the failed ids
            failed = [request_id for request_id in self._request_of.values() if self._finished(request_id)]
            for request_id in failed:
                controller.pop_result(request_id)
            self._forget(failed)
            self._send(("failed", failed, f"{type(error).__name__}: {error}"))
            if self.command_group is not None:
                raise  # under TP every rank stops (the lockstep check raises on the others)
            return
        finished: Optional[Dict[int, object]] = None
        key_of = self._key_of
        for request_id, _, done in outputs:
            if done and request_id in key_of:  # else aborted: popped already
                finished = finished or {}
                finished[request_id] = controller.pop_result(request_id).finish_reason
        if finished:
            self._forget(finished.keys())
        if outputs or added:
            self._send(("step", added, outputs, finished))

    def _forget(self, request_ids) -> None:
        for request_id in request_ids:
            del self._request_of[self._key_of.pop(request_id)]

    def _finished(self, request_id: int) -> bool:
        """Whether the controller ended the request (a failed step leaves queued ones queued)."""
        try:
            self.controller.result(request_id)
        except ValueError:  # "has not finished"
            return False
        return True


def _freeze_startup_objects() -> None:
    """Leave what start-up made (model, graphs, imports: most of the heap) out of every later
    garbage collection, so the loop's collections stay short (``gc.unfreeze()`` undoes it)."""
    gc.collect()
    gc.freeze()


def follow(controller: TextGenerationController, command_group) -> None:
    """A TP rank other than 0: apply rank 0's commands and step with it, until it stops."""
    source = dist.get_global_rank(command_group, 0)
    _freeze_startup_objects()
    try:
        _follow(controller, command_group, source)
    finally:
        gc.unfreeze()


def _follow(controller: TextGenerationController, command_group, source: int) -> None:
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
