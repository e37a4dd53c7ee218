"""examples/custom_proposer.py: its neural drafter (a paged KV cache of its own, bound through a
DraftContext only) keeps the output equal to plain decoding, greedy and sampled, with arrivals,
chunked prefill and preemption; the script runs end to end."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_ctrl.controllers import SamplingParams
from tests.unit.controller_fixtures import PROMPTS, build_models, make_controller, run_with_arrivals
from tests.unit.megatron_fixtures import ensure_single_process_groups

ROOT = Path(__file__).resolve().parents[2]


def _example():
    spec = importlib.util.spec_from_file_location("custom_proposer_example", ROOT / "examples" / "custom_proposer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the classes; main() runs only as a script
    return module


@pytest.fixture(scope="module")
def model():
    ensure_single_process_groups()
    return build_models()[0]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_neural_drafter_equals_plain_under_churn(model, torch_twins, temperature):
    arrivals = [(step, list(PROMPTS[index % len(PROMPTS)]),
                 SamplingParams(max_new_tokens=6 + index, temperature=temperature, seed=index))
                for index, step in enumerate([0, 0, 1, 2, 2, 4])]
    plain = run_with_arrivals(make_controller(model, 0, overlap_scheduling=False), arrivals)
    # few KV blocks: requests are preempted and recomputed, their drafter cache rewritten from position 0
    controller = make_controller(model, 2, proposer=_example().AttentionDrafterProposer(), num_kv_blocks=12,
                                 max_tokens_per_step=16)
    assert run_with_arrivals(controller, arrivals) == plain
    assert controller.metrics.verify_steps > 0
    assert controller.context.allocator.num_free_blocks == controller.context.allocator.num_blocks


def test_script_runs_the_neural_drafter():
    completed = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_proposer.py"), "--proposer", "neural",
                                "--max-new-tokens", "4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert "request 0:" in completed.stdout and "mean accepted length" in completed.stdout
