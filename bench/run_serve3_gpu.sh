#!/usr/bin/env bash
# One device call for issue 35 (helper serve3, <= 220 s): bench_serving.py on the demo model at S = 2,
# then S = 0 (each: lone requests for TTFT against the offline first token on fresh prompts, the
# closed-loop saturation load of 1024 requests, 64 in flight from 4 client processes, and the
# offline loop in the same run); then BASELINE's server (another checkout, e.g. the lead's main: ../..)
# under the same saturation load at S = 2, driven by this checkout's client (the same-run A/B of the
# engine loop); then, with the time left, bench/profile_engine_loop.py at S = 2 (the engine loop
# against the frontend's end of the pipe, no HTTP, and the offline loop: what the loop itself
# costs). Each part under its own timeout; a short table last.
# Needs FastAPI, uvicorn and httpx (the carried .whl_serve wheels installed into /tmp/site).
# Usage (device machine, repo root): bash bench/run_serve3_gpu.sh [BASELINE]   (--quick: tiny loads on
# the CPU, to check the script)
set -uo pipefail
quick=""; [[ "${1:-}" == "--quick" ]] && { quick="--quick --device cpu"; shift; }
baseline="${1:-}"; [[ -n "$baseline" ]] && baseline="$(cd "$baseline" && pwd)"
budget="${SERVE3_BUDGET:-195}"  # seconds for the whole script (the call's timeout less the wheel installs)
# SERVE3_S: the S values to serve (default "2 0"). A fresh machine compiles every Triton kernel
# while the first server warms up: at S = 2 that took more than 100 s on an H100 (the first call cut
# it with nothing printed), at S = 0 ~55 s. A rerun of S = 2 alone: SERVE3_S=2 (its part may take 160 s).
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import fastapi, uvicorn, httpx" || exit 1
started=$SECONDS
left() { echo $(( budget - (SECONDS - started) )); }
first=1
for S in ${SERVE3_S:-2 0}; do
  limit=$(( first ? 160 : 90 )); first=0; (( $(left) - 5 < limit )) && limit=$(( $(left) - 5 ))
  (( limit < 30 )) && { echo "== S = $S: skipped (${limit} s left)"; continue; }
  echo "== bench_serving S = $S (timeout ${limit} s)"
  timeout "$limit" python3 bench/bench_serving.py $quick --speculative-tokens "$S" --rates "" 2>&1 | grep -v Warning \
    > "$out/bench_serving_s$S.log"
  grep "^\[" "$out/bench_serving_s$S.log" | cut -c1-200
done
limit=$(( $(left) - 3 )); (( limit > 60 )) && limit=60
if [[ -n "$baseline" && -d "$baseline/mtp_ctrl/serve" ]] && (( limit >= 30 )); then
  echo "== baseline server S = 2: $(git -C "$baseline" log -1 --format=%h 2>/dev/null || echo "$baseline") (timeout ${limit} s)"
  timeout "$limit" python3 bench/bench_serving.py $quick --speculative-tokens 2 --rates "" --lone 0 --no-offline \
    --server-pythonpath "$baseline" 2>&1 | grep -v Warning > "$out/bench_serving_baseline_s2.log"
  grep "^\[" "$out/bench_serving_baseline_s2.log" | cut -c1-200
fi
limit=$(( $(left) - 3 ))
if (( limit >= 35 )); then
  echo "== profile_engine_loop S = 2 (timeout ${limit} s)"
  profile="--device cuda"; [[ -n "$quick" ]] && profile="--stand-in-step-us 300 --requests 256"
  timeout "$limit" python3 bench/profile_engine_loop.py $profile 2>&1 | grep -v Warning > "$out/profile_engine_loop.log"
  tail -3 "$out/profile_engine_loop.log"
else
  echo "== profile_engine_loop: skipped (${limit} s left)"
fi
echo "== table (the script took $(( SECONDS - started )) s)"
for log in s2 s0 baseline_s2; do
  echo "-- $log"; sed -n '/; demo model; streaming/,$p' "$out/bench_serving_$log.log" 2>/dev/null | grep -v "^tok/s:"
done
