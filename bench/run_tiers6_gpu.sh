#!/usr/bin/env bash
# One device call for issue 34, helper tiers6 (mixed steps' own verify tiers; joins take the held
# depth), <= 240 s in all (each part under its own timeout, the last part gets what is left of 225 s):
#  1. tests/functional/test_adaptive_gpu.py -k mixed_steps (<= 60 s): steps with prefill chunks replay
#     every verify tier's warmed-up graph with no host sync, == plain;
#  2. bench_adaptive.py (<= 125 s, no point started after 90 s): the 1B at batch 64 and 8, the closed mix
#     and the queued mix (4x the slots in requests), fixed S = 0..3 and goodput at S_max = 3; then the
#     demo at batch 32 and 128, T = 0 and 1, fixed S = 0..2 and goodput with the MTP windows skipped on
#     no-draft steps (tiers5's better engine);
#  3. the rest of tests/functional/test_adaptive_gpu.py (what is left of 225 s).
# Usage (device machine, repo root): bash bench/run_tiers6_gpu.sh [--quick]   (--quick: CPU smoke run, no tests)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" 2>/dev/null || { cd "$(dirname "$0")/.."; out="${OUT:-gpu_logs}"; mkdir -p "$out"; }
quick=()
points=(--large-batches 64 8 --demo-batches 32 128)
[ "${1:-}" = "--quick" ] && quick=(--quick) && points=()
if [ ${#quick[@]} -eq 0 ]; then
  timeout 60 python3 -m pytest tests/functional/test_adaptive_gpu.py -k mixed_steps -q -x -p no:cacheprovider -W ignore \
    2>&1 | tee "$out/functional_mixed.log" | tail -5
fi
echo "== bench at ${SECONDS}s"
timeout 125 python3 bench/bench_adaptive.py "${quick[@]}" --budget-seconds "${ADAPTIVE_BUDGET:-90}" \
  --json "$out/bench_adaptive.json" "${points[@]}" --large-workloads mixed queued --demo-goodput skip \
  --no-pinned 2>&1 | tee "$out/bench_adaptive.log" | grep -v -i warn | grep -v '^{' | tail -70
left=$((225 - SECONDS))
echo "== rest of the GPU test at ${SECONDS}s (${left}s left)"
if [ ${#quick[@]} -eq 0 ] && [ "$left" -gt 20 ]; then
  timeout "$left" python3 -m pytest tests/functional/test_adaptive_gpu.py -k "not mixed_steps" -q -p no:cacheprovider \
    -W ignore 2>&1 | tee "$out/functional.log" | tail -5
fi
