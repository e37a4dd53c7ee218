"""One MTP layer drafting several tokens (Qwen3-Next ships one): ``mtp_reuse_last_layer`` runs the
model's last MTP layer for the deeper depths, each with a KV cache of its own. On a Gated DeltaNet
hybrid with 1 MTP layer: S = 2 and 3 == plain under arrivals, preemption and seeded sampling; the
drafts equal those of a 2-layer model whose second layer is a copy of the first (so a reused depth
is exactly a depth of its own); without the flag S > 1 is refused."""

import pytest
import torch

from mtp_ctrl.controllers import MTPProposer, SamplingParams
from tests.unit.controller_fixtures import PROMPTS, make_controller, run_with_arrivals
from tests.unit.gdn_fixtures import build_gdn_model
from tests.unit.megatron_fixtures import ensure_single_process_groups
from tests.unit.megatron_fixtures import torch_twins as twin_ops
from tests.unit.test_controller_gdn import CONFIG, _arrivals, _assert_released


@pytest.fixture(scope="module")
def model():
    ensure_single_process_groups()
    return build_gdn_model(mtp_num_layers=1)


@pytest.fixture(scope="module")
def plain_outputs(model):
    with twin_ops():
        return {sampled: run_with_arrivals(make_controller(model, 0, **CONFIG), _arrivals(sampled))
                for sampled in (False, True)}


@pytest.mark.parametrize("num_speculative_tokens, sampled", [(2, False), (3, False), (3, True)],
                         ids=["greedy-2", "greedy-3", "sampled-3"])
def test_one_layer_drafts_several_tokens_losslessly(model, plain_outputs, num_speculative_tokens, sampled,
                                                    torch_twins):
    controller = make_controller(model, num_speculative_tokens, mtp_reuse_last_layer=True, **CONFIG)
    assert run_with_arrivals(controller, _arrivals(sampled)) == plain_outputs[sampled]
    assert controller.metrics.as_dict()["num_speculative_tokens"] == num_speculative_tokens
    _assert_released(controller)


def test_preempted_requests_with_a_reused_layer(model, torch_twins):
    params = [SamplingParams(max_new_tokens=9)] * len(PROMPTS)
    plain = make_controller(model, 0, max_model_len=22).generate(list(PROMPTS), params)
    controller = make_controller(model, 3, max_model_len=22, num_kv_blocks=12, mtp_reuse_last_layer=True,
                                 prefix_caching=False)  # the subject is preemption: shared blocks would avoid it
    results = controller.generate(list(PROMPTS), params)
    assert [r.output_tokens for r in results] == [r.output_tokens for r in plain]
    assert max(result.preemptions for result in results) >= 1


class RecordingMTP(MTPProposer):
    """The MTP proposer, recording every step's drafts ``[G, S]``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drafts = []

    def propose(self, batch):
        drafts = super().propose(batch)
        self.drafts.append(drafts.clone())
        return drafts


def test_a_reused_depth_drafts_as_a_copied_layer_would(model, torch_twins):
    twin = build_gdn_model(mtp_num_layers=2)
    ours = model.state_dict()
    twin.load_state_dict({name: ours[name.replace("mtp.layers.1.", "mtp.layers.0.")]
                          for name in twin.state_dict()})
    params = SamplingParams(max_new_tokens=7)
    reused, copied = RecordingMTP(reuse_last_layer=True), RecordingMTP()
    outputs = [make_controller(m, 2, proposer=p, **CONFIG).generate(list(PROMPTS), params)
               for m, p in ((model, reused), (twin, copied))]
    assert [r.output_tokens for r in outputs[0]] == [r.output_tokens for r in outputs[1]]
    assert len(reused.drafts) == len(copied.drafts) > 3
    for ours_step, copied_step in zip(reused.drafts, copied.drafts):
        assert torch.equal(ours_step, copied_step)


def test_more_depths_than_layers_need_the_flag(model):
    with pytest.raises(ValueError, match="MTP depth"):
        make_controller(model, 2)
    with pytest.raises(TypeError, match="reuse_last_layer"):
        MTPProposer(reuse_last_layer=1)
    with pytest.raises(TypeError, match="mtp_reuse_last_layer"):
        make_controller(model, 2, mtp_reuse_last_layer="yes")
