"""examples/train_mtp.py on a tiny model: training lowers every loss, the checkpoint loads into the paged
model, and speculative generation on it (S = 2) emits plain decoding's tokens."""

import math
import sys
from pathlib import Path

import pytest
import torch

from mtp_ctrl.controllers import InferenceConfig, SamplingParams, TextGenerationController
from tests.unit.megatron_fixtures import ensure_single_process_groups

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # the scripts import siblings by name
import byte_corpus  # noqa: E402
import demo_model  # noqa: E402
import train_mtp  # noqa: E402

TINY_MODEL_ARGS = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                       mtp_num_layers=2, vocab_size=256, max_sequence_length=128)
SEQ_LEN = 48


@pytest.fixture(scope="module")
def corpus():
    return byte_corpus.load_stdlib_corpus()


@pytest.fixture(scope="module")
def trained(corpus):
    """(dense model after 40 steps, held-out report before, held-out report after, last training report)."""
    ensure_single_process_groups()
    torch.manual_seed(0)
    model = demo_model.build_demo_model(TINY_MODEL_ARGS, dense=True, mtp_loss_scaling_factor=0.5)
    before = train_mtp.evaluate(model, corpus.held_out, SEQ_LEN, num_windows=8)
    report = train_mtp.train(model, corpus.train, steps=40, batch_size=8, seq_len=SEQ_LEN, lr=1e-2, seed=0,
                             log_every=20)
    after = train_mtp.evaluate(model, corpus.held_out, SEQ_LEN, num_windows=8)
    return model, before, after, report


def test_corpus_holds_out_the_last_files(corpus):
    files = [path.name for path in byte_corpus.stdlib_source_files()]
    assert Path(corpus.held_out_files[-1]).name == files[-1]
    assert corpus.held_out.dtype == torch.uint8 and corpus.held_out.numel() < corpus.train.numel()
    assert byte_corpus.decode_bytes(list(b"def f():") + [300]) == "def f():"


def test_training_lowers_held_out_and_every_mtp_loss(trained):
    _, before, after, report = trained
    assert after.loss < before.loss - 0.5, (before, after)
    assert len(after.mtp_losses) == 2
    for depth in range(2):
        assert after.mtp_losses[depth] < before.mtp_losses[depth] - 0.5, (before, after)
    assert len(report.mtp_losses) == 2 and all(math.isfinite(value) for value in report.mtp_losses)
    assert report.loss < math.log(256)


def test_checkpoint_loads_strictly_into_the_paged_model(trained, tmp_path):
    model = trained[0]
    path = tmp_path / "tiny.pt"
    demo_model.save_checkpoint(str(path), TINY_MODEL_ARGS, model)
    model_args, state_dict = demo_model.load_checkpoint(str(path))
    assert model_args == TINY_MODEL_ARGS
    assert all(value.dtype == demo_model.CHECKPOINT_DTYPE for value in state_dict.values() if torch.is_tensor(value))
    paged = demo_model.build_demo_model(model_args)
    paged.load_state_dict(state_dict)  # strict
    for name, value in paged.state_dict().items():
        if torch.is_tensor(value):
            torch.testing.assert_close(value, model.state_dict()[name].to(torch.bfloat16).float())


def test_checkpoint_file_of_another_format_is_rejected(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="not a demo checkpoint"):
        demo_model.load_checkpoint(str(path))


def test_speculative_generation_on_the_trained_model_equals_plain(trained, corpus, tmp_path, torch_twins):
    # the subject is the trained checkpoint in the loop, not the kernels: torch twins (conftest)
    path = tmp_path / "tiny.pt"
    demo_model.save_checkpoint(str(path), TINY_MODEL_ARGS, trained[0])
    model_args, state_dict = demo_model.load_checkpoint(str(path))
    paged = demo_model.build_demo_model(model_args)
    demo_model.load_full_state_dict(paged, state_dict)
    prompts = [window.tolist() for window in byte_corpus.evenly_spaced_windows(corpus.held_out, 2, 12)]
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    outputs = {}
    for S in (0, 2):
        config = InferenceConfig(num_speculative_tokens=S, max_requests=2, block_size_tokens=4, max_model_len=32,
                                 max_tokens_per_step=32)
        controller = TextGenerationController(paged.eval(), config)
        outputs[S] = [result.output_tokens for result in controller.generate(prompts, params)]
    assert outputs[2] == outputs[0]
    assert all(len(tokens) == 10 for tokens in outputs[0])
