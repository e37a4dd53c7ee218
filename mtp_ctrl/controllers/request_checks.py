"""Validation of what a user passes as prompts, before any state changes."""

from typing import List

import torch


def check_prompt(prompt_tokens, vocab_size: int, max_model_len: int) -> List[int]:
    """A prompt as a list of ints: a 1-D int tensor or a sequence of ints, non-empty, shorter
    than ``max_model_len`` and inside the vocabulary; ``TypeError``/``ValueError`` otherwise."""
    if isinstance(prompt_tokens, torch.Tensor):
        if prompt_tokens.dim() != 1 or prompt_tokens.dtype not in (torch.int32, torch.int64):
            raise TypeError("prompt_tokens must be a 1-D int tensor or a sequence of ints")
        prompt = prompt_tokens.tolist()  # host-ok: user input, outside the step
    elif isinstance(prompt_tokens, (list, tuple, range)):
        prompt = list(prompt_tokens)
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise TypeError("prompt_tokens must be a 1-D int tensor or a sequence of ints")
    else:
        raise TypeError(f"prompt_tokens must be a 1-D int tensor or a sequence of ints, got {type(prompt_tokens).__name__}")
    if not prompt:
        raise ValueError("prompt_tokens is empty")
    if len(prompt) >= max_model_len:
        raise ValueError(f"prompt_tokens has {len(prompt)} tokens; max_model_len ({max_model_len}) "
                         "leaves no room to generate")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(f"prompt_tokens must lie in [0, {vocab_size}) (the vocabulary)")
    return prompt


def check_prompts(prompts) -> list:
    """``generate``'s prompts: a sequence of prompts (not one flat prompt)."""
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    if any(isinstance(prompt, int) for prompt in prompts):
        raise TypeError("prompts must be a list of prompts (each a sequence of ints), not one flat list of ints")
    return list(prompts)
