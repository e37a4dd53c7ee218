"""OutputRows: the vectorised stop rules of a whole launch (one step or a decode run) over the
step's slots (scattered, in step order), its no-stop fast path, and requests that left their
slot since the launch (not present: left alone)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtp_ctrl.controllers.config import SamplingParams
from mtp_ctrl.controllers.output_rows import OutputRows
from mtp_ctrl.state.engine_shape import EngineShape
from mtp_ctrl.state.request_table import RequestTable

MAX_MODEL_LEN = 40
SLOTS = np.array([2, 0, 3, 1])  # the table slot of the step's request i: not in step order


def _table(S):
    return RequestTable(EngineShape(max_requests=4, max_model_len=MAX_MODEL_LEN, block_size_tokens=4,
                                    num_speculative_tokens=S, max_tokens_per_step=4 * (S + 1)))


def _rows(S, requests):
    """OutputRows over a table of 4 slots; ``requests``: (params, prompt length, output so far) of
    the step's requests, in slots ``SLOTS``."""
    outputs = OutputRows(_table(S))
    for slot, (params, prompt_length, output) in zip(SLOTS, requests):
        outputs.start(slot, params, prompt_length, output, 0, 0)
    return outputs


def _state(outputs, n):
    slots = SLOTS[:n]
    return [outputs.output_of(slot) for slot in slots], outputs.finished[slots].tolist(), \
        outputs.decode_steps[slots].tolist(), outputs.accepted_drafts[slots].tolist()


@settings(max_examples=80, deadline=None)
@given(S=st.integers(0, 3), num_steps=st.integers(1, 3), data=st.data())
def test_fast_path_equals_the_full_stop_check_and_step_by_step(S, num_steps, data):
    """Whatever a launch of 1-3 steps accepted, the no-stop fast path (taken when no row can
    stop), the full check (forced by passing ``present``) and applying the steps one at a time
    give the same tokens, counts and finishes, also with max_new_tokens and max_model_len exactly
    at or one past the launch's reach, and eos ids that stop a row mid-run."""
    n = data.draw(st.integers(1, 4))
    requests = []
    for _ in range(n):
        prompt_length = data.draw(st.integers(1, 20))
        output = data.draw(st.lists(st.integers(0, 99), max_size=8))
        reach = len(output) + num_steps * (1 + S)  # the output length after full accepts
        max_new_tokens = data.draw(st.sampled_from([reach - 1, reach, reach + 1, 50])) if reach > 1 else 50
        eos = data.draw(st.sampled_from([(), (7,)]))
        requests.append((SamplingParams(max_new_tokens=max(1, max_new_tokens), eos_token_ids=eos), prompt_length,
                         output))
    readbacks = np.zeros((num_steps, n, S + 2), dtype=np.int64)
    for step in range(num_steps):
        for row in range(n):
            readbacks[step, row, 0] = data.draw(st.integers(0, S))
            readbacks[step, row, 1:] = data.draw(st.lists(st.integers(0, 9), min_size=S + 1, max_size=S + 1))
    decode = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    fast, full, stepwise = _rows(S, requests), _rows(S, requests), _rows(S, requests)
    slots = SLOTS[:n]
    took_fast = fast._no_stop_possible(slots, readbacks[:, :, 0])
    params_of_row = lambda row: requests[row][0]  # noqa: E731
    got = fast.apply(readbacks, decode, slots, params_of_row)
    want = full.apply(readbacks, decode, slots, params_of_row, np.ones(n, dtype=bool))
    assert np.array_equal(got[0], want[0]) and got[1] == want[1]
    by_step = [stepwise.apply(readbacks[step : step + 1], decode, slots, params_of_row) for step in range(num_steps)]
    assert np.array_equal(np.concatenate([emitted for emitted, _ in by_step]), want[0])
    assert [finish for _, finished in by_step for finish in finished] == want[1]
    assert _state(fast, n) == _state(full, n) == _state(stepwise, n)
    if took_fast:
        assert got[1] == []


def test_the_fast_path_is_taken_only_when_no_row_can_stop():
    S, output = 2, [1, 2]
    reach = len(output) + 1 + S  # 5: the output length after a step that accepts every draft
    full, none = np.full((1, 1), S), np.zeros((1, 1), dtype=np.int64)  # [k, n] accepted drafts
    assert _rows(S, [(SamplingParams(max_new_tokens=reach + 1), 3, output)])._no_stop_possible(SLOTS[:1], full)
    assert not _rows(S, [(SamplingParams(max_new_tokens=reach), 3, output)])._no_stop_possible(SLOTS[:1], full)
    # what the launch accepted counts, not what it might have: one token emitted stays short of max_new_tokens
    assert _rows(S, [(SamplingParams(max_new_tokens=reach), 3, output)])._no_stop_possible(SLOTS[:1], none)
    run_of_2 = np.full((2, 1), S)
    assert not _rows(S, [(SamplingParams(max_new_tokens=reach + 1), 3, output)])._no_stop_possible(SLOTS[:1], run_of_2)
    rows = _rows(S, [(SamplingParams(max_new_tokens=50), MAX_MODEL_LEN - reach, output)])
    assert not rows._no_stop_possible(SLOTS[:1], full)
    rows = _rows(S, [(SamplingParams(max_new_tokens=50), MAX_MODEL_LEN - reach - 1, output)])
    assert rows._no_stop_possible(SLOTS[:1], full)
    rows = _rows(S, [(SamplingParams(max_new_tokens=50, eos_token_ids=(3,)), 3, output)])
    assert not rows._no_stop_possible(SLOTS[:1], none)
    rows = _rows(S, [(SamplingParams(max_new_tokens=50, stop_sequences=((4, 5),)), 3, output)])
    assert not rows._no_stop_possible(SLOTS[:1], none)


