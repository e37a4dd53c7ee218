"""GenerationMetrics' tokens/s counts the time the controller works, not the time between calls."""

import time

from mtp_ctrl.controllers.metrics import GenerationMetrics


def test_tokens_per_second_leaves_out_idle_time_between_calls():
    metrics = GenerationMetrics(num_speculative_tokens=2)
    assert metrics.tokens_per_second() == 0.0  # nothing ran yet
    metrics.record_step(0.25, steps=2)  # a first generate call: 2 steps in 0.25 s, 10 tokens
    metrics.emitted_tokens += 10
    time.sleep(0.05)  # the caller's own work between two generate calls
    metrics.record_step(0.25)  # a second call: 1 step, 10 more tokens
    metrics.emitted_tokens += 10
    assert metrics.tokens_per_second() == 20 / 0.5
    summary = metrics.as_dict()
    assert summary["tokens_per_second"] == 20 / 0.5
    assert summary["elapsed_seconds"] >= 0.05  # wall time since the reset still includes the idle time
