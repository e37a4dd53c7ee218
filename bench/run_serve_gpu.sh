#!/usr/bin/env bash
# One device call for the server (issue 35): bench_serving.py as in RESULTS' "Serving" section
# (the demo model, 128 streaming completions of 256 tokens, S = 0 and 2, 16 req/s and all at once,
# the offline loop in the same run), all at once also from 4 client processes.
# Needs FastAPI, uvicorn and httpx (the carried .whl_serve wheels).
# Usage (device machine, repo root): bash bench/run_serve_gpu.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import fastapi, uvicorn, httpx" || exit 1
timeout 270 python3 bench/bench_serving.py --num-requests 128 --rates 16,inf --max-tokens 256 \
  --client-processes 1,4 2>&1 | grep -v Warning | tee "$out/bench_serving.log" | tail -16
