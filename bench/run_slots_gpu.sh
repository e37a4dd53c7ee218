#!/usr/bin/env bash
# One device call for stable slots (issue 26 item 1): the slot-indexed step kernels on CUDA, then
# the GPU tests that cover the step loop (TP = 2 cases skipped: one GPU). Logs go to $OUT (or ./gpu_logs).
# Usage (device machine, repo root): bash bench/run_slots_gpu.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
timeout 150 python3 -m pytest tests/functional/test_step_glue_gpu.py tests/functional/test_overlap_gpu.py \
  tests/functional/test_state_gpu.py tests/functional/test_decode_runs_gpu.py tests/functional/test_graph_replay_gpu.py \
  tests/functional/test_controller_gpu.py -q -x -p no:cacheprovider -W ignore -k "not tp2" 2>&1 \
  | tee "$out/functional.log" | tail -15
