"""GenerationMetrics' tokens/s counts the time the controller works, not the time between calls."""

import time

import numpy as np

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


def test_acceptance_counts_per_depth_and_draft_length_from_random_steps():
    """Per depth: drafted = request-steps that verified at least that many drafts, accepted = those
    that accepted at least that many; verify steps by drafts verified; in any order of steps."""
    rng = np.random.default_rng(3)
    for S in (1, 2, 3):
        metrics = GenerationMetrics(num_speculative_tokens=S)
        all_lengths, all_counts = [], []
        for _ in range(20):
            n = int(rng.integers(0, 9))
            lengths = rng.integers(0, S + 1, size=n) * (rng.random() < 0.7)  # some steps verify nothing
            counts = (rng.random(n) * (lengths + 1)).astype(np.int64)  # accepted <= verified
            given = None if rng.random() < 0.3 else lengths
            if given is not None and not lengths.any() and rng.random() < 0.5:
                metrics.record_no_drafts(n)  # the controller's path for a step where nobody verified a draft
            else:
                metrics.record_acceptance(counts, given)
            all_lengths += (lengths if given is not None else np.full(n, S)).tolist()
            all_counts += counts.tolist()
        lengths, counts = np.array(all_lengths, np.int64), np.array(all_counts, np.int64)
        data = metrics.as_dict()
        assert data["verify_steps"] == len(lengths)
        assert data["drafted_per_depth"] == [int((lengths > depth).sum()) for depth in range(S)]
        assert data["accepted_per_depth"] == [int((counts > depth).sum()) for depth in range(S)]
        assert data["draft_length_counts"] == [int((lengths == k).sum()) for k in range(S + 1)]
        assert data["mean_accepted_length"] == 1 + counts.sum() / len(counts)
        metrics.reset()
        assert metrics.as_dict()["draft_length_counts"] == [0] * (S + 1) and metrics.drafted_per_depth == [0] * S
