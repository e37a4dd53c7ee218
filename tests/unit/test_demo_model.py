"""mtp_ctrl.load_demo_model: the trained demo GPT that ships as package data, on the CPU; what a
user can get wrong (a bad path, a file of another kind, a device, no process group) is named."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtp_ctrl.models import shipped_checkpoint_path
from mtp_ctrl.checkpoints import SHIPPED_CHECKPOINTS
from tests.unit.megatron_fixtures import ensure_single_process_groups

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def process_groups():
    ensure_single_process_groups()


def test_default_is_the_shipped_trained_model_ready_to_serve(process_groups):
    import mtp_ctrl

    model = mtp_ctrl.load_demo_model(device="cpu")
    assert not model.training
    assert {parameter.device.type for parameter in model.parameters()} == {"cpu"}
    assert model.config.mtp_num_layers == 2 and model.max_sequence_length == 1024
    # the shipped weights, not a fresh random draw: equal to the checkpoint's bf16 values
    state_dict = torch.load(shipped_checkpoint_path(), weights_only=True)["state_dict"]
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    torch.testing.assert_close(model.state_dict()[name], state_dict[name].float())


def test_every_shipped_checkpoint_is_package_data():
    assert all(Path(shipped_checkpoint_path(name)).is_file() for name in SHIPPED_CHECKPOINTS)
    with pytest.raises(ValueError, match="name must be one of"):
        shipped_checkpoint_path("gpt2")


def test_bad_arguments_are_named(process_groups, tmp_path):
    import mtp_ctrl

    with pytest.raises(FileNotFoundError, match="does_not_exist.pt"):
        mtp_ctrl.load_demo_model(str(tmp_path / "does_not_exist.pt"), device="cpu")
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="corrupt.pt is not a readable torch checkpoint"):
        mtp_ctrl.load_demo_model(str(corrupt), device="cpu")
    with pytest.raises(TypeError, match="path must be"):
        mtp_ctrl.load_demo_model(3, device="cpu")
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        mtp_ctrl.load_demo_model(device="meta")


def test_without_process_groups_it_says_what_to_call():
    code = "import mtp_ctrl\nmtp_ctrl.load_demo_model(device='cpu')"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode != 0 and "call mtp_ctrl.init_single_process() first" in result.stderr
