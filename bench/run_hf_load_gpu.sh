#!/usr/bin/env bash
# One device call for issue 31: the Hugging Face loader's GPU test, then bench_hf_load (an 8B-shaped
# Llama-3 written by save_pretrained on the device; load_hf_checkpoint vs transformers' from_pretrained).
# Usage (device machine, repo root): bash bench/run_hf_load_gpu.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import transformers, safetensors, tokenizers; print('transformers', transformers.__version__)" | tee "$out/versions.txt"
timeout 110 python3 -m pytest tests/functional/test_hf_checkpoint_gpu.py -q -p no:cacheprovider -W ignore 2>&1 \
  | tee "$out/functional.log" | tail -8
free -g | tee "$out/free.txt"
timeout 140 python3 bench/bench_hf_load.py --repeats 2 2>&1 | grep -v -i "warn\|Loading weights" | tee "$out/bench_hf_load.log" | tail -16
