"""HiddenStateCapture: output == plain decoding; the recorded aux states, token ids and positions
equal a plain dense forward's across several flushes (a small buffer); bad inputs raise."""

import pytest
import torch

from mtp_ctrl.controllers import HiddenStateCapture, SamplingParams
from mtp_ctrl.controllers.hidden_state_capture import load_capture
from tests.unit.controller_fixtures import PROMPTS, make_controller
from tests.unit.eagle_fixtures import build_eagle_models, dense_aux
from tests.unit.megatron_fixtures import ensure_single_process_groups

LAYERS = (1, 0)


@pytest.fixture(scope="module")
def models():
    ensure_single_process_groups()
    model, dense, _, _ = build_eagle_models()
    return model, dense


def test_capture_records_every_position_of_requests_that_never_draft(models, tmp_path, torch_twins):
    """Requests that opt out (``num_speculative_tokens=0``): their decode steps still reach the
    capture (``Proposer.sees_never_drafting_steps``), which records every verified position."""
    model, _ = models
    prompts = [list(p) for p in PROMPTS]
    capture = HiddenStateCapture(LAYERS, tmp_path / "capture", capacity_tokens=4096)
    results = make_controller(model, 1, proposer=capture).generate(
        prompts, SamplingParams(max_new_tokens=8, num_speculative_tokens=0))
    capture.close()
    _, _, positions, request_ids = load_capture(tmp_path / "capture")
    for request_id, (prompt, result) in enumerate(zip(prompts, results)):
        recorded = sorted(set(positions[request_ids == request_id].tolist()))
        assert recorded == list(range(len(prompt) + len(result.output_tokens) - 1)), request_id


def test_capture_equals_dense_states_across_flushes(models, tmp_path, torch_twins):
    model, dense = models
    prompts = [list(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=8)
    plain = make_controller(model, 0).generate(prompts, params)
    capture = HiddenStateCapture(LAYERS, tmp_path / "capture", capacity_tokens=20)
    controller = make_controller(model, 1, proposer=capture, max_tokens_per_step=16)
    results = controller.generate(prompts, params)
    capture.close()
    assert [r.output_tokens for r in results] == [r.output_tokens for r in plain]
    assert len(capture.shard_paths) >= 3  # 4 prompts of 28 tokens and 32 outputs through a 20-row buffer
    hidden, tokens, positions, request_ids = load_capture(tmp_path / "capture")
    for request_id, (prompt, result) in enumerate(zip(prompts, plain)):
        sequence = torch.tensor(prompt + list(result.output_tokens))
        mine = (request_ids == request_id) & (positions < sequence.shape[0] - 1)  # the last token is never verified
        assert positions[mine].tolist() == list(range(sequence.shape[0] - 1)), request_id
        assert tokens[mine].tolist() == sequence[:-1].tolist()
        torch.testing.assert_close(hidden[mine], dense_aux(dense, sequence[:-1], LAYERS), rtol=1e-4, atol=1e-4)


def test_bad_inputs_raise(models, tmp_path):
    model, _ = models
    with pytest.raises(ValueError, match="aux_layer_ids"):
        make_controller(model, 1, proposer=HiddenStateCapture((0, 2), tmp_path))
    with pytest.raises(ValueError, match="aux_layer_ids"):
        HiddenStateCapture((0, 0), tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="output_dir"):
        HiddenStateCapture((0,), tmp_path / "file" / "sub")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_controller(model, 2, proposer=HiddenStateCapture((0,), tmp_path))
    with pytest.raises(ValueError, match="capacity_tokens"):
        make_controller(model, 1, proposer=HiddenStateCapture((0,), tmp_path, capacity_tokens=8))
    controller = make_controller(model, 1, proposer=HiddenStateCapture((0,), tmp_path / "ok"))
    assert len(controller.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))[0].output_tokens) == 3


def _shard_records(capture):
    """(request_ids, positions) of every record of every shard written, as lists."""
    from safetensors.torch import load_file

    shards = [load_file(path) for path in capture.shard_paths]
    return (sum((s["request_ids"].tolist() for s in shards), []), sum((s["positions"].tolist() for s in shards), []))


def test_records_do_not_depend_on_decode_steps_per_launch(models, tmp_path, torch_twins):
    """Decode runs (k = 4) run requests past their stop on the device; those rows, and the
    extra overlapped step of k = 1, must never be recorded: every shard holds only positions
    before each request's last emitted token, and the records of k = 1 and k = 4 are equal."""
    model, _ = models
    prompts = [list(p) for p in PROMPTS]
    plain = make_controller(model, 0).generate(prompts, SamplingParams(max_new_tokens=10))
    eos = plain[1].output_tokens[2]  # request 1 stops on its third token (an eos), the rest by length
    params = [SamplingParams(max_new_tokens=n, eos_token_ids=(eos,)) for n in (9, 10, 5, 7)]
    loaded = {}
    for k in (1, 4):
        capture = HiddenStateCapture(LAYERS, tmp_path / f"k{k}", capacity_tokens=64)
        results = make_controller(model, 1, proposer=capture, decode_steps_per_launch=k).generate(prompts, params)
        capture.close()
        lengths = [len(prompt) + len(result.output_tokens) for prompt, result in zip(prompts, results)]
        assert results[1].output_tokens[-1] == eos
        request_ids, positions = _shard_records(capture)
        past = [(r, p) for r, p in zip(request_ids, positions) if p >= lengths[r] - 1]
        assert past == [], f"k = {k}: records at or past the last emitted token: {past}"
        loaded[k] = load_capture(tmp_path / f"k{k}")
    for name, one, four in zip(("hidden", "tokens", "positions", "request_ids"), loaded[1], loaded[4]):
        torch.testing.assert_close(four, one, msg=name)


def test_write_failure_costs_no_generation(models, tmp_path, torch_twins):
    """The capture directory disappears mid-run (safetensors raises its own error, not an OSError):
    every request still finishes with plain decoding's output, the failure is reported (a warning,
    ``write_error``), later flushes write nothing, and close() raises naming the directory."""
    model, _ = models
    prompts = [list(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=8)
    plain = make_controller(model, 0).generate(prompts, params)
    capture = HiddenStateCapture(LAYERS, tmp_path / "gone", capacity_tokens=20)
    controller = make_controller(model, 1, proposer=capture, max_tokens_per_step=16)
    (tmp_path / "gone").rmdir()
    (tmp_path / "gone").write_text("a file where the directory was")
    with pytest.warns(RuntimeWarning, match="gone"):
        results = controller.generate(prompts, params)
    assert [r.output_tokens for r in results] == [r.output_tokens for r in plain]
    assert capture.write_error is not None and capture.shard_paths == []
    assert [r.output_tokens for r in controller.generate(prompts, params)] == [r.output_tokens for r in plain]
    with pytest.raises(RuntimeError, match="gone"):
        capture.close()
