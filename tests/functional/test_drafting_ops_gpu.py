"""Drafting-input ops on CUDA: kernel == reference, no host sync, CUDA-graph capture and replay.

Every op is captured once in a CUDA graph, then replayed on new inputs of the same shapes
(request lengths permuted, new values) copied into the captured tensors.
"""

import dataclasses

import pytest
import torch

from mtp_ctrl.state.attention_metadata import AttentionMetadata
from mtp_ctrl.triton_ops import (
    copy_and_expand_eagle_inputs,
    eagle_prepare_inputs_padded,
    eagle_prepare_next_token_padded,
    eagle_step_update_slot_mapping_and_metadata,
    extend_all_queries_by_n,
    ptd_prepare_inputs,
    reference,
    shift_and_gather_cache,
    shift_and_gather_cache_hidden,
)
from tests.functional.sync_checks import no_host_sync
from tests.unit import drafting_cases as cases

DEVICE = "cuda"
# request lengths of the captured batch: decodes, a long prefill spanning many row blocks, a short prefill
BASE_LENGTHS = [4, 4, 1, 700, 4, 37, 2, 4]


def _make_args(name, generator, lengths):
    """Arguments of op ``name`` whose shapes depend only on ``lengths`` (a graph can replay them)."""
    num = len(lengths)
    if name == "copy_and_expand_eagle_inputs":
        return cases.eagle_inputs_case(generator, num_requests=num, max_rows=0, shift=True, device=DEVICE,
                                       padding_rows=5, lengths=lengths, num_padding_slots=3)
    if name == "copy_and_expand_eagle_inputs_no_shift":
        return cases.eagle_inputs_case(generator, num_requests=num, max_rows=0, shift=False, device=DEVICE,
                                       padding_rows=5, lengths=lengths, num_padding_slots=3)
    if name == "eagle_prepare_inputs_padded":
        return cases.prepare_inputs_padded_case(generator, num_requests=num * 40, max_drafts=4, device=DEVICE)
    if name == "eagle_prepare_next_token_padded":
        return cases.prepare_next_token_padded_case(generator, num_requests=num * 40, num_sampled=5,
                                                    vocab_size=1000, device=DEVICE)
    if name == "eagle_step_update_slot_mapping_and_metadata":
        return cases.step_slot_mapping_case(generator, batch_size=num * 40, padding_rows=13, device=DEVICE,
                                            block_size=16, max_model_len=4096)
    if name == "ptd_prepare_inputs":
        return cases.ptd_case(generator, num_requests=num, max_rows=max(lengths), hidden_size=4096, num_drafts=4,
                              device=DEVICE, dtype=torch.bfloat16, padding_rows=3, lengths=lengths,
                              block_size=16, max_model_len=max(lengths) + 8)
    if name == "shift_and_gather_cache":
        return cases.shift_gather_case(generator, num_seqs=num, max_rows=0, max_shift=3, device=DEVICE,
                                       padding_rows=6, lengths=lengths)
    if name == "shift_and_gather_cache_hidden":
        return cases.shift_gather_case(generator, num_seqs=num, max_rows=0, max_shift=3, hidden_size=7168,
                                       device=DEVICE, dtype=torch.bfloat16, padding_rows=6, lengths=lengths)
    raise KeyError(name)


OPS = {
    "copy_and_expand_eagle_inputs": copy_and_expand_eagle_inputs,
    "copy_and_expand_eagle_inputs_no_shift": copy_and_expand_eagle_inputs,
    "eagle_prepare_inputs_padded": eagle_prepare_inputs_padded,
    "eagle_prepare_next_token_padded": eagle_prepare_next_token_padded,
    "eagle_step_update_slot_mapping_and_metadata": eagle_step_update_slot_mapping_and_metadata,
    "ptd_prepare_inputs": ptd_prepare_inputs,
    "shift_and_gather_cache": shift_and_gather_cache,
    "shift_and_gather_cache_hidden": shift_and_gather_cache_hidden,
}
IN_PLACE = "eagle_step_update_slot_mapping_and_metadata"


def _reference_op(name):
    return getattr(reference, OPS[name].__name__)


def _clone(args):
    return [arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in args]


def _results(name, args, returned):
    """What an op produced: its return value, or for the in-place op the tensors it wrote."""
    if name == IN_PLACE:
        return args[2], args[5], args[6]  # seq_lens, out_clamped_positions, out_slot_mapping
    return returned


def _assert_same(got, want):
    if want is None:
        assert got is None
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), (got, want)
    else:
        assert len(got) == len(want)
        for got_item, want_item in zip(got, want):
            _assert_same(got_item, want_item)


