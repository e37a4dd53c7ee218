#!/usr/bin/env bash
# The rest of this session's GPU work in one call: the functional tests not yet run, then
# bench_sampling, bench_overlap and bench_speedup. Logs go to $OUT (or ./gpu_logs).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_logs}"; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
timeout 150 python3 -m pytest tests/functional/test_state_gpu.py tests/functional/test_step_ops_gpu.py \
  tests/functional/test_train_mtp_gpu.py -q -p no:cacheprovider -W ignore 2>&1 | tee "$out/functional.log" | tail -4
timeout 120 python3 bench/bench_sampling.py --quick 2>&1 | tee "$out/bench_sampling.log" | tail -14
timeout 150 python3 bench/bench_overlap.py 2>&1 | tee "$out/bench_overlap.log" | tail -15
timeout 120 python3 bench/bench_speedup.py --quick 2>&1 | tee "$out/bench_speedup.log" | tail -10
