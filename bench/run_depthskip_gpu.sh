#!/usr/bin/env bash
# One device call for issue 34's per-depth skipped MTP windows (helper depthskip, <= 240 s): the GPU
# tests of skipped windows (graphs of every plan replay with no host sync; drafts == run windows),
# then the D = 1 step of the S_max = 2 engine against fixed S = 1 / 2 (bench_depth_skip.py: demo at
# batch 32 and 128, windows run and skipped at M = 8 and 16), then bench_adaptive's demo points
# (fixed S = 0 / 1 / 2 and goodput, same process), then a short table. Each part under its own timeout.
# Usage (device machine, repo root): bash bench/run_depthskip_gpu.sh [--quick]   (--quick: CPU smoke run)
# Env: DEPTHSKIP_TEST_TIMEOUT (default 70 s: the helper's call, where 1 of the 6 tests ran; ~240 runs
# them all), DEPTHSKIP_STEP_TIMEOUT (80), DEPTHSKIP_TOTAL (225: bench_adaptive gets what is left).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" 2>/dev/null || { cd "$(dirname "$0")/.."; out="${OUT:-gpu_logs}"; mkdir -p "$out"; }
if [ "${1:-}" = "--quick" ]; then
  quick=(--quick); batches=(4); adaptive_batches=(4)
else
  quick=(); batches=(32 128); adaptive_batches=(32 128)
  echo "== GPU tests at ${SECONDS}s"
  timeout "${DEPTHSKIP_TEST_TIMEOUT:-70}" python3 -m pytest tests/functional/test_adaptive_gpu.py -k skipped_mtp_windows \
    -q -p no:cacheprovider -W ignore 2>&1 | tee "$out/functional.log" | tail -4
fi
echo "== bench_depth_skip at ${SECONDS}s"
timeout "${DEPTHSKIP_STEP_TIMEOUT:-80}" python3 bench/bench_depth_skip.py "${quick[@]}" --batches "${batches[@]}" \
  --catch-up-positions 8 16 2>&1 | tee "$out/bench_depth_skip.log" | grep -v -i warn | grep -v '^warm-up' | tail -14
left=$((${DEPTHSKIP_TOTAL:-225} - SECONDS))
echo "== bench_adaptive at ${SECONDS}s (${left}s left)"
if [ "$left" -gt 30 ]; then
  timeout "$left" python3 bench/bench_adaptive.py "${quick[@]}" --skip-large --demo-batches "${adaptive_batches[@]}" \
    --no-pinned --demo-goodput skip --budget-seconds $((left - 25)) --json "$out/bench_adaptive.json" 2>&1 \
    | tee "$out/bench_adaptive.log" | grep -v -i warn | grep -v '^{' | tail -30
fi
echo "== table at ${SECONDS}s"
grep -h "passed\|failed" "$out/functional.log" 2>/dev/null | tail -1
grep -h "^  \|^demo\|^NVIDIA\|^CPU" "$out/bench_depth_skip.log" 2>/dev/null
