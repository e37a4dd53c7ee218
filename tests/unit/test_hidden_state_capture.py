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


def test_capture_equals_dense_states_across_flushes(models, tmp_path):
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
