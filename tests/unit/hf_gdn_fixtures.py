"""Tiny random Qwen3-Next and Qwen3.5 checkpoints written by ``transformers`` (no download), their
MTP layers in the published ``mtp.*`` layout, a plain-torch reference of the MTP step, and a paged
schedule over the GDN hybrid (prefill, verify rows, state commit, chunked prefill).

Shapes: hidden 64, 4 decoder layers (GDN, attention, GDN, attention), 4 query heads over 2 KV
heads of 16 (half of each rotated), GDN 2 key heads of 16 and 4 value heads of 8, vocabulary 96.
Qwen3-Next: layer 0 a dense MLP (``mlp_only_layers``), the others MoE (4 experts, top 2, a gated
shared expert); Qwen3.5: dense, saved as the vision-language checkpoint (``model.language_model.*``
and a one-block vision tower the loader skips). Every zero-centred norm weight is drawn around 0,
the GDN output norm around 1, so a missing ``1 + w`` shows.
"""

import json
from pathlib import Path
from typing import Dict, List

import torch

from tests.unit.hf_moe_fixtures import hub_layout
from tests.unit.megatron_fixtures import MAX_SEQUENCE_LENGTH, VOCAB_SIZE, allocate_kv_caches, make_metadata

MTP_DEPTH = 2  # released checkpoints ship 1; 2 lets the controller run S = 2 (the fc and norms are shared)
LAYER_TYPES = ["linear_attention", "full_attention"] * 2
TEXT_SHAPE = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                  linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
                  max_position_embeddings=MAX_SEQUENCE_LENGTH, rms_norm_eps=1e-6, tie_word_embeddings=False)
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
MTP_FIELD = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5": "mtp_num_hidden_layers"}


def _qwen3_next(num_hidden_layers: int = 4, layer_types=None, mlp_only_layers=(0,)):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(**{**TEXT_SHAPE, "num_hidden_layers": num_hidden_layers},
                             layer_types=list(layer_types or LAYER_TYPES), rope_parameters=dict(ROPE), num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=list(mlp_only_layers))
    return Qwen3NextForCausalLM(config).eval()


def _qwen3_5_text_config(num_hidden_layers: int = 4, layer_types=None):
    return dict(TEXT_SHAPE, num_hidden_layers=num_hidden_layers, layer_types=list(layer_types or LAYER_TYPES),
                rope_parameters={**ROPE, "mrope_section": [2, 1, 1], "mrope_interleaved": True})


def _qwen3_5(num_hidden_layers: int = 4, layer_types=None):
    """The vision-language model for the trunk; its text model (``Qwen3_5ForCausalLM``) for MTP layers."""
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    text = _qwen3_5_text_config(num_hidden_layers, layer_types)
    if num_hidden_layers != 4:
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text)).eval()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    return Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()


FAMILIES = {"qwen3_next": _qwen3_next, "qwen3_5": _qwen3_5}


@torch.no_grad()
def _randomise(model, generator: torch.Generator) -> None:
    """Zero-centred norms around 0 (GDN output norms around 1), decay parameters and routers spread."""
    for name, parameter in model.named_parameters():
        if "visual" in name:
            continue
        if name.endswith("linear_attn.norm.weight"):
            parameter.normal_(1.0, 0.1, generator=generator)
        elif name.endswith("norm.weight"):
            parameter.normal_(0.0, 0.1, generator=generator)
        elif name.endswith(("dt_bias", "A_log")):
            parameter.normal_(0.0, 0.5, generator=generator)
        elif name.endswith("mlp.gate.weight"):
            parameter.normal_(0.0, 0.3, generator=generator)


def _text_model(model):
    """The decoder (``model.model`` or, for the vision-language model, its language model)."""
    return getattr(model.model, "language_model", model.model)


