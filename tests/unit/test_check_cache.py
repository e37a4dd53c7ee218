"""Validation verdicts cached per argument signature: what the signature keys, that a cached
signature skips the check, and that the step ops still reject any argument that differs from a
cached good call in a checked property."""

import pytest
import torch

from mtp_ctrl.triton_ops import (
    StepCommit,
    fused_step,
    prepare_next_forward_pass,
    reference,
    rewind_kv_cache,
    verify_and_commit,
    verify_speculative_tokens,
)
from mtp_ctrl.triton_ops._checks import ValidatedSignatures, argument_signature
from tests.unit.step_cases import assert_all_equal, clone_all, make_kv_state, make_token_case


class _CountingCheck:
    """A check that records its calls and rejects a negative int first argument."""

    def __init__(self):
        self.calls = 0

    def __call__(self, value, *rest):
        self.calls += 1
        if isinstance(value, int) and value < 0:
            raise ValueError("value must be >= 0")


def test_signature_of_tensors_scalars_and_sequences():
    tensor = torch.zeros(3, dtype=torch.int64)
    assert argument_signature((tensor, 2, None)) == (
        (torch.int64, torch.Size([3]), torch.device("cpu")), (int, 2), (type(None), None))
    assert argument_signature(([tensor], (1,))) == ((list, ((torch.int64, (3,), torch.device("cpu")),)),
                                                    (tuple, ((int, 1),)))


@pytest.mark.parametrize(
    "other",
    [
        lambda t: t.int(),  # dtype
        lambda t: t[:2],  # shape
        lambda t: t[None],  # number of dimensions
        lambda t: t.to("meta"),  # device
        lambda t: torch.nn.Parameter(t, requires_grad=False),  # a tensor subclass
    ],
    ids=["dtype", "shape", "ndim", "device", "subclass"],
)
def test_signature_tells_apart_every_checked_tensor_property(other):
    tensor = torch.zeros(3, dtype=torch.int64)
    assert argument_signature((tensor,)) != argument_signature((other(tensor),))


def test_signature_ignores_values_and_strides_and_tells_bool_from_int():
    tensor = torch.zeros(3, dtype=torch.int64)
    strided = torch.ones(3, 2, dtype=torch.int64)[:, 0]  # stride 2, other values
    assert argument_signature((tensor,)) == argument_signature((strided,))
    assert argument_signature((True,)) != argument_signature((1,))
    assert argument_signature((0,)) != argument_signature((None,))


def test_a_repeated_signature_skips_the_check_and_a_new_one_runs_it():
    check, cache = _CountingCheck(), ValidatedSignatures()
    tensor = torch.zeros(4)
    cache.validate(check, 1, tensor)
    cache.validate(check, 1, torch.ones(4))  # same signature, other values
    assert check.calls == 1
    cache.validate(check, 2, tensor)
    cache.validate(check, 1, torch.zeros(5))
    assert check.calls == 3


def test_a_failing_signature_is_never_remembered():
    check, cache = _CountingCheck(), ValidatedSignatures()
    for _ in range(3):
        with pytest.raises(ValueError, match="value"):
            cache.validate(check, -1)
    assert check.calls == 3


def test_values_without_a_signature_are_checked_on_every_call():
    check, cache = _CountingCheck(), ValidatedSignatures()
    for _ in range(3):
        cache.validate(check, 1.5, {"not": "keyed"})
    assert check.calls == 3


def test_capacity_drops_the_oldest_signature():
    check, cache = _CountingCheck(), ValidatedSignatures(capacity=2)
    for value in (1, 2, 3):  # 3 pushes 1 out
        cache.validate(check, value)
    cache.validate(check, 3)
    cache.validate(check, 2)
    assert check.calls == 3
    cache.validate(check, 1)
    assert check.calls == 4


def _fused_args():
    """Valid verify_and_commit arguments: 2 decode + 1 prefill requests, S = 2, block size 4."""
    case = make_token_case(2, 1, 2, seed=0, extra_rows=2)
    buffers = [torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64),
               torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)]
    out = StepCommit(torch.zeros(3, dtype=torch.int64), torch.zeros(9, dtype=torch.bool),
                     torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.bool))
    return [case.input_tokens, case.output_tokens, case.required_logit_indices, *buffers,
            *make_kv_state(3, 2, 4, seed=0), 2, 1, 2, 4, torch.tensor([3]), out]


def test_fused_op_checks_each_signature_once(monkeypatch):
    check_calls = []
    check = fused_step._check_args
    monkeypatch.setattr(fused_step, "_VALIDATED", ValidatedSignatures())
    monkeypatch.setattr(fused_step, "_check_args", lambda *args: check_calls.append(args) or check(*args))
    args = _fused_args()
    verify_and_commit(*args)
    verify_and_commit(*args)
    assert len(check_calls) == 1
    args[12], args[13] = 1, 2  # the same grid split into 1 decode and 2 prefill requests
    verify_and_commit(*args)
    assert len(check_calls) == 2


