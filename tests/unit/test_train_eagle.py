"""examples/train_eagle.py --quick: capture, training, checkpoint and the held-out evaluation run
end to end on the shipped demo model (CPU, torch reference kernels), and the head loads back."""

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_train_eagle_quick_smoke(tmp_path):
    out = tmp_path / "eagle_quick.pt"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    completed = subprocess.run([sys.executable, str(ROOT / "examples" / "train_eagle.py"), "--quick", "--out", str(out)],
                               env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "draft agreement per depth" in completed.stdout and "saved" in completed.stdout
    checkpoint = torch.load(out, weights_only=True)
    assert checkpoint["aux_layer_ids"] == [0, 2, 3] and checkpoint["model_args"]["num_layers"] == 4
    assert any(name.startswith("fc.") for name in checkpoint["state_dict"])


def test_train_ptd_quick_smoke(tmp_path):
    """--mode ptd: the multi-anchor training, mask_token_id + mask_hidden saved, the held-out
    evaluation through ParallelDraftingProposer, and the checkpoint serves through generate.py's loader."""
    out = tmp_path / "ptd_quick.pt"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    completed = subprocess.run([sys.executable, str(ROOT / "examples" / "train_eagle.py"), "--mode", "ptd", "--quick",
                                "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "token loss per depth" in completed.stdout and "draft agreement per depth" in completed.stdout
    checkpoint = torch.load(out, weights_only=True)
    assert checkpoint["mode"] == "ptd" and checkpoint["mask_token_id"] == checkpoint["model_args"]["vocab_size"] - 1
    assert checkpoint["state_dict"]["mask_hidden"].shape == (checkpoint["model_args"]["hidden_size"],)
