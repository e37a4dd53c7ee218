#!/usr/bin/env bash
# One device call for MLA (issue 30): its GPU tests, then bench_mla (RESULTS' "MLA" section).
# Usage (device machine, repo root): bash bench/run_mla_gpu.sh [kernels|tune|e2e]
#   kernels (default): tests/functional/test_mla_gpu.py + the kernel table (default tiles vs the
#     shape table vs the fastest --tune candidate, 16 and 128 heads, batch 1/32/128, 2k-128k)
#   tune: the kernel table only
#   e2e: the kernel table at the default and table tiles + sections 2-4 (the MLA GPT's decode steps)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
mode="${1:-kernels}"
if [ "$mode" = kernels ]; then
  timeout 75 python3 -m pytest tests/functional/test_mla_gpu.py -q -x -p no:cacheprovider -W ignore 2>&1 \
    | tee "$out/functional_mla.log" | tail -8
  timeout 175 python3 bench/bench_mla.py --tune --kernels-only 2>&1 | tee "$out/bench_mla_tune.log"
elif [ "$mode" = tune ]; then
  timeout 240 python3 bench/bench_mla.py --tune --kernels-only 2>&1 | tee "$out/bench_mla_tune.log"
else
  timeout 240 python3 bench/bench_mla.py --e2e 2>&1 | tee "$out/bench_mla.log"
fi
