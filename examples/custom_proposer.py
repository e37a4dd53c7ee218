"""Plug a proposer of your own into the controller, and hook the end of each step.

    python examples/custom_proposer.py

``RepeatLastTokenProposer`` drafts S copies of the token each request sampled last: a cheap
drafter that pays off on repetitive text. Any proposer is lossless: the target verifies every
draft, so the output equals plain decoding whatever is drafted.
"""

import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from mtp_ctrl.controllers import DraftBatch, InferenceConfig, Proposer, SamplingParams, TextGenerationController
from mtp_ctrl.models import build_gpt_model


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


def main():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True)
    torch.manual_seed(0)
    model = build_gpt_model(config, vocab_size=64, max_sequence_length=128)  # no MTP layers needed
    controller = PrintingController(model, InferenceConfig(num_speculative_tokens=3, max_requests=2, max_model_len=64),
                                    proposer=RepeatLastTokenProposer())
    results = controller.generate([[1, 2, 3], [7, 7, 7, 7]], SamplingParams(max_new_tokens=8))
    for result in results:
        print(f"request {result.request_id}: {list(result.output_tokens)}, "
              f"mean accepted length {result.mean_accepted_length:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
