#!/usr/bin/env bash
# One device call for the step loop: controller/state GPU tests, then bench_overlap and bench_speedup.
# Usage (device machine, repo root): bash bench/run_overlap_gpu.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_logs}"; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
timeout 300 python3 -m pytest tests/functional/test_controller_gpu.py tests/functional/test_step_ops_gpu.py \
  tests/functional/test_mtp_draft_oracles_gpu.py tests/functional/test_state_gpu.py -q -p no:cacheprovider -W ignore -k "not tp2" 2>&1 \
  | tee "$out/functional.log" | tail -15
timeout 400 python3 bench/bench_overlap.py "$@" 2>&1 | grep -v Warning | tee "$out/bench_overlap.log" | tail -22
