"""examples/train_multi_layer_eagle.py: --quick runs capture, training, checkpoint and the held-out
evaluation end to end on the shipped demo model (CPU); its checkpoint loader round-trips draft
layers and refuses bad checkpoints with errors that say what is wrong."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtp_ctrl.models import build_multi_layer_eagle_heads
from tests.unit.megatron_fixtures import build_tiny_model, ensure_single_process_groups, tiny_config

ROOT = Path(__file__).resolve().parents[2]


def test_train_multi_layer_eagle_quick_smoke(tmp_path):
    out = tmp_path / "mle_quick.pt"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    completed = subprocess.run([sys.executable, str(ROOT / "examples" / "train_multi_layer_eagle.py"), "--quick",
                                "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "draft agreement per depth" in completed.stdout and "saved" in completed.stdout
    checkpoint = torch.load(out, weights_only=True)
    assert checkpoint["num_layers"] == 2 and checkpoint["aux_layer_ids"] == [0, 2, 3]
    assert checkpoint["model_args"]["num_layers"] == 4
    names = checkpoint["state_dict"]
    assert "layers.0.fc.weight" in names and "layers.1.eh_proj.weight" in names and "layers.1.fc.weight" not in names


@pytest.fixture(scope="module")
def loader():
    sys.path.insert(0, str(ROOT / "examples"))
    from mtp_ctrl.cli.draft_heads import load_multi_layer_eagle_heads

    ensure_single_process_groups()
    return load_multi_layer_eagle_heads


def _save(path, heads, **fields):
    saved = {"model_args": {}, "aux_layer_ids": list(heads.aux_layer_ids), "num_layers": heads.num_layers,
             "target_checkpoint": "tiny", "state_dict": heads.state_dict()}
    saved.update(fields)
    saved = {key: value for key, value in saved.items() if value is not None}
    torch.save(saved, path)
    return str(path)


def test_checkpoint_round_trip_and_bad_checkpoints(tmp_path, loader):
    model = build_tiny_model(tiny_config(mtp_num_layers=0))
    torch.manual_seed(4)
    heads = build_multi_layer_eagle_heads(model, 2, (0, 1))
    loaded = loader(model, _save(tmp_path / "good.pt", heads))
    assert loaded.num_layers == 2 and loaded.aux_layer_ids == (0, 1)
    assert all(torch.equal(value, loaded.state_dict()[name]) for name, value in heads.state_dict().items()
               if torch.is_tensor(value))  # megatron's extra states are None

    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="not a multi-layer EAGLE checkpoint"):
        loader(model, str(tmp_path / "list.pt"))
    with pytest.raises(ValueError, match="no num_layers: a single EAGLE head"):
        loader(model, _save(tmp_path / "eagle.pt", heads, num_layers=None))
    with pytest.raises(ValueError, match="num_layers must be an int >= 1"):
        loader(model, _save(tmp_path / "zero.pt", heads, num_layers=0))
    with pytest.raises(ValueError, match="num_layers is 3 but the state_dict holds 2 draft layers"):
        loader(model, _save(tmp_path / "three.pt", heads, num_layers=3))
    missing = {name: value for name, value in heads.state_dict().items() if not name.startswith("layers.1.enorm")}
    with pytest.raises(ValueError, match="(?s)does not fit this target.*Missing key.*layers.1.enorm"):
        loader(model, _save(tmp_path / "missing.pt", heads, state_dict=missing))
    with pytest.raises(ValueError, match="aux_layer_ids"):
        loader(model, _save(tmp_path / "aux.pt", heads, aux_layer_ids=[0, 7]))
