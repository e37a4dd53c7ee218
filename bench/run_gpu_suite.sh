#!/usr/bin/env bash
# Everything GPU-side in one go: functional tests, then every benchmark. Logs go to $OUT (or ./gpu_logs).
# Usage: bash bench/run_gpu_suite.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_logs}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/device.txt"
python3 -m pytest tests/functional -q -p no:cacheprovider -x 2>&1 | tee "$out/functional.log" | tail -25
for bench in bench/bench_*.py; do
  name=$(basename "$bench" .py)
  echo "== $name"
  python3 "$bench" "$@" > "$out/$name.log" 2>&1 || echo "FAILED: $name (see $out/$name.log)"
  tail -40 "$out/$name.log"
done
