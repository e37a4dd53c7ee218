"""Grow every query of a batch's attention metadata by ``n`` rows (contract: docs/kernels.md).

Metadata arithmetic in torch (a handful of tiny element-wise ops, CUDA-graph safe, no host
sync); there is no Triton kernel. The object is duck-typed (a dataclass with the fields of
``mtp_ctrl.state.AttentionMetadata``), because ``triton_ops`` does not import ``state``.
"""

import dataclasses
from typing import Optional

import torch

from mtp_ctrl.triton_ops import reference
from mtp_ctrl.triton_ops._checks import INDEX_DTYPES, check_int, check_same_device, check_tensor

_REQUIRED_FIELDS = (
    "query_start_loc",
    "seq_lens",
    "slot_mapping",
    "positions",
    "num_actual_tokens",
    "max_query_len",
    "max_seq_len",
)


def _check_args(metadata, n, new_slot_mapping, new_positions):
    if not dataclasses.is_dataclass(metadata) or isinstance(metadata, type):
        raise TypeError(f"metadata must be an AttentionMetadata dataclass instance, got {type(metadata).__name__}")
    field_names = {field.name for field in dataclasses.fields(metadata)}
    missing = [name for name in _REQUIRED_FIELDS if name not in field_names]
    if missing:
        raise TypeError(f"metadata is missing the AttentionMetadata fields {missing}")
    check_tensor("metadata.seq_lens", metadata.seq_lens, dtypes=INDEX_DTYPES, ndim=1)
    batch_size = metadata.seq_lens.shape[0]
    check_tensor("metadata.query_start_loc", metadata.query_start_loc, dtypes=INDEX_DTYPES, shape=(batch_size + 1,))
    check_tensor("metadata.positions", metadata.positions, dtypes=INDEX_DTYPES, ndim=1)
    check_int("metadata.num_actual_tokens", metadata.num_actual_tokens, low=0)
    check_int("metadata.max_query_len", metadata.max_query_len, low=0)
    check_int("metadata.max_seq_len", metadata.max_seq_len, low=0)
    check_int("n", n, low=0)
    num_rows = metadata.num_actual_tokens + batch_size * n
    check_tensor("new_slot_mapping", new_slot_mapping, dtypes=(torch.int64,), ndim=1)
    if new_slot_mapping.shape[0] < num_rows:
        raise ValueError(
            f"new_slot_mapping has {new_slot_mapping.shape[0]} rows, needs at least "
            f"num_actual_tokens + B * n = {num_rows}"
        )
    tensors = dict(query_start_loc=metadata.query_start_loc, seq_lens=metadata.seq_lens,
                   new_slot_mapping=new_slot_mapping)
    if new_positions is not None:
        check_tensor("new_positions", new_positions, dtypes=INDEX_DTYPES, shape=tuple(new_slot_mapping.shape))
        tensors["new_positions"] = new_positions
    check_same_device(**tensors)


def extend_all_queries_by_n(
    metadata,  # AttentionMetadata of a batch of B requests
    n: int,  # rows added to every query (e.g. the parallel-draft rows)
    new_slot_mapping: torch.Tensor,  # [T_new >= num_actual_tokens + B * n] int64, KV slot per new row
    new_positions: Optional[torch.Tensor] = None,  # [T_new] int32/int64; default: derived, see below
):
    """Return a copy of ``metadata`` in which every request has ``n`` more query rows.

    ``query_start_loc += n * arange(B + 1)``, ``seq_lens += n``, ``num_actual_tokens += B * n``,
    ``max_query_len += n``, ``max_seq_len += n``, the slot mapping is replaced by
    ``new_slot_mapping``. The positions are replaced by ``new_positions`` when given; otherwise
    they are derived from the new metadata, so that it stays consistent: row ``k`` of request
    ``b`` sits at ``seq_lens[b] - query_len[b] + k`` and rows past the last request (padding) at 0.
    The input object is not mutated.

    Example, ``n = 2``: ``query_start_loc = [0, 3, 4]``, ``seq_lens = [3, 6]`` -> ``query_start_loc
    = [0, 5, 8]``, ``seq_lens = [5, 8]``, positions ``[0 1 2 3 4 | 5 6 7]``.
    """
    _check_args(metadata, n, new_slot_mapping, new_positions)
    return reference.extend_all_queries_by_n(metadata, n, new_slot_mapping, new_positions)
