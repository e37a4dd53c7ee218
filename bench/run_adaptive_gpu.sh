#!/usr/bin/env bash
# One device call for issue 34 (per-request draft lengths): the GPU test (draft lengths replay the
# warmed-up graphs of every verify tier with no host sync, == plain), then bench_adaptive.py under a time budget (its
# table last). Logs and the bench's JSON go to $OUT (or ./gpu_logs). Fits a 300 s call.
# Usage (device machine, repo root): bash bench/run_adaptive_gpu.sh [bench args, e.g. --skip-large]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
timeout 80 python3 -m pytest tests/functional/test_adaptive_gpu.py -q -x -p no:cacheprovider -W ignore 2>&1 \
  | tee "$out/functional.log" | tail -5
timeout 185 python3 bench/bench_adaptive.py --budget-seconds 160 --json "$out/bench_adaptive.json" "$@" 2>&1 \
  | tee "$out/bench_adaptive.log" | tail -90
