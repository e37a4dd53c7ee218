"""PagedMambaMixer == megatron-core's own MambaMixer (mamba_ssm + causal_conv1d kernels) on CUDA.

Both hold the same parameters (same names and shapes); megatron's mixer runs one whole sequence
through its fused training-path kernels, ours runs it as a prefill chunk, then decode rows
(1 + S per step, committed after the last accepted row), then another prefill chunk, and every
output row must equal megatron's row at the same position. Skipped without the kernels.
"""

import pytest
import torch

pytest.importorskip("mamba_ssm")
pytest.importorskip("causal_conv1d")

from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules  # noqa: E402
from megatron.core.tensor_parallel import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
    model_parallel_cuda_manual_seed,
)

from mtp_ctrl.triton_ops import mamba_state_selective_copy  # noqa: E402
from tests.unit.hybrid_fixtures import hybrid_config  # noqa: E402
from tests.unit.test_mamba_reference import S, make_slots, random_mixer, run_mixer  # noqa: E402

# megatron's chunked scan uses tl.dot, which may run fp32 inputs as TF32
TOLERANCE = dict(rtol=5e-3, atol=5e-3)


def _megatron_twin(ours):
    config = hybrid_config()
    model_parallel_cuda_manual_seed(123)  # MambaMixer builds its conv1d under the CUDA RNG tracker
    theirs = MambaMixer(config, MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
                        d_model=config.hidden_size, d_conv=ours.d_conv, layer_number=1,
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups()).cuda().eval()
    ours_params = dict(ours.named_parameters())
    theirs_params = dict(theirs.named_parameters())
    assert set(theirs_params) == set(ours_params)  # same names
    with torch.no_grad():
        for name, param in theirs_params.items():
            assert param.shape == ours_params[name].shape, name  # same shapes
            param.copy_(ours_params[name])
    return theirs


@pytest.mark.parametrize("accepted", [0, S])
def test_prefill_decode_commit_prefill_equals_megatrons_mixer(accepted):
    ours = random_mixer(chunk_size=4).cuda()
    theirs = _megatron_twin(ours)
    hidden = torch.randn(7 + 1 + S + 6, 64, generator=torch.Generator().manual_seed(accepted)).cuda()
    with torch.no_grad():
        want, bias = theirs(hidden[:, None])  # [T, 1, hidden], the whole sequence at once
    assert bias is None
    want = want[:, 0]

    slots = make_slots(ours, 2, device="cuda")
    prefill = run_mixer(ours, slots, hidden[:7], prefill=((0, 7, 1),))
    verify = run_mixer(ours, slots, hidden[7 : 8 + S], decode_slots=(1,))
    for intermediate, current in (("intermediate_conv_states", "conv_states"),
                                  ("intermediate_ssm_states", "ssm_states")):
        mamba_state_selective_copy(slots[intermediate], slots[current], torch.zeros(1, dtype=torch.int64, device="cuda"),
                                   torch.tensor([1], device="cuda"), torch.tensor([accepted], device="cuda"), 1)
    resume = 8 + accepted  # the row after the last accepted one
    rest = run_mixer(ours, slots, hidden[resume:], prefill=((0, hidden.shape[0] - resume, 1),))
    torch.testing.assert_close(prefill, want[:7], **TOLERANCE)
    torch.testing.assert_close(verify, want[7 : 8 + S], **TOLERANCE)
    torch.testing.assert_close(rest, want[resume:], **TOLERANCE)
