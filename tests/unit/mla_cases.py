"""Random paged latent-cache cases for the MLA kernel tests (CPU interpreter and GPU), and a
dense SDPA oracle: absorbed MLA is attention with one kv head whose key and value are the
cached row ``[latent | rope key]`` (the output's rope dims dropped)."""

import dataclasses

import torch

from tests.unit.paged_attention_cases import PagedCase, dense_attention, make_paged_case


@dataclasses.dataclass
class MLACase:
    paged: PagedCase  # one kv head of width C + R; value_cache is key_cache
    latent_dim: int

    @property
    def query_latent(self):
        return self.paged.query[..., :self.latent_dim].contiguous()

    @property
    def query_rope(self):
        return self.paged.query[..., self.latent_dim:].contiguous()

    @property
    def latent_cache(self):
        return self.paged.key_cache[:, :, 0]

    def op_args(self):
        case = self.paged
        return (self.query_latent, self.query_rope, self.latent_cache, case.block_table, case.seq_lens,
                case.query_start_loc, case.softmax_scale)

    def expected(self):
        return dense_attention(self.paged)[..., :self.latent_dim]


def make_mla_case(q_lens, seq_lens, *, num_heads, latent_dim, rope_dim, block_size_tokens, dtype=torch.float32,
                  device="cpu", padding_rows=0, seed=0) -> MLACase:
    case = make_paged_case(q_lens, seq_lens, num_query_heads=num_heads, num_kv_heads=1,
                           head_dim=latent_dim + rope_dim, block_size_tokens=block_size_tokens, dtype=dtype,
                           device=device, padding_rows=padding_rows, seed=seed)
    case.value_cache, case.values = case.key_cache, case.keys
    return MLACase(case, latent_dim)
