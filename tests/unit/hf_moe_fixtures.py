"""Tiny random Qwen3-MoE, GLM-4.5 and DeepSeek-V3 checkpoints written by ``transformers`` (no
download), their MTP layers in the published layout, and a reference MTP step built from
``transformers``' own decoder layer.

Shapes follow ``megatron_fixtures`` (2 layers, hidden 64, 4 query heads, vocabulary 96) so its paged
schedule applies. Layer 0 is dense, layer 1 MoE (4 experts, top 2); GLM-4.5 and DeepSeek-V3 add a
shared expert, sigmoid routing with a random ``e_score_correction_bias`` and a routed scaling
factor; DeepSeek-V3 also group-limited routing (2 groups, 1 chosen), q LoRA and YaRN.

``transformers`` does not build the MTP layers (it ignores ``model.layers.{L}.*`` on load): they are
written here as a second shard, ``model.layers.{L + k}.*`` with a decoder layer (MoE, as in the
released checkpoints), ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and the layer's own
copies of the embedding and output head (``embed_tokens``, ``shared_head.head``).
"""

import json
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from tests.unit.megatron_fixtures import MAX_SEQUENCE_LENGTH, VOCAB_SIZE

NEXTN_DEPTH = 2  # released checkpoints ship 1; 2 lets the controller run S = 2
BASE_SHAPE = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=MAX_SEQUENCE_LENGTH, rms_norm_eps=1e-6,
                  num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=False)
NEXTN_ROUTING = dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                     norm_topk_prob=True)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=0.7,
            original_max_position_embeddings=32, beta_fast=4.0, beta_slow=1.0)


def qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**BASE_SHAPE, num_key_value_heads=2, head_dim=16, num_experts=4, mlp_only_layers=[0],
                          norm_topk_prob=True)


def glm4_moe_config(num_hidden_layers: int = 2, first_k_dense_replace: int = 1):
    from transformers import Glm4MoeConfig

    shape = {**BASE_SHAPE, "num_hidden_layers": num_hidden_layers}
    routing = {**NEXTN_ROUTING, "first_k_dense_replace": first_k_dense_replace}
    return Glm4MoeConfig(**shape, **routing, num_key_value_heads=2, head_dim=16, attention_bias=True,
                         use_qk_norm=True, num_nextn_predict_layers=NEXTN_DEPTH,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


def deepseek_v3_config(num_hidden_layers: int = 2, first_k_dense_replace: int = 1):
    from transformers import DeepseekV3Config

    shape = {**BASE_SHAPE, "num_hidden_layers": num_hidden_layers}
    routing = {**NEXTN_ROUTING, "first_k_dense_replace": first_k_dense_replace}
    return DeepseekV3Config(**shape, **routing, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=24,
                            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_parameters=dict(YARN),
                            num_nextn_predict_layers=NEXTN_DEPTH)


FAMILIES = {"qwen3_moe": ("Qwen3MoeForCausalLM", qwen3_moe_config),
            "glm4_moe": ("Glm4MoeForCausalLM", glm4_moe_config),
            "deepseek_v3": ("DeepseekV3ForCausalLM", deepseek_v3_config)}


def _randomise_routing(model, generator: torch.Generator) -> None:
    """Expert biases random (zeros at init), router weights larger, so the bias and the groups
    change which experts are chosen."""
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.rand(buffer.shape, generator=generator) * 0.1)
    for name, parameter in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            parameter.data.normal_(0.0, 0.3, generator=generator)


def _class(name: str):
    import transformers

    return getattr(transformers, name)


