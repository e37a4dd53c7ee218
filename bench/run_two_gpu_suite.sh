#!/usr/bin/env bash
# The two-GPU runs (TP = 2 and EP = 2 over NCCL) in as few calls as possible. Logs go to $OUT (or ./gpu_logs).
#
#   bash bench/run_two_gpu_suite.sh tests generate overlap   # the 2-GPU functional tests, TP 2 vs TP 1, bench_overlap --tp 2
#   bash bench/run_two_gpu_suite.sh moe                      # bench_moe at EP 2 and at TP 2
#   bash bench/run_two_gpu_suite.sh functional               # all of tests/functional with both GPUs visible
#
# NVLink multicast stays off (the machine's own setting, repeated here for programs that reset it).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_logs}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
nvidia-smi topo -m 2>&1 | head -4 | tee -a "$out/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'GPUs', torch.cuda.device_count())" \
  | tee -a "$out/device.txt"
summary=()

run_part() {  # name, command...: run, keep the log, print its tail
  local name=$1; shift
  local started=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  summary+=("$name: rc $rc, $((SECONDS - started)) s")
  echo "== $name (rc $rc, $((SECONDS - started)) s)"; grep -v "Warning\|warnings.warn" "$out/$name.log" | tail -${TAIL:-30}
}

parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(tests generate overlap)
for part in "${parts[@]}"; do
  case $part in
    tests)  # the cases that skip on one GPU
      run_part two_gpu_tests python3 -m pytest -q -p no:cacheprovider -rs \
        tests/functional/test_moe_gpu.py tests/functional/test_controller_gpu.py tests/functional/test_models_gpu.py \
        tests/functional/test_mamba_tp_gpu.py -k "parallel_moe or tp2" ;;
    functional)  # all of tests/functional: the 2-GPU cases, then the rest in two halves, one per GPU, side by side
      run_part two_gpu_tests python3 -m pytest -q -p no:cacheprovider -rs \
        tests/functional/test_moe_gpu.py tests/functional/test_controller_gpu.py tests/functional/test_models_gpu.py \
        tests/functional/test_mamba_tp_gpu.py -k "parallel_moe or tp2"
      files=(tests/functional/test_*.py)
      half_a=("${files[@]:0:$(( ${#files[@]} / 2 ))}"); half_b=("${files[@]:$(( ${#files[@]} / 2 ))}")
      started=$SECONDS
      CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider -rs "${half_a[@]}" > "$out/functional_a.log" 2>&1 &
      CUDA_VISIBLE_DEVICES=1 python3 -m pytest -q -p no:cacheprovider -rs "${half_b[@]}" > "$out/functional_b.log" 2>&1
      wait
      for half in a b; do echo "== functional_$half"; grep -E "passed|failed|error" "$out/functional_$half.log" | tail -3
        grep -E "^(FAILED|ERROR)" "$out/functional_$half.log" | head -20; done
      summary+=("functional halves: $((SECONDS - started)) s") ;;
    generate)  # TP 2 vs TP 1 on the shipped demo model: plain vs S = 2 with decode runs, same outputs
      run_part generate_tp1 python3 examples/generate.py --num-prompts 8 --repeats 5 --metrics-json "$out/generate_tp1.json"
      run_part generate_tp2 torchrun --nproc-per-node 2 examples/generate.py --tp 2 --num-prompts 8 --repeats 5 \
        --metrics-json "$out/generate_tp2.json"
      python3 - "$out" <<'EOF'
import json, sys
runs = {tp: json.load(open(f"{sys.argv[1]}/generate_tp{tp}.json"))["comparison"] for tp in (1, 2)}
for tp, c in runs.items():
    print(f"TP {tp}: plain {c['plain_median_tokens_per_second']:.0f} tok/s, S={c['num_speculative_tokens']} "
          f"{c['speculative_median_tokens_per_second']:.0f} tok/s, {c['speed_up']:.2f}x, spec == plain: {c['outputs_identical']}")
print("TP 2 plain outputs == TP 1 plain outputs:", runs[1]["plain_outputs_sha256"] == runs[2]["plain_outputs_sha256"])
EOF
      ;;
    overlap)
      TAIL=20 run_part overlap_tp2 torchrun --nproc-per-node 2 bench/bench_overlap.py --tp 2 ;;
    moe)
      TAIL=45 run_part moe_ep2 torchrun --nproc-per-node 2 bench/bench_moe.py --ep 2 --steps 10
      TAIL=45 run_part moe_tp2 torchrun --nproc-per-node 2 bench/bench_moe.py --tp 2 --steps 10 ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
printf '%s\n' "${summary[@]}"
