#!/usr/bin/env bash
# One device call for rejection acceptance's sampling_probs kernel: bench_rejection first (plain,
# exact match and rejection at T = 0.7 and 1.0 on the demo, same run), then the kernel's GPU tests
# (kernel == twin, graph replay without host sync) and the controller in rejection mode. Logs go to
# $OUT (or ./gpu_logs). Usage (device machine, repo root): bash bench/run_suite_gpu.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
timeout 95 python3 bench/bench_rejection.py 2>&1 | grep -v Warning | tee "$out/bench_rejection.log" | tail -14
timeout 40 python3 -m pytest tests/functional/test_sampling_filter_gpu.py tests/functional/test_rejection_gpu.py \
  -q -p no:cacheprovider -W ignore -k "sampling_filter or controller_in_rejection" 2>&1 | tee "$out/functional.log" | tail -8