@torch.no_grad()
def write_checkpoint(family: str, directory: Path, seed: int = 0):
    """``save_pretrained`` of a random model of ``family``, plus NEXTN_DEPTH MTP layers for GLM-4.5 and
    DeepSeek-V3. Returns (the transformers model, {depth: one-layer transformers model holding
    that MTP layer} or None)."""
    from safetensors.torch import save_file

    class_name, make_config = FAMILIES[family]
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = _class(class_name)(make_config()).eval()
    _randomise_routing(model, generator)
    model.save_pretrained(str(directory), safe_serialization=True)
    if family == "qwen3_moe":
        return model, None
    num_layers = model.config.num_hidden_layers
    mtp_models, mtp_tensors = {}, {}
    for depth in range(NEXTN_DEPTH):
        layer_model = _class(class_name)(make_config(num_hidden_layers=1, first_k_dense_replace=0)).eval()
        _randomise_routing(layer_model, generator)
        layer_model.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
        layer_model.lm_head.weight.copy_(model.lm_head.weight)
        layer_model.model.norm.weight.normal_(1.0, 0.1, generator=generator)  # shared_head.norm
        hidden = model.config.hidden_size
        layer_model.enorm = torch.ones(hidden) + torch.randn(hidden, generator=generator) * 0.1
        layer_model.hnorm = torch.ones(hidden) + torch.randn(hidden, generator=generator) * 0.1
        layer_model.eh_proj = torch.randn(hidden, 2 * hidden, generator=generator) * 0.05
        p = f"model.layers.{num_layers + depth}."
        mtp_tensors.update({p + name: tensor for name, tensor in hub_layout(layer_model.model.layers[0]).items()})
        mtp_tensors.update({p + "enorm.weight": layer_model.enorm, p + "hnorm.weight": layer_model.hnorm,
                            p + "eh_proj.weight": layer_model.eh_proj,
                            p + "shared_head.norm.weight": layer_model.model.norm.weight.clone(),
                            p + "embed_tokens.weight": model.model.embed_tokens.weight.clone(),
                            p + "shared_head.head.weight": model.lm_head.weight.clone()})
        mtp_models[depth] = layer_model
    save_file(mtp_tensors, str(directory / "model-mtp.safetensors"), metadata={"format": "pt"})
    weight_map = {name: "model.safetensors" for name in model.state_dict()}
    weight_map.update({name: "model-mtp.safetensors" for name in mtp_tensors})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model, mtp_models


def hub_layout(layer) -> Dict[str, torch.Tensor]:
    """A decoder layer's tensors as the hub stores them: ``transformers`` >= 5 holds the experts
    stacked (``mlp.experts.gate_up_proj`` [E, 2I, H] with gate rows first, ``down_proj`` [E, H, I])
    and converts to per-expert ``mlp.experts.{e}.gate_proj`` ... only inside ``save_pretrained``."""
    tensors = {}
    for name, tensor in layer.state_dict().items():
        if name == "mlp.experts.gate_up_proj":
            gates, ups = tensor.chunk(2, dim=1)  # [E, I, H] each
            for expert, (gate, up) in enumerate(zip(gates, ups)):
                tensors[f"mlp.experts.{expert}.gate_proj.weight"] = gate.clone()
                tensors[f"mlp.experts.{expert}.up_proj.weight"] = up.clone()
        elif name == "mlp.experts.down_proj":
            for expert, down in enumerate(tensor):
                tensors[f"mlp.experts.{expert}.down_proj.weight"] = down.clone()
        else:
            tensors[name] = tensor.clone()
    return tensors


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def nextn_mtp_reference(layer_model, hidden: torch.Tensor,
                        next_tokens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One MTP depth over one sequence, DeepSeek-V3's published layout:
    ``eh_proj(cat(enorm(embed(next)), hnorm(hidden)))`` -> the decoder layer (``transformers``' own,
    run as a one-layer model on ``inputs_embeds``, its final norm = ``shared_head.norm``) -> the
    shared head. ``hidden`` [T, H]: the trunk's normed output (or the previous depth's). Returns
    (logits [T, V], output [T, H])."""
    embedded = layer_model.model.embed_tokens.weight[next_tokens]  # [T, H]
    combined = torch.cat((_rms(embedded, layer_model.enorm), _rms(hidden, layer_model.hnorm)), dim=-1)  # [T, 2H]
    out = layer_model.model(inputs_embeds=(combined @ layer_model.eh_proj.T)[None]).last_hidden_state[0]
    return out @ layer_model.lm_head.weight.T, out


@torch.no_grad()
def reference_mtp_logits(model, mtp_models, sequences: List[torch.Tensor], shifted_tokens) -> List[List[torch.Tensor]]:
    """[depth][request] -> [n, V]: the MTP chain over each whole sequence, fed as megatron feeds it
    (depth k reads the tokens shifted by k + 1; depth k + 1 reads depth k's normed output)."""
    per_depth = [[] for _ in mtp_models]
    for tokens in sequences:
        hidden = model.model(tokens[None]).last_hidden_state[0]  # [n, H] after the final norm
        for depth in range(len(mtp_models)):
            logits, hidden = nextn_mtp_reference(mtp_models[depth], hidden, shifted_tokens(tokens, depth + 1))
            per_depth[depth].append(logits)
    return per_depth


def tensors_of(directory: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def generate_tokens(model, prompts, num_speculative_tokens, new_tokens, **sampling):
    """The output tokens of ``controller.generate`` for the loaded HF test models (small engine)."""
    from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController

    config = InferenceConfig(num_speculative_tokens=num_speculative_tokens, max_requests=len(prompts),
                             block_size_tokens=4, max_model_len=32, max_tokens_per_step=32)
    results = TextGenerationController(model, config, seed=0).generate(
        [list(p) for p in prompts], SamplingParams(max_new_tokens=new_tokens, **sampling))
    return [list(result.output_tokens) for result in results]
