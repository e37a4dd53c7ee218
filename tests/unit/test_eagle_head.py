"""The runner's aux hidden states and the EAGLE head: paged (chunked, through the head's own
KV cache) equals dense (whole sequence, causal SDPA), and bad layer ids raise."""

import pytest
import torch

from mtp_ctrl.models import PagedGPTRunner, build_eagle_head
from mtp_ctrl.models.eagle_head import dense_eagle_forward, eagle_logits
from tests.unit.eagle_fixtures import dense_aux
from tests.unit.megatron_fixtures import (
    BLOCK_TABLES, NUM_BLOCKS, SCHEDULE, allocate_kv_caches, build_dense_twin, build_tiny_model,
    ensure_single_process_groups, make_metadata, random_sequences, tiny_config,
)

AUX_LAYERS = (1, 0)  # any order: fc reads them as given


@pytest.fixture(scope="module")
def models():
    ensure_single_process_groups()
    config = tiny_config(mtp_num_layers=1)
    model = build_tiny_model(config)
    dense = build_dense_twin(config, model)
    torch.manual_seed(5)
    head = build_eagle_head(model, AUX_LAYERS).eval()
    dense_head = build_eagle_head(dense, AUX_LAYERS, dense=True).eval()
    dense_head.load_state_dict(head.state_dict())
    return model, dense, head, dense_head


@torch.no_grad()
def test_aux_hidden_and_paged_head_match_dense(models):
    model, dense, head, dense_head = models
    runner = PagedGPTRunner(model)
    runner.set_aux_layers(AUX_LAYERS)
    sequences = random_sequences(seed=3)
    kv_caches = allocate_kv_caches(runner.num_kv_layers, NUM_BLOCKS, 2, 16)
    head_cache = allocate_kv_caches(1, NUM_BLOCKS, 2, 16)
    aux_rows = [[] for _ in sequences]
    logits_rows = [[] for _ in sequences]
    for chunks in SCHEDULE:
        metadata = make_metadata(BLOCK_TABLES, chunks)
        token_ids = torch.cat([sequences[b][start:start + q] for b, (start, q) in enumerate(chunks)])
        runner.forward(token_ids, metadata.positions, metadata, kv_caches)
        aux = runner.aux_hidden  # [T, 2H]
        next_ids = torch.cat([torch.cat([sequences[b], sequences[b][:1]])[start + 1:start + q + 1]
                              for b, (start, q) in enumerate(chunks)])
        logits, _ = runner.eagle_forward(head, head.project_aux(aux), next_ids, metadata.positions, metadata, head_cache)
        row = 0
        for b, (_, q) in enumerate(chunks):
            aux_rows[b].append(aux[row:row + q])
            logits_rows[b].append(logits[row:row + q])
            row += q
    for b, tokens in enumerate(sequences):
        want_aux = dense_aux(dense, tokens, AUX_LAYERS)
        torch.testing.assert_close(torch.cat(aux_rows[b]), want_aux, rtol=1e-4, atol=1e-4)
        next_tokens = torch.cat([tokens[1:], tokens[:1]])[None]  # [1, n]
        out = dense_eagle_forward(dense, dense_head, dense_head.project_aux(want_aux)[:, None], next_tokens)
        torch.testing.assert_close(torch.cat(logits_rows[b]), eagle_logits(dense, out)[:, 0], rtol=1e-4, atol=1e-4)
    runner.set_aux_layers(())
    runner.forward(token_ids, metadata.positions, metadata, kv_caches)
    assert runner.aux_hidden is None


@pytest.mark.parametrize("bad, error", [((), ValueError), ((0, 2), ValueError), ((1, 1), ValueError),
                                        ((-1,), ValueError), ((0.5,), ValueError), ("01", TypeError)])
def test_bad_aux_layer_ids(models, bad, error):
    model = models[0]
    with pytest.raises(error, match="aux_layer_ids"):
        build_eagle_head(model, bad)
    runner = PagedGPTRunner(model)
    if bad != ():
        with pytest.raises(error, match="aux_layer_ids"):
            runner.set_aux_layers(bad)
    assert runner.aux_layer_ids == ()
