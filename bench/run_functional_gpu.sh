#!/usr/bin/env bash
# One device call: the named tests/functional files (default: all), each file under its own time
# cap so one slow file cannot eat the call; a summary table last.
# Usage (device machine, repo root): bash bench/run_functional_gpu.sh [CAP_S] [test_x_gpu.py ...]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
cap="${1:-120}"; shift || true
files=("$@"); [ ${#files[@]} -eq 0 ] && files=($(cd tests/functional && ls test_*_gpu.py))
summary=""
for f in "${files[@]}"; do
  log="$out/${f%.py}.log"
  timeout "$cap" python3 -m pytest "tests/functional/$f" -q -p no:cacheprovider -W ignore -rfs --tb=short > "$log" 2>&1
  rc=$?
  summary+="$(printf '%-34s rc=%-3s %s' "$f" "$rc" "$(grep -E '^[0-9]+ (passed|failed)|passed|failed|error' "$log" | tail -1)")"$'\n'
done
for f in "${files[@]}"; do grep -E "^(FAILED|ERROR)" "$out/${f%.py}.log" | head -5; done
echo "$summary"
