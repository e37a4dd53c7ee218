"""The scripts people run: --help answers at once, --metrics-json writes the documented keys,
progress bars stay off when stdout is not a terminal, and megatron's known notices are hidden."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(str(path.relative_to(ROOT)) for folder in ("examples", "bench") for path in (ROOT / folder).glob("*.py")
                 if path.name not in ("byte_corpus.py", "demo_model.py", "steady_decode.py"))  # modules, not scripts
METRICS_KEYS = {"tokens_per_second", "emitted_tokens", "elapsed_seconds", "num_speculative_tokens", "verify_steps",
                "mean_accepted_length", "acceptance_per_depth", "drafted_per_depth", "accepted_per_depth", "draft_length_counts",
                "prefix_cache",
                "step_time"}
STEP_TIME_KEYS = {"steps", "step_seconds", "mean_step_ms", "gpu_steps", "gpu_seconds", "mean_gpu_ms"}


def run_script(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)  # the scripts' CPU path runs the torch references
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


BAD_CHECKPOINTS = [
    (["--checkpoint", "{corrupt}"], "error: --checkpoint {corrupt}: "),
    (["--checkpoint", "mtp_ctrl/checkpoints/eagle_demo.pt"], "is not a demo checkpoint"),
    (["--proposer", "eagle", "--draft-checkpoint", "{corrupt}"], "error: --draft-checkpoint {corrupt}: not a readable"),
    (["--proposer", "eagle", "--draft-checkpoint", "mtp_ctrl/checkpoints/mtp_demo.pt"], "not a draft-head checkpoint"),
    (["--proposer", "ptd", "--draft-checkpoint", "mtp_ctrl/checkpoints/eagle_demo.pt"], "it is a serial EAGLE head"),
]
REJECTED_DRAFTS = len(BAD_CHECKPOINTS)  # the index of the too-many-drafts run in failed_runs
# One interpreter imports torch and megatron-core once (not once a run), then forks a child per argv: it
# runs the script as __main__ with its own stdout / stderr files and ends as Python's top level would
# (SystemExit's message or a traceback on stderr, the exit status), then leaves by os._exit: tearing
# down the copied modules would cost each child seconds.
FORKED_RUNS = """
import atexit, gc, json, os, runpy, sys, tempfile, traceback
import mtp_ctrl
mtp_ctrl.quiet_known_warnings(False)
import torch, mtp_ctrl.cli.generate, mtp_ctrl.models.demo_model
gc.freeze()  # the children's collections skip (and do not copy) the imported objects
results = []
for argv in json.loads(sys.argv[1]):
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        sys.argv, code = argv, 0
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as stop:
            code = stop.code if stop.code is None or isinstance(stop.code, int) else print(stop.code, file=sys.stderr) or 1
        except BaseException:
            traceback.print_exc(); code = 1
        atexit._run_exitfuncs(); sys.stdout.flush(); sys.stderr.flush()
        os._exit(code or 0)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    results.append([status] + [(f.seek(0), f.read().decode())[1] for f in (out, err)])
