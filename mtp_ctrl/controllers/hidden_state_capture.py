"""HiddenStateCapture: record the target's aux hidden states of every verified token (EAGLE training data).

A proposer with S = 1 whose draft is the token it was given (the bonus token each request just
verified, repeated): drafting is not its job, the output is plain decoding's (a repeated token is
accepted exactly when the target would have produced it). Its job: in every step, for every
verified packed row (a prompt chunk's rows; a decode's base row and its accepted draft), copy the
target's outputs at ``aux_layer_ids`` (:meth:`~mtp_ctrl.models.PagedGPTRunner.set_aux_layers`:
the same forward, no second pass), the token id at that row, its position and its request id
into a preallocated device buffer. No host sync per step (the row count lives on the device;
the step's rows are the same rows the EAGLE proposer's first draft step reads, found with
:func:`~mtp_ctrl.triton_ops.eagle_prepare_inputs_padded`), so it runs in captured decode steps.

The host bounds the buffer's fill from the rows it scheduled; before a step could overflow it,
and at :meth:`close`, the buffer is copied to the host and written to
``output_dir/capture_NNNNN.safetensors`` once every step it holds has been applied (tensors
``hidden_states [n, k * H]`` in the model dtype, ``token_ids``, ``positions``, ``request_ids``
``[n]`` int64; metadata ``aux_layer_ids``, ``hidden_size``). A preempted request is recomputed
from its prompt, so its positions appear again with the same token ids: readers keep one
record per ``(request_id, position)``. Under tensor parallelism every rank holds the same
states; tensor-parallel rank 0 writes.

Only positions before each request's last emitted token are written, whatever
``decode_steps_per_launch`` and overlap scheduling do: the device runs a request past its stop
(the rest of a decode run, the overlapped step), and the host learns the stop only when it applies
that launch. So a flushed buffer waits on the host until its steps are applied, and the records of
a finished request at or past position ``len(prompt) + len(output) - 1`` are dropped.

A failed write (a full disk, a vanished directory; safetensors raises its own error type) costs
no generation: it is reported once (a ``RuntimeWarning`` and :attr:`write_error`), capturing
stops (later flushes empty the buffer and write nothing) and :meth:`close` raises it.
"""

import collections
import json
import os
import warnings
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import torch

from mtp_ctrl.controllers.draft_context import DraftContext
from mtp_ctrl.controllers.proposers import DraftBatch, Proposer
from mtp_ctrl.models.runner import check_aux_layer_ids
from mtp_ctrl.state.step_metadata import StepMetadata
from mtp_ctrl.triton_ops import eagle_prepare_inputs_padded


