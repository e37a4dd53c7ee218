#!/usr/bin/env bash
# One device call for issue 33 (prefix caching): its GPU test (on == off in CUDA graphs, admission
# of a hit with a step in flight under sync-debug "error"; dense, Mamba-2 and GDN hybrids), then
# bench_prefix_cache: single-request TTFT cold vs hit per prefix length (2k, 8k, 16k) on the ~1B
# GPT and on a Mamba hybrid (state snapshots), then the batch workloads (64 requests sharing a 2k
# system prompt, multi-turn chat, random prompts; caching on vs off, same run).
# Logs go to $OUT (or ./gpu_logs). Usage (device machine, repo root): bash bench/run_prefix_gpu.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
timeout 100 python3 -m pytest tests/functional/test_prefix_cache_gpu.py -q -p no:cacheprovider -W ignore 2>&1 \
  | tee "$out/functional.log" | tail -6
timeout 95 python3 bench/bench_prefix_cache.py --parts sweep,hybrid --json "$out/bench_prefix_sweep.json" 2>&1 \
  | grep -v Warning | tee "$out/bench_prefix_sweep.log" | tail -14
timeout 85 python3 bench/bench_prefix_cache.py --parts batch --json "$out/bench_prefix_cache.json" 2>&1 \
  | grep -v Warning | tee "$out/bench_prefix_cache.log" | tail -14
