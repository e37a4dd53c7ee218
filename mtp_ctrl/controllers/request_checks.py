"""Validation of what users pass as prompts, before any state is touched.

Each check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, bad value)
naming the argument, and returns the prompt in the one form the controller stores: a list of
Python ints (:func:`checked_prompt` also gives the ``[P]`` int64 array the context takes, built
once here). Prompts are user input read outside the decode step, so reading a device tensor's
values here (``tolist``) is allowed.
"""

import operator
from collections.abc import Mapping, Sequence, Set
from typing import List, Tuple

import numpy as np
import torch

# torch integer dtypes a prompt tensor may have (bool is not an integer here)
_TENSOR_INT_DTYPES = tuple(
    dtype for dtype in (getattr(torch, name, None) for name in
                        ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64"))
    if dtype is not None
)
_PROMPT_KINDS = "a list, tuple or range of ints, a 1-D int numpy array, or a 1-D int CPU/CUDA tensor"


def _is_numpy_array(value) -> bool:
    kind = type(value)
    return kind.__module__ == "numpy" and kind.__name__ == "ndarray"  # no numpy import needed


def _token_id(name: str, position: int, token) -> int:
    """``token`` as a Python int: an int or an integer scalar (numpy, 0-d int tensor), never a bool."""
    if isinstance(token, bool) or (type(token).__module__ == "numpy" and "bool" in type(token).__name__):
        raise TypeError(f"{name}[{position}] is a bool; token ids must be ints")
    if isinstance(token, torch.Tensor) and (token.dim() != 0 or token.dtype not in _TENSOR_INT_DTYPES):
        raise TypeError(f"{name}[{position}] must be an int, got a tensor of shape {tuple(token.shape)}, {token.dtype}")
    try:
        return operator.index(token)  # int, numpy integers; rejects float, str, None
    except TypeError:
        raise TypeError(f"{name}[{position}] must be an int, got {type(token).__name__} {token!r}") from None


def _tensor_tokens(name: str, tokens: torch.Tensor) -> List[int]:
    if tokens.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on the {tokens.device.type} device; pass a CPU or CUDA tensor (or a list of ints)")
    if tokens.layout != torch.strided:
        raise TypeError(f"{name} must be a dense tensor, got layout {tokens.layout}")
    if tokens.dtype not in _TENSOR_INT_DTYPES:
        raise TypeError(f"{name} must have an integer dtype, got {tokens.dtype}")
    if tokens.dim() != 1:
        raise ValueError(f"{name} must be 1-D (one prompt), got shape {tuple(tokens.shape)}")
    return tokens.tolist()  # host-ok: user input, read before the request joins


def _numpy_tokens(name: str, tokens) -> List[int]:
    if tokens.dtype.kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype, got numpy {tokens.dtype}")
    if tokens.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one prompt), got shape {tokens.shape}")
    return [int(token) for token in tokens.tolist()]  # host-ok: user input, outside the step


def _as_token_list(name: str, prompt_tokens) -> List[int]:
    """The token ids of one prompt as a list of Python ints (type checks only)."""
    if isinstance(prompt_tokens, torch.Tensor):
        return _tensor_tokens(name, prompt_tokens)
    if _is_numpy_array(prompt_tokens):
        return _numpy_tokens(name, prompt_tokens)
    if isinstance(prompt_tokens, (str, bytes, bytearray)):
        raise TypeError(f"{name} must be token ids ({_PROMPT_KINDS}), got {type(prompt_tokens).__name__}; "
                        "tokenize text first")
    if isinstance(prompt_tokens, (Set, Mapping)):
        raise TypeError(f"{name} must be an ordered sequence of token ids ({_PROMPT_KINDS}), got "
                        f"{type(prompt_tokens).__name__}, whose order is arbitrary")
    if not isinstance(prompt_tokens, Sequence):
        raise TypeError(f"{name} must be {_PROMPT_KINDS}, got {type(prompt_tokens).__name__}")
    if set(map(type, prompt_tokens)) <= {int}:  # plain ints (bool is not int here): no per-token call
        return list(prompt_tokens)
    return [_token_id(name, position, token) for position, token in enumerate(prompt_tokens)]


def check_prompt(prompt_tokens, vocab_size: int, max_model_len: int, name: str = "prompt_tokens") -> List[int]:
    """Validate one prompt and return it as a list of Python ints.

    Accepts a list, tuple or range of ints (numpy integers and 0-d int tensors count as ints), a
    1-D integer numpy array, or a 1-D integer CPU/CUDA tensor. Rejects, naming ``name``: None,
    a single number, a str/bytes, a set or dict (no order), bools, floats, tensors of another
    device (e.g. meta), shape or dtype; an empty prompt; a prompt of ``max_model_len`` tokens or
    more (no room to generate); ids outside ``[0, vocab_size)``.

    Example: ``check_prompt(range(3), vocab_size=10, max_model_len=8) -> [0, 1, 2]``;
    ``check_prompt([1, 12], 10, 8)`` raises ``ValueError: prompt_tokens[1] = 12 is outside ...``.
    """
    return checked_prompt(prompt_tokens, vocab_size, max_model_len, name)[0]


