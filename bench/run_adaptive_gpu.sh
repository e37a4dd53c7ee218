#!/usr/bin/env bash
# One device call for issue 34 (per-request draft lengths): the GPU test (draft lengths replay the
# warmed-up graphs of every verify tier with no host sync, == plain), then bench_adaptive.py under a time budget (its
# table last). Logs and the bench's JSON go to $OUT (or ./gpu_logs). Fits a 300 s call.
# Usage (device machine, repo root): bash bench/run_adaptive_gpu.sh [bench args, e.g. --demo-batches 32 128]
# Env: ADAPTIVE_TEST=0 skips the GPU test; ADAPTIVE_BUDGET (default 160) is the bench's budget in seconds.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
budget="${ADAPTIVE_BUDGET:-160}"
if [ "${ADAPTIVE_TEST:-1}" != 0 ]; then
  timeout 80 python3 -m pytest tests/functional/test_adaptive_gpu.py -q -x -p no:cacheprovider -W ignore 2>&1 \
    | tee "$out/functional.log" | tail -5
fi
timeout $((budget + 25)) python3 bench/bench_adaptive.py --budget-seconds "$budget" --json "$out/bench_adaptive.json" "$@" 2>&1 \
  | tee "$out/bench_adaptive.log" | grep -v -i warn | tail -90
