#!/usr/bin/env bash
# Device calls for issue 33 (prefix caching). Logs go to $OUT (or ./gpu_logs).
#   bash bench/run_prefix_gpu.sh profile  # where a hit's TTFT goes: bench/profile_prefix_hit.py (steps,
#       graph or eager, kernel times; 2k and 16k prefixes) on this tree and, with BASELINE=DIR (another
#       checkout, e.g. main), on DIR's package in the same call; then the paged attention GPU test
#   bash bench/run_prefix_gpu.sh bench    # the GPU test (on == off in CUDA graphs, a hit's admission
#       with a step in flight under sync-debug "error"; dense, Mamba-2 and GDN hybrids), then
#       bench_prefix_cache: TTFT cold vs hit per prefix length (2k, 8k, 16k) on the ~1B GPT and a Mamba
#       hybrid, then the batch workloads (64 requests sharing a 2k system prompt, multi-turn chat,
#       random prompts; caching on vs off, same run)
#   bash bench/run_prefix_gpu.sh check    # the GPU test; on a failure, its evicting case alone, here and
#       on BASELINE (is a failure this tree's?)
#   bash bench/run_prefix_gpu.sh          # both, shorter: profile, the GPU tests, the batch workloads
#   bash bench/run_prefix_gpu.sh final    # one call of <= 220 s, most important first, each part bounded by
#       what is left of FINAL_SECONDS (190): the GPU test (all cases), the batch workloads, bench_split_combine
#       (this tree and, with BASELINE, DIR's kernels in the same process), profile_prefix_hit at 2k (cold,
#       hit, the decode floor, the 64-request batch call by call), the 8k point and a hybrid with nothing shared
#   bash bench/run_prefix_gpu.sh target   # what `final` cut short on a cold H100: the batch workloads on vs off
#       (the 64-request 10x target), the GDN hybrid GPU test case, the 8k point, a hybrid with nothing shared
# QUICK=1 runs the python parts with --quick on the CPU (a smoke test of this script).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
mode="${1:-all}"
quick=""; [ "${QUICK:-0}" = 1 ] && quick="--quick"
lengths="2048,16384"; short="2048"; [ -n "$quick" ] && lengths="64,128" && short="64"

