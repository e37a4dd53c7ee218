"""Token sampling with no host sync: greedy, temperature, top-k, top-p, per-request seeds.

Sampling is Gumbel-max with counter-based noise: the noise for vocabulary entry v when sampling
the token at position p of a request with seed s is a fixed hash of (s, p, v). So a token depends
only on the logits, the seed and its position, never on the batch, the step, or how many drafts
were verified with it. Two consequences:

- Speculative decoding reproduces plain decoding exactly for the same seeds (the target's sample
  at position p is the same draw in both), so acceptance by exact match is lossless, and each
  sampled token follows softmax(logits / temperature) restricted by top-k/top-p.
- Every tensor-parallel rank computes the same tokens from the same (gathered) logits; no
  broadcast is needed.

Example: argmax(logits / T + G) with G ~ Gumbel(0, 1) i.i.d. is a draw from softmax(logits / T).

The work is one op, :func:`mtp_ctrl.triton_ops.sample_tokens`: a Triton kernel on CUDA (no sort
of the vocabulary) and its torch twin on CPU. The exact rule (ties at the top-k value are kept;
the nucleus is the smallest set of top tokens whose mass reaches top_p, tied tokens kept
together, and it always holds the top token, so a tiny top_p samples greedily) is written in
:mod:`mtp_ctrl.triton_ops.reference.sampling`.
"""

from typing import Optional

import torch

from mtp_ctrl import triton_ops
from mtp_ctrl.triton_ops.reference.sampling import GREEDY_TEMPERATURE, filter_top_k_top_p, gumbel_noise

__all__ = ["GREEDY_TEMPERATURE", "filter_top_k_top_p", "gumbel_noise", "sample_tokens"]


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    all_greedy: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Sample one token per row.

    logits: [R, V] float; temperature: [R] float32 (below GREEDY_TEMPERATURE = greedy row); top_k: [R] int64
    (0 = off); top_p: [R] float32 (1 = off); seeds: [R] int64; positions: [R] int64, the position the
    sampled token will occupy. all_greedy: a host-side flag (from the requests' SamplingParams, not
    from tensor values) that skips the sampling path when no row samples. out: optional [R] int64
    written in place. Returns [R] int64.
    """
    return triton_ops.sample_tokens(logits, temperature, top_k, top_p, seeds, positions, all_greedy, out)
