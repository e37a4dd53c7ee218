#!/usr/bin/env bash
# Device calls for issue 33 (prefix caching). Logs go to $OUT (or ./gpu_logs).
#   bash bench/run_prefix_gpu.sh profile   # where a hit's TTFT goes: attention test, then
#       bench/profile_prefix_hit.py (steps, graph or eager, kernel times) on this tree and, with
#       BASELINE=DIR (another checkout, e.g. main), on DIR's package in the same call
#   bash bench/run_prefix_gpu.sh           # the GPU test (on == off in CUDA graphs, a hit's admission
#       with a step in flight under sync-debug "error"; dense, Mamba-2 and GDN hybrids), then
#       bench_prefix_cache: TTFT cold vs hit per prefix length (2k, 8k, 16k) on the ~1B GPT and a Mamba
#       hybrid, then the batch workloads (64 requests sharing a 2k system prompt, multi-turn chat,
#       random prompts; caching on vs off, same run)
# QUICK=1 runs the python parts with --quick on the CPU (a smoke test of this script).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
mode="${1:-all}"
quick=""; [ "${QUICK:-0}" = 1 ] && quick="--quick"
lengths="2048,16384"; short="2048"; [ -n "$quick" ] && lengths="64,128" && short="64"
if [ "$mode" = profile ]; then
  [ -z "$quick" ] && timeout 45 python3 -m pytest tests/functional/test_attention_gpu.py -q -x -p no:cacheprovider \
    -W ignore 2>&1 | tee "$out/attention_test.log" | tail -3
  if [ -n "${BASELINE:-}" ] && [ -d "$BASELINE/mtp_ctrl" ]; then
    echo "== baseline: $BASELINE ($(git -C "$BASELINE" log -1 --format=%h 2>/dev/null || echo unknown))"
    PYTHONPATH="$(cd "$BASELINE" && pwd):/tmp/site" timeout 95 python3 bench/profile_prefix_hit.py $quick \
      --prefix-lengths "$lengths" --repeats 3 --kernels 2>&1 | grep -v Warning | tee "$out/profile_baseline.log"
  fi
  echo "== this tree"
  timeout 95 python3 bench/profile_prefix_hit.py $quick --prefix-lengths "$lengths" --repeats 3 --kernels \
    2>&1 | grep -v Warning | tee "$out/profile_branch.log"
  echo "== this tree, controllers sized for the short prefix"
  timeout 45 python3 bench/profile_prefix_hit.py $quick --prefix-lengths "$short" --model-len $((short + 352)) \
    --repeats 5 --host-profile 2>&1 | grep -v Warning | tee "$out/profile_branch_short.log" | grep -v "^    launch"
  exit 0
fi
timeout 100 python3 -m pytest tests/functional/test_prefix_cache_gpu.py -q -p no:cacheprovider -W ignore 2>&1 \
  | tee "$out/functional.log" | tail -6
timeout 95 python3 bench/bench_prefix_cache.py $quick --parts sweep,hybrid --json "$out/bench_prefix_sweep.json" 2>&1 \
  | grep -v Warning | tee "$out/bench_prefix_sweep.log" | tail -14
timeout 85 python3 bench/bench_prefix_cache.py $quick --parts batch --json "$out/bench_prefix_cache.json" 2>&1 \
  | grep -v Warning | tee "$out/bench_prefix_cache.log" | tail -14
