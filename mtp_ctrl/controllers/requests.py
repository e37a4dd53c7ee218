"""What the controller keeps per request on the host (:class:`Request`, all of them in a
:class:`RequestBook`), and what it hands back (:class:`GenerationResult`)."""

import dataclasses
import enum
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from mtp_ctrl.controllers.config import SamplingParams
from mtp_ctrl.controllers.stop_rules import FinishReason

from mtp_ctrl.state.request_table import RowGroup

if TYPE_CHECKING:  # annotations only: output_rows imports nothing from here, but keep the graph flat
    from mtp_ctrl.controllers.output_rows import OutputRows
    from mtp_ctrl.state.request_table import RequestTable


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for a row (new, or evicted and waiting to be recomputed)
    PREFILLING = "prefilling"  # holds a row, its prompt (or recompute) is not all in the KV cache yet
    DECODING = "decoding"  # runs 1 + S rows a step
    PAUSED = "paused"  # holds a row and its state, runs nothing (KV pressure, or pause_request)
    FINISHED = "finished"  # has a finish reason; its result waits to be taken


_STATUS_OF_GROUP = {RowGroup.DECODE: RequestStatus.DECODING, RowGroup.PREFILL: RequestStatus.PREFILLING,
                    RowGroup.PAUSED: RequestStatus.PAUSED}


@dataclasses.dataclass
class Request:
    """One request on the host: everything the controller knows about it, read through one object.

    Fixed at ``add_request``: the prompt, the sampling parameters and the seed. Changed by the
    loop: the output so far and the verify counters, which live in the request's table row
    (``OutputRows``, numpy rows the step's stop rules update for the whole batch at once: a cache
    of the running requests, filled when one joins) while it holds one, and in this object once it
    leaves (finished or preempted): :meth:`attach` and :meth:`detach` move them, so each of these
    facts has exactly one owner at any time and the properties below always read the current one.
    Lifecycle: :attr:`status`, ``finish_reason``, ``preemptions``.
    """

    request_id: int
    prompt_tokens: List[int]
    params: SamplingParams
    seed: int  # the request's sampling seed (its params' seed, or one drawn at admission)
    finish_reason: Optional[FinishReason] = None
    preemptions: int = 0  # times it was evicted for KV space and recomputed
    use_prefix_cache: bool = True  # may reuse and share cached prompt blocks (InferenceConfig.prefix_caching)
    _saved: Tuple[List[int], int, int] = dataclasses.field(default_factory=lambda: ([], 0, 0), repr=False)
    # [P] int64, read-only: the prompt as admission takes it, built once by the prompt check (a 2k-token
    # list takes ~0.1 ms to convert, on the host path of every admission); None: built when first needed
    _prompt_array: Optional[np.ndarray] = dataclasses.field(default=None, repr=False)
    _source: Optional[Tuple["OutputRows", "RequestTable"]] = dataclasses.field(default=None, repr=False)

    def attach(self, outputs: "OutputRows", table: "RequestTable") -> None:
        """The request took a table row: fill the row's stop-check cache (``outputs.start``) from
        what this object holds, then read output and counters from the row."""
        outputs.start(table.slot_of(self.request_id), self.params, len(self.prompt_tokens), self.output_tokens,
                      self.decode_steps, self.accepted_drafts)
        self._source = (outputs, table)

    def prefill_tokens(self) -> np.ndarray:
        """``[P]`` int64: what its prefill computes, the prompt and (after a preemption) the output so far."""
        if self._prompt_array is None:
            self._prompt_array = np.array(self.prompt_tokens, dtype=np.int64)
            self._prompt_array.flags.writeable = False
        output = self.output_tokens
        return self._prompt_array if not output else np.concatenate([self._prompt_array, np.array(output, dtype=np.int64)])

    def detach(self) -> None:
        """The request leaves its row: keep what the row held."""
        self._saved = (self.output_tokens, self.decode_steps, self.accepted_drafts)
        self._source = None

    @property
    def status(self) -> RequestStatus:
        """Where the request is in its life (read from the request table's group while it holds a row)."""
        if self.finish_reason is not None:
            return RequestStatus.FINISHED
        if self._source is None:
            return RequestStatus.WAITING
        return _STATUS_OF_GROUP[self._source[1].group_of(self.request_id)]

    def _live_slot(self) -> Optional[Tuple["OutputRows", int]]:
        if self._source is None:
            return None
        outputs, table = self._source
        return outputs, table.slot_of(self.request_id)

    @property
    def output_tokens(self) -> List[int]:
        """The tokens generated so far (a copy)."""
        live = self._live_slot()
        return live[0].output_of(live[1]) if live is not None else list(self._saved[0])

    @property
    def decode_steps(self) -> int:
        """Verify steps this request took part in."""
        live = self._live_slot()
        return int(live[0].decode_steps[live[1]]) if live is not None else self._saved[1]

    @property
    def accepted_drafts(self) -> int:
        """Drafts accepted over those steps."""
        live = self._live_slot()
        return int(live[0].accepted_drafts[live[1]]) if live is not None else self._saved[2]


