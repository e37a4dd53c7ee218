import pytest

from mtp_ctrl.controllers.config import SamplingParams
from mtp_ctrl.controllers.stop_rules import FinishReason, accept_new_tokens


@pytest.mark.parametrize(
    "params, prior, new, emitted, reason",
    [
        (SamplingParams(max_new_tokens=10, eos_token_ids=(2,)), [], [5, 2, 7], [5, 2], FinishReason.EOS),
        (SamplingParams(max_new_tokens=10), [1], [3, 4], [3, 4], None),
        (SamplingParams(max_new_tokens=3), [1], [3, 4, 5], [3, 4], FinishReason.LENGTH),
        # a stop sequence that starts in an earlier step
        (SamplingParams(max_new_tokens=10, stop_sequences=((8, 9, 1),)), [8], [9, 1, 6], [9, 1], FinishReason.STOP_SEQUENCE),
        (SamplingParams(max_new_tokens=10, stop_sequences=((9, 9),)), [], [9, 8, 9, 9, 4], [9, 8, 9, 9], FinishReason.STOP_SEQUENCE),
    ],
)
def test_accept_new_tokens(params, prior, new, emitted, reason):
    output = list(prior)
    got, got_reason = accept_new_tokens(output, new, params, prompt_len=4, max_model_len=100)
    assert got == emitted and got_reason == reason
    assert output == prior + emitted


def test_max_model_len_stops_generation():
    output = []
    got, reason = accept_new_tokens(output, [1, 2, 3], SamplingParams(max_new_tokens=50), prompt_len=6, max_model_len=8)
    assert got == [1, 2] and reason == FinishReason.MAX_MODEL_LEN


def test_no_new_tokens_emit_nothing():
    output = [1]
    assert accept_new_tokens(output, [], SamplingParams(max_new_tokens=1), prompt_len=4, max_model_len=8) == ([], None)
    assert output == [1]


def _naive_stop(output, new_tokens, params, prompt_len, max_model_len):
    """The rules read literally, token by token (the oracle of the vectorised implementation)."""
    output, kept = list(output), []
    for token in new_tokens:
        output.append(token)
        kept.append(token)
        if token in params.eos_token_ids:
            return kept, FinishReason.EOS
        if any(tuple(output[-len(seq):]) == seq for seq in params.stop_sequences if len(output) >= len(seq)):
            return kept, FinishReason.STOP_SEQUENCE
        if len(output) >= params.max_new_tokens:
            return kept, FinishReason.LENGTH
        if prompt_len + len(output) >= max_model_len:
            return kept, FinishReason.MAX_MODEL_LEN
    return kept, None


def test_vectorised_rules_equal_the_rules_read_literally():
    """Random requests (eos lists longer than the vectorised columns, stop sequences spanning
    steps, every length limit): accept_new_tokens == the token-by-token oracle."""
    import random

    rng = random.Random(5)
    for _ in range(400):
        params = SamplingParams(max_new_tokens=rng.randint(1, 8),
                                eos_token_ids=tuple(rng.sample(range(8), rng.choice([0, 1, 2, 6]))),
                                stop_sequences=tuple(tuple(rng.randrange(8) for _ in range(rng.randint(1, 3)))
                                                     for _ in range(rng.choice([0, 0, 1, 2]))))
        output = [rng.randrange(8) for _ in range(rng.randint(0, 4))]
        new = [rng.randrange(8) for _ in range(rng.randint(1, 4))]
        prompt_len = rng.randint(1, 5)
        want = _naive_stop(output, new, params, prompt_len, 12)
        got_output = list(output)
        assert accept_new_tokens(got_output, new, params, prompt_len, 12) == want
        assert got_output == output + want[0]
