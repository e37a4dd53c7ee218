"""A damaged or mismatched dist checkpoint never loads silently and never leaks a raw library error:
every corrupt file is named with its checkpoint, an architecture that differs without changing
shapes is a ValueError naming the field, and a flipped bit in a shard fails its checksum. The
model keeps its weights in every case."""

import json
import shutil

import pytest

from mtp_ctrl.models import load_distributed_checkpoint, save_distributed_checkpoint
from mtp_ctrl.models.checkpoint_record import RECORD_FILE
from tests.unit.dist_checkpoint_fixtures import parameter_mismatches, snapshot, unchanged
from tests.unit.megatron_fixtures import build_tiny_model, ensure_single_process_groups, tiny_config


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint dir, the saved model) of a TP = 1 save of the tiny model."""
    ensure_single_process_groups()
    model = build_tiny_model(tiny_config(mtp_num_layers=1), seed=1234)
    checkpoint_dir = tmp_path_factory.mktemp("integrity") / "checkpoint"
    save_distributed_checkpoint(model, checkpoint_dir)
    return checkpoint_dir, model


@pytest.fixture
def fresh_model():
    ensure_single_process_groups()
    return build_tiny_model(tiny_config(mtp_num_layers=1), seed=99)


def test_saved_checkpoint_loads_with_its_record(saved, fresh_model):
    checkpoint_dir, model = saved
    record = json.loads((checkpoint_dir / RECORD_FILE).read_text())
    assert record["architecture"]["num_attention_heads"] == 4
    assert record["architecture"]["num_query_groups"] == 2
    assert any(name.endswith(".distcp") for name in record["sha256"])
    load_distributed_checkpoint(fresh_model, checkpoint_dir)
    assert parameter_mismatches(fresh_model, model) == []


def _truncate(path):
    path.write_bytes(path.read_bytes()[:20])


def _garbage(path):
    path.write_bytes(b"\x80\x04garbage that no reader accepts" * 3)


CORRUPTIONS = {
    "truncated_torch_metadata": (".metadata", _truncate),
    "garbage_torch_metadata": (".metadata", _garbage),
    "deleted_torch_metadata": (".metadata", lambda path: path.unlink()),
    "garbage_metadata_json": ("metadata.json", lambda path: path.write_text("{not json")),
    "empty_metadata_json": ("metadata.json", lambda path: path.write_text("{}")),
    "deleted_common": ("common.pt", lambda path: path.unlink()),
    "garbage_common": ("common.pt", _garbage),
    "truncated_common": ("common.pt", _truncate),
    "garbage_record": (RECORD_FILE, lambda path: path.write_text("[1, 2")),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_file_is_named_with_its_checkpoint(saved, fresh_model, tmp_path, corruption):
    file_name, corrupt = CORRUPTIONS[corruption]
    broken = tmp_path / f"broken_{corruption}"
    shutil.copytree(saved[0], broken)
    corrupt(broken / file_name)
    before = snapshot(fresh_model)
    with pytest.raises(ValueError) as raised:
        load_distributed_checkpoint(fresh_model, broken)
    message = str(raised.value)
    assert str(broken) in message and file_name in message, message
    assert "weights_only" not in message  # torch's advice to unpickle anything is not ours to give
    assert unchanged(fresh_model, before)


def test_architecture_with_the_same_shapes_is_rejected(saved):
    """8 heads over 4 query groups of 8 channels: every tensor has the 4-head model's shape."""
    ensure_single_process_groups()
    model = build_tiny_model(tiny_config(mtp_num_layers=1, num_attention_heads=8, num_query_groups=4, kv_channels=8))
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"num_attention_heads.*checkpoint has 4.*model has 8"):
        load_distributed_checkpoint(model, saved[0])
    assert unchanged(model, before)


def test_flipped_bit_in_a_shard_fails_its_checksum(saved, fresh_model, tmp_path):
    broken = tmp_path / "flipped"
    shutil.copytree(saved[0], broken)
    shard = sorted(broken.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x04
    shard.write_bytes(bytes(data))
    before = snapshot(fresh_model)
    with pytest.raises(ValueError, match=rf"{shard.name}.*checksum"):
        load_distributed_checkpoint(fresh_model, broken)
    assert unchanged(fresh_model, before)


def test_megatron_lm_args_are_compared_when_there_is_no_record(saved, fresh_model, tmp_path):
    """A checkpoint without our record (megatron wrote it) carries only what Megatron-LM saved as its
    training ``args`` in common.pt: the fields they share with the model are compared."""
    import argparse

    import torch

    for heads, name in ((4, "same"), (8, "other")):
        copy = tmp_path / name
        shutil.copytree(saved[0], copy)
        (copy / RECORD_FILE).unlink()
        with torch.serialization.safe_globals([argparse.Namespace]):
            common = torch.load(copy / "common.pt", weights_only=True)
        common["args"] = argparse.Namespace(num_attention_heads=heads, group_query_attention=True, num_query_groups=2,
                                            normalization="LayerNorm", swiglu=False, num_experts=None)
        torch.save(common, copy / "common.pt")
    load_distributed_checkpoint(fresh_model, tmp_path / "same")
    assert parameter_mismatches(fresh_model, saved[1]) == []
    before = snapshot(fresh_model)
    with pytest.raises(ValueError, match=r"(?s)Megatron-LM.s saved args.*num_attention_heads: the checkpoint has 8"):
        load_distributed_checkpoint(fresh_model, tmp_path / "other")
    assert unchanged(fresh_model, before)