RequestRecord = Request  # the name the accept_tokens hook documented before (kept for subclasses)


class RequestBook:
    """Every request the controller remembers, by id: waiting, live, paused, and finished ones
    whose result is not taken yet. It owns request ids, seeds, and the window of unclaimed
    step-API results (the newest ``finished_results_kept``; older ones are forgotten).

    Requests a running ``generate()`` waits for are *held*: they never enter that window, and
    ``generate()`` forgets them itself once it has their results.
    """

    def __init__(self, seed: int, finished_results_kept: int):
        self._requests: Dict[int, Request] = {}
        self._unclaimed: Dict[int, None] = {}  # finished step-API requests, oldest first
        self._held: set = set()
        self._seed_generator = torch.Generator().manual_seed(seed)  # seeds of requests that give none
        self._results_kept = finished_results_kept
        self.next_request_id = 0  # the id the next new() returns

    def new(self, prompt: List[int], params: SamplingParams, prompt_array: Optional[np.ndarray] = None) -> Request:
        """A new request; ``prompt_array``: the prompt as a read-only ``[P]`` int64 array, if the caller has it."""
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_generator))
        request = Request(self.next_request_id, prompt, params, seed, _prompt_array=prompt_array)
        self._requests[request.request_id] = request
        self.next_request_id += 1
        return request

    def __getitem__(self, request_id: int) -> Request:
        if request_id not in self._requests:
            raise ValueError(f"unknown request_id {request_id} (never added, or its result was taken)")
        return self._requests[request_id]

    def get(self, request_id: int) -> Optional[Request]:
        return self._requests.get(request_id)

    def __len__(self) -> int:
        return len(self._requests)

    def finished(self, request_ids: Iterable[int]) -> None:
        """These requests finished and left their slots: step-API results become claimable."""
        for request_id in request_ids:
            if request_id not in self._held and request_id in self._requests:
                self._unclaimed[request_id] = None
        while len(self._unclaimed) > self._results_kept:
            oldest = next(iter(self._unclaimed))
            del self._unclaimed[oldest], self._requests[oldest]

    def forget(self, request_id: int) -> None:
        """The result was taken (``pop_result``)."""
        del self._requests[request_id]
        self._unclaimed.pop(request_id, None)

    @property
    def unclaimed_ids(self) -> List[int]:
        """Finished step-API requests whose result is not taken, oldest first."""
        return list(self._unclaimed)

    def hold(self, request_ids: Iterable[int]) -> None:
        self._held.update(request_ids)

    def release(self, request_ids: Iterable[int]) -> None:
        """``generate()`` is done with these: forget the finished ones (an aborted call's
        unfinished ones were dropped before)."""
        self._held.difference_update(request_ids)
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is not None and request.finish_reason is not None:
                del self._requests[request_id]


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    request_id: int
    prompt_tokens: Tuple[int, ...]
    output_tokens: Tuple[int, ...]
    finish_reason: FinishReason
    decode_steps: int
    accepted_drafts: int
    num_speculative_tokens: int
    preemptions: int = 0  # times it was evicted for KV space and recomputed

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verify step: 1 (the target's own token) + accepted drafts."""
        return 1.0 + self.accepted_drafts / self.decode_steps if self.decode_steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        drafted = self.decode_steps * self.num_speculative_tokens
        return self.accepted_drafts / drafted if drafted else 0.0

    @classmethod
    def from_record(cls, record: Request, num_speculative_tokens: int) -> "GenerationResult":
        return cls(
            request_id=record.request_id,
            prompt_tokens=tuple(record.prompt_tokens),
            output_tokens=tuple(record.output_tokens),
            finish_reason=record.finish_reason,
            decode_steps=record.decode_steps,
            accepted_drafts=record.accepted_drafts,
            num_speculative_tokens=num_speculative_tokens,
            preemptions=record.preemptions,
        )


@dataclasses.dataclass(frozen=True)
class ControllerDebugView:
    """``TextGenerationController.debug_view()``: what the controller holds now, for tests and
    tools (the loop never reads it). Counts are host ints."""

    num_cuda_graphs: int  # CUDA graphs captured (0 when eager)
    cuda_graphs_enabled: bool  # steps padded to a graph shape replay CUDA graphs
    num_waiting: int  # requests queued for a row
    num_live: int  # requests holding a row (prefilling, decoding, paused, or finished with the row not freed yet)
    num_records: int  # requests the controller keeps: live, waiting, and finished results not taken
    num_unclaimed_results: int  # finished step-API results kept until pop_result (finished_results_kept)
    num_retiring: int  # finished requests whose rows are not freed yet
    step_in_flight: bool  # a launch whose read-back has not been applied
    num_prefills_held: int  # requests whose prefill tokens the context keeps (live requests only)
    next_request_id: int  # the id the next add_request returns
    last_accepted_counts: torch.Tensor  # [R] int64 device tensor: accepted drafts of the last step launched (a live view)
