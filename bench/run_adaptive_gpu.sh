#!/usr/bin/env bash
# One device call for issue 34 (per-request draft lengths): the GPU test (draft lengths replay the
# warmed-up graphs of every verify tier with no host sync, == plain), then bench_adaptive.py under a
# time budget (its table last: tokens/s of fixed S and the policy, measured acceptance per label).
# Logs and the bench's JSON go to $OUT (or ./gpu_logs). Fits a 300 s call (test <= 85 s, bench <=
# ADAPTIVE_BUDGET + 25 s; on 5b65363 the bench's points took ~105 s on an H100, the test over 60 s;
# the queued mixed workload and the policy's exploration calls add ~20 s).
# Usage (device machine, repo root): bash bench/run_adaptive_gpu.sh [--quick] [bench args]
#   --quick: CPU smoke run of the same script (tiny shapes; no GPU test).
# Env: ADAPTIVE_TEST=0 skips the GPU test; ADAPTIVE_BUDGET (default 150) is the bench's budget in seconds.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" 2>/dev/null || { cd "$(dirname "$0")/.."; out="${OUT:-gpu_logs}"; mkdir -p "$out"; }
budget="${ADAPTIVE_BUDGET:-150}"
if [ "${1:-}" = "--quick" ]; then
  shift
  timeout 600 python3 bench/bench_adaptive.py --quick --budget-seconds 60 --json "$out/bench_adaptive.json" "$@" 2>&1 \
    | tee "$out/bench_adaptive.log" | grep -v -i warn | tail -40
  exit
fi
if [ "${ADAPTIVE_TEST:-1}" != 0 ]; then
  timeout 85 python3 -m pytest tests/functional/test_adaptive_gpu.py -q -x -p no:cacheprovider -W ignore 2>&1 \
    | tee "$out/functional.log" | tail -5
fi
# the 1B first (its honest oracle workloads, closed and queued), then the demo at batch 1 / 32 / 128, T = 0 and 1
timeout $((budget + 25)) python3 bench/bench_adaptive.py --budget-seconds "$budget" --json "$out/bench_adaptive.json" \
  --large-batches 8 64 --demo-batches 1 32 128 "$@" 2>&1 \
  | tee "$out/bench_adaptive.log" | grep -v -i warn | grep -v '^{' | tail -120
