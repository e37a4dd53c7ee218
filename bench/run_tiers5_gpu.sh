#!/usr/bin/env bash
# One device call for issue 34, helper tiers5 (a no-draft step's cost), <= 240 s:
#  1. profile_no_draft_gpu.py (<= 70 s): demo batch 128, plain vs the S = 2 engine at D = 0 with the MTP
#     windows run / skipped (wall, GPU, host split per step); the 1B closed batch at 0.2, plain vs goodput
#     (GPU per phase, top kernels);
#  2. bench_adaptive.py on the workloads that missed (demo batch 128 T = 0 / 1, 1B batch 64 at 0.2, mixed,
#     queued mixed) and demo batch 32 as a check (<= 90 s, points started within 60 s);
#  3. tests/functional/test_adaptive_gpu.py (<= 65 s).
# Usage (device machine, repo root): bash bench/run_tiers5_gpu.sh [--quick]   (--quick: CPU smoke run)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" 2>/dev/null || { cd "$(dirname "$0")/.."; out="${OUT:-gpu_logs}"; mkdir -p "$out"; }
quick=()
points=(--demo-batches 128 32 --large-batches 64)
[ "${1:-}" = "--quick" ] && quick=(--quick) && points=()
timeout 70 python3 bench/profile_no_draft_gpu.py "${quick[@]}" 2>&1 | tee "$out/profile_no_draft.log" | grep -v -i warn
timeout 90 python3 bench/bench_adaptive.py "${quick[@]}" --budget-seconds "${ADAPTIVE_BUDGET:-60}" \
  --json "$out/bench_adaptive.json" --demo-first "${points[@]}" \
  --large-workloads 0.2 mixed queued --no-pinned 2>&1 \
  | tee "$out/bench_adaptive.log" | grep -v -i warn | grep -v '^{' | tail -60
if [ ${#quick[@]} -eq 0 ]; then
  timeout 65 python3 -m pytest tests/functional/test_adaptive_gpu.py -q -x -p no:cacheprovider -W ignore 2>&1 \
    | tee "$out/functional.log" | tail -5
fi
