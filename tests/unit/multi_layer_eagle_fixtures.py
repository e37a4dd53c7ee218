"""Fixtures of the multi-layer EAGLE tests: random draft layers for the EAGLE tests' target (whose
greedy tokens come from a small set, so random drafts are often accepted), their dense twin, and
the dense oracle of the drafts."""

from typing import List, Sequence

import torch

from mtp_ctrl.controllers import MultiLayerEagleProposer
from mtp_ctrl.models import build_multi_layer_eagle_heads, dense_multi_layer_eagle_forward
from mtp_ctrl.models.eagle_head import eagle_logits
from tests.unit.eagle_fixtures import AUX_LAYERS, dense_aux, recording


def build_heads(model, dense, num_layers: int, seed: int = 5):
    """(paged heads, dense heads or None), same random weights."""
    torch.manual_seed(seed)
    heads = build_multi_layer_eagle_heads(model, num_layers, AUX_LAYERS).eval()
    if dense is None:
        return heads, None
    dense_heads = build_multi_layer_eagle_heads(dense, num_layers, AUX_LAYERS, dense=True).eval()
    dense_heads.load_state_dict(heads.state_dict())
    return heads, dense_heads


RecordingMultiLayerEagleProposer = recording(MultiLayerEagleProposer)


@torch.no_grad()
def dense_multi_layer_drafts(dense, dense_heads, tokens: Sequence[int]) -> List[int]:
    """Greedy drafts after ``tokens`` = ``t_0 .. t_e``: layer k over positions ``[0, e)`` reads
    ``t_{p+k}``, the drafts ``d_1 .. d_{k-1}`` past ``t_e``; ``d_k`` is its argmax at ``e - 1``."""
    tokens = torch.tensor(tokens, dtype=torch.int64)
    num_layers, length = dense_heads.num_layers, tokens.shape[0] - 1  # e
    features = dense_heads.project_aux(dense_aux(dense, tokens[:-1]))[:, None]  # [e, 1, H]
    drafts: List[int] = []
    for depth in range(num_layers):
        padding = torch.zeros(num_layers - 1 - len(drafts), dtype=torch.int64)  # never read by layers <= depth + 1
        next_tokens = torch.cat([tokens[1:], torch.tensor(drafts, dtype=torch.int64), padding])[None]  # [1, e + S - 1]
        outputs = dense_multi_layer_eagle_forward(dense, dense_heads, features, next_tokens)
        drafts.append(int(eagle_logits(dense, outputs[depth][length - 1:])[0, 0].argmax()))
    return drafts
