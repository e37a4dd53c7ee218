"""Random cases of ``rejection_sample``: probabilities with exact zeros, rows without a draft,
garbage drafts of padding rows, greedy rows among sampled ones."""

import torch


def _random_probs(num_rows, vocab_size, gen, zeros):
    """[K, V] float32 rows summing to 1, with about ``zeros`` of the entries exactly 0 (as top-k/top-p give)."""
    logits = torch.randn(num_rows, vocab_size, generator=gen) * torch.empty(num_rows, 1).uniform_(0.2, 4.0, generator=gen)
    logits[torch.rand(num_rows, vocab_size, generator=gen) < zeros] = float("-inf")
    logits[:, 0] = logits[:, 0].clamp(min=-30.0)  # at least one entry survives per row
    return logits.softmax(-1)


def make_case(num_rows, vocab_size, seed, with_q=True, zeros=0.3, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    p = _random_probs(num_rows, vocab_size, gen, zeros)
    q = _random_probs(num_rows, vocab_size, gen, zeros)
    drafts = torch.randint(0, vocab_size, (num_rows,), generator=gen)
    drafts[torch.rand(num_rows, generator=gen) < 0.2] = -1  # rows without a draft (bonus, prefill, padding)
    drafts[torch.rand(num_rows, generator=gen) < 0.1] = vocab_size + 3  # garbage of a padding row
    temperature = torch.empty(num_rows).uniform_(0.3, 2.0, generator=gen)
    temperature[torch.rand(num_rows, generator=gen) < 0.25] = 0.0  # greedy rows
    return dict(
        target_probs=p.to(dtype), draft_probs=q.to(dtype) if with_q else None, draft_tokens=drafts,
        target_tokens=torch.randint(0, vocab_size, (num_rows,), generator=gen), temperature=temperature,
        seeds=torch.randint(0, 2**62, (num_rows,), generator=gen), positions=torch.randint(0, 2**20, (num_rows,), generator=gen),
        draft_indices=torch.randint(0, 4, (num_rows,), generator=gen))
