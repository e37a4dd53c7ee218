#!/usr/bin/env bash
# One device call for decode runs (InferenceConfig.decode_steps_per_launch): their GPU tests and the
# step-loop GPU tests they touch, then bench_overlap (step wall vs GPU with one step per launch and
# with decode runs), then the README's demo command. Logs go to $OUT (or ./gpu_logs).
# Usage (device machine, repo root): bash bench/run_decode_runs_gpu.sh [tests|bench|all]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
what="${1:-all}"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 330 python3 -m pytest tests/functional/test_decode_runs_gpu.py tests/functional/test_controller_gpu.py \
    tests/functional/test_overlap_gpu.py tests/functional/test_state_gpu.py \
    -q -p no:cacheprovider -W ignore -k "not tp2" 2>&1 | tee "$out/functional.log" | tail -15
  timeout 200 python3 bench/bench_overlap.py --quick 2>&1 | grep -v Warning | tee "$out/bench_overlap_quick.log" | tail -8
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 420 python3 bench/bench_overlap.py 2>&1 | grep -v Warning | tee "$out/bench_overlap.log" | tail -16
  timeout 120 python3 examples/generate.py --checkpoint mtp_ctrl/checkpoints/mtp_demo.pt 2>&1 | tee "$out/demo.log" | tail -14
fi
