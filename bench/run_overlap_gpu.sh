#!/usr/bin/env bash
# One device call for the step loop, the fused forward, sampling and rejection acceptance: their
# GPU tests, then bench_overlap, bench_forward, bench_rejection and bench_speedup (the tables in
# RESULTS' "Overlapped step loop", "Mixed-step graphs", "Fused layer glue" and "Rejection" sections).
# Usage (device machine, repo root): bash bench/run_overlap_gpu.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
timeout 200 python3 -m pytest tests/functional/test_controller_gpu.py tests/functional/test_overlap_gpu.py \
  tests/functional/test_mtp_draft_oracles_gpu.py \
  tests/functional/test_state_gpu.py tests/functional/test_forward_gpu.py tests/functional/test_sampling_gpu.py \
  tests/functional/test_layer_glue_gpu.py tests/functional/test_rejection_gpu.py \
  -q -p no:cacheprovider -W ignore -k "not tp2 and not churn" 2>&1 | tee "$out/functional.log" | tail -12
timeout 150 python3 bench/bench_overlap.py 2>&1 | grep -v Warning | tee "$out/bench_overlap.log" | tail -16
timeout 120 python3 bench/bench_forward.py 2>&1 | tee "$out/bench_forward.log" | tail -30
timeout 60 python3 bench/bench_rejection.py 2>&1 | tee "$out/bench_rejection.log" | tail -10
timeout 60 python3 bench/bench_sampling.py 2>&1 | tee "$out/bench_sampling.log" | tail -12
