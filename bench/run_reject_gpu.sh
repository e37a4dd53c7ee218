#!/usr/bin/env bash
# One device call for issue 26's rejection-acceptance speed: bench_rejection.py on this checkout
# (T = 0.7 / 1.0; S = 0, exact match, rejection; same run), GPU ops per decode step per mode, the
# rejection GPU tests, then (when run from <main>/.wt/<name>, main's tree two levels up) this
# bench on main's package for a before/after in the same lease. Logs go to $OUT.
# Usage (device machine): bash bench/run_reject_gpu.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
site="${PYTHONPATH#"$PWD:"}"  # what gpu_env.sh put behind this checkout (the wheels), if anything
timeout 70 python3 bench/bench_rejection.py --repeats 20 2>&1 | tee "$out/bench_after.log" | tail -10
timeout 30 python3 bench/count_rejection_kernels.py --steps 8 --top 12 2>&1 | tee "$out/count_after.log" \
  | grep -v "^ *[0-9.]\+ \+[0-9.]\+  " | tail -9
timeout 90 python3 -m pytest tests/functional/test_rejection_gpu.py tests/functional/test_sampling_filter_gpu.py \
  "tests/functional/test_ptd_gpu.py::test_ptd_graph_replay_rejection_sampling_keeps_running" -q -x -p no:cacheprovider \
  -W ignore 2>&1 | tee "$out/functional.log" | tail -4
main_root="$(cd ../.. && pwd)"
if [ -f "$main_root/bench/bench_rejection.py" ] && [ "$main_root" != "$PWD" ]; then
  echo "== before: main's package ($main_root)"
  (cd "$main_root" && PYTHONPATH="$main_root${site:+:$site}" timeout 60 python3 "$OLDPWD/bench/bench_rejection.py" \
    --repeats 20 2>&1 | tee "$out/bench_before.log" | tail -10)
fi
