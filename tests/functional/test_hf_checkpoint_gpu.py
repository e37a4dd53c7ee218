"""load_hf_checkpoint on CUDA: parameters allocated on the GPU and filled from the mapped files; the
paged model's logits (decoder and MiMo MTP depths) == transformers' / the plain-torch MTP step on
the same device (fp32), and bf16 loads."""

import pytest
import torch

pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from mtp_ctrl.models import PagedGPTRunner, count_kv_layers, load_hf_checkpoint  # noqa: E402
from tests.unit import hf_fixtures  # noqa: E402
from tests.unit.megatron_fixtures import (  # noqa: E402
    NUM_BLOCKS,
    allocate_kv_caches,
    ensure_single_process_groups,
    random_sequences,
    run_paged_schedule,
    shifted_tokens,
)

GPU_FP32_TOL = dict(atol=1e-3, rtol=1e-3)


def test_mimo_on_cuda_matches_transformers(tmp_path):
    ensure_single_process_groups()
    trunk, mtp = hf_fixtures.write_mimo(tmp_path)
    model = load_hf_checkpoint(tmp_path, device="cuda")
    assert all(p.is_cuda for p in model.parameters())
    caches = allocate_kv_caches(count_kv_layers(model), NUM_BLOCKS, num_kv_heads_local=2, head_dim=16, device="cuda")
    sequences = [s.cuda() for s in random_sequences(seed=0)]
    decoder_logits, mtp_logits = run_paged_schedule(PagedGPTRunner(model), sequences, caches, device="cuda")
    trunk = trunk.cuda()
    mtp = {name: tensor.cuda() for name, tensor in mtp.items()}
    with torch.no_grad():
        for b, tokens in enumerate(sequences):
            torch.testing.assert_close(decoder_logits[b], trunk(tokens[None]).logits[0], **GPU_FP32_TOL)
            hidden = trunk.model(tokens[None]).last_hidden_state[0]
            for depth in range(hf_fixtures.MIMO_MTP_DEPTH):
                expected, hidden = hf_fixtures.mimo_mtp_reference(mtp, depth, hidden, shifted_tokens(tokens, depth + 1),
                                                                  trunk.model.embed_tokens.weight, trunk.lm_head.weight)
                torch.testing.assert_close(mtp_logits[depth][b], expected, **GPU_FP32_TOL)
    bf16 = load_hf_checkpoint(tmp_path, device="cuda", dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
