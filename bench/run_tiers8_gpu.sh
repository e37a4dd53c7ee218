#!/usr/bin/env bash
# One device call for issue 34, helper tiers8 (step costs calibrated by the loop's realised walls;
# a 2 % margin for deeper drafts; garbage collections counted per point), <= 240 s in all:
#  1. bench_adaptive.py (<= 160 s, no point started after TIERS8_BUDGET s): the demo at batch 32 and
#     128, T = 0 and 1 (fixed S = 0..2 and goodput, the default engine), then the 1B at batch 64, the
#     queued mix (fixed S = 0..3 and goodput at S_max = 3); per point the goodput policy's cost
#     model (steady wall, realised wall and calibration, realised vs expected tokens a request-step)
#     and the garbage collections inside the timed generates;
#  2. profile_no_draft_gpu.py --skip-large (<= 45 s): the demo at batch 128, plain against the S = 2
#     engine drafting nothing (windows skipped) with a forced catch-up every M + 1 steps, M = 8 and 32;
#  3. what is left of 225 s: tests/functional/test_adaptive_gpu.py (graphs, no host sync, == plain).
# Usage (device machine, repo root): bash bench/run_tiers8_gpu.sh [--quick]   (--quick: CPU smoke run, no tests)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" 2>/dev/null || { cd "$(dirname "$0")/.."; out="${OUT:-gpu_logs}"; mkdir -p "$out"; }
quick=()
points=(--large-batches 64 --demo-batches 32 128)
if [ "${1:-}" = "--quick" ]; then quick=(--quick --new-tokens 4); points=(--large-batches 4 --skip-demo); fi
echo "== bench at ${SECONDS}s"
timeout 160 python3 bench/bench_adaptive.py "${quick[@]}" --budget-seconds "${TIERS8_BUDGET:-110}" \
  --json "$out/bench_adaptive.json" "${points[@]}" --demo-first --large-workloads queued --demo-goodput skip --no-pinned 2>&1 \
  | tee "$out/bench_adaptive.log" | grep -v -i warn | grep -v '^{' | tail -60
echo "== no-draft step at ${SECONDS}s"
timeout 45 python3 bench/profile_no_draft_gpu.py --skip-large --skip-run-windows --catch-up-positions 8 32 \
  "${quick[@]:0:1}" 2>&1 | tee "$out/profile_no_draft.log" | grep -v -i warn
left=$((225 - SECONDS))
echo "== GPU test at ${SECONDS}s (${left}s left)"
if [ ${#quick[@]} -eq 0 ] && [ "$left" -gt 25 ]; then
  timeout "$left" python3 -m pytest tests/functional/test_adaptive_gpu.py -q -x -p no:cacheprovider -W ignore 2>&1 \
    | tee "$out/functional.log" | tail -5
fi
echo "== done at ${SECONDS}s"