def test_length_budgets_of_the_unfinished_rows():
    outputs = _rows(1, [(SamplingParams(max_new_tokens=9), 3, [4, 5]),  # 7 to max_new_tokens, 35 to max_model_len
                        (SamplingParams(max_new_tokens=50), MAX_MODEL_LEN - 10, [6]),  # 9 to max_model_len
                        (SamplingParams(max_new_tokens=2), 3, [1])])  # 1, but finished below
    outputs.finished[SLOTS[2]] = 1
    assert outputs.length_budgets(SLOTS[:3]) == (9, 9)  # fewest to max_model_len, most to any length stop
    assert outputs.length_budgets(SLOTS[:1]) == (35, 7)
    assert outputs.length_budgets(SLOTS[:0]) == (0, 0)


def test_requests_not_present_are_left_alone():
    """A request that left its slot since the launch (``present`` False) gets nothing, even when
    another request holds the slot now."""
    outputs = _rows(1, [(SamplingParams(max_new_tokens=1), 3, []), (SamplingParams(max_new_tokens=9), 3, [4])])
    readback = np.array([[[1, 5, 6], [1, 7, 8]]], dtype=np.int64)
    emitted, finished = outputs.apply(readback, np.ones(2, dtype=bool), SLOTS[:2], None, np.array([False, True]))
    assert emitted.tolist() == [[0, 2]] and finished == []
    assert outputs.output_of(SLOTS[0]) == [] and outputs.output_of(SLOTS[1]) == [4, 8, 7]
    assert outputs.decode_steps[SLOTS[:2]].tolist() == [0, 1]


@pytest.mark.parametrize("S", [0, 2])
def test_decode_mask_counts_verify_steps_only_for_decode_rows(S):
    outputs = _rows(S, [(SamplingParams(max_new_tokens=30), 3, [])] * 2)
    readback = np.zeros((1, 2, S + 2), dtype=np.int64)
    readback[:, :, 0] = S
    outputs.apply(readback, np.array([True, False]), SLOTS[:2], None)
    assert outputs.decode_steps[SLOTS[:2]].tolist() == [1, 0]
    assert outputs.accepted_drafts[SLOTS[:2]].tolist() == [S, 0]


def test_a_record_reads_its_row_while_attached_and_keeps_it_after():
    """RequestRecord: one owner at a time for the output and counters. Attached, it reads the
    request's slot; detached, what the slot held; re-admitted (a preemption), the new slot
    starts from it."""
    from mtp_ctrl.controllers.requests import RequestRecord
    from mtp_ctrl.state.request_table import RowGroup

    table = _table(1)
    outputs = OutputRows(table)
    params = SamplingParams(max_new_tokens=30)
    records = {request_id: RequestRecord(request_id, [1, 2], params, seed=0) for request_id in (7, 8)}
    for request_id, record in records.items():
        row = table.insert(request_id, RowGroup.DECODE)
        outputs.start(row, params, 2, record.output_tokens, record.decode_steps, record.accepted_drafts)
        record.attach(outputs, table)
    outputs.apply(np.array([[[1, 5, 4], [0, 6, 9]]]), np.ones(2, dtype=bool), np.array([0, 1]), None)
    assert (records[7].output_tokens, records[7].decode_steps, records[7].accepted_drafts) == ([4, 5], 1, 1)
    assert records[8].output_tokens == [6]
    records[7].detach()
    table.remove([7])  # request 8 keeps its slot
    assert table.slot_of(8) == 1 and records[8].output_tokens == [6]
    assert (records[7].output_tokens, records[7].decode_steps, records[7].accepted_drafts) == ([4, 5], 1, 1)
    outputs.apply(np.array([[[0, 3, 0]]]), np.ones(1, dtype=bool), np.array([1]), None)  # only request 8 runs now
    assert records[7].output_tokens == [4, 5] and records[8].output_tokens == [6, 3]
    row = table.insert(7, RowGroup.DECODE)  # back after a preemption
    outputs.start(row, params, 2, records[7].output_tokens, records[7].decode_steps, records[7].accepted_drafts)
    records[7].attach(outputs, table)
    assert (records[7].output_tokens, records[7].decode_steps, records[7].accepted_drafts) == ([4, 5], 1, 1)