def _permuted_lengths(generator):
    return [BASE_LENGTHS[i] for i in torch.randperm(len(BASE_LENGTHS), generator=generator).tolist()]


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_matches_reference_without_host_sync(name, seed):
    generator = torch.Generator().manual_seed(seed)
    args = _make_args(name, generator, _permuted_lengths(generator))
    reference_args = _clone(args)
    OPS[name](*_clone(args))  # compile outside sync-debug mode
    torch.cuda.synchronize()
    with no_host_sync():
        returned = OPS[name](*args)
    expected = _results(name, reference_args, _reference_op(name)(*reference_args))
    _assert_same(_results(name, args, returned), expected)


@pytest.mark.parametrize("num_requests", [0, 1, 1024])
def test_batch_sizes_at_the_edges(num_requests):
    generator = torch.Generator().manual_seed(num_requests)
    args = cases.ptd_case(generator, num_requests=num_requests, max_rows=4, hidden_size=7168, num_drafts=4,
                          device=DEVICE, dtype=torch.bfloat16, padding_rows=2)
    _assert_same(ptd_prepare_inputs(*args), reference.ptd_prepare_inputs(*args))
    args = cases.eagle_inputs_case(generator, num_requests=num_requests, max_rows=4, shift=True, device=DEVICE,
                                   padding_rows=2)
    _assert_same(copy_and_expand_eagle_inputs(*args), reference.copy_and_expand_eagle_inputs(*args))
    args = cases.shift_gather_case(generator, num_seqs=num_requests, max_rows=4, max_shift=3, hidden_size=4096,
                                   device=DEVICE, dtype=torch.bfloat16, padding_rows=2)
    _assert_same(shift_and_gather_cache_hidden(*args), reference.shift_and_gather_cache_hidden(*args))


@pytest.mark.parametrize("name", sorted(OPS))
def test_cuda_graph_replay_with_new_inputs(name):
    op = OPS[name]
    static_args = _make_args(name, torch.Generator().manual_seed(0), BASE_LENGTHS)
    op(*_clone(static_args))  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_returned = op(*static_args)
    for seed in (1, 2, 3):
        generator = torch.Generator().manual_seed(seed)
        new_args = _make_args(name, generator, _permuted_lengths(generator))
        for static, new in zip(static_args, new_args):
            if isinstance(static, torch.Tensor):
                static.copy_(new)
            else:
                assert static == new, "scalar arguments are baked into the graph"
        expected = _results(name, new_args, _reference_op(name)(*new_args))
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(_results(name, static_args, static_returned), expected)


def _metadata(generator, lengths):
    query_start_loc = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    context = torch.randint(0, 50, (len(lengths),), generator=generator, dtype=torch.int32)
    num_rows = int(query_start_loc[-1]) + 4
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=context + torch.tensor(lengths, dtype=torch.int32),
        slot_mapping=torch.randint(0, 1000, (num_rows,), generator=generator),
        block_table=torch.randint(0, 100, (len(lengths), 64), generator=generator, dtype=torch.int32),
        positions=torch.randint(0, 1000, (num_rows,), generator=generator),
        num_actual_tokens=num_rows - 4,
        max_query_len=max(lengths),
        max_seq_len=int((context + torch.tensor(lengths)).max()),
    )
    moved = {f.name: getattr(metadata, f.name).to(DEVICE) for f in dataclasses.fields(metadata)
             if isinstance(getattr(metadata, f.name), torch.Tensor)}
    return dataclasses.replace(metadata, **moved)


def test_extend_all_queries_by_n_in_a_cuda_graph():
    n = 3
    metadata = _metadata(torch.Generator().manual_seed(0), BASE_LENGTHS)
    new_slot_mapping = torch.arange(metadata.num_tokens + len(BASE_LENGTHS) * n, device=DEVICE)
    extend_all_queries_by_n(metadata, n, new_slot_mapping)
    torch.cuda.synchronize()
    with no_host_sync():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_extended = extend_all_queries_by_n(metadata, n, new_slot_mapping)
    for seed in (1, 2):
        generator = torch.Generator().manual_seed(seed)
        new_metadata = _metadata(generator, _permuted_lengths(generator))
        for field in ("query_start_loc", "seq_lens"):
            getattr(metadata, field).copy_(getattr(new_metadata, field))
        expected = reference.extend_all_queries_by_n(new_metadata, n, new_slot_mapping)
        graph.replay()
        torch.cuda.synchronize()
        for field in ("query_start_loc", "seq_lens", "positions"):
            assert torch.equal(getattr(static_extended, field), getattr(expected, field)), field
