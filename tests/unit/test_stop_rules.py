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
