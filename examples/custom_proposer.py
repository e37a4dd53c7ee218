"""Plug a proposer of your own into the controller, and hook the end of each step.

    python examples/custom_proposer.py                     # RepeatLastTokenProposer
    python examples/custom_proposer.py --proposer neural   # AttentionDrafterProposer

``RepeatLastTokenProposer`` drafts S copies of the token each request sampled last: a cheap
drafter that pays off on repetitive text. ``AttentionDrafterProposer`` is a small neural
drafter with a paged KV cache of its own (docs/proposers.md walks through it): one attention
layer over the target's hidden states, then one linear head per draft. Here its weights are
random (train them on captured hidden states, see examples/train_eagle.py), so it rarely
guesses right. Any proposer is lossless: the target verifies every draft, so the output equals
plain decoding whatever is drafted.
"""

import argparse


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-speculative-tokens", type=int, default=3, help="S, tokens drafted per step")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--proposer", choices=("repeat", "neural"), default="repeat")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args(argv)
    if args.num_speculative_tokens < 1 or args.max_new_tokens < 1:
        parser.error("--num-speculative-tokens and --max-new-tokens must be >= 1")
    return args


if __name__ == "__main__":
    ARGS = parse_args()  # --help answers before torch and megatron-core load
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)  # before megatron-core is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from mtp_ctrl import init_single_process  # noqa: E402
from mtp_ctrl.controllers import (  # noqa: E402
    DraftBatch, InferenceConfig, Proposer, SamplingParams, TextGenerationController)
from mtp_ctrl.models import build_gpt_model  # noqa: E402
from mtp_ctrl.triton_ops import paged_attention, write_kv_cache  # noqa: E402


class RepeatLastTokenProposer(Proposer):
    def propose(self, batch: DraftBatch) -> torch.Tensor:
        # [G] -> [G, S] on the device: no host sync, nothing read back
        S = self.draft_context.shape.num_speculative_tokens
        return batch.next_tokens[:, None].expand(-1, S).clone()


class AttentionDrafter(torch.nn.Module):
    """One attention head over the target's final hidden states (its K/V kept per position in a
    paged cache), then S linear heads: head k reads the last verified row and predicts draft k."""

    def __init__(self, hidden_size: int, vocab_size: int, num_speculative_tokens: int, head_dim: int = 16):
        super().__init__()
        self.head_dim = head_dim
        self.qkv = torch.nn.Linear(hidden_size, 3 * head_dim)
        self.out = torch.nn.Linear(head_dim, hidden_size)
        self.heads = torch.nn.Linear(hidden_size, num_speculative_tokens * vocab_size)


class AttentionDrafterProposer(Proposer):
    """Drafts with an :class:`AttentionDrafter` (built in ``bind``, where the sizes are known).

    Every step, each of the step's rows writes its K/V into the drafter's cache at the row's own
    position (the same slots as the target's cache: the step's ``slot_mapping``). Rows of
    rejected drafts write positions past the bonus token ``e``; the next step's rows start at
    ``e`` and rewrite them before anything reads them, so the drafter only ever attends to
    verified positions ``[0, e)``. Then each request's last verified row (position ``e - 1``)
    attends over them and the heads give the S drafts, sampled with the request's own
    parameters at positions ``e + 1 .. e + S``. All device work, no host sync: it runs inside the
    step's CUDA graph.
    """

    def bind(self, draft_context):
        super().bind(draft_context)
        shape, runner = draft_context.shape, draft_context.runner
        torch.manual_seed(1)
        self.drafter = AttentionDrafter(runner.hidden_size, shape.vocab_size, shape.num_speculative_tokens)
        self.drafter = self.drafter.to(device=shape.device, dtype=shape.kv_dtype).eval()
        # [num_blocks, block_size, 1, D] keys and values, addressed by the target's block table
        (self.key_cache, self.value_cache), = draft_context.allocate_kv_cache(num_kv_heads=1,
                                                                              head_dim=self.drafter.head_dim)

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> torch.Tensor:
        context, attention, drafter = self.draft_context, batch.step.attention, self.drafter
        G, S, T = batch.num_requests, context.shape.num_speculative_tokens, batch.hidden.shape[0]
        device = batch.hidden.device
        query, key, value = drafter.qkv(batch.hidden).view(T, 3, 1, drafter.head_dim).unbind(1)  # [T, 1, D] each
        write_kv_cache(key.contiguous(), value.contiguous(), self.key_cache, self.value_cache,
                       attention.slot_mapping[:T])  # padding rows have slot -1: skipped
        last_rows = batch.last_accepted_rows.clamp(min=0)  # [G] int64, each request's row at e - 1
        one_row_each = torch.arange(G + 1, dtype=torch.int32, device=device)  # [G + 1]
        seq_lens = torch.where(batch.samples, batch.bonus_positions, 0).to(torch.int32)  # [G]: attend to [0, e)
        attended = paged_attention(query[last_rows].contiguous(), self.key_cache, self.value_cache,
                                   attention.block_table[:G], seq_lens, one_row_each, drafter.head_dim ** -0.5,
                                   max_query_len=1, max_seq_len=attention.max_seq_len)  # [G, 1, D]
        features = batch.hidden[last_rows] + drafter.out(attended.flatten(1))  # [G, H]
        logits = drafter.heads(features).view(G * S, -1)  # [G * S, V]: request-major, then depth
        table_rows = batch.write_rows.repeat_interleave(S)  # [G * S]: each request's table row (padding: scratch)
        positions = (batch.bonus_positions[:, None] + torch.arange(1, S + 1, device=device)).flatten()  # [G * S]
        return context.sample_rows(logits.float(), table_rows, positions).view(G, S)


class PrintingController(TextGenerationController):
    def on_step_end(self, outputs):
        for request_id, tokens, finished in outputs:
            print(f"  request {request_id}: +{tokens}{' (finished)' if finished else ''}")


def main(args):
    init_single_process("cpu")  # torch.distributed (gloo) and megatron's parallel_state at TP = 1
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True)
    torch.manual_seed(0)
    model = build_gpt_model(config, vocab_size=64, max_sequence_length=128)  # no MTP layers needed
    inference_config = InferenceConfig(num_speculative_tokens=args.num_speculative_tokens, max_requests=2,
                                       max_model_len=64)
    proposer = AttentionDrafterProposer() if args.proposer == "neural" else RepeatLastTokenProposer()
    controller = PrintingController(model, inference_config, proposer=proposer)
    results = controller.generate([[1, 2, 3], [7, 7, 7, 7]], SamplingParams(max_new_tokens=args.max_new_tokens))
    for result in results:
        print(f"request {result.request_id}: {list(result.output_tokens)}, "
              f"mean accepted length {result.mean_accepted_length:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
