#!/usr/bin/env bash
# One device call for MLA (issue 30): its GPU tests, then bench_mla (RESULTS' "MLA" section).
# Usage (device machine, repo root): bash bench/run_mla_gpu.sh [kernels|tune|e2e]
#   kernels (default): tests/functional/test_mla_gpu.py + the kernel tables at the default tiles
#   tune: the kernel tables with every tile configuration
#   e2e: the kernel tables + the MLA GPT's decode steps
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
mode="${1:-kernels}"
if [ "$mode" = kernels ]; then
  timeout 55 python3 -m pytest tests/functional/test_mla_gpu.py -q -x -p no:cacheprovider -W ignore 2>&1 \
    | tee "$out/functional_mla.log" | tail -8
  timeout 45 python3 bench/bench_mla.py 2>&1 | tee "$out/bench_mla.log"
elif [ "$mode" = tune ]; then
  timeout 140 python3 bench/bench_mla.py --tune 2>&1 | tee "$out/bench_mla_tune.log"
else
  timeout 140 python3 bench/bench_mla.py --e2e 2>&1 | tee "$out/bench_mla.log"
fi
