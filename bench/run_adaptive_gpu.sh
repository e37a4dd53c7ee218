#!/usr/bin/env bash
# One device call for issue 34: its whole measurement (bench/bench_adaptive.py), every engine of a
# point timed ADAPTIVE_REPEATS (3) times (a demo point ADAPTIVE_DEMO_REPEATS, 7: its runs are short and
# its host-bound loop noisy) interleaved round-robin, in parts, each a process under its
# own timeout (a hang or a cut in one still returns the others), inside ADAPTIVE_TOTAL (560) s:
#  1. the ~1B model with the acceptance oracle, the mixed workload closed and queued, fixed S = 0..3,
#     goodput and per-request, at batch ADAPTIVE_LARGE_BATCHES ("128 256 64 8"; 128 and 256: the
#     costlier-rows points, where a decode-only step at 4 rows a request costs 2-3x one at a row);
#     no batch started after ADAPTIVE_LARGE_BUDGET (290) s;
#  2. the demo model at batch ADAPTIVE_DEMO_BATCHES ("32 128 1 8"), T = 0 and 1, fixed S = 0..2 and
#     goodput (192 tokens a request, 2 x batch requests); no point started after
#     ADAPTIVE_DEMO_BUDGET (140) s;
# (H200, this script's parts measured apart: 1B batch 256 116 s, demo batch 32 + 128 66 s; the whole
#  default ~400 s before the test.)
#  3. the table of both parts (bench/adaptive_report.py over their JSON: partial parts included);
#  4. tests/functional/test_adaptive_gpu.py in the time left, if >= 90 s (ADAPTIVE_TEST=0: never).
# A part whose batches are "" is skipped; what was skipped for time is printed.
# Usage (device machine, repo root): bash bench/run_adaptive_gpu.sh [--quick] [bench_adaptive.py args]
#   --quick: CPU smoke run of the same script (tiny shapes, 1 run a point; no GPU test).
#   bench args go to both parts, e.g. --length-spread 0.5 (1B requests' lengths 48 x (1 -+ 0.5): plain
#   decoding's queued requests no longer finish in lockstep; bench/RESULTS.md, "Adaptive", benchrep).
# Logs, JSON and the table go to $OUT (or ./gpu_logs).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" 2>/dev/null || { cd "$(dirname "$0")/.."; out="${OUT:-gpu_logs}"; mkdir -p "$out"; }
total="${ADAPTIVE_TOTAL:-560}"
large_batches="${ADAPTIVE_LARGE_BATCHES-128 256 64 8}"
demo_batches="${ADAPTIVE_DEMO_BATCHES-32 128 1 8}"
large_budget="${ADAPTIVE_LARGE_BUDGET:-290}"
demo_budget="${ADAPTIVE_DEMO_BUDGET:-140}"
test_on="${ADAPTIVE_TEST:-1}"
common=(--repeats "${ADAPTIVE_REPEATS:-3}")
slack=(70 50)  # seconds a part may run past its budget (the point in flight): 1B, demo
if [ "${1:-}" = "--quick" ]; then
  shift
  common=(--quick); large_batches="${ADAPTIVE_LARGE_BATCHES-4}"; demo_batches="${ADAPTIVE_DEMO_BATCHES-4}"
  large_budget="${ADAPTIVE_LARGE_BUDGET:-20}"; demo_budget="${ADAPTIVE_DEMO_BUDGET:-20}"; test_on=0
  slack=(200 200); total="${ADAPTIVE_TOTAL:-900}"  # a shared 2-core CPU: slow points
fi
left() { echo $((total - SECONDS)); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
rm -f "$out/adaptive_1b.json" "$out/adaptive_demo.json"
if [ -n "$large_batches" ]; then
  reserve=$([ -n "$demo_batches" ] && echo 100 || echo 15)  # the demo part's least time
  limit=$(min $((large_budget + slack[0])) $(($(left) - reserve)))
  echo "== 1B part (batches $large_batches) at ${SECONDS}s: no point after ${large_budget}s, timeout ${limit}s"
  timeout "$limit" python3 bench/bench_adaptive.py "${common[@]}" --skip-demo --large-batches $large_batches \
    --large-workloads mixed queued --budget-seconds "$large_budget" --json "$out/adaptive_1b.json" "$@" 2>&1 \
    | tee "$out/adaptive_1b.log" | grep -v -i warn | grep -v '^{' | sed '/^== summary/,$d' | tail -60
  [ "${PIPESTATUS[0]}" = 124 ] && echo "== 1B part: cut by its timeout (${limit}s): the table below has what it finished"
fi
if [ -n "$demo_batches" ]; then
  budget=$(min "$demo_budget" $(($(left) - 60)))
  limit=$(min $((budget + slack[1])) $(($(left) - 5)))
  echo "== demo part (batches $demo_batches) at ${SECONDS}s: no point after ${budget}s, timeout ${limit}s"
  demo_repeats=(); [ "${common[0]}" = --quick ] || demo_repeats=(--demo-repeats "${ADAPTIVE_DEMO_REPEATS:-7}")
  timeout "$limit" python3 bench/bench_adaptive.py "${common[@]}" "${demo_repeats[@]}" --skip-large --demo-batches $demo_batches \
    --demo-goodput skip --no-pinned --budget-seconds "$budget" --json "$out/adaptive_demo.json" "$@" 2>&1 \
    | tee "$out/adaptive_demo.log" | grep -v -i warn | grep -v '^{' | sed '/^== summary/,$d' | tail -60
  [ "${PIPESTATUS[0]}" = 124 ] && echo "== demo part: cut by its timeout (${limit}s): the table below has what it finished"
fi
device=$(cat "$out/device.txt" 2>/dev/null)
echo "== the table at ${SECONDS}s (${device:-CPU})"
python3 bench/adaptive_report.py "$out/adaptive_1b.json" "$out/adaptive_demo.json" 2>&1 | tee "$out/adaptive_table.txt"
if [ "$test_on" != 0 ]; then
  if [ "$(left)" -ge 90 ]; then
    echo "== GPU test at ${SECONDS}s ($(($(left) - 5))s)"
    timeout $(($(left) - 5)) python3 -m pytest tests/functional/test_adaptive_gpu.py -q -p no:cacheprovider -W ignore 2>&1 \
      | tee "$out/functional.log" | tail -5
  else
    echo "== GPU test skipped for time ($(left)s left)"
  fi
fi
echo "== done at ${SECONDS}s"
