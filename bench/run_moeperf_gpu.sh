#!/usr/bin/env bash
# One device call for issue 27's batch-1 MoE figures: the MoE GPU tests, then bench_moe on this
# tree, then (the same-run "before") on the checkout it was copied into, when there is one.
# Usage (device machine): bash bench/run_moeperf_gpu.sh [tests|bench|all|tests+after] [bench_moe args...]
#   (tests+after: the tests, then the bench on this tree only)
#   e.g. bash bench/run_moeperf_gpu.sh all --steps 10 --batches 1 --no-megatron
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
what="${1:-all}"; shift || true
bench_args=("$@"); [ ${#bench_args[@]} -eq 0 ] && bench_args=(--steps 10)
if [ "$what" = tests ] || [ "$what" = all ] || [ "$what" = tests+after ]; then
  timeout 90 python3 -m pytest tests/functional/test_moe_gpu.py -k "not parallel" -q -p no:cacheprovider -W ignore \
    2>&1 | tee "$out/moe_functional.log" | tail -6
fi
if [ "$what" = bench ] || [ "$what" = all ] || [ "$what" = tests+after ]; then
  echo "== after: this tree"
  timeout 200 python3 bench/bench_moe.py "${bench_args[@]}" 2>&1 | grep -v Warning | tee "$out/bench_moe_after.log" \
    | grep -v "^ *warnings.warn"
  base="$(cd ../.. 2>/dev/null && pwd)"  # the outer checkout when this tree is its .wt/<name>: the "before"
  if [ "$what" != tests+after ] && [ -f "$base/mtp_ctrl/models/moe_inference.py" ] && [ "$base" != "$PWD" ]; then
    echo "== before: $base ($(git -C "$base" log -1 --format=%h 2>/dev/null))"
    PYTHONPATH="$base:${PYTHONPATH#$PWD:}" timeout 200 python3 bench/bench_moe.py "${bench_args[@]}" 2>&1 \
      | grep -v Warning | tee "$out/bench_moe_before.log" | grep -v "^ *warnings.warn"
  fi
fi
