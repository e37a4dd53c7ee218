"""EngineShape: the one owner of the engine's sizes. Bad sizes fail naming the field; the derived
sizes have known answers; InferenceConfig makes one with the model's facts."""

import pytest
import torch

from mtp_ctrl.controllers import InferenceConfig
from mtp_ctrl.state import EngineShape

SIZES = dict(max_requests=4, max_model_len=32, block_size_tokens=4, num_speculative_tokens=2, max_tokens_per_step=12)


@pytest.mark.parametrize("field, value", [("max_requests", 0), ("max_model_len", True), ("block_size_tokens", 2.0),
                                          ("num_speculative_tokens", -1), ("decode_steps_per_launch", 0),
                                          ("vocab_size", 0)])
def test_bad_sizes_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineShape(**{**SIZES, field: value})


def test_tokens_per_step_must_hold_every_decode_row():
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        EngineShape(**{**SIZES, "max_tokens_per_step": 11})  # 4 requests x (1 + 2) rows = 12


def test_kv_dtype_must_be_a_dtype():
    with pytest.raises(TypeError, match="kv_dtype"):
        EngineShape(**SIZES, kv_dtype="bfloat16")


def test_derived_sizes():
    shape = EngineShape(**SIZES)
    assert shape.stride == 3
    assert shape.max_blocks_per_request == 10  # ceil((32 + 2 x 3) / 4): a step run past the stop in flight
    assert shape.device == torch.device("cpu")


def test_inference_config_makes_the_shape():
    config = InferenceConfig(num_speculative_tokens=2, max_requests=4, block_size_tokens=4, max_model_len=32,
                             max_tokens_per_step=12, decode_steps_per_launch=2)
    shape = config.engine_shape(vocab_size=100, device="cpu", kv_dtype=torch.bfloat16)
    assert shape == EngineShape(**SIZES, decode_steps_per_launch=2, vocab_size=100, kv_dtype=torch.bfloat16)
