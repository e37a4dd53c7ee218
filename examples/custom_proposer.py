"""Plug a proposer of your own into the controller, and hook the end of each step.

    python examples/custom_proposer.py

``RepeatLastTokenProposer`` drafts S copies of the token each request sampled last: a cheap
drafter that pays off on repetitive text. Any proposer is lossless: the target verifies every
draft, so the output equals plain decoding whatever is drafted.
"""

import argparse


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-speculative-tokens", type=int, default=3, help="S, tokens drafted per step")
    parser.add_argument("--max-new-tokens", type=int, default=8)
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


class RepeatLastTokenProposer(Proposer):
    def bind(self, controller):
        super().bind(controller)
        self.num_speculative_tokens = controller.config.num_speculative_tokens

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        # [n] -> [n, S] on the device: no host sync, nothing read back
        next_tokens = batch.next_tokens[: batch.num_sampling_requests]  # [n]
        return next_tokens[:, None].expand(-1, self.num_speculative_tokens).clone()


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
    controller = PrintingController(model, inference_config, proposer=RepeatLastTokenProposer())
    results = controller.generate([[1, 2, 3], [7, 7, 7, 7]], SamplingParams(max_new_tokens=args.max_new_tokens))
    for result in results:
        print(f"request {result.request_id}: {list(result.output_tokens)}, "
              f"mean accepted length {result.mean_accepted_length:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
