"""Real text on every machine, offline: the Python standard library's source files, as byte tokens.

Files are read in sorted order of their path under ``sysconfig.get_paths()["stdlib"]``
(installed packages excluded), so the corpus is the same on every run of one Python version.
The last files in that order (``zipfile.py``, ``zoneinfo/...``) are held out for evaluation and
prompts. Token ids are the bytes 0..255.
"""

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

import torch

BYTE_VOCAB_SIZE = 256
_INSTALLED_PACKAGE_DIRS = {"site-packages", "dist-packages"}


@dataclass(frozen=True)
class ByteCorpus:
    train: torch.Tensor  # [n_train] uint8
    held_out: torch.Tensor  # [n_held_out] uint8
    held_out_files: List[str]  # paths relative to the stdlib folder


def stdlib_source_files() -> List[Path]:
    """Every ``*.py`` of the standard library, sorted by path relative to its folder."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [path for path in root.rglob("*.py")
             if path.is_file() and not _INSTALLED_PACKAGE_DIRS & set(path.relative_to(root).parts)]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def load_stdlib_corpus(held_out_fraction: float = 0.01) -> ByteCorpus:
    """Train on the leading files; hold out the fewest trailing files holding ``held_out_fraction`` of the bytes.

    Files are joined with a blank line between them.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    files = stdlib_source_files()
    if len(files) < 2:
        raise RuntimeError(f"found {len(files)} standard-library source files under {sysconfig.get_paths()['stdlib']}")
    contents = [path.read_bytes() for path in files]
    total_bytes = sum(len(content) for content in contents)
    split, held_out_bytes = len(files), 0
    while split > 1 and held_out_bytes < held_out_fraction * total_bytes:
        split -= 1
        held_out_bytes += len(contents[split])
    root = Path(sysconfig.get_paths()["stdlib"])
    return ByteCorpus(
        train=_as_tokens(contents[:split]),
        held_out=_as_tokens(contents[split:]),
        held_out_files=[path.relative_to(root).as_posix() for path in files[split:]],
    )


def _as_tokens(contents: Sequence[bytes]) -> torch.Tensor:  # [n] uint8
    return torch.frombuffer(bytearray(b"\n\n".join(contents)), dtype=torch.uint8)


def sample_windows(tokens: torch.Tensor, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``batch_size`` windows of ``length`` consecutive tokens at random starts -> [batch_size, length] int64.

    ``tokens`` [n] uint8 may live on any device; starts are drawn on the CPU from ``generator``.
    """
    if tokens.shape[0] < length:
        raise ValueError(f"the corpus has {tokens.shape[0]} tokens, fewer than a window of {length}")
    starts = torch.randint(0, tokens.shape[0] - length + 1, (batch_size, 1), generator=generator)  # [B, 1]
    index = (starts + torch.arange(length)).to(tokens.device)  # [B, length] int64
    return tokens[index].long()


def evenly_spaced_windows(tokens: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """``count`` windows of ``length`` tokens starting at evenly spaced offsets -> [count, length] int64.

    Example: 100 tokens, count 3, length 10 -> starts 0, 45, 90.
    """
    if tokens.shape[0] < length:
        raise ValueError(f"the text has {tokens.shape[0]} tokens, fewer than a window of {length}")
    starts = torch.linspace(0, tokens.shape[0] - length, count).long()[:, None]  # [count, 1]
    return tokens[(starts + torch.arange(length)).to(tokens.device)].long()


def decode_bytes(token_ids: Sequence[int]) -> str:
    """Text of byte tokens (ids past 255, which a padded vocabulary allows, are dropped)."""
    return bytes(token for token in token_ids if 0 <= token < BYTE_VOCAB_SIZE).decode("utf-8", errors="replace")