@torch.no_grad()
def write_checkpoint(family: str, directory: Path, seed: int = 0):
    """``save_pretrained`` of a random ``family`` model plus MTP_DEPTH MTP layers (a second shard:
    ``mtp.fc``, ``mtp.pre_fc_norm_*``, ``mtp.norm``, ``mtp.layers.{k}.*``) and the config's MTP depth.
    Returns (the transformers model, the MTP tensors by their ``mtp.`` names, [one-layer models
    holding each depth's layer])."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    make = FAMILIES[family]
    model = make()
    _randomise(model, generator)
    model.save_pretrained(str(directory), safe_serialization=True)
    hidden = TEXT_SHAPE["hidden_size"]
    mtp = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=generator) * 0.05}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = torch.randn(hidden, generator=generator) * 0.1
    layer_models = []
    for depth in range(MTP_DEPTH):
        layer_model = make(num_hidden_layers=1, layer_types=["full_attention"]) if family == "qwen3_5" else \
            make(num_hidden_layers=1, layer_types=["full_attention"], mlp_only_layers=())
        _randomise(layer_model, generator)
        _text_model(layer_model).norm.weight.copy_(mtp["mtp.norm.weight"])
        mtp.update({f"mtp.layers.{depth}.{name}": tensor
                    for name, tensor in hub_layout(_text_model(layer_model).layers[0]).items()})
        layer_models.append(layer_model)
    save_file(mtp, str(directory / "model-mtp.safetensors"), metadata={"format": "pt"})
    weight_map = {name: "model.safetensors" for name in model.state_dict()}
    weight_map.update({name: "model-mtp.safetensors" for name in mtp})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((directory / "config.json").read_text())
    (config.get("text_config") or config)[MTP_FIELD[family]] = MTP_DEPTH
    (directory / "config.json").write_text(json.dumps(config))
    return model, mtp, layer_models


def _zero_centred_rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


@torch.no_grad()
def reference_mtp_logits(model, mtp: Dict[str, torch.Tensor], layer_models, tokens: torch.Tensor,
                         shifted_tokens) -> List[torch.Tensor]:
    """[depth] -> [n, V]: Qwen3-Next's published MTP step over one whole sequence, in plain torch
    around transformers' decoder layer: ``fc(cat(pre_fc_norm_embedding(embed(next)),
    pre_fc_norm_hidden(hidden)))`` -> depth k's layer -> ``mtp.norm`` -> the trunk's ``lm_head``
    (norms zero-centred). Depth 0 reads the trunk's final hidden state (after its norm), depth
    k + 1 depth k's normed output, with the tokens shifted by k + 1, as megatron chains depths."""
    text = _text_model(model)
    embed, head = text.embed_tokens.weight, model.lm_head.weight
    hidden = text(tokens[None]).last_hidden_state[0]  # [n, H] after the final norm
    per_depth = []
    for depth, layer_model in enumerate(layer_models):
        embedded = embed[shifted_tokens(tokens, depth + 1)]  # [n, H]
        combined = torch.cat((_zero_centred_rms(embedded, mtp["mtp.pre_fc_norm_embedding.weight"]),
                              _zero_centred_rms(hidden, mtp["mtp.pre_fc_norm_hidden.weight"])), dim=-1)  # [n, 2H]
        # the one-layer model: depth k's layer, then its final norm = mtp.norm
        hidden = _text_model(layer_model)(inputs_embeds=(combined @ mtp["mtp.fc.weight"].T)[None]).last_hidden_state[0]
        per_depth.append(hidden @ head.T)
    return per_depth


@torch.no_grad()
def paged_logits(runner, tokens: torch.Tensor, tensor_parallel_size: int = 1, device="cpu"):
    """Our model over one request: prefill 5 rows, verify 3 rows as a decode request (1 + S = 3),
    commit after 1 accepted draft, decode position 7 as one row (it applies the kept rows), prefill
    the rest from position 8 -> decoder logits of positions ``0..4, 5..7, 7, 8..n-1`` [n + 1, V];
    then the whole sequence as one prefill in a fresh slot with every MTP depth over it -> [depth] [n, V]. ``tokens`` and the caches on ``device``."""
    from mtp_ctrl.models import MambaForward
    from mtp_ctrl.state import MambaStateSlots
    from tests.unit.megatron_fixtures import shifted_tokens

    n, blocks = tokens.shape[0], [[3, 0, 2, 1, 4, 5]]
    kv_caches = allocate_kv_caches(runner.num_kv_layers, 8, 2 // tensor_parallel_size, 16, device=device)
    slots = MambaStateSlots(runner.mamba_spec, 2, 2, torch.device(device))

    def forward(start, end, decode, slot=1):
        metadata = make_metadata(blocks, [(start, end - start)], device=device)
        slot_ids = torch.tensor([slot], device=device)
        mamba = MambaForward(slots.conv_states, slots.ssm_states, slots.intermediate_conv_states[:, :, :end - start],
                             slots.intermediate_ssm_states, verify_row_inputs=slots.verify_row_inputs,
                             pending_rows=slots.pending_rows, input_parity=slots.input_parity,
                             decode_slot_ids=slot_ids if decode else slot_ids[:0],
                             **({} if decode else dict(prefill_row_start=torch.tensor([0], device=device),
                                                       prefill_row_count=torch.tensor([end - start], device=device),
                                                       prefill_slot_ids=slot_ids)))
        logits, hidden = runner.forward(tokens[start:end], metadata.positions, metadata, kv_caches, mamba=mamba)
        return logits, hidden, metadata

    rows = [forward(0, 5, False)[0], forward(5, 8, True)[0]]
    one = torch.ones(1, dtype=torch.int64, device=device)  # slot 1, 1 accepted draft
    slots.commit_accepted(torch.zeros_like(one), one, one)  # GDN: the kept rows wait for the slot's next step
    rows.append(forward(7, 8, True)[0])  # one decode row: applies them, then its own
    slots.commit_accepted(torch.zeros_like(one), one, one - 1, rows_per_request=1)
    rows.append(forward(8, n, False)[0])
    _, hidden, metadata = forward(0, n, False, slot=0)
    mtp_logits = []
    for depth in range(runner.mtp_num_layers):
        logits, hidden = runner.mtp_forward(depth, hidden, shifted_tokens(tokens, depth + 1), metadata.positions,
                                            metadata, kv_caches)
        mtp_logits.append(logits)
    return torch.cat(rows), mtp_logits


def expected_decoder_rows(logits: torch.Tensor) -> torch.Tensor:
    """transformers' logits [n, V] at the rows :func:`paged_logits` returns."""
    return torch.cat((logits[:8], logits[7:]))
