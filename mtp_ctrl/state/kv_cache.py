"""The paged KV cache tensors: one (key_cache, value_cache) pair per attention layer.

Layer ``l < L`` is decoder layer ``l``; layer ``L + k`` is MTP depth ``k`` (each MTP layer keeps
its own paged cache). Every cache is ``[num_blocks, block_size_tokens, num_kv_heads, head_dim]``
with this rank's (tensor-parallel local) KV heads; block ``b`` of every layer belongs to the
request that holds block id ``b``. Token ``p`` of a request lives at slot
``block_ids[p // block_size_tokens] * block_size_tokens + p % block_size_tokens``.
"""

import dataclasses
from typing import List, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int  # attention layers with a cache: decoder layers, then one per MTP depth
    num_kv_heads: int  # KV heads local to this tensor-parallel rank
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {self.dtype!r}")

    def bytes_per_block(self, block_size_tokens: int) -> int:
        """Bytes one KV block costs over every layer, keys and values."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * block_size_tokens * self.num_kv_heads * self.head_dim * element_size

    def allocate(self, num_blocks: int, block_size_tokens: int, device: torch.device) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed caches in one allocation; returns ``[(key_cache, value_cache)] * num_layers``."""
        caches = torch.zeros(  # [layers, 2, num_blocks, block_size_tokens, num_kv_heads, head_dim]
            self.num_layers, 2, num_blocks, block_size_tokens, self.num_kv_heads, self.head_dim,
            dtype=self.dtype, device=device,
        )
        return [(caches[layer, 0], caches[layer, 1]) for layer in range(self.num_layers)]
