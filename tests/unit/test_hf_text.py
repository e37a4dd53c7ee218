"""HFText (tokenizer.json through ``tokenizers``, EOS ids, chat template) against ``transformers``'
tokenizer of the same files, and stop strings through the controller on a loaded checkpoint."""

import shutil

import pytest
import torch

pytest.importorskip("transformers")

from mtp_ctrl.models import load_hf_checkpoint  # noqa: E402
from mtp_ctrl.models.hf_text import HFText  # noqa: E402
from tests.unit import hf_fixtures  # noqa: E402
from tests.unit.megatron_fixtures import ensure_single_process_groups  # noqa: E402

TEXTS = ["the quick brown fox", "speculative decoding of megatron models", "zebras jump quickly!"]


@pytest.fixture(scope="module")
def mimo_with_tokenizer(tmp_path_factory):
    ensure_single_process_groups()
    directory = tmp_path_factory.mktemp("mimo_text")
    hf_fixtures.write_mimo(directory)
    special = hf_fixtures.write_tokenizer(directory)
    return directory, special


def test_encode_decode_eos_and_chat_template_match_transformers(mimo_with_tokenizer):
    from transformers import AutoTokenizer

    directory, special = mimo_with_tokenizer
    text, oracle = HFText(directory), AutoTokenizer.from_pretrained(str(directory))
    for sample in TEXTS:
        assert text.encode(sample) == oracle(sample)["input_ids"]
        assert text.encode(sample, add_special_tokens=False) == oracle(sample, add_special_tokens=False)["input_ids"]
        ids = text.encode(sample)
        assert text.decode(ids) == oracle.decode(ids, skip_special_tokens=True)
    assert text.eos_token_ids == (special["</s>"],)
    messages = [{"role": "user", "content": "the lazy dog"}]
    rendered = oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<s>user: the lazy dog</s><s>assistant:"
    assert text.apply_chat_template(messages) == oracle(rendered, add_special_tokens=False)["input_ids"]


def test_missing_files_and_bad_arguments(tmp_path, mimo_with_tokenizer):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFText(tmp_path)
    with pytest.raises(TypeError, match="path"):
        HFText(None)
    shutil.copy(mimo_with_tokenizer[0] / "tokenizer.json", tmp_path / "tokenizer.json")
    text = HFText(tmp_path)
    assert text.eos_token_ids == ()  # no generation_config.json, config.json or tokenizer_config.json
    with pytest.raises(ValueError, match="no chat template"):
        text.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="stop strings"):
        text.stop_strings("abc")
    with pytest.raises(TypeError, match="text"):
        text.encode(5)


def test_stop_strings_end_the_output_at_the_first_match(mimo_with_tokenizer, torch_twins):
    """Speculative (S = 2) with every draft accepted (an oracle proposer drafting the plain greedy
    continuation), so a stop string can complete in the middle of a step's tokens: the output is
    the plain output's shortest prefix whose text holds the stop string."""
    from mtp_ctrl.cli.hf_generate import stop_string_controller_class
    from mtp_ctrl.controllers import InferenceConfig, SamplingParams
    from tests.unit.controller_fixtures import OracleProposer

    directory, _ = mimo_with_tokenizer
    text = HFText(directory)
    model = load_hf_checkpoint(directory, device="cpu")
    prompt = text.encode("the quick brown fox")

    def run(speculative, stop_strings, max_new_tokens, proposer=None):
        config = InferenceConfig(num_speculative_tokens=speculative, max_requests=2, block_size_tokens=4,
                                 max_model_len=48, max_tokens_per_step=32)
        controller_class = stop_string_controller_class(text.stop_strings(stop_strings) if stop_strings else None)
        controller = controller_class(model, config, proposer=proposer, seed=0)
        return list(controller.generate([prompt], SamplingParams(max_new_tokens=max_new_tokens))[0].output_tokens)

    plain = run(0, None, 16)  # 12 tokens to search, and the oracle's drafts past them
    full_text = text.decode(plain[:12])
    stop = next(full_text[i:i + 3] for i in range(4, len(full_text) - 3)
                if full_text[i:i + 3].strip() == full_text[i:i + 3])
    expected = next(plain[:n] for n in range(1, 13) if stop in text.decode(plain[:n]))
    assert len(expected) < 12
    oracle = OracleProposer({rid: prompt + plain for rid in range(4)}, lambda rid, index: 2)  # all drafts right
    output = run(2, [stop], 12, proposer=oracle)
    assert output == expected
    assert max(max(counts, default=0) for counts in oracle.observed.values()) == 2  # steps of 3 tokens ran
    assert text.stop_strings([stop]).cut(text.decode(output)) == full_text[:full_text.find(stop)]


def test_stream_decoder_and_the_server_adapter(mimo_with_tokenizer):
    """Streamed text == the whole decode, however the ids arrive; the server's adapter adds BOS to a
    plain prompt but not to a rendered chat prompt (which carries its own)."""
    from mtp_ctrl.serve.hf_tokenizer import HFTokenizer

    directory, special = mimo_with_tokenizer
    text = HFText(directory)
    generator = torch.Generator().manual_seed(0)
    ids = text.encode("speculative decoding drafts tokens", add_special_tokens=False) + \
        torch.randint(3, text.vocab_size, (20,), generator=generator).tolist()
    for chunk in (1, 2, 5):
        stream = text.new_stream_decoder()
        streamed = "".join(stream.decode(ids[i:i + chunk]) for i in range(0, len(ids), chunk)) + stream.flush()
        assert streamed == text.decode(ids), chunk
    adapter = HFTokenizer(text)
    messages = [{"role": "user", "content": "the lazy dog"}]
    assert adapter.encode(adapter.apply_chat_template(messages)) == text.apply_chat_template(messages)
    assert adapter.encode("the fox") == text.encode("the fox") and adapter.encode("the fox")[0] == special["<s>"]
    assert adapter.eos_token_ids == (special["</s>"],) and adapter.has_chat_template
    assert adapter.stop_token_sequences(["x"]) == ()
