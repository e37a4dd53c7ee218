"""A tiny MoE GPT with MTP layers, and helpers for the MoE tests (CPU, gloo).

Decoder layer 0 has a dense MLP, layer 1 an MoE MLP (4 experts, top-2, one shared expert); the
MTP layers follow the last decoder layer, so they are MoE layers too (megatron's rule).
"""

from typing import Dict, List

import torch

from tests.unit.megatron_fixtures import build_tiny_model, tiny_config

NUM_EXPERTS = 4
MOE_PROMPTS = ([5, 17, 3, 88, 41], [9, 9, 2], [60, 1, 33, 70, 12, 8, 45])


def moe_config(mtp_num_layers: int = 2, tensor_parallel_size: int = 1, expert_parallel_size: int = 1, **overrides):
    """``tiny_config`` with megatron's MoE settings (no linear biases: megatron's shared experts
    and expert-TP reject them)."""
    fields = dict(num_moe_experts=NUM_EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=48,
                  moe_shared_expert_intermediate_size=32, moe_layer_freq=[0, 1], add_bias_linear=False,
                  expert_model_parallel_size=expert_parallel_size)
    fields.update(overrides)
    return tiny_config(mtp_num_layers=mtp_num_layers, tensor_parallel_size=tensor_parallel_size, **fields)


def build_moe_model(config=None):
    return build_tiny_model(moe_config() if config is None else config)


def expert_parallel_state_dict(full: Dict[str, torch.Tensor], model, ep_rank: int) -> Dict[str, torch.Tensor]:
    """The EP = 1 state dict ``full`` cut to what rank ``ep_rank`` of ``model`` holds: local expert
    i of that rank is global expert ``ep_rank * num_local + i`` (megatron's expert placement);
    every other tensor is the same on every rank (TP = 1)."""
    wanted = model.state_dict()
    num_local = _local_expert_count(wanted)  # experts per rank and MoE layer
    shard = {}
    for key in wanted:
        if ".local_experts." in key:
            head, tail = key.split(".local_experts.")
            local_index, rest = tail.split(".", 1)
            key_full = f"{head}.local_experts.{ep_rank * num_local + int(local_index)}.{rest}"
            shard[key] = full[key_full]
        else:
            shard[key] = full[key]
    return shard


def _local_expert_count(state_dict) -> int:
    indices = {int(key.split(".local_experts.")[1].split(".")[0]) for key in state_dict if ".local_experts." in key}
    return len(indices)


def generate_cases(model, cases, prompts=MOE_PROMPTS, max_new_tokens: int = 6,
                   moe_backend: str = "triton") -> List[List[List[int]]]:
    """Output tokens of every ``(num_speculative_tokens, sampling kwargs)`` case, per prompt."""
    from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController

    outputs = []
    for num_speculative_tokens, sampling in cases:
        config = InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=len(prompts),
                                 block_size_tokens=4, max_model_len=32, max_tokens_per_step=64,
                                 moe_backend=moe_backend)
        controller = TextGenerationController(model, config)
        results = controller.generate([list(p) for p in prompts],
                                      SamplingParams(max_new_tokens=max_new_tokens, **sampling))
        outputs.append([list(result.output_tokens) for result in results])
    return outputs
