"""Random cases of ``rejection_sample``: a step's logits rows (decode requests' ``S + 1`` rows
first, then rows without a draft), logits with -inf entries, per-slot top-k / top-p, masked (-1)
and garbage drafts, greedy requests among sampled ones."""

import torch

ARG_ORDER = ("logits", "draft_logits", "input_tokens", "target_tokens", "row_slots", "positions", "num_decode",
             "num_speculative_tokens", "temperature", "top_k", "top_p", "seeds")


def random_logits(shape, gen, zeros):
    """Logits of ``shape`` (last dim V) with about ``zeros`` of the entries -inf, at least one finite
    per row, at a random scale per row."""
    logits = torch.randn(*shape, generator=gen) * torch.empty(*shape[:-1], 1).uniform_(0.2, 4.0, generator=gen)
    logits[torch.rand(*shape, generator=gen) < zeros] = float("-inf")
    logits[..., 0] = logits[..., 0].clamp(min=-30.0)
    return logits


def make_case(num_decode, num_other, S, vocab_size, seed, with_q=True, zeros=0.3, dtype=torch.float32,
              num_slots=7, filters=True):
    """A step of ``num_decode`` decode requests (``S + 1`` rows each) and ``num_other`` rows without
    a draft (prefill ends, padding), over ``num_slots`` table slots."""
    gen = torch.Generator().manual_seed(seed)
    num_rows = num_decode * (S + 1) + num_other
    inputs = torch.randint(0, vocab_size, (num_rows,), generator=gen)
    inputs[torch.rand(num_rows, generator=gen) < 0.15] = -1  # masked drafts (past a request's draft length)
    inputs[torch.rand(num_rows, generator=gen) < 0.05] = vocab_size + 3  # garbage of a padding row
    temperature = torch.empty(num_slots).uniform_(0.3, 2.0, generator=gen)
    temperature[torch.rand(num_slots, generator=gen) < 0.2] = 0.0  # greedy requests
    top_k = torch.randint(0, vocab_size + 2, (num_slots,), generator=gen) if filters else torch.zeros(num_slots)
    top_k[torch.rand(num_slots, generator=gen) < 0.4] = 0
    top_p = torch.where(torch.rand(num_slots, generator=gen) < 0.5, torch.empty(num_slots).uniform_(0.3, 1.0,
                        generator=gen), torch.ones(num_slots)) if filters else torch.ones(num_slots)
    return dict(
        logits=random_logits((num_rows, vocab_size), gen, zeros).to(dtype),
        draft_logits=random_logits((num_slots, S, vocab_size), gen, zeros).to(dtype) if with_q else None,
        input_tokens=inputs, target_tokens=torch.randint(0, vocab_size, (num_rows,), generator=gen),
        row_slots=torch.randint(0, num_slots, (num_rows,), generator=gen),
        positions=torch.randint(0, 2**20, (num_rows,), generator=gen),
        num_decode=torch.tensor([num_decode]), num_speculative_tokens=S, temperature=temperature,
        top_k=top_k.to(torch.int64), top_p=top_p, seeds=torch.randint(0, 2**62, (num_slots,), generator=gen))


def args_of(case, device=None):
    """The op's positional arguments, moved to ``device`` when given."""
    def move(value):
        return value.to(device) if device is not None and isinstance(value, torch.Tensor) else value
    return [move(case[name]) for name in ARG_ORDER]
