"""InferenceConfig and SamplingParams reject bad values on construction, naming the field."""

import pytest
import torch

from mtp_ctrl.controllers.config import InferenceConfig, SamplingParams


@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        (dict(num_speculative_tokens=-1), ValueError, "num_speculative_tokens"),
        (dict(num_speculative_tokens=1.5), TypeError, "num_speculative_tokens"),
        (dict(max_requests=0), ValueError, "max_requests"),
        (dict(block_size_tokens=0), ValueError, "block_size_tokens"),
        (dict(max_model_len=1), ValueError, "max_model_len"),
        (dict(num_kv_blocks=4, kv_cache_bytes=1024), ValueError, "num_kv_blocks"),
        (dict(num_kv_blocks=0), ValueError, "num_kv_blocks"),
        (dict(max_tokens_per_step=15, max_requests=8, num_speculative_tokens=1), ValueError, "max_tokens_per_step"),
        (dict(cuda_graph_batch_sizes=(4, 2)), ValueError, "cuda_graph_batch_sizes"),
        (dict(cuda_graph_batch_sizes=(1, 128), max_requests=2, max_tokens_per_step=64), ValueError, "cuda_graph_batch_sizes"),
        (dict(mtp_attention="full"), ValueError, "mtp_attention"),
        (dict(cuda_graph_batch_sizes=4), TypeError, "cuda_graph_batch_sizes"),
        (dict(cuda_graph_token_counts=(128, 64)), ValueError, "cuda_graph_token_counts"),
        (dict(cuda_graph_token_counts=(64, 512)), ValueError, "cuda_graph_token_counts"),
        (dict(cuda_graph_token_counts=128), TypeError, "cuda_graph_token_counts"),
        (dict(cuda_graph_batch_sizes=None), TypeError, "cuda_graph_batch_sizes"),
        (dict(cuda_graph_batch_sizes={1, 2}), TypeError, "cuda_graph_batch_sizes"),
        (dict(cuda_graph_batch_sizes="12"), TypeError, "cuda_graph_batch_sizes"),
        (dict(cuda_graph_batch_sizes=(1, 2.0)), TypeError, "cuda_graph_batch_sizes"),
    ],
)
def test_inference_config_rejects(kwargs, error, field):
    with pytest.raises(error, match=field):
        InferenceConfig(**kwargs)


def test_inference_config_defaults_and_normalisation():
    config = InferenceConfig(num_speculative_tokens=2, cuda_graph_batch_sizes=[1, 2, 4])
    assert config.cuda_graph_batch_sizes == (1, 2, 4)


@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(temperature=-0.1), ValueError, "temperature"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(temperature="hot"), TypeError, "temperature"),
        (dict(top_k=-1), ValueError, "top_k"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(seed=-3), ValueError, "seed"),
        (dict(seed=2**63), ValueError, "seed"),
        (dict(top_k=2**63), ValueError, "top_k"),
        (dict(temperature=float("inf")), ValueError, "temperature"),
        (dict(eos_token_ids=(-1,)), ValueError, "eos_token_ids"),
        (dict(stop_sequences=((),)), ValueError, "stop_sequences"),
        (dict(stop_sequences=((1, -2),)), ValueError, "stop_sequences"),
        # values must fit the device rows they are written into (float32 / int64)
        (dict(temperature=1e39), ValueError, "temperature"),
        (dict(temperature=3.5e38), ValueError, "temperature"),
        (dict(temperature=10**400), ValueError, "temperature"),  # too large even for a double
        (dict(top_p=10**400), ValueError, "top_p"),
        (dict(eos_token_ids=(2**63,)), ValueError, "eos_token_ids"),
        (dict(stop_sequences=((1, 2**63),)), ValueError, "stop_sequences"),
        # containers: a bare int, None, an unordered set, a flat sequence
        (dict(eos_token_ids=5), TypeError, "eos_token_ids"),
        (dict(eos_token_ids=None), TypeError, "eos_token_ids"),
        (dict(eos_token_ids={1, 2}), TypeError, "eos_token_ids"),
        (dict(eos_token_ids="2"), TypeError, "eos_token_ids"),
        (dict(eos_token_ids=(True,)), TypeError, "eos_token_ids"),
        (dict(stop_sequences=(1, 2)), TypeError, "stop_sequences"),
        (dict(stop_sequences=None), TypeError, "stop_sequences"),
        (dict(stop_sequences=[{1, 2}]), TypeError, "stop_sequences"),
        (dict(stop_sequences=["ab"]), TypeError, "stop_sequences"),
        (dict(stop_sequences=((1.0, 2),)), TypeError, "stop_sequences"),
    ],
)
def test_sampling_params_rejects(kwargs, error, field):
    with pytest.raises(error, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_vocabulary_check():
    params = SamplingParams(eos_token_ids=[3], stop_sequences=[[1, 2]], temperature=1)
    assert params.eos_token_ids == (3,) and params.stop_sequences == ((1, 2),) and not params.greedy
    params.check_vocab(4)
    with pytest.raises(ValueError, match="eos_token_ids"):
        params.check_vocab(3)
    with pytest.raises(ValueError, match="stop_sequences"):
        SamplingParams(stop_sequences=[[9]]).check_vocab(5)


def test_sampling_params_accepts_the_edges_of_the_device_dtypes():
    # the largest float32 temperature and int64 ids are stored exactly as given
    params = SamplingParams(temperature=3.4028234663852886e38, eos_token_ids=range(2**63 - 2, 2**63),
                            stop_sequences=[range(3), (2**63 - 1,)], top_k=2**63 - 1, seed=2**63 - 1)
    assert params.temperature == 3.4028234663852886e38 and params.eos_token_ids == (2**63 - 2, 2**63 - 1)
    assert params.stop_sequences == ((0, 1, 2), (2**63 - 1,))
    assert torch.tensor([params.temperature], dtype=torch.float32).isfinite().all()
    assert SamplingParams(temperature=2).temperature == 2.0 and SamplingParams(top_p=1).top_p == 1.0


def test_inference_config_accepts_lists_and_ranges_of_buckets():
    assert InferenceConfig(cuda_graph_batch_sizes=range(1, 4)).cuda_graph_batch_sizes == (1, 2, 3)
    assert InferenceConfig(cuda_graph_batch_sizes=[]).cuda_graph_batch_sizes == ()
