#!/usr/bin/env bash
# One device call for issue 34, helper tiers7 (skipped MTP windows caught up exactly; "skip" the
# default), <= 240 s:
#  1. tests/functional/test_adaptive_gpu.py -k skipped_mtp (<= 75 s): graphs of every catch-up plan
#     replay with no host sync, == eager == plain; drafts with the windows skipped == run;
#  2. profile_no_draft_gpu.py --skip-large (<= 40 s): demo batch 128, plain vs the S = 2 engine at
#     D = 0 with the windows run / skipped (forced catch-ups included);
#  3. bench_adaptive.py, demo batch 128 and 32, T = 0 / 1: fixed S = 0, 1, 2, goodput (default:
#     skip), goodput with mtp_idle_windows="run" (<= 100 s, points started within TIERS7_BUDGET s);
#  4. the rest of test_adaptive_gpu.py when time is left (TIERS7_REST=1).
# Usage (device machine, repo root): bash bench/run_tiers7_gpu.sh [--quick]   (--quick: CPU smoke run)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" 2>/dev/null || { cd "$(dirname "$0")/.."; out="${OUT:-gpu_logs}"; mkdir -p "$out"; }
quick=()
points=(--demo-batches 128 32)
[ "${1:-}" = "--quick" ] && quick=(--quick) && points=()
if [ ${#quick[@]} -eq 0 ]; then
  timeout 75 python3 -m pytest tests/functional/test_adaptive_gpu.py -k skipped_mtp -q -p no:cacheprovider \
    -W ignore 2>&1 | tee "$out/functional.log" | tail -5
fi
timeout 40 python3 bench/profile_no_draft_gpu.py --skip-large "${quick[@]}" 2>&1 | tee "$out/profile_no_draft.log" \
  | grep -v -i warn
timeout 100 python3 bench/bench_adaptive.py "${quick[@]}" --budget-seconds "${TIERS7_BUDGET:-65}" \
  --json "$out/bench_adaptive.json" --skip-large --no-pinned --demo-goodput both "${points[@]}" 2>&1 \
  | tee "$out/bench_adaptive.log" | grep -v -i warn | grep -v '^{' | tail -40
if [ ${#quick[@]} -eq 0 ] && [ "${TIERS7_REST:-0}" = 1 ]; then
  timeout 60 python3 -m pytest tests/functional/test_adaptive_gpu.py -k "not skipped_mtp" -q -x -p no:cacheprovider \
    -W ignore 2>&1 | tee "$out/functional_rest.log" | tail -5
fi