profile() {  # $1: seconds for each profile run
  if [ -n "${BASELINE:-}" ] && [ -d "$BASELINE/mtp_ctrl" ]; then
    echo "== baseline: $BASELINE ($(git -C "$BASELINE" log -1 --format=%h 2>/dev/null || echo unknown))"
    PYTHONPATH="$(cd "$BASELINE" && pwd):/tmp/site" timeout "$1" python3 bench/profile_prefix_hit.py $quick \
      --prefix-lengths "$lengths" --repeats 3 --kernels 2>&1 | grep -v Warning | tee "$out/profile_baseline.log"
  fi
  echo "== this tree"
  timeout "$1" python3 bench/profile_prefix_hit.py $quick --prefix-lengths "$lengths" --repeats 3 --kernels \
    2>&1 | grep -v Warning | tee "$out/profile_branch.log"
}
gpu_tests() {  # $1: seconds for each file
  [ -n "$quick" ] && return
  for file in tests/functional/test_prefix_cache_gpu.py tests/functional/test_attention_gpu.py; do
    timeout "$1" python3 -m pytest "$file" -q -x -p no:cacheprovider -W ignore 2>&1 \
      | tee "$out/$(basename "$file" .py).log" | tail -3
  done
}
short_controller() {  # $1: seconds
  echo "== this tree, controllers sized for the short prefix"
  timeout "$1" python3 bench/profile_prefix_hit.py $quick --prefix-lengths "$short" --model-len $((short + 352)) \
    --repeats 5 --host-profile 2>&1 | grep -v Warning | tee "$out/profile_branch_short.log" | grep -v "^    launch"
}
batch() {  # $1: seconds
  timeout "$1" python3 bench/bench_prefix_cache.py $quick --parts batch --json "$out/bench_prefix_cache.json" 2>&1 \
    | grep -v Warning | tee "$out/bench_prefix_cache.log" | tail -14
}
check() {  # the prefix-cache GPU test on this tree; on a failure, its evicting case alone here and on BASELINE
  local test=tests/functional/test_prefix_cache_gpu.py
  timeout 50 python3 -m pytest "$test" -q -p no:cacheprovider -W ignore 2>&1 | tee "$out/check_branch.log" | tail -4
  if ! grep -q " passed" "$out/check_branch.log" || grep -q "failed" "$out/check_branch.log"; then
    echo "== this tree, the evicting case alone"
    timeout 25 python3 -m pytest "$test" -q -p no:cacheprovider -W ignore -k 18 2>&1 | tail -2
    if [ -n "${BASELINE:-}" ] && [ -d "$BASELINE/mtp_ctrl" ]; then
      echo "== baseline $BASELINE, the evicting case alone"
      (cd "$BASELINE" && PYTHONPATH="$PWD:/tmp/site" timeout 25 python3 -m pytest "$test" -q -p no:cacheprovider \
        -W ignore -k 18 2>&1 | tail -2)
    fi
  fi
}
final() {
  local stop=$((SECONDS + ${FINAL_SECONDS:-190}))
  left() { local rest=$((stop - SECONDS)); [ "$rest" -lt 5 ] && rest=5; echo $(( rest < $1 ? rest : $1 )); }
  if [ -z "$quick" ]; then
    timeout "$(left 55)" python3 -m pytest tests/functional/test_prefix_cache_gpu.py -q -p no:cacheprovider -W ignore \
      2>&1 | tee "$out/test_prefix_cache_gpu.log" | tail -3
  fi
  echo "== batch workloads (left $((stop - SECONDS)) s)"
  batch "$(left 55)"
  echo "== split combine (left $((stop - SECONDS)) s)"
  timeout "$(left 30)" python3 bench/bench_split_combine.py $quick ${BASELINE:+--baseline "$BASELINE"} 2>&1 \
    | grep -v Warning | tee "$out/bench_split_combine.log" | tail -13
  echo "== profile at the short prefix, the floor, the batch call by call (left $((stop - SECONDS)) s)"
  timeout "$(left 45)" python3 bench/profile_prefix_hit.py $quick --prefix-lengths "$short" --model-len $((short + 352)) \
    --repeats 3 --batch "${BATCH:-64}" 2>&1 | grep -v Warning | tee "$out/profile_final.log" | grep -v "^    launch"
  echo "== 8k point, hybrid with nothing shared (left $((stop - SECONDS)) s)"
  local long=8192; [ -n "$quick" ] && long=128
  timeout "$(left 45)" python3 bench/bench_prefix_cache.py $quick --parts sweep,hybrid_random --prefix-lengths "$long" \
    --json "$out/bench_prefix_8k_hybrid.json" 2>&1 | grep -v Warning | tee "$out/bench_prefix_8k_hybrid.log" | tail -6
  echo "== done at $SECONDS s"
}
target() {  # what the final call (55 s test and batch caps on a cold H100) cut short, ~230 s in all
  batch 110
  timeout 60 python3 -m pytest tests/functional/test_prefix_cache_gpu.py -q -p no:cacheprovider -W ignore -k gdn \
    2>&1 | tee "$out/test_prefix_cache_gpu_hybrid.log" | tail -3
  timeout 60 python3 bench/bench_prefix_cache.py --parts sweep,hybrid_random --prefix-lengths 8192 \
    --json "$out/bench_prefix_8k_hybrid.json" 2>&1 | grep -v Warning | tee "$out/bench_prefix_8k_hybrid.log" | tail -6
}
case "$mode" in
  check) check ;;
  final) final ;;
  target) target ;;
  profile) profile 95; gpu_tests 45; short_controller 40 ;;
  bench)
    gpu_tests 100
    timeout 95 python3 bench/bench_prefix_cache.py $quick --parts sweep,hybrid --json "$out/bench_prefix_sweep.json" \
      2>&1 | grep -v Warning | tee "$out/bench_prefix_sweep.log" | tail -14
    batch 85 ;;
  *) profile 65; gpu_tests 40; short_controller 30; batch 70 ;;
esac