@pytest.mark.parametrize(
    "index,bad,error,match",
    [
        (0, lambda t: t.float(), TypeError, "input_tokens"),  # dtype
        (0, lambda t: t[None, :6], ValueError, "input_tokens"),  # [1, T] with too few rows
        (1, lambda t: t[:6], ValueError, "output_tokens"),  # shape
        (2, lambda t: t.to("meta"), ValueError, "required_logit_indices"),  # device
        (5, lambda t: t[:, :1], ValueError, "accepted_tokens_per_request"),
        (7, lambda t: t.to(torch.int16), TypeError, "last_kv_block_offset"),
        (11, lambda t: t[:, :0], ValueError, "kv_block_ids"),
        (12, lambda n: 3, ValueError, "input_tokens"),  # an int: more decode rows than T holds
        (12, lambda n: True, TypeError, "num_decode_requests"),  # a bool where an int belongs
        (14, lambda s: 2.0, TypeError, "num_speculative_tokens"),  # a value without a signature
        (16, lambda n: torch.tensor([3], device="meta"), ValueError, "num_active_requests"),
        (16, lambda n: 4, ValueError, "num_active_requests"),
        (17, lambda o: list(o[:3]), TypeError, "out"),
        (17, lambda o: o._replace(remove_mask=o.remove_mask.long()), TypeError, "out.remove_mask"),
    ],
)
def test_fused_op_rejects_a_bad_call_after_a_cached_good_one(index, bad, error, match):
    args = _fused_args()
    verify_and_commit(*args)
    verify_and_commit(*args)  # the signature is cached now
    args[index] = bad(args[index])
    for _ in range(2):  # and a bad signature never becomes cached
        with pytest.raises(error, match=match):
            verify_and_commit(*args)


def test_fused_op_results_are_unchanged_by_cached_checks():
    """Calls that hit the cache ([T] then [1, T] tokens, int then tensor counts) == the reference."""
    for input_rows, num_active in [(None, None), (None, None), ("[1, T]", 2), ("[1, T]", torch.tensor([2]))]:
        args = _fused_args()
        args[16] = num_active
        if input_rows == "[1, T]":
            args[0] = args[0][None, :]
        want = clone_all(args[3:12])
        want_out = reference.verify_and_commit(args[0].reshape(-1), *args[1:3], *want, *args[12:17])
        got_out = verify_and_commit(*args)
        assert_all_equal(list(got_out) + args[3:12], list(want_out) + want)


def _verify_args():
    case = make_token_case(2, 1, 2, seed=0)
    return [case.input_tokens, case.output_tokens, 2, 1, 2]


def _prepare_args():
    case = make_token_case(2, 1, 2, seed=0)
    last_one_indices, mask, _ = reference.verify_speculative_tokens(case.input_tokens, case.output_tokens, 2, 1, 2)
    buffers = [torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64),
               torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)]
    return [2, case.output_tokens, case.required_logit_indices, last_one_indices, mask, case.input_tokens, *buffers, 2]


def _rewind_args():
    return [torch.tensor([0, 1, 2]), torch.tensor([0, 0, 1]), *make_kv_state(3, 2, 4, seed=0), 2, 4, None]


@pytest.mark.parametrize(
    "op,valid_args,index,bad,error,match",
    [
        (verify_speculative_tokens, _verify_args, 0, lambda t: t.float(), TypeError, "input_tokens"),
        (verify_speculative_tokens, _verify_args, 1, lambda t: t[:5], ValueError, "output_tokens"),
        (verify_speculative_tokens, _verify_args, 2, lambda n: 3, ValueError, "input_tokens"),
        (prepare_next_forward_pass, _prepare_args, 0, lambda n: 4, ValueError, "num_decode_requests"),
        (prepare_next_forward_pass, _prepare_args, 4, lambda t: t.long(), TypeError, "accepted_tokens_mask"),
        (prepare_next_forward_pass, _prepare_args, 6, lambda t: t[:2], ValueError, "sampled_tokens_buf"),
        (rewind_kv_cache, _rewind_args, 1, lambda t: t[:2], ValueError, "prefill_status"),
        (rewind_kv_cache, _rewind_args, 6, lambda t: t[:, :0], ValueError, "kv_block_ids"),
        (rewind_kv_cache, _rewind_args, 9, lambda n: 4, ValueError, "num_active_requests"),
    ],
)
def test_separate_ops_reject_a_bad_call_after_a_cached_good_one(op, valid_args, index, bad, error, match):
    args = valid_args()
    op(*args)
    op(*args)
    args[index] = bad(args[index])
    for _ in range(2):
        with pytest.raises(error, match=match):
            op(*args)
