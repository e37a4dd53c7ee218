"""extend_all_queries_by_n on AttentionMetadata: worked example, immutability, validation."""

import dataclasses

import pytest
import torch

from mtp_ctrl.state.attention_metadata import AttentionMetadata
from mtp_ctrl.triton_ops import extend_all_queries_by_n, reference


def _metadata():
    """A 3-row prefill of a new prompt and a 1 + S = 2 row decode over 5 cached tokens, 1 padding row."""
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
        seq_lens=torch.tensor([3, 7], dtype=torch.int32),
        slot_mapping=torch.tensor([0, 1, 2, 37, 38, -1]),
        block_table=torch.tensor([[0, -1], [4, 5]], dtype=torch.int32),
        positions=torch.tensor([0, 1, 2, 5, 6, 0]),
        num_actual_tokens=5,
        max_query_len=3,
        max_seq_len=7,
    )


@pytest.mark.parametrize("op", [extend_all_queries_by_n, reference.extend_all_queries_by_n])
def test_worked_example_derives_positions(op):
    metadata = _metadata()
    new_slot_mapping = torch.arange(10, dtype=torch.int64)  # 5 + 2 * 2 real rows and one padding row
    extended = op(metadata, 2, new_slot_mapping)
    assert extended.query_start_loc.tolist() == [0, 5, 9]
    assert extended.query_start_loc.dtype == torch.int32 and extended.seq_lens.dtype == torch.int32
    assert extended.seq_lens.tolist() == [5, 9]
    assert extended.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 0]
    assert extended.slot_mapping is new_slot_mapping
    assert (extended.num_actual_tokens, extended.max_query_len, extended.max_seq_len) == (9, 5, 9)
    assert extended.block_table is metadata.block_table


def test_input_metadata_is_not_mutated():
    metadata = _metadata()
    before = {field.name: getattr(metadata, field.name) for field in dataclasses.fields(metadata)}
    before = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in before.items()}
    extend_all_queries_by_n(metadata, 3, torch.zeros(11, dtype=torch.int64))
    for name, value in before.items():
        now = getattr(metadata, name)
        assert torch.equal(now, value) if isinstance(value, torch.Tensor) else now == value


def test_given_positions_replace_the_derived_ones():
    new_positions = torch.arange(9) * 10
    extended = extend_all_queries_by_n(_metadata(), 2, torch.zeros(9, dtype=torch.int64), new_positions)
    assert extended.positions.tolist() == new_positions.tolist()


def test_n_zero_keeps_the_batch_shape():
    metadata = _metadata()
    extended = extend_all_queries_by_n(metadata, 0, metadata.slot_mapping)
    assert torch.equal(extended.query_start_loc, metadata.query_start_loc)
    assert extended.positions.tolist() == [0, 1, 2, 5, 6, 0]


def test_empty_batch():
    metadata = AttentionMetadata(
        query_start_loc=torch.zeros(1, dtype=torch.int32),
        seq_lens=torch.zeros(0, dtype=torch.int32),
        slot_mapping=torch.full((2,), -1),
        block_table=torch.zeros(0, 4, dtype=torch.int32),
        positions=torch.zeros(2, dtype=torch.int64),
        num_actual_tokens=0,
        max_query_len=0,
        max_seq_len=0,
    )
    extended = extend_all_queries_by_n(metadata, 2, torch.full((2,), -1))
    assert extended.query_start_loc.tolist() == [0] and extended.positions.tolist() == [0, 0]
    assert extended.num_actual_tokens == 0 and extended.max_query_len == 2


@pytest.mark.parametrize(
    "args, error, match",
    [
        (("not metadata", 1, torch.zeros(7, dtype=torch.int64)), TypeError, "metadata"),
        ((None, -1, torch.zeros(7, dtype=torch.int64)), ValueError, "n must be"),
        ((None, 1, torch.zeros(7, dtype=torch.int32)), TypeError, "new_slot_mapping"),
        ((None, 2, torch.zeros(8, dtype=torch.int64)), ValueError, "new_slot_mapping"),
        ((None, 1, torch.zeros(7, dtype=torch.int64), torch.zeros(6)), TypeError, "new_positions"),
        ((None, 1, torch.zeros(7, dtype=torch.int64), torch.zeros(6, dtype=torch.int64)), ValueError,
         "new_positions"),
    ],
)
def test_bad_arguments_are_named(args, error, match):
    args = (_metadata() if args[0] is None else args[0], *args[1:])
    with pytest.raises(error, match=match):
        extend_all_queries_by_n(*args)


@pytest.mark.parametrize(
    "field, bad, error, match",
    [
        ("query_start_loc", lambda t: t[:-1], ValueError, "metadata.query_start_loc"),  # shorter than B + 1
        ("query_start_loc", lambda t: t.float(), TypeError, "metadata.query_start_loc"),
        ("seq_lens", lambda t: t.tolist(), TypeError, "metadata.seq_lens"),
        ("seq_lens", lambda t: t[:, None], ValueError, "metadata.seq_lens"),
        ("positions", lambda t: t.float(), TypeError, "metadata.positions"),
        ("num_actual_tokens", lambda v: float(v), TypeError, "metadata.num_actual_tokens"),
        ("max_query_len", lambda v: -1, ValueError, "metadata.max_query_len"),
    ],
)
def test_bad_metadata_fields_are_named(field, bad, error, match):
    metadata = _metadata()
    metadata = dataclasses.replace(metadata, **{field: bad(getattr(metadata, field))})
    with pytest.raises(error, match=match):
        extend_all_queries_by_n(metadata, 1, torch.zeros(7, dtype=torch.int64))
