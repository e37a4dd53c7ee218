"""Helpers for the distributed-checkpoint tests: megatron's own GPTModel, its greedy oracle, our generate.

The checkpoints are written on the fly (no binary fixtures): megatron's GPTModel built with its own
local layer spec saves through ``dist_checkpointing.save``. On a CPU-only torch the save uses
``mtp_ctrl.models.dist_checkpoint.SynchronousTorchDistSaveStrategy`` (megatron-core 0.16.1's
default torch_dist writer calls CUDA unconditionally); on CUDA, megatron's default writer.

The oracle is megatron's own ``GPTModel.forward`` over the whole sequence, with no KV cache, once
per generated token. Two megatron-core 0.16.1 details need care:
- With MTP layers, ``GPTModel.forward`` requires labels (it computes the MTP losses) and then
  returns the loss, not logits; a forward hook on ``output_layer`` records the logits it computes
  (the MTP depths' first, the decoder's last).
- On a CPU-only torch, two calls reach for CUDA with nothing to do on the CPU: the rotary
  embedding moves its frequencies to ``torch.cuda.current_device()``, and attention enters the
  CUDA RNG tracker's fork around its dropout (dropout is 0 and the model is in eval mode).
  :func:`_cpu_shim` points the first at the CPU and makes the second a no-op, only when CUDA is
  absent; every computation is megatron's own.
"""

import contextlib
import copy
from typing import List, Sequence
from unittest import mock

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

from tests.unit.megatron_fixtures import MAX_SEQUENCE_LENGTH, VOCAB_SIZE, torch_twins

PROMPTS = ([5, 17, 3, 88, 41], [9, 9, 2], [60, 1, 33, 70, 12, 8, 45])
MAX_NEW_TOKENS = 6
SPECULATIVE_SIZES = (0, 2)  # S of the generate runs compared with the oracle


def build_megatron_gpt(config, seed: int = 1234, fused_norm_names: bool = True) -> GPTModel:
    """megatron's GPTModel with its local layer spec, rotary embedding and ``config.mtp_num_layers`` MTP layers.

    ``fused_norm_names=False`` clears the spec's ``sharded_state_dict_keys_map``, so the layer norms
    are saved as ``input_layernorm.*`` / ``pre_mlp_layernorm.*`` instead of Transformer Engine's
    fused ``*.layer_norm_*`` names (the spelling of checkpoints written before megatron mapped them).
    """
    spec = get_gpt_layer_local_spec()
    if not fused_norm_names:
        spec = copy.deepcopy(spec)
        spec.submodules.sharded_state_dict_keys_map = {}
    torch.manual_seed(seed)
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if config.mtp_num_layers else None
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB_SIZE,
                     max_sequence_length=MAX_SEQUENCE_LENGTH, position_embedding_type="rope", mtp_block_spec=mtp_spec)
    return model.eval()


class _NoForkTracker:
    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


@contextlib.contextmanager
def _cpu_shim():
    if torch.cuda.is_available():
        yield
        return
    with mock.patch("torch.cuda.current_device", return_value="cpu"), \
            mock.patch("megatron.core.tensor_parallel.get_cuda_rng_tracker", return_value=_NoForkTracker()):
        yield


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V / tp]`` shards of every tensor-parallel rank -> ``[..., V]``."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if tp_size == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp_size)]
    dist.all_gather(parts, logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


@torch.no_grad()
def megatron_logits(model: GPTModel, tokens: Sequence[int]) -> torch.Tensor:
    """Decoder logits [n, V] fp32 of megatron's ``GPTModel.forward`` over ``tokens`` (one causal pass)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(tokens)], device=device)  # [1, n] int64
    n = ids.shape[1]
    positions = torch.arange(n, device=device)[None]  # [1, n] int64
    causal_mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), diagonal=1)[None, None]  # True = masked
    recorded = []
    handle = model.output_layer.register_forward_hook(lambda module, args, output: recorded.append(output[0]))
    try:
        with _cpu_shim():
            model(ids, positions, causal_mask, labels=ids)  # labels: megatron's MTP forward needs them
    finally:
        handle.remove()
    return _gather_vocab(recorded[-1][:, 0].float())  # the decoder's logits come last


def megatron_greedy(model: GPTModel, prompts=PROMPTS, max_new_tokens: int = MAX_NEW_TOKENS) -> List[List[int]]:
    """Greedy continuation of each prompt by re-running megatron's full forward for every new token."""
    outputs = []
    for prompt in prompts:
        tokens = list(prompt)
        for _ in range(max_new_tokens):
            tokens.append(int(megatron_logits(model, tokens)[-1].argmax()))
        outputs.append(tokens[len(prompt):])
    return outputs


def generate_greedy(model, num_speculative_tokens: int, prompts=PROMPTS,
                    max_new_tokens: int = MAX_NEW_TOKENS) -> List[List[int]]:
    """Our controller's greedy outputs on ``model`` (a paged model) with S drafts per step.

    The subject is the loaded weights, not the kernels: every op runs its torch twin (each
    kernel == its twin in its own tests; the controller tests run the loop on the kernels)."""
    from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController

    config = InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=len(prompts),
                             block_size_tokens=4, max_model_len=48, max_tokens_per_step=64)
    with torch_twins():
        controller = TextGenerationController(model, config)
        try:
            results = controller.generate(list(prompts),
                                          SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
        finally:
            controller.close()
    return [list(result.output_tokens) for result in results]


def parameter_mismatches(model, reference) -> List[str]:
    """Names whose values differ (or that only one of the two models has)."""
    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    names = sorted(set(ours) | set(theirs))
    return [name for name in names if name not in ours or name not in theirs
            or not torch.equal(ours[name].detach().float(), theirs[name].detach().float())]


def snapshot(model) -> dict:
    return {name: value.detach().clone() for name, value in model.state_dict().items() if torch.is_tensor(value)}


def unchanged(model, before: dict) -> bool:
    after = model.state_dict()
    return all(torch.equal(after[name], value) for name, value in before.items())