class HiddenStateCapture(Proposer):
    """``HiddenStateCapture(aux_layer_ids, output_dir)``; use with ``num_speculative_tokens=1``
    and call :meth:`close` (or the controller's ``close`` followed by it) to write the last shard."""

    def __init__(self, aux_layer_ids: Sequence[int], output_dir: str, capacity_tokens: int = 1 << 16):
        if isinstance(aux_layer_ids, (str, bytes, torch.Tensor)) or not isinstance(aux_layer_ids, Sequence):
            raise TypeError(f"aux_layer_ids must be a sequence of ints, got {type(aux_layer_ids).__name__}")
        self.aux_layer_ids = check_aux_layer_ids(aux_layer_ids, num_decoder_layers=1 << 30)  # range: at bind
        if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, int) or capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be an int >= 1, got {capacity_tokens!r}")
        if not isinstance(output_dir, (str, os.PathLike)):
            raise TypeError(f"output_dir must be a path, got {type(output_dir).__name__}")
        try:
            import safetensors.torch  # noqa: F401  (a clear error now rather than at the first flush)
        except ImportError as error:
            raise ImportError("HiddenStateCapture writes safetensors shards: pip install safetensors") from error
        self.output_dir = os.fspath(output_dir)
        try:
            os.makedirs(self.output_dir, exist_ok=True)
        except OSError as error:
            raise ValueError(f"output_dir {self.output_dir!r} cannot be created: {error}") from None
        if not os.path.isdir(self.output_dir) or not os.access(self.output_dir, os.W_OK | os.X_OK):
            raise ValueError(f"output_dir {self.output_dir!r} is not a writable directory")
        self.capacity_tokens = capacity_tokens
        self.shard_paths = []  # written so far, in order
        self.records_written = 0
        self.write_error: Optional[str] = None  # the failed write that stopped capturing, if any

    def bind(self, draft_context: DraftContext) -> None:
        runner, shape = draft_context.runner, draft_context.shape
        if shape.num_speculative_tokens != 1:
            raise ValueError(f"HiddenStateCapture needs num_speculative_tokens == 1, got {shape.num_speculative_tokens}")
        check_aux_layer_ids(self.aux_layer_ids, runner.num_decoder_layers)
        # one launch: a step with prefill, or a decode run of up to decode_steps_per_launch steps
        self._most_rows_per_launch = max(shape.max_tokens_per_step,
                                         shape.decode_steps_per_launch * shape.max_requests * 2)
        if self.capacity_tokens < self._most_rows_per_launch:
            raise ValueError(f"capacity_tokens ({self.capacity_tokens}) must hold one launch's rows: "
                             f">= max(max_tokens_per_step, decode_steps_per_launch x max_requests x 2) "
                             f"= {self._most_rows_per_launch}")
        super().bind(draft_context)
        runner.set_aux_layers(self.aux_layer_ids)
        device, capacity = shape.device, self.capacity_tokens
        self._hidden_size = runner.hidden_size
        width = len(self.aux_layer_ids) * self._hidden_size
        # row `capacity` is a scratch row: rows that record nothing are written there
        self._hidden = torch.zeros(capacity + 1, width, dtype=shape.kv_dtype, device=device)  # [C + 1, k * H]
        self._records = torch.zeros(3, capacity + 1, dtype=torch.int64, device=device)  # token, position, request id
        self._count = torch.zeros(1, dtype=torch.int64, device=device)  # [1] records in the buffer
        self._host_bound = 0  # >= the device count: every row the host scheduled since the last flush
        self._scheduled: Deque[Tuple[int, StepMetadata]] = collections.deque()  # launched, not yet applied
        self._num_scheduled = 0  # steps launched so far (an index for each)
        self._applied_through = 0  # every step up to this index was applied (or abandoned)
        self._written_through = 0  # every record of the steps up to this index was written (or dropped)
        # flushed, waiting for their steps to be applied: (last step index, hidden [n, k * H], records [3, n])
        self._pending: List[Tuple[int, torch.Tensor, torch.Tensor]] = []
        self._ends: Dict[int, Tuple[int, int]] = {}  # finished request -> (first position not written, steps then)

    # ----- device: one step ----------------------------------------------------------------

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        step, attention, device = batch.step, batch.step.attention, batch.hidden.device
        G = batch.num_requests
        query_start_loc = attention.query_start_loc[: G + 1]  # [G + 1]
        request_index = torch.arange(G, device=device)
        # [G] int64, inclusive cumsum: V <= S = 1 draft per decode request
        cu_num_drafts = step.verify_width * torch.minimum(request_index + 1, step.device_num_decode)
        last_rows, _ = eagle_prepare_inputs_padded(cu_num_drafts, batch.accepted_counts + 1, query_start_loc)  # [G]
        num_rows = step.input_ids.shape[0]
        rows = torch.arange(num_rows, device=device)  # [T] int64
        owner = torch.searchsorted(query_start_loc[1:].long().contiguous(), rows, right=True).clamp(max=max(G - 1, 0))
        verified = (rows < query_start_loc[G]) & (rows <= last_rows[owner])  # [T] bool
        offsets = self._count + torch.cumsum(verified, 0) - 1  # [T] int64
        dest = torch.where(verified & (offsets < self.capacity_tokens), offsets, self.capacity_tokens)  # [T]
        self._hidden[dest] = batch.aux_hidden.to(self._hidden.dtype)
        request_ids = step.device_request_ids[owner]  # [T]
        self._records[:, dest] = torch.stack([step.input_ids, attention.positions, request_ids])
        self._count += verified.sum()
        return batch.next_tokens[:, None].clone()  # [G, 1]: the token it was given

    # ----- host ----------------------------------------------------------------------------

    def on_step_scheduled(self, step: StepMetadata) -> None:
        self._num_scheduled += 1
        self._scheduled.append((self._num_scheduled, step))
        self._host_bound += int(step.host_query_start_loc[-1])  # host-ok: host tensor
        if self._host_bound + self._most_rows_per_launch > self.capacity_tokens:
            self.flush()  # the next launch could overflow the buffer

    def on_step_committed(self, step: StepMetadata, accepted_counts: Sequence[int]) -> None:
        # steps are applied in launch order; one launched before this one and never applied was abandoned
        while self._scheduled:
            index, scheduled = self._scheduled.popleft()
            self._applied_through = index
            if scheduled is step:
                break

    def forget(self, request_id: int) -> None:
        self._note_end(request_id)

    def _note_end(self, request_id: int) -> bool:
        """Remember where a finished request's records end (its result is read while the controller has it)."""
        try:
            result = self.draft_context.request_result(request_id)
        except ValueError:  # preempted (it comes back), or its result was taken already
            return False
        self._ends[request_id] = (len(result.prompt_tokens) + len(result.output_tokens) - 1, self._num_scheduled)
        return True

    def flush(self) -> None:
        """Wait for the launched steps and empty the buffer; what it held is written as one shard once
        every step that recorded it has been applied (at once when they all have, e.g. after ``close``)."""
        device = self.draft_context.shape.device
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # host-ok: a flush, not a step
        count = int(self._count[0])  # host-ok: a flush
        self._host_bound = 0
        if count > 0 and self.write_error is None:  # after a failed write the records are dropped
            # copies: the buffer is reused, and moving a CPU tensor "to the CPU" returns the same storage
            self._pending.append((self._num_scheduled,
                                  self._hidden[:count].to("cpu", copy=True),  # host-ok: a flush
                                  self._records[:, :count].to("cpu", copy=True)))  # host-ok: a flush
        self._count.zero_()
        self._write_applied(self._applied_through)

    def _write_applied(self, applied_through: int) -> None:
        """Write the pending records of steps up to ``applied_through`` as one shard, cut at each request's end."""
        ready = [chunk for chunk in self._pending if chunk[0] <= applied_through]
        if not ready:
            return
        self._pending = self._pending[len(ready):]
        hidden = torch.cat([chunk[1] for chunk in ready])  # [n, k * H]
        records = torch.cat([chunk[2] for chunk in ready], dim=1)  # [3, n] int64: token, position, request id
        ends = torch.full_like(records[2], torch.iinfo(torch.int64).max)  # [n] int64
        for request_id in records[2].unique().tolist():  # host-ok: host tensor
            if request_id in self._ends or self._note_end(request_id):
                ends[records[2] == request_id] = self._ends[request_id][0]
        keep = records[1] < ends  # [n] bool: nothing at or past a finished request's last token
        self._written_through = ready[-1][0]
        self._ends = {rid: end for rid, end in self._ends.items() if end[1] > self._written_through}
        if self.write_error is None and bool(keep.any()):
            self._write_shard(hidden[keep], records[:, keep])

    def _write_shard(self, hidden_states: torch.Tensor, records: torch.Tensor) -> None:
        from megatron.core import parallel_state
        from safetensors.torch import save_file

        if parallel_state.get_tensor_model_parallel_rank() == 0:
            tensors = {"hidden_states": hidden_states.contiguous(), "token_ids": records[0].contiguous(),
                       "positions": records[1].contiguous(), "request_ids": records[2].contiguous()}
            path = os.path.join(self.output_dir, f"capture_{len(self.shard_paths):05d}.safetensors")
            try:
                save_file(tensors, path, metadata={"aux_layer_ids": json.dumps(list(self.aux_layer_ids)),
                                                   "hidden_size": str(self._hidden_size)})
            except Exception as error:  # noqa: BLE001  (safetensors' own error type, OSError, ...)
                self.write_error = f"writing {path} failed: {type(error).__name__}: {error}"
                self._pending.clear()
                warnings.warn(f"HiddenStateCapture into {self.output_dir!r} stopped: {self.write_error}. "
                              "Generation goes on; close() raises this error.", RuntimeWarning, stacklevel=2)
                return
            self.shard_paths.append(path)
        self.records_written += records.shape[1]

    def close(self) -> None:
        """Finish the steps in flight and write what the buffer holds; raise RuntimeError if a write
        failed (the shards written before it are complete)."""
        self.draft_context.finish_steps_in_flight()
        self.flush()
        self._write_applied(self._num_scheduled)  # nothing is in flight: a step never applied was abandoned
        if self.write_error is not None:
            raise RuntimeError(f"HiddenStateCapture into {self.output_dir!r} stopped early "
                               f"({len(self.shard_paths)} shard(s) written): {self.write_error}")


def load_capture(output_dir: str):
    """Every shard of ``output_dir`` merged, one record per ``(request_id, position)``, sorted by
    request then position: ``(hidden_states [n, k * H], token_ids, positions, request_ids [n])``."""
    from safetensors.torch import load_file

    paths = sorted(p for p in os.listdir(output_dir) if p.startswith("capture_") and p.endswith(".safetensors"))
    if not paths:
        raise ValueError(f"no capture_*.safetensors shards in {output_dir!r}")
    shards = [load_file(os.path.join(output_dir, p)) for p in paths]
    hidden = torch.cat([s["hidden_states"] for s in shards])
    tokens, positions, request_ids = (torch.cat([s[name] for s in shards])
                                      for name in ("token_ids", "positions", "request_ids"))
    key = request_ids * (1 << 32) + positions  # [n] int64
    order = torch.argsort(key, stable=True)
    key = key[order]
    first = torch.ones_like(key, dtype=torch.bool)
    first[1:] = key[1:] != key[:-1]  # the first record of each (request, position)
    keep = order[first]
    return hidden[keep], tokens[keep], positions[keep], request_ids[keep]