def checked_prompt(prompt_tokens, vocab_size: int, max_model_len: int,
                   name: str = "prompt_tokens") -> Tuple[List[int], np.ndarray]:
    """:func:`check_prompt`, also returning the prompt as a read-only ``[P]`` int64 array (the
    range check runs on it: numpy's min and max, not Python's, and admission takes it as is)."""
    for arg, value, low in (("vocab_size", vocab_size, 1), ("max_model_len", max_model_len, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{arg} must be an int >= {low}, got {value!r}")
    if prompt_tokens is None:
        raise TypeError(f"{name} is None; pass {_PROMPT_KINDS}")
    prompt = _as_token_list(name, prompt_tokens)
    if not prompt:
        raise ValueError(f"{name} is empty; a prompt needs at least one token")
    if len(prompt) >= max_model_len:
        raise ValueError(f"{name} has {len(prompt)} tokens; max_model_len ({max_model_len}) leaves no room to generate")
    try:
        array = np.fromiter(prompt, dtype=np.int64, count=len(prompt))  # plain ints by now
        low, high = int(array.min()), int(array.max())
    except OverflowError:  # beyond int64: surely outside the vocabulary, found below
        array, low, high = None, min(prompt), max(prompt)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{name}[{prompt.index(bad)}] = {bad} is outside the vocabulary [0, {vocab_size})")
    array.flags.writeable = False
    return prompt, array


def _looks_like_one_prompt(prompts) -> bool:
    """A flat sequence of token ids (what ``generate([1, 2, 3])`` passes by mistake)."""
    if isinstance(prompts, torch.Tensor) or _is_numpy_array(prompts):
        return prompts.ndim == 1
    return any(_is_scalar(item) for item in prompts)


def _is_scalar(item) -> bool:
    """An int, float or integer scalar (numpy), as opposed to a prompt."""
    if isinstance(item, (int, float)):
        return True
    return hasattr(item, "__index__") and not isinstance(item, torch.Tensor) and not _is_numpy_array(item)


def check_prompts(prompts, name: str = "prompts") -> list:
    """Validate the outer container of ``generate(prompts)``; return the prompts as a list.

    ``prompts`` must be a list or tuple of prompts (each checked later by :func:`check_prompt`),
    or a 2-D int tensor / numpy array (one prompt per row). A flat list of ints, a 1-D tensor, a
    str, a set, a dict or None raises ``TypeError`` naming ``name``. An empty list gives ``[]``.

    Example: ``check_prompts([[1, 2], (3,)]) -> [[1, 2], (3,)]``; ``check_prompts([1, 2, 3])``
    raises ``TypeError: prompts must be a sequence of prompts ... wrap one prompt as [prompt]``.
    """
    if prompts is None or isinstance(prompts, (str, bytes, bytearray, Set, Mapping)):
        raise TypeError(f"{name} must be a list of prompts (each a sequence of token ids), "
                        f"got {type(prompts).__name__}")
    is_array = isinstance(prompts, torch.Tensor) or _is_numpy_array(prompts)
    if not is_array and not isinstance(prompts, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of prompts (each a sequence of token ids), "
                        f"got {type(prompts).__name__}")
    if _looks_like_one_prompt(prompts):
        raise TypeError(f"{name} must be a sequence of prompts (each a sequence of token ids), got a flat "
                        "sequence of token ids; to generate for one prompt, wrap it: [prompt]")
    if is_array and prompts.ndim != 2:
        raise ValueError(f"{name} as an array must be 2-D (one prompt per row), got shape {tuple(prompts.shape)}")
    return list(prompts)


def check_sampling_params_list(sampling_params, name: str = "sampling_params") -> None:
    """``generate``'s per-prompt form of ``sampling_params``: a list or tuple (one entry per prompt;
    each entry is checked with its request). A dict, a str, a set or another container raises
    ``TypeError`` naming ``name`` (a dict of options is a common slip: build a SamplingParams)."""
    if not isinstance(sampling_params, (list, tuple)):
        hint = ": build SamplingParams(**options) from it" if isinstance(sampling_params, Mapping) else ""
        raise TypeError(f"{name} must be a SamplingParams, None, or a list or tuple of them (one per prompt), "
                        f"got {type(sampling_params).__name__}{hint}")
