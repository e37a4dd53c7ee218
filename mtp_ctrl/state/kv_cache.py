"""The paged KV cache tensors, one entry per attention layer; the layout is the model's.

- :class:`KVCacheSpec` (standard attention): a ``(key_cache, value_cache)`` pair per layer.
- :class:`LatentKVCacheSpec` (multi-latent attention): one ``[num_blocks, block_size_tokens,
  latent_dim]`` tensor per layer, the compressed latent plus the shared rotary key of each token
  (``kv_lora_rank + qk_pos_emb_head_dim``), replicated on every tensor-parallel rank.

Layer ``l < L`` is decoder layer ``l``; layer ``L + k`` is MTP depth ``k`` (each MTP layer keeps
its own paged cache). Every standard cache is ``[num_blocks, block_size_tokens, num_kv_heads, head_dim]``
with this rank's (tensor-parallel local) KV heads; block ``b`` of every layer belongs to the
request that holds block id ``b``. Token ``p`` of a request lives at slot
``block_ids[p // block_size_tokens] * block_size_tokens + p % block_size_tokens``.
"""

import dataclasses
from typing import List, Tuple, Union

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


@dataclasses.dataclass(frozen=True)
class LatentKVCacheSpec:
    num_layers: int  # MLA layers with a cache: decoder layers, then one per MTP depth
    latent_dim: int  # per token: kv_lora_rank + qk_pos_emb_head_dim (e.g. 512 + 64 = 576)
    dtype: torch.dtype

    def __post_init__(self):
        for name in ("num_layers", "latent_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {self.dtype!r}")

    def bytes_per_block(self, block_size_tokens: int) -> int:
        """Bytes one KV block costs over every layer."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * block_size_tokens * self.latent_dim * element_size

    def allocate(self, num_blocks: int, block_size_tokens: int, device: torch.device) -> List[torch.Tensor]:
        """Zeroed caches in one allocation; returns ``[latent_cache] * num_layers``, each
        ``[num_blocks, block_size_tokens, latent_dim]``."""
        caches = torch.zeros(self.num_layers, num_blocks, block_size_tokens, self.latent_dim,
                             dtype=self.dtype, device=device)
        return list(caches.unbind(0))


AnyKVCacheSpec = Union[KVCacheSpec, LatentKVCacheSpec]
