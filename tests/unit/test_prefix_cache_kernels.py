"""Prefix caching with the step's kernels through Triton's interpreter (no torch twins), once:
the other prefix-caching tests run the twins (each kernel == its twin in its own tests)."""

import pytest

from mtp_ctrl.controllers import SamplingParams
from tests.unit.controller_fixtures import build_models, make_controller
from tests.unit.megatron_fixtures import ensure_single_process_groups
from tests.unit.megatron_fixtures import torch_twins as twin_ops
from tests.unit.prefix_cache_fixtures import SYSTEM, run_staggered


@pytest.fixture(scope="module")
def models():
    ensure_single_process_groups()
    return build_models()


def test_interpreted_kernels_on_equals_off(models, model_twins):
    """The same with the step's kernels through Triton's interpreter (the model's attention, rope
    and sampling on their twins): a hit's first chunk starts past the cached blocks in
    prepare_step_inputs and the MTP window kernels."""
    model, _ = models
    prompts = [SYSTEM[:10] + [1], SYSTEM[:10] + [2, 3]]
    params = [SamplingParams(max_new_tokens=1)] * 2
    with twin_ops():  # the reference run through the twins
        off = run_staggered(make_controller(model, 2, prefix_caching=False), prompts, params, stagger=2)
    controller = make_controller(model, 2, prefix_caching=True, max_requests=1)
    assert run_staggered(controller, prompts, params, stagger=2) == off
    assert controller.metrics.as_dict()["prefix_cache"]["hit_tokens"] == 8
