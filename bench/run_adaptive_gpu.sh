#!/usr/bin/env bash
# One device call for issue 34 (per-request draft lengths): the GPU test (draft lengths replay the
# warmed-up graphs of every verify tier with no host sync, == plain), then bench_adaptive.py under a
# time budget (its table last: tokens/s of fixed S and the policy, measured acceptance per label).
# Logs and the bench's JSON go to $OUT (or ./gpu_logs). Test <= ADAPTIVE_TEST_TIMEOUT (default 200) s,
# bench <= ADAPTIVE_BUDGET + 25 s, then (while the script is under ADAPTIVE_TOTAL - 60 s) the no-draft
# step's profile (demo, batch 128: plain against the S = 2 engine drafting nothing).
# The whole issue-34 call (seventh session): ADAPTIVE_BUDGET=270 bash bench/run_adaptive_gpu.sh
#   --large-batches 64 8 --large-workloads mixed queued --demo-batches 32 128 --demo-goodput skip --no-pinned
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
  timeout "${ADAPTIVE_TEST_TIMEOUT:-200}" python3 -m pytest tests/functional/test_adaptive_gpu.py -q -p no:cacheprovider -W ignore 2>&1 \
    | tee "$out/functional.log" | tail -5
fi
# the 1B first (its honest oracle workloads, closed and queued), then the demo at batch 1 / 32 / 128, T = 0 and 1
timeout $((budget + 25)) python3 bench/bench_adaptive.py --budget-seconds "$budget" --json "$out/bench_adaptive.json" \
  --large-batches 8 64 --demo-batches 1 32 128 "$@" 2>&1 \
  | tee "$out/bench_adaptive.log" | grep -v -i warn | grep -v '^{' | tail -120
if [ $((${ADAPTIVE_TOTAL:-560} - SECONDS)) -gt 60 ]; then
  echo "== no-draft step profile at ${SECONDS}s"
  timeout $((${ADAPTIVE_TOTAL:-560} - SECONDS)) python3 bench/profile_no_draft_gpu.py --skip-large --skip-run-windows 2>&1 \
    | tee "$out/profile_no_draft.log" | grep -v -i warn | tail -8
fi
