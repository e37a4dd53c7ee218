"""Random sampling cases and the pre-kernel sort-based sampler, kept as an independent oracle."""

import torch

from mtp_ctrl.triton_ops.reference.sampling import GREEDY_TEMPERATURE, gumbel_noise

TEMPERATURES = [0.0, 1e-6, 1e-5, 0.3, 0.7, 1.0, 2.0, 1e4, 1e30]
TOP_PS = [1.0, 1.0, 1e-46, 1e-6, 0.3, 0.5, 0.9, 0.999]


def make_case(num_rows, vocab_size, seed, ties=False, neg_inf=False, dtype=torch.float32):
    """Keyword arguments of ``sample_tokens`` for ``num_rows`` random rows of ``vocab_size`` logits."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.empty(num_rows, 1).uniform_(0.1, 8.0, generator=gen)
    logits = torch.randn(num_rows, vocab_size, generator=gen) * scale  # [R, V] float32
    if ties:  # few distinct values: exact ties at the max, the k-th value and the top-p boundary
        logits = logits.round()
    if neg_inf:
        logits[torch.rand(num_rows, vocab_size, generator=gen) < 0.3] = float("-inf")
        logits[: num_rows // 4] = float("-inf")  # whole rows of -inf too
    pick = lambda options: torch.tensor(options)[torch.randint(len(options), (num_rows,), generator=gen)]  # noqa: E731
    top_k_options = [0, 0, 1, 2, 3, vocab_size - 1, vocab_size, vocab_size + 5, -1]
    return dict(
        logits=logits.to(dtype),
        temperature=pick(TEMPERATURES).float(),  # [R] float32
        top_k=pick(top_k_options).long(),  # [R] int64
        top_p=pick(TOP_PS).float(),  # [R] float32
        seeds=torch.randint(0, 2**40, (num_rows,), generator=gen),  # [R] int64, high halves used too
        positions=torch.randint(0, 2**20, (num_rows,), generator=gen),  # [R] int64
    )


def old_filter_top_k_top_p(scaled_logits, top_k, top_p):
    """The sort-based filter sample_tokens used before the kernel (top-p cut by sorted cumsum)."""
    vocab_size = scaled_logits.shape[-1]
    sorted_logits, sorted_ids = scaled_logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), torch.full_like(top_k, vocab_size))
    kth_value = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    outside_nucleus = (mass_before >= top_p.unsqueeze(1)) & (top_p.unsqueeze(1) < 1.0)
    sorted_logits = sorted_logits.masked_fill(outside_nucleus, float("-inf"))
    return torch.full_like(scaled_logits, float("-inf")).scatter(1, sorted_ids, sorted_logits)


def old_sample_tokens(logits, temperature, top_k, top_p, seeds, positions):
    """The sort-based sampler before the kernel (same noise); top_p = 1e-46 masks every token."""
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    is_greedy = temperature < GREEDY_TEMPERATURE
    safe_temperature = torch.where(is_greedy, torch.ones_like(temperature), temperature)
    scaled = old_filter_top_k_top_p(logits / safe_temperature.unsqueeze(1), top_k, top_p)
    sampled_tokens = (scaled + gumbel_noise(seeds, positions, logits.shape[-1])).argmax(dim=-1)
    return torch.where(is_greedy, greedy_tokens, sampled_tokens)
