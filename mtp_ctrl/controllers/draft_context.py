"""DraftContext: everything a proposer may use, and nothing more.

The controller hands one to :meth:`Proposer.bind` once, at construction. A proposer drafts with
the target's forward entry points (``runner``: ``mtp_forward``, ``eagle_forward``,
``rotary_tables``, ``set_aux_layers``), the controller's sampler (:meth:`sample_rows`), the sizes
of the engine (``shape``), per-request device rows of its own (:meth:`add_device_rows`, indexed by
the request's table slot, which it keeps while it lives), and KV caches of its own addressed by the
target's block ids (:meth:`allocate_kv_cache`). It never sees the controller, the scheduler or
the request table, so the step loop can change without touching a drafter.

Example, a drafter with one attention layer of its own (see ``docs/proposers.md``)::

    def bind(self, draft_context):
        super().bind(draft_context)
        S = draft_context.shape.num_speculative_tokens
        self.history = draft_context.add_device_rows("my_history", (S,), torch.int64)  # [R + 1, S]
        self.kv_cache = draft_context.allocate_kv_cache(num_kv_heads=2, head_dim=64)  # [(key, value)]
"""

from typing import Callable, List, Optional, Tuple

import torch

from mtp_ctrl.controllers.acceptance import DraftLogits
from mtp_ctrl.models.runner import PagedGPTRunner
from mtp_ctrl.state import EngineShape, RequestTable

Sampler = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DraftContext:
    """shape: the engine's sizes (S, block size, R, max_model_len, device, KV dtype, vocabulary).
    runner: the target model's forward entry points. target_kv_caches: the target's paged caches
    (one ``(key, value)`` pair per layer, decoder layers then MTP depths), which the MTP proposer
    writes at its depths' layers. num_kv_blocks: block ids of the target's caches are
    ``[0, num_kv_blocks)`` (the pool and its scratch block).
    rejection: whether the controller accepts by rejection sampling (then record the drafts' logits).
    """

    def __init__(self, shape: EngineShape, runner: PagedGPTRunner, sampler: Sampler, table: RequestTable,
                 target_kv_caches: List[Tuple[torch.Tensor, torch.Tensor]], num_kv_blocks: int, rejection: bool,
                 finish_steps: Callable[[], None], request_result: Callable[[int], object],
                 prefix_caching: bool = False):
        self.shape = shape
        self.runner = runner
        self.target_kv_caches = target_kv_caches
        self.num_kv_blocks = num_kv_blocks
        self.rejection = rejection
        self.prefix_caching = prefix_caching  # requests may start from cached prompt blocks (KV length > 0)
        self._sampler = sampler
        self._table = table
        self._finish_steps = finish_steps
        self._request_result = request_result

    @property
    def scratch_row(self) -> int:
        """The scratch slot padding requests write (row ``R`` of every ``add_device_rows`` buffer)."""
        return self._table.scratch_row

    def sample_rows(self, logits: torch.Tensor, table_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The controller's sampler (its ``sample_rows`` hook): one token per logits row ``[K, V]``
        under the parameters of the request in table slot ``table_rows`` ``[K]`` int64, with the noise of
        ``positions`` ``[K]`` int64 (the position the token will occupy). Returns ``[K]`` int64."""
        return self._sampler(logits, table_rows, positions)

    def add_device_rows(self, name: str, row_shape: Tuple[int, ...], dtype: torch.dtype,
                        fill: float = 0, kv_start: bool = False) -> torch.Tensor:
        """A ``[R + 1, *row_shape]`` device buffer of the proposer's own: row ``s`` belongs to the
        request in table slot ``s`` (``DraftBatch.write_rows``) while it lives (a new request in
        the slot finds what the last one left); the last row is the scratch slot padding requests
        write. ``name`` must be unique. ``kv_start`` (scalar rows): a joining request's row is set
        to its first KV length (0, or the cached prompt prefix it starts with under prefix
        caching)."""
        self._table.add_device_rows(name, row_shape, dtype, fill=fill, kv_start=kv_start)
        return self._table.device_rows_with_scratch(name)

    def allocate_kv_cache(self, num_kv_heads: int, head_dim: int, extra_blocks: int = 0,
                          dtype: Optional[torch.dtype] = None) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """A private paged KV cache for one attention layer, addressed like the target's: a
        request's K/V at position ``p`` go to block ``block_table[p // bs]`` of this cache, so
        the step's ``attention.block_table`` serves it unchanged (the host reserves blocks for
        the verified rows; ``extra_blocks`` adds ids ``[num_kv_blocks, + extra_blocks)`` for a
        drafter's own spill-over, e.g. EAGLE's tail blocks). Returns ``[(key, value)]``, each
        ``[num_kv_blocks + extra_blocks, bs, num_kv_heads, head_dim]`` in ``dtype`` (default the
        KV dtype), zeroed."""
        shape = self.shape
        size = (self.num_kv_blocks + extra_blocks, shape.block_size_tokens, num_kv_heads, head_dim)
        dtype = shape.kv_dtype if dtype is None else dtype
        return [(torch.zeros(size, dtype=dtype, device=shape.device), torch.zeros(size, dtype=dtype, device=shape.device))]

    def draft_logits_rows(self, name: str) -> Optional[DraftLogits]:
        """Rows to record the drafts' logits in (see ``Proposer.draft_logits``) when the controller
        accepts by rejection sampling, else None: ``[R + 1, S, V]`` float32 device rows named ``name``."""
        if not self.rejection:
            return None
        shape = self.shape
        rows = self.add_device_rows(name, (shape.num_speculative_tokens, shape.vocab_size), torch.float32)
        return DraftLogits(rows)

    def request_result(self, request_id: int):
        """The ``GenerationResult`` of a finished request the controller still holds (ValueError
        otherwise, e.g. a preempted request), for a proposer that records per-request data."""
        return self._request_result(request_id)

    def finish_steps_in_flight(self) -> None:
        """Wait for the launched steps and apply them on the host (for a proposer that flushes
        what its steps recorded, e.g. :class:`HiddenStateCapture`). Not for use inside ``propose``."""
        self._finish_steps()
