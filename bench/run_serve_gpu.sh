#!/usr/bin/env bash
# One device call for the server (issue 35): bench_serving.py on the demo model, S = 0 and 2:
# lone requests (TTFT vs the offline first step), 16 req/s, and saturation (1024 requests of 256
# tokens, 64 in flight, closed-loop clients from 4 processes), the offline loop in the same
# run (~200 s on an H200). With BASELINE (another checkout, e.g. the lead's main: ../..; ~50 s more:
# the first part's timeout leaves no room for it in one 300 s call), its server runs the lone and
# saturation loads at S = 0 too, driven by this checkout's client.
# Needs FastAPI, uvicorn and httpx (the carried .whl_serve wheels).
# Usage (device machine, repo root): bash bench/run_serve_gpu.sh [BASELINE]   (--quick: short loads, CPU)
# SERVE_BENCH_TIMEOUT (seconds, default 275) and SERVE_BENCH_ARGS (more bench_serving.py options,
# e.g. --rates "" to skip the 16 req/s load, ~25 s less) for a shorter call.
set -uo pipefail
quick=""; [[ "${1:-}" == "--quick" ]] && { quick="--quick --device cpu"; shift; }
baseline="${1:-}"
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import fastapi, uvicorn, httpx" || exit 1
timeout "${SERVE_BENCH_TIMEOUT:-275}" python3 bench/bench_serving.py $quick ${SERVE_BENCH_ARGS:-} 2>&1 | grep -v Warning \
  | tee "$out/bench_serving.log" | tail -14
if [[ -n "$baseline" && -d "$baseline/mtp_ctrl/serve" ]]; then
  echo "== baseline server: $(git -C "$baseline" log -1 --format=%h 2>/dev/null || echo "$baseline")"
  timeout 80 python3 bench/bench_serving.py --speculative-tokens 0 --rates "" --client-processes 4 --no-offline \
    --server-pythonpath "$(cd "$baseline" && pwd)" $quick 2>&1 | grep -v Warning \
    | tee "$out/bench_serving_baseline.log" | tail -5
fi
