"""The one tensor-parallel gather the paged forwards need, on the rows' own device.

megatron's ``gather_from_tensor_model_parallel_region`` allocates its buffer on
``torch.cuda.current_device()``, so it fails on CPU tensors (gloo tests) and is avoided here.
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def gather_last_dim_over_tp(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate the tensor-parallel ranks' shards along the last dim (device-agnostic)."""
    group = parallel_state.get_tensor_model_parallel_group()
    world_size = dist.get_world_size(group=group)
    if world_size == 1:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return torch.cat(shards, dim=-1)
