"""Tiny random Hugging Face checkpoints written by ``transformers`` (no download), and a plain-torch MTP oracle.

Every checkpoint has the shapes of ``megatron_fixtures``' tiny model (2 layers, hidden 64, 4
query heads over 2 kv heads, head_dim 16, vocabulary 96) so its paged schedule and KV helpers
apply. MiMo has no class in ``transformers``: its trunk is a Qwen2 model, and its MTP layers are
random tensors in MiMo's published layout, written as a second safetensors shard with an index.
"""

import json
import math
from pathlib import Path
from typing import Dict, Tuple

import torch
import torch.nn.functional as F

from tests.unit.megatron_fixtures import MAX_SEQUENCE_LENGTH, VOCAB_SIZE

TINY_SHAPE = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=MAX_SEQUENCE_LENGTH, rms_norm_eps=1e-6)
MIMO_MTP_DEPTH = 2
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _save(model, directory: Path) -> None:
    model.save_pretrained(str(directory), safe_serialization=True)


def write_llama(directory: Path, seed: int = 0):
    """A Llama-3 checkpoint with llama3 rope scaling, untied output layer. Returns the HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**TINY_SHAPE, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    _save(model, directory)
    return model


def write_qwen3(directory: Path, seed: int = 1):
    """A Qwen3 checkpoint (q/k norms) with tied embeddings. Returns the HF model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY_SHAPE, tie_word_embeddings=True)).eval()
    _save(model, directory)
    return model


def mimo_mtp_tensors(depths: int, seed: int = 3) -> Dict[str, torch.Tensor]:
    """Random MTP layers in MiMo's layout (``model.mtp_layers.{k}.*``), fp32."""
    generator = torch.Generator().manual_seed(seed)
    hidden, ffn, heads, kv_heads, head_dim = 64, 128, 4, 2, 16

    def rand(*shape, scale=0.05):
        return torch.randn(*shape, generator=generator) * scale

    def norm(size):
        return 1.0 + rand(size, scale=0.1)

    tensors = {}
    for depth in range(depths):
        p = f"model.mtp_layers.{depth}."
        tensors.update({
            p + "token_layernorm.weight": norm(hidden), p + "hidden_layernorm.weight": norm(hidden),
            p + "input_proj.weight": rand(hidden, 2 * hidden), p + "final_layernorm.weight": norm(hidden),
            p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden), p + "self_attn.q_proj.bias": rand(heads * head_dim),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden), p + "self_attn.k_proj.bias": rand(kv_heads * head_dim),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden), p + "self_attn.v_proj.bias": rand(kv_heads * head_dim),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(ffn, hidden), p + "mlp.up_proj.weight": rand(ffn, hidden),
            p + "mlp.down_proj.weight": rand(hidden, ffn),
        })
    return tensors


def write_mimo(directory: Path, seed: int = 2) -> Tuple[object, Dict[str, torch.Tensor]]:
    """A MiMo checkpoint: a Qwen2 trunk (``save_pretrained``) plus MIMO_MTP_DEPTH MTP layers in a
    second shard, an index over both, and MiMo's config fields. Returns (HF Qwen2 trunk, MTP tensors)."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    trunk = Qwen2ForCausalLM(Qwen2Config(**TINY_SHAPE, tie_word_embeddings=False)).eval()
    _save(trunk, directory)
    mtp = mimo_mtp_tensors(MIMO_MTP_DEPTH)
    save_file(mtp, str(directory / "model-mtp.safetensors"), metadata={"format": "pt"})
    trunk_names = list(trunk.state_dict())
    weight_map = {name: "model.safetensors" for name in trunk_names}
    weight_map.update({name: "model-mtp.safetensors" for name in mtp})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((directory / "config.json").read_text())
    config.update(architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=MIMO_MTP_DEPTH)
    (directory / "config.json").write_text(json.dumps(config))
    return trunk, mtp


# ----- a plain-torch MTP step in MiMo's published layout (independent of megatron) -----------------

def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:  # [T, heads, D], half-split
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim)  # [D / 2]
    angles = positions.float()[:, None] * inv_freq  # [T, D / 2]
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
    rotated = torch.cat((-x[..., dim // 2:], x[..., :dim // 2]), dim=-1)
    return x * cos + rotated * sin


def qwen2_layer(w: Dict[str, torch.Tensor], p: str, x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """One Qwen2 decoder layer over one causal sequence ``x`` [T, H] at positions 0..T-1."""
    seq_len, heads, kv_heads, head_dim = x.shape[0], 4, 2, 16
    positions = torch.arange(seq_len, device=x.device)
    y = _rms(x, w[p + "input_layernorm.weight"])
    q = (y @ w[p + "self_attn.q_proj.weight"].T + w[p + "self_attn.q_proj.bias"]).view(seq_len, heads, head_dim)
    k = (y @ w[p + "self_attn.k_proj.weight"].T + w[p + "self_attn.k_proj.bias"]).view(seq_len, kv_heads, head_dim)
    v = (y @ w[p + "self_attn.v_proj.weight"].T + w[p + "self_attn.v_proj.bias"]).view(seq_len, kv_heads, head_dim)
    q, k = _rope(q, positions, theta), _rope(k, positions, theta)
    k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(head_dim)  # [heads, T, T]
    scores = scores.masked_fill(torch.ones(seq_len, seq_len, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    attention = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(seq_len, heads * head_dim)
    x = x + attention @ w[p + "self_attn.o_proj.weight"].T
    y = _rms(x, w[p + "post_attention_layernorm.weight"])
    return x + (F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) @ \
        w[p + "mlp.down_proj.weight"].T


@torch.no_grad()
def mimo_mtp_reference(mtp: Dict[str, torch.Tensor], depth: int, hidden: torch.Tensor, next_tokens: torch.Tensor,
                       embedding: torch.Tensor, lm_head: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """MiMo's MTP depth over one sequence: ``input_proj(cat(hidden_layernorm(hidden),
    token_layernorm(embed(next))))`` -> Qwen2 layer -> ``final_layernorm`` -> shared ``lm_head``.
    ``hidden`` [T, H] (the trunk's normed output, or the previous depth's output), ``next_tokens``
    [T] int64. Returns (logits [T, V], output [T, H])."""
    p = f"model.mtp_layers.{depth}."
    combined = torch.cat((_rms(hidden, mtp[p + "hidden_layernorm.weight"]),
                          _rms(embedding[next_tokens], mtp[p + "token_layernorm.weight"])), dim=-1)  # [T, 2H]
    out = _rms(qwen2_layer(mtp, p, combined @ mtp[p + "input_proj.weight"].T), mtp[p + "final_layernorm.weight"])
    return out @ lm_head.T, out


# ----- a tiny tokenizer (trained here with the tokenizers library) --------------------------------

CHAT_TEMPLATE = ("{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "speculative decoding drafts tokens and verifies them",
          "megatron models predict several tokens at once", "a small model of words and letters for tests",
          "pack my box with five dozen liquor jugs", "how vexingly quick daft zebras jump"] * 4


def write_tokenizer(directory: Path) -> Dict[str, int]:
    """A BPE tokenizer of VOCAB_SIZE ids (Metaspace, like SentencePiece) with <s>, </s> and a chat
    template; generation_config.json names </s> as EOS. Returns the special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(CORPUS, trainer)
    assert tokenizer.get_vocab_size() <= VOCAB_SIZE
    special = {name: tokenizer.token_to_id(name) for name in ("<s>", "</s>")}
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", special["<s>"])])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [special["</s>"]]}))
    return special
