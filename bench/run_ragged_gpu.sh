#!/usr/bin/env bash
# One device call for issue 34, helper ragged (per-request verify rows: a decode request runs 1 + s_r
# rows; PerRequestGoodputPolicy), <= 300 s in all, each part under its own timeout:
#  1. tests/functional/test_adaptive_gpu.py -k ragged (<= 70 s): ragged token counts' graphs replay with
#     no host sync, == eager == plain, nothing captured while serving (device oracle + random lengths;
#     paged MTP + the per-request policy);
#  2. bench_adaptive.py (<= 170 s, no point started after ADAPTIVE_BUDGET = 120 s): the 1B at batch 64
#     and 8, the closed mix and the queued mix, fixed S = 0..3, goodput (one D) and per-request goodput
#     (ragged rows) in the same run;
#  3. the rest of tests/functional/test_adaptive_gpu.py (what is left of 280 s): the fixed policy's and
#     the goodput policy's graphs and replays as before.
# Usage (device machine, repo root): bash bench/run_ragged_gpu.sh [--quick]   (--quick: CPU smoke run, no tests)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" 2>/dev/null || { cd "$(dirname "$0")/.."; out="${OUT:-gpu_logs}"; mkdir -p "$out"; }
quick=()
points=(--large-batches 64 8)
[ "${1:-}" = "--quick" ] && quick=(--quick) && points=()
if [ ${#quick[@]} -eq 0 ]; then
  timeout 70 python3 -m pytest tests/functional/test_adaptive_gpu.py -k ragged -q -x -p no:cacheprovider -W ignore \
    2>&1 | tee "$out/functional_ragged.log" | tail -5
fi
echo "== bench at ${SECONDS}s"
timeout 170 python3 bench/bench_adaptive.py "${quick[@]}" --budget-seconds "${ADAPTIVE_BUDGET:-120}" \
  --json "$out/bench_adaptive.json" --skip-demo "${points[@]}" --large-workloads mixed queued \
  2>&1 | tee "$out/bench_adaptive.log" | grep -v -i warn | grep -v '^{' | tail -60
left=$((280 - SECONDS))
echo "== rest of the GPU test at ${SECONDS}s (${left}s left)"
if [ ${#quick[@]} -eq 0 ] && [ "$left" -gt 25 ]; then
  timeout "$left" python3 -m pytest tests/functional/test_adaptive_gpu.py -k "not ragged" -q -p no:cacheprovider \
    -W ignore 2>&1 | tee "$out/functional.log" | tail -5
fi
