"""Multi-layer EAGLE: S separate draft layers for a frozen target GPT; layer k drafts token k.

Each draft layer is an :class:`~mtp_ctrl.models.EagleHead` (enorm, hnorm, ``eh_proj`` and one
transformer layer of the target's layer spec, with its own paged KV cache when serving). Layer 1
reads ``fc`` of the target's aux hidden states, as the single EAGLE head does; layer ``k > 1``
reads layer ``k - 1``'s output at the same position, and the token one further on (the layers
chain like megatron's MTP depths)::

    h^0_p = fc(cat(aux_0[p], .., aux_{m-1}[p]))                  (only layer 1 has an fc)
    h^k_p = layer_k(eh_proj_k(cat(enorm_k(embed(t_{p+k})), hnorm_k(h^{k-1}_p))))  predicts t_{p+k+1}

Drafting after the bonus token ``t_e``: every layer reads position ``e - 1``; layer 1 reads
``t_e`` and drafts ``d_1``, layer k reads ``d_{k-1}`` and ``h^{k-1}_{e-1}`` and drafts ``d_k``.
Unlike the single head applied S times, each draft comes from a layer trained for that depth,
and training has no train/serve gap: layer k sees the true ``t_{p+k}`` in training and the
draft ``d_{k-1}`` when serving, which is the same token whenever the earlier drafts are right.

The window (why the proposer keeps earlier verified rows): layer k's cache entry at ``p``
depends on ``t_{p+1} .. t_{p+k}``, so it is final only once ``t_{p+k}`` is verified. Entries
built from drafts (or, at a chunk's end, from tokens not yet known) must be rewritten once the
tokens are known, which reaches back ``S - 1`` positions before a step's first row. So each
step every layer runs over a window of ``max(q, S) + S - 1`` positions (``q``: the request's
rows this step; ``2S`` for a decode), ending at ``e - 1``, clipped at position 0. Its rows
before the step's first row come from a per-request cache of the last ``2S - 1`` verified
rows' tokens, positions and ``h^0`` (see
:class:`~mtp_ctrl.controllers.MultiLayerEagleProposer`).

``dense=True`` builds the training twin (causal SDPA attention over whole sequences, same
parameter names); :func:`dense_multi_layer_eagle_forward` runs it.
"""

from typing import List, Optional, Sequence

import torch
from megatron.core.models.gpt import GPTModel

from mtp_ctrl.models.eagle_head import EagleHead, build_eagle_head, dense_eagle_forward


class MultiLayerEagleHeads(torch.nn.Module):
    """``layers``: S :class:`EagleHead` draft layers; only ``layers[0]`` keeps its ``fc``."""

    def __init__(self, layers: Sequence[EagleHead]):
        super().__init__()
        layers = list(layers)
        if not layers or not all(isinstance(layer, EagleHead) for layer in layers):
            raise TypeError("layers must be a non-empty sequence of EagleHead (mtp_ctrl.models.build_eagle_head)")
        if len({layer.aux_layer_ids for layer in layers}) != 1:
            raise ValueError("every draft layer must be built for the same aux_layer_ids")
        self.layers = torch.nn.ModuleList(layers)
        for layer in self.layers[1:]:
            layer.fc = None  # layers 2..S read the previous layer's output, not the aux states

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def aux_layer_ids(self) -> tuple:
        return self.layers[0].aux_layer_ids

    @property
    def config(self):
        return self.layers[0].config

    def project_aux(self, aux_hidden: torch.Tensor) -> torch.Tensor:  # [..., m * H] -> [..., H]
        """``h^0``: layer 1's ``fc`` of the concatenated aux hidden states."""
        return self.layers[0].project_aux(aux_hidden)


def build_multi_layer_eagle_heads(target_model: GPTModel, num_layers: int,
                                  aux_layer_ids: Optional[Sequence[int]] = None, *, dense: bool = False,
                                  use_transformer_engine: Optional[bool] = None) -> MultiLayerEagleHeads:
    """``num_layers`` draft layers for ``target_model`` (same config, dtype, device and TP size);
    serve them with ``num_speculative_tokens == num_layers``. ``aux_layer_ids`` default:
    :func:`~mtp_ctrl.models.default_aux_layer_ids`. ``dense=True``: the training twin."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
    layers = [build_eagle_head(target_model, aux_layer_ids, dense=dense, use_transformer_engine=use_transformer_engine)
              for _ in range(num_layers)]
    return MultiLayerEagleHeads(layers)


def dense_multi_layer_eagle_forward(target_model: GPTModel, heads: MultiLayerEagleHeads, features: torch.Tensor,
                                    next_tokens: torch.Tensor) -> List[torch.Tensor]:
    """All layers of dense heads over whole sequences from position 0.

    ``features`` ``[s, b, H]``: ``h^0`` (``heads.project_aux`` of the aux states) at positions
    ``0 .. s - 1``; ``next_tokens`` ``[b, >= s + S - 1]`` int64 with ``next_tokens[:, j] = t_{j+1}``.
    Returns S outputs ``[s, b, H]``: layer k's (1-based) at row p reads ``t_{p+k}`` and predicts
    ``t_{p+k+1}``; apply :func:`~mtp_ctrl.models.eagle_head.eagle_logits` for logits."""
    seq_len, num_layers = features.shape[0], heads.num_layers
    if next_tokens.dim() != 2 or next_tokens.shape[1] < seq_len + num_layers - 1:
        raise ValueError(f"next_tokens must be [b, >= {seq_len + num_layers - 1}] (s + S - 1), "
                         f"got {tuple(next_tokens.shape)}")
    outputs = []
    for depth, layer in enumerate(heads.layers):
        features = dense_eagle_forward(target_model, layer, features, next_tokens[:, depth: depth + seq_len])
        outputs.append(features)
    return outputs