print(json.dumps(results))
"""


def forked_runs(argvs, timeout):
    """[subprocess.CompletedProcess] of each argv (a script and its arguments) run by FORKED_RUNS."""
    result = run_script("-c", FORKED_RUNS, json.dumps(argvs), timeout=timeout)
    assert result.returncode == 0, result.stderr
    return [subprocess.CompletedProcess(argv, code, stdout, stderr)
            for argv, (code, stdout, stderr) in zip(argvs, json.loads(result.stdout.splitlines()[-1]))]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_usage_without_running(script):
    result = run_script(script, "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage:")
    assert "--verbose" in result.stdout
    assert "torch" not in result.stderr  # nothing imported torch-side and failed or warned


def test_generate_writes_metrics_json_quietly(tmp_path):
    path = tmp_path / "metrics.json"
    result = run_script("examples/generate.py", "--random-weights", "--device", "cpu", "--max-new-tokens", "4",
                        "--num-prompts", "1", "--repeats", "1", "--metrics-json", str(path))
    assert result.returncode == 0, result.stderr
    metrics = json.loads(path.read_text())
    assert set(metrics) == {"plain", "speculative", "comparison"}
    for mode in ("plain", "speculative"):
        assert set(metrics[mode]) == METRICS_KEYS
        assert set(metrics[mode]["step_time"]) == STEP_TIME_KEYS
        assert metrics[mode]["emitted_tokens"] == 4
    assert metrics["speculative"]["num_speculative_tokens"] == 2
    assert len(metrics["speculative"]["acceptance_per_depth"]) == 2
    comparison = metrics["comparison"]
    assert comparison["outputs_identical"] is True
    assert len(comparison["plain_tokens_per_second"]) == len(comparison["speculative_tokens_per_second"]) == 1
    assert "speed-up:" in result.stdout and "outputs identical: yes" in result.stdout
    assert "verdict:" in result.stdout and "only 1 timed run" in result.stdout  # it says the figure is rough
    # stdout is a pipe here: no progress bar (tqdm draws with carriage returns on stderr), plain lines instead
    assert "\r" not in result.stderr and "tok/s]" not in result.stderr and "it/s" not in result.stderr
    assert "warm-up run 1/4 (plain): 4/4 tokens done" in result.stdout
    assert "timed run 4/4 (speculative): 4/4 tokens done" in result.stdout and "(16 tokens in all)" in result.stdout
    # megatron-core's notices about Apex / Transformer Engine are filtered by message
    assert "Apex" not in result.stderr and "Transformer Engine" not in result.stderr


def test_generate_rejects_more_drafts_than_mtp_layers_before_running(failed_runs):
    result = failed_runs[1][REJECTED_DRAFTS]
    assert result.returncode != 0
    assert "--num-speculative-tokens 3" in result.stderr and "has 2" in result.stderr
    assert "--mtp-reuse-last-layer" in result.stderr  # the way out is named
    assert "tokens/s" not in result.stdout  # nothing was generated


def test_verbose_shows_megatron_notices_again():
    # the filter is the package helper the scripts call; --verbose skips it
    code = ("import warnings, mtp_ctrl; mtp_ctrl.quiet_known_warnings({verbose})\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('default')\n"
            "    mtp_ctrl.quiet_known_warnings({verbose})\n"
            "    warnings.warn('Apex is not installed. Falling back to Torch Norm')\n"
            "    warnings.warn('something else')\n"
            "print(sorted(str(w.message)[:14] for w in caught))")
    quiet = run_script("-c", code.format(verbose=False), timeout=30)
    loud = run_script("-c", code.format(verbose=True), timeout=30)
    assert quiet.stdout.strip() == "['something else']", quiet.stderr
    assert loud.stdout.strip() == "['Apex is not in', 'something else']", loud.stderr


DRAFTERS = [("eagle", 2), ("ptd", 3), ("multi_layer_eagle", 3)]


@pytest.fixture(scope="module")
def drafter_runs():
    """{proposer: subprocess.CompletedProcess} of examples/generate.py serving each shipped drafter."""
    argvs = [["examples/generate.py", "--device", "cpu", "--proposer", proposer, "--num-speculative-tokens", str(S),
              "--max-new-tokens", "6", "--num-prompts", "1", "--repeats", "1"] for proposer, S in DRAFTERS]
    # the demo has 2 MTP layers: S = 3 reruns the last one for the third draft
    argvs.append(["examples/generate.py", "--device", "cpu", "--num-speculative-tokens", "3", "--mtp-reuse-last-layer",
                  "--max-new-tokens", "6", "--num-prompts", "1", "--repeats", "1"])
    return dict(zip([proposer for proposer, _ in DRAFTERS] + ["mtp_reuse"], forked_runs(argvs, timeout=600)))


@pytest.mark.parametrize("proposer", [proposer for proposer, _ in DRAFTERS])
def test_generate_serves_each_shipped_drafter(drafter_runs, proposer):
    """--proposer picks the shipped head (mtp_ctrl/checkpoints) for the shipped target, and its output
    equals plain decoding."""
    result = drafter_runs[proposer]
    assert result.returncode == 0, result.stderr
    assert "outputs identical: yes" in result.stdout
    header = result.stdout.splitlines()[0]  # the drafter is named before anything slow happens
    assert header.startswith("generate: mtp_demo.pt on cpu") and f"from {proposer}_demo.pt" in header


def test_generate_reruns_the_last_mtp_layer_past_the_checkpoints_depth(drafter_runs):
    """--mtp-reuse-last-layer lifts the S <= MTP layers check (test above); output equals plain."""
    result = drafter_runs["mtp_reuse"]
    assert result.returncode == 0, result.stderr
    assert "outputs identical: yes" in result.stdout


def test_generate_names_the_missing_draft_checkpoint():
    """No shipped head is assumed for a target it was not trained for (here a random model)."""
    result = run_script("examples/generate.py", "--random-weights", "--device", "cpu", "--proposer", "ptd", timeout=60)
    assert result.returncode != 0 and "--proposer ptd needs --draft-checkpoint" in result.stderr


def test_generate_checks_its_arguments_before_importing_torch():
    cases = [["--device", "tpu"], ["--tp", "2"], ["--checkpoint", "missing.pt"], ["--load", "missing_dir"],
             ["--draft-checkpoint", "mtp_ctrl/checkpoints/eagle_demo.pt"], ["--random-weights", "--proposer", "eagle"],
             ["--max-new-tokens", "0"]]
    code = ("import sys\nfrom mtp_ctrl.cli import generate\n"
            f"for argv in {cases!r}:\n"
            "    try:\n        generate.parse_args(argv)\n    except SystemExit as stop:\n        assert stop.code == 2, argv\n"
            "    else:\n        raise AssertionError(argv)\n"
            "print('torch' in sys.modules)")
    result = run_script("-c", code, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == len(cases)
    for expected in ("--device must be cpu or cuda", "--tp 2 needs 2 processes", "--checkpoint missing.pt does not exist",
                     "--load missing_dir does not exist", "--draft-checkpoint PATH goes with --proposer",
                     "--proposer eagle needs --draft-checkpoint", "--max-new-tokens must be >= 1"):
        assert any(expected in line for line in errors), expected


@pytest.fixture(scope="module")
def failed_runs(tmp_path_factory):
    """[subprocess.CompletedProcess] of examples/generate.py for each BAD_CHECKPOINTS case, then
    the too-many-drafts case (REJECTED_DRAFTS): each fails before building the model."""
    corrupt = tmp_path_factory.mktemp("scripts") / "corrupt.pt"
    corrupt.write_bytes(b"\x80\x02 truncated")
    argvs = [["examples/generate.py", "--device", "cpu", *[flag.format(corrupt=corrupt) for flag in flags],
              "--num-speculative-tokens", "2", "--max-new-tokens", "2", "--num-prompts", "1", "--repeats", "1"]
             for flags, _ in BAD_CHECKPOINTS]
    argvs.append(["examples/generate.py", "--checkpoint", "mtp_ctrl/checkpoints/mtp_demo.pt",
                  "--num-speculative-tokens", "3"])
    return corrupt, forked_runs(argvs, timeout=300)


@pytest.mark.parametrize("case", range(len(BAD_CHECKPOINTS)))
def test_generate_reports_a_bad_checkpoint_in_one_error_line(failed_runs, case):
    corrupt, runs = failed_runs
    expected, result = BAD_CHECKPOINTS[case][1], runs[case]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and expected.format(corrupt=corrupt) in errors[0], \
        result.stderr


def test_generate_progress_is_a_bar_over_tokens_on_a_terminal_and_lines_otherwise(monkeypatch, capsys):
    from mtp_ctrl.cli import generate

    monkeypatch.setattr(generate, "PROGRESS_SECONDS", 0.0)  # a line at every step report
    for terminal in (True, False):
        monkeypatch.setattr(sys.stdout, "isatty", lambda: terminal, raising=False)
        progress = generate.Progress(num_runs=2, tokens_per_run=8, enabled=True)
        progress.start_run("warm-up", "plain")
        progress.add(3)
        progress.end_run(8, 0.5)
        progress.start_run("timed", "speculative")
        progress.end_run(8, 0.25)
        progress.close()
        captured = capsys.readouterr()
        if terminal:  # tqdm draws on stderr: the run in its description, tokens as its unit
            assert "timed run 2/2 (speculative)" in captured.err and "16/16" in captured.err
            assert "tok" in captured.err and captured.out == ""
        else:
            assert captured.out.splitlines() == [
                "warm-up run 1/2 (plain): 3/8 tokens so far, " + captured.out.splitlines()[0].split("so far, ")[1],
                "warm-up run 1/2 (plain): 8/8 tokens done, 16.0 tok/s (8 tokens in all)",
                "timed run 2/2 (speculative): 8/8 tokens done, 32.0 tok/s (16 tokens in all)"]
            assert captured.err == ""


def test_host_profile_compares_engines_in_one_process_on_cpu():
    """``bench/profile_step_host.py --compare``'s smoke run (its GPU runs cost device time): every
    engine built in one process, a column each, a row per host part."""
    result = run_script("bench/profile_step_host.py", "--device", "cpu", "--batch", "1", "--compare", "0:fixed",
                        "2:pinned0", "--steps", "2", "--rounds", "1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = next(index for index, line in enumerate(lines) if line.split()[:1] == ["part"])
    assert lines[start].split() == ["part", "0:fixed", "2:pinned0"]
    end = lines.index("", start)  # the table ends at a blank line; each engine's step() tail follows
    rows = {line.split()[0]: [float(value) for value in line.split()[1:]] for line in lines[start + 1:end]}
    assert {"choose", "plan_launch", "step", "build_step", "commit_readback", "reserve"} <= set(rows)
    assert rows["plan_launch"][1] > 0 == rows["plan_launch"][0]  # only the S = 2 engine plans MTP windows
    tails = [line.split()[0].rstrip(":") for line in lines[end + 2:] if " over 2 calls" in line]
    assert tails == ["0:fixed", "2:pinned0"]  # median / mean / tail of each engine's step() calls
    bad = run_script("bench/profile_step_host.py", "--device", "cpu", "--compare", "2:bogus")
    assert bad.returncode != 0 and "--compare" in bad.stderr


def test_the_benchmarks_pinned_policies_never_explore(monkeypatch):
    """``bench_adaptive.PinnedPlain`` (the "pinned 0" engine) holds D = 0 and ``PinnedGoodput`` S on
    every decision: neither tries another depth, nor times one again (``retime_explored``), however
    many steps pass (their figures are the policy path's cost at one depth)."""
    import numpy as np

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import bench_adaptive
    from mtp_ctrl.controllers.draft_policy import DraftLengthQuery
    from mtp_ctrl.state import EngineShape

    S, G = 2, 8
    shape = EngineShape(max_requests=G, max_model_len=64, block_size_tokens=4, num_speculative_tokens=S,
                        max_tokens_per_step=64)
    ids, caps = np.arange(G, dtype=np.int64), np.full(G, S, dtype=np.int64)
    for policy, depth in ((bench_adaptive.PinnedPlain(), 0), (bench_adaptive.PinnedGoodput(), S)):
        policy.bind(shape)
        for _ in range(50):  # 50 decisions of 64 steps each: past every exploration wait
            lengths = policy.choose(DraftLengthQuery(ids, caps, S, G, 64, num_waiting=G))
            assert lengths.tolist() == [depth] * G
            policy.observe(ids, lengths, np.minimum(lengths, 1))
        assert policy.explored == 0


def test_lossless_check_runs_every_schedule_on_cpu():
    """``bench/check_lossless.py --quick``: plain decoding and S = 2 over the all-at-once, a seeded
    random and the held-joins arrival schedules, every output compared with plain decoding's."""
    result = run_script("bench/check_lossless.py", "--quick", "--held-joins", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert sum(" requests differ from plain decoding's schedule 0" in line for line in lines) == 5  # 2 + 3 schedules
    assert lines[-1].endswith("0 differing outputs in all")
