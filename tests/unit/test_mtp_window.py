"""mtp_draft_window / mtp_advance_window: kernel == reference on random steps (decode rows,
prefill chunks, a mid-prompt chunk, padding requests and rows, block boundaries), the module's
worked example, and named errors."""

import pytest
import torch

from mtp_ctrl.triton_ops import TokenRecord, mtp_advance_window, mtp_draft_window, reference

BLOCK_SIZE = 4


def mtp_window_case(generator, num_decode, prefill_lengths, num_padding, S, hidden_size=8, max_requests=12,
               padding_step_rows=3, mid_prompt=True, dtype=torch.float32, extra_window_rows=None, verify_width=None,
               catch_up=0):
    """A step's tensors: ``num_decode`` decode requests, prefill chunks of ``prefill_lengths`` (the
    last one mid-prompt when ``mid_prompt``), ``num_padding`` padding requests. ``verify_width`` V
    (with or without prefill chunks: a step verifies its own tier): decode requests of ``1 + V``
    rows, w at most ``S - 1`` before the first row (as the controller leaves it), windows of
    ``S + V`` rows (``decode_window_rows``). ``catch_up`` m: skipped windows, a ring of ``S + m``
    slots, decode w up to ``S - 1 + m`` before the first row, windows of ``S + V + m`` rows."""
    def randint(low, high, size=()):
        return torch.randint(low, high, size, generator=generator)

    num_prefill = len(prefill_lengths)
    G = num_decode + num_prefill + num_padding
    R, history_len = max_requests, 96
    padding_row = R
    V = S if verify_width is None else verify_width
    query_lengths = [1 + V] * num_decode + list(prefill_lengths) + [0] * num_padding
    first, ends, samples = [], [], []
    for r in range(G):
        if r < num_decode:
            start = int(randint(0, 40))
            first.append(start)
            ends.append(start + 1 + int(randint(0, V + 1)))
            samples.append(True)
        elif r < num_decode + num_prefill:
            start = 0 if bool(randint(0, 2)) else int(randint(1, 30))
            first.append(start)
            ends.append(start + query_lengths[r])
            samples.append(not (mid_prompt and r == num_decode + num_prefill - 1))
        else:
            first.append(int(randint(-3, 50)))  # a padding request's stale value
            ends.append(int(randint(-3, 50)))
            samples.append(False)
    starts = torch.zeros(G + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lengths, dtype=torch.int32), 0)
    T = int(starts[-1]) + padding_step_rows
    step_positions = torch.zeros(T, dtype=torch.int64)
    for r in range(G):
        step_positions[int(starts[r]): int(starts[r + 1])] = torch.arange(query_lengths[r]) + first[r]
    write_rows = torch.randperm(R, generator=generator)[:G].clone()  # [G] int64
    write_rows[num_decode + num_prefill:] = padding_row
    window_starts = randint(0, 40, (R + 1,))
    for r in range(num_decode + num_prefill):  # w <= first, at most S before it (S - 1 with a verify width)
        lag = int(randint(0, catch_up + 1)) if r < num_decode else 0
        window_starts[write_rows[r]] = max(0, first[r] - lag - int(randint(0, S + (verify_width is None))))
    Tm = G * (S + V + catch_up) if not num_prefill else T + G * (S + catch_up)
    Tm += int(randint(0, 4)) if extra_window_rows is None else extra_window_rows  # padding rows past the windows
    blocks_per_request = (history_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    return dict(
        query_start_loc=starts, first_positions=torch.tensor(first, dtype=torch.int64),
        bonus_positions=torch.tensor(ends, dtype=torch.int64), write_rows=write_rows,
        samples=torch.tensor(samples, dtype=torch.bool), num_decode=torch.tensor([num_decode]),
        num_active=torch.tensor([num_decode + num_prefill]), step_positions=step_positions,
        step_input_ids=randint(0, 50, (T,)), next_tokens=randint(0, 50, (G + 2,)),
        step_hidden=torch.randn(T, hidden_size, generator=generator).to(dtype),
        block_table=randint(0, 200, (G + 1, blocks_per_request)).to(torch.int32),
        window_starts=window_starts, token_history=randint(0, 50, (R + 1, history_len)),
        hidden_ring=torch.randn(R + 1, S + catch_up, hidden_size, generator=generator).to(dtype),
        num_speculative_tokens=S, block_size=BLOCK_SIZE, padding_row=padding_row,
        out_window_query_start_loc=torch.full((G + 1,), -7, dtype=torch.int32),
        out_positions=torch.full((Tm,), -7), out_slot_mapping=torch.full((Tm,), -7),
        out_history_rows=torch.full((Tm,), -7), out_hidden=torch.full((Tm, hidden_size), 7.0, dtype=dtype),
        **({} if verify_width is None else dict(decode_window_rows=S + verify_width + catch_up)),
    )


def _clone(case):
    return {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in case.items()}


def _assert_same(got, want, padding_row):
    for name, value in got.items():
        if not isinstance(value, torch.Tensor):
            continue
        if name in ("token_history", "hidden_ring", "window_starts"):  # the padding row takes racing writes
            value, expected = value[:padding_row], want[name][:padding_row]
        else:
            expected = want[name]
        assert torch.equal(value, expected), name


ADVANCE_ARGS = ("first_positions", "bonus_positions", "write_rows", "samples", "query_start_loc", "step_hidden",
                "window_starts", "hidden_ring", "num_speculative_tokens")


def _assert_window_then_advance_match_twins(case):
    """The window op, then the advance, each == its twin on a copy of ``case``."""
    want = _clone(case)
    mtp_draft_window(**case)
    reference.mtp_draft_window(**want)
    _assert_same(case, want, case["padding_row"])
    mtp_advance_window(**{name: case[name] for name in ADVANCE_ARGS})
    reference.mtp_advance_window(**{name: want[name] for name in ADVANCE_ARGS})
    _assert_same(case, want, case["padding_row"])


@pytest.mark.parametrize("S", [1, 2, 3])
@pytest.mark.parametrize("shape", [(1, (), 0), (3, (), 2), (0, (5,), 0), (2, (7, 3), 1), (0, (33,), 3),
                                   (4, (1, 6, 2), 0), (0, (), 2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_kernels_match_reference(S, shape, seed):
    num_decode, prefill_lengths, num_padding = shape
    generator = torch.Generator().manual_seed(seed * 100 + S * 10 + num_decode)
    case = mtp_window_case(generator, num_decode, prefill_lengths, num_padding, S, mid_prompt=bool(seed))
    _assert_window_then_advance_match_twins(case)


@pytest.mark.parametrize("S,verify_width", [(2, 0), (3, 1), (3, 2)])
@pytest.mark.parametrize("shape", [(2, (7, 3), 1), (3, (5,), 0), (1, (1, 6), 2)])
def test_kernels_match_reference_with_a_verify_width_and_prefill_chunks(S, verify_width, shape):
    """Steps with prefill chunks verify their own tier too: decode windows of S + V rows, then the
    chunks' windows (a mid-prompt one last), padding requests and rows."""
    num_decode, prefill_lengths, num_padding = shape
    generator = torch.Generator().manual_seed(S * 10 + verify_width + num_decode + 7)
    case = mtp_window_case(generator, num_decode, prefill_lengths, num_padding, S, verify_width=verify_width)
    _assert_window_then_advance_match_twins(case)


@pytest.mark.parametrize("S,verify_width", [(1, 0), (2, 0), (2, 1), (3, 1), (3, 2)])
@pytest.mark.parametrize("shape", [(1, 0), (3, 2), (4, 0)])
def test_kernels_match_reference_with_a_verify_width(S, verify_width, shape):
    """Decode-only steps of a verify tier V < S: windows of S + V rows (decode_window_rows)."""
    num_decode, num_padding = shape
    generator = torch.Generator().manual_seed(S * 10 + verify_width + num_decode)
    case = mtp_window_case(generator, num_decode, (), num_padding, S, verify_width=verify_width)
    want = _clone(case)
    mtp_draft_window(**case)
    reference.mtp_draft_window(**want)
    _assert_same(case, want, case["padding_row"])
    positions, slots = case["out_positions"], case["out_slot_mapping"]
    ends = case["bonus_positions"][:num_decode]
    assert torch.equal(case["out_window_query_start_loc"][: num_decode + 1].long(),
                       torch.arange(num_decode + 1) * (S + verify_width))
    for r in range(num_decode):  # each window ends at e - 1 and covers [w, e): every position from w is written
        rows = slice(r * (S + verify_width), (r + 1) * (S + verify_width))
        assert positions[rows][-1] == ends[r] - 1
        w = int(case["window_starts"][case["write_rows"][r]])
        assert bool(((positions[rows] >= w) == (slots[rows] >= 0)).all())
        assert int(positions[rows][0]) <= max(w, 0)


@pytest.mark.parametrize("S,verify_width,catch_up", [(1, 0, 1), (2, 0, 3), (2, 2, 8), (3, 1, 5)])
@pytest.mark.parametrize("shape", [(1, (), 0), (3, (), 2), (2, (5,), 1)])
@pytest.mark.parametrize("move_window_start", [True, False])
def test_kernels_match_reference_catching_up(S, verify_width, catch_up, shape, move_window_start):
    """Skipped windows (``InferenceConfig(mtp_idle_windows="skip")``): a ring of ``S + m`` slots,
    decode windows of ``S + V + m`` rows reaching back to a w up to m positions older, padding rows;
    a skipped step's advance keeps w and moves only the ring. Every position in [w, e) is covered."""
    num_decode, prefill_lengths, num_padding = shape
    generator = torch.Generator().manual_seed(S * 100 + verify_width * 10 + catch_up + num_decode)
    case = mtp_window_case(generator, num_decode, prefill_lengths, num_padding, S, catch_up=catch_up,
                           verify_width=None if prefill_lengths else verify_width)
    size = 2 * S + catch_up if prefill_lengths else S + verify_width + catch_up  # (the mixed case at V = S)
    case["decode_window_rows"] = size
    want = _clone(case)
    mtp_draft_window(**case)
    reference.mtp_draft_window(**want)
    _assert_same(case, want, case["padding_row"])
    for r in range(0 if prefill_lengths else num_decode):  # (the mixed case draws w up to S before the first row)
        rows = slice(r * size, (r + 1) * size)
        w = int(case["window_starts"][case["write_rows"][r]])
        assert int(case["out_positions"][rows][0]) <= max(w, 0)  # the window reaches back to w
    starts_before = case["window_starts"].clone()
    mtp_advance_window(**{name: case[name] for name in ADVANCE_ARGS}, move_window_start=move_window_start)
    reference.mtp_advance_window(**{name: want[name] for name in ADVANCE_ARGS}, move_window_start=move_window_start)
    _assert_same(case, want, case["padding_row"])
    if not move_window_start:
        assert torch.equal(case["window_starts"], starts_before)


def _record_of(case):
    return TokenRecord(case["step_positions"], case["step_input_ids"], case["next_tokens"], case["token_history"],
                       case["padding_row"])


@pytest.mark.parametrize("S,catch_up", [(1, 0), (2, 0), (2, 3), (3, 5)])
@pytest.mark.parametrize("shape", [(1, (), 0), (4, (), 3), (2, (5, 2), 1), (0, (), 2), (0, (), 0)])
@pytest.mark.parametrize("move_window_start", [True, False])
def test_advance_with_a_token_record_equals_an_empty_window_then_the_advance(S, catch_up, shape, move_window_start):
    """A step that runs no window records its tokens inside the advance (``record``): the same
    history, ring and starts as the window op at 0 rows followed by the advance, kernel and twin
    alike (decode rows of one token, chunks, a mid-prompt chunk that samples nothing, padding)."""
    num_decode, prefill_lengths, num_padding = shape
    generator = torch.Generator().manual_seed(S * 100 + catch_up * 10 + num_decode + len(prefill_lengths))
    case = mtp_window_case(generator, num_decode, prefill_lengths, num_padding, S, catch_up=catch_up, verify_width=0,
                           extra_window_rows=0)
    for name in ("out_positions", "out_slot_mapping", "out_history_rows"):
        case[name] = case[name][:0]
    case["out_hidden"] = case["out_hidden"][:0]
    case["decode_window_rows"] = S
    two_launches, twin = _clone(case), _clone(case)
    mtp_draft_window(**two_launches)
    mtp_advance_window(**{name: two_launches[name] for name in ADVANCE_ARGS}, move_window_start=move_window_start)
    mtp_advance_window(**{name: case[name] for name in ADVANCE_ARGS}, move_window_start=move_window_start,
                       record=_record_of(case))
    reference.mtp_advance_window(**{name: twin[name] for name in ADVANCE_ARGS}, move_window_start=move_window_start,
                                 record=_record_of(twin))
    for want in (two_launches, twin):
        for name in ("token_history", "hidden_ring", "window_starts"):  # the padding row takes racing writes
            assert torch.equal(case[name][: case["padding_row"]], want[name][: case["padding_row"]]), name


def test_advance_record_is_checked():
    case = mtp_window_case(torch.Generator().manual_seed(3), 2, (), 1, 2, verify_width=0)
    advance = {name: case[name] for name in ADVANCE_ARGS}
    with pytest.raises(TypeError, match="record"):
        mtp_advance_window(**advance, record=tuple(_record_of(case)))
    with pytest.raises(ValueError, match="step_positions"):
        mtp_advance_window(**advance, record=_record_of(case)._replace(step_positions=case["step_positions"][:-1]))
    with pytest.raises(ValueError, match="padding_row"):
        mtp_advance_window(**advance, record=_record_of(case)._replace(padding_row=10_000))


@pytest.mark.parametrize("op", [mtp_draft_window, reference.mtp_draft_window])
def test_worked_example(op):
    """S = 2, one decode request: e = 12, w = 9, first = 10 -> window positions 8, 9, 10, 11."""
    case = mtp_window_case(torch.Generator().manual_seed(0), 1, (), 0, 2, max_requests=2)
    case.update(first_positions=torch.tensor([10]), bonus_positions=torch.tensor([12]),
                write_rows=torch.tensor([0]))
    case["step_positions"][:3] = torch.tensor([10, 11, 12])
    case["window_starts"][0] = 9
    case["block_table"][0, 2] = 5  # positions 8..11 sit in block column 2
    op(**case)
    assert case["out_window_query_start_loc"].tolist() == [0, 4]
    assert case["out_positions"][:4].tolist() == [8, 9, 10, 11]
    assert case["out_slot_mapping"][:4].tolist() == [-1, 21, 22, 23]
    hidden, ring = case["out_hidden"], case["hidden_ring"]
    assert torch.equal(hidden[1], ring[0, 9 % 2]) and torch.equal(hidden[2:4], case["step_hidden"][0:2])
    assert case["token_history"][0, 10:13].tolist() == [*case["step_input_ids"][:2].tolist(),
                                                       int(case["next_tokens"][0])]  # the bonus wins at e


@pytest.mark.parametrize("op", [mtp_draft_window, reference.mtp_draft_window])
def test_empty_grid_writes_padding_rows(op):
    case = mtp_window_case(torch.Generator().manual_seed(1), 0, (), 0, 2)
    case["out_positions"] = torch.full((5,), -7)
    for name in ("out_slot_mapping", "out_history_rows"):
        case[name] = torch.full((5,), -7)
    case["out_hidden"] = torch.full((5, 8), 7.0)
    op(**case)
    assert case["out_positions"].tolist() == [-1] * 5 and case["out_slot_mapping"].tolist() == [-1] * 5
    assert case["out_history_rows"].tolist() == [case["padding_row"]] * 5
    assert case["out_hidden"].abs().sum() == 0 and case["out_window_query_start_loc"].tolist() == [0]


@pytest.mark.parametrize("name, value, error", [
    ("first_positions", torch.zeros(2, dtype=torch.int32), TypeError),
    ("samples", torch.zeros(2, dtype=torch.int64), TypeError),
    ("num_decode", torch.zeros(2, dtype=torch.int64), ValueError),
    ("hidden_ring", torch.zeros(12, 2, 8), ValueError),
    ("hidden_ring", torch.zeros(13, 1, 8), ValueError),
    ("decode_window_rows", 5, ValueError),
    ("out_hidden", torch.zeros(4, 8, dtype=torch.float64), TypeError),
    ("num_speculative_tokens", 0, ValueError),
    ("padding_row", 99, ValueError),
])
def test_bad_arguments_are_named(name, value, error):
    case = mtp_window_case(torch.Generator().manual_seed(2), 2, (), 0, 2)
    case[name] = value
    with pytest.raises(error, match=name):
        mtp_draft_window(**case)
