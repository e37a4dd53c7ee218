"""examples/train_mtp.py on CUDA: a tiny model's training lowers its losses, and its checkpoint serves
speculative generation (S = 2) with plain decoding's tokens."""

import sys
from pathlib import Path

import torch

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from tests.unit.megatron_fixtures import ensure_single_process_groups

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # the scripts import siblings by name
import byte_corpus  # noqa: E402
import demo_model  # noqa: E402
import train_mtp  # noqa: E402

TINY_MODEL_ARGS = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                       mtp_num_layers=2, vocab_size=256, max_sequence_length=128)
SEQ_LEN = 64


def test_training_on_gpu_then_generation_from_its_checkpoint(tmp_path):
    ensure_single_process_groups()
    corpus = byte_corpus.load_stdlib_corpus()
    train_tokens, held_out = corpus.train.cuda(), corpus.held_out.cuda()
    torch.manual_seed(0)
    model = demo_model.build_demo_model(TINY_MODEL_ARGS, dense=True, mtp_loss_scaling_factor=0.5).cuda()
    before = train_mtp.evaluate(model, held_out, SEQ_LEN, num_windows=8)
    train_mtp.train(model, train_tokens, steps=60, batch_size=16, seq_len=SEQ_LEN, lr=1e-2, seed=0, log_every=30)
    after = train_mtp.evaluate(model, held_out, SEQ_LEN, num_windows=8)
    assert after.loss < before.loss - 0.5, (before, after)
    assert all(a < b - 0.5 for a, b in zip(after.mtp_losses, before.mtp_losses)), (before, after)

    path = tmp_path / "tiny.pt"
    demo_model.save_checkpoint(str(path), TINY_MODEL_ARGS, model)
    model_args, state_dict = demo_model.load_checkpoint(str(path))
    paged = demo_model.build_demo_model(model_args)
    demo_model.load_full_state_dict(paged, state_dict)
    paged = paged.cuda().eval()
    prompts = [window.tolist() for window in byte_corpus.evenly_spaced_windows(corpus.held_out, 4, 24)]
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    outputs = {}
    for S in (0, 2):
        config = InferenceConfig(num_speculative_tokens=S, max_requests=4, block_size_tokens=16, max_model_len=64,
                                 max_tokens_per_step=128)
        controller = TextGenerationController(paged, config)
        outputs[S] = [result.output_tokens for result in controller.generate(prompts, params)]
    assert outputs[2] == outputs[0]
