#!/usr/bin/env bash
# One device call for MLA (issue 30): its GPU tests, then bench_mla (RESULTS' "MLA" section).
# Usage (device machine, repo root):
#   bash bench/run_mla_gpu.sh [kernels|probe|final|verify|wgmma|overlap|splits|tune|e2e] [--quick]
#   kernels (default): tests/functional/test_mla_gpu.py + the kernel table (default tiles vs the
#     shape table vs the fastest --tune candidate, 16 and 128 heads, batch 1/32/128, 2k-128k)
#   probe: the --tune candidates at 128 / 64 heads (batch 32 / 128, 8k / 32k) and 16 heads
#     (batch 32, 8k), each beside the default and the table, with the same-run copy; then
#     tests/functional/test_mla_gpu.py
#   final: the 16-head batch-32 / 8k candidates (bench_mla --pick), whose winner the table takes for
#     the rest of the run; the default vs the table at 16 heads x batch 1/32/128 x 2k-128k, 32/64/128
#     heads at batch 32/128 x 8k-128k, verify rows (1 + S = 3) at 16/128 heads, absorbed vs
#     decompressed, KV bytes; tests/functional/test_mla_gpu.py; a summary (rows under 70 %)
#   verify: the 16-head verify-row candidates (--pick --rows 3), the winner's table at 3 rows, the tests,
#     then 128-head verify rows (--tune)
#   wgmma: the Gluon kernel's GPU twin tests, then the Gluon kernel vs the Triton kernel (same process)
#     at 64 / 128 heads x batch 1/32/128 x 2k/8k/32k, the other kernel tests the Gluon tiles touch
#     (every table entry, the DeepSeek shape), then 16-head verify rows (3 a request) in both; ~210 s
#   overlap: the Gluon kernel's GPU twin tests (every schedule), then at 64 / 128 heads x batch
#     1/32/128 x 2k/8k/32k the Triton tiles, main's Gluon kernel (.scratch/baseline/mla_wgmma_main.py,
#     copied aside from main before the change) and this kernel's schedules (serial, async; the
#     warp-specialized one in a process of its own beside main's again), then 16-head verify rows
#     (3 a request) in all; a summary; ~220 s
#   splits: the warp-specialized GPU tests (decode rows, verify rows, long splits), then the split
#     sweep of the warp-specialized entry (bench_mla_splits.py: the table's count, counts 1-8 and
#     the combine alone, main's ws kernel (.scratch/baseline/mla_wgmma_ws_main.py) beside) at 128
#     heads B 32 / 8k, the four 128-head target points and 64 heads B 32 / 8k, then 16-head verify
#     rows (3 a request) in the serial and the warp-specialized schedule; a summary; ~210 s
#   combine: the split-K combine (mla8): bench_split_combine --combine-sweep (its tiles at MLA's
#     128-head partials, the MLA op at 128 heads B 32 / 8k, 32k and B 128 / 8k with main's combine
#     (.scratch/baseline/mtp_ctrl/triton_ops/paged_attn.py, copied aside) and this one), the GPU
#     tests of the combine and the split/ws kernels, bench_split_combine's small cases beside main's,
#     then bench_mla --wgmma (ws) at 128 heads B 32 / 128 x 8k; a summary; ~145 s
#   tune: the kernel table only
#   e2e: the kernel table at the default and table tiles + sections 2-4 (the MLA GPT's decode steps)
# --quick: tiny shapes (a CPU smoke run of the script)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
mode="${1:-kernels}"
quick="${2:-}"
bench="python3 bench/bench_mla.py --kernels-only $quick"
if [ "$mode" = kernels ]; then
  timeout 75 python3 -m pytest tests/functional/test_mla_gpu.py -q -x -p no:cacheprovider -W ignore 2>&1 \
    | tee "$out/functional_mla.log" | tail -8
  timeout 175 $bench --tune --heads 16,128 2>&1 | tee "$out/bench_mla_tune.log"
elif [ "$mode" = probe ]; then
  # most wanted first: a call cut short still returns what ran
  timeout 80 $bench --tune --heads 128,64 --batches 32,128 --contexts 8192,32768 2>&1 | tee "$out/probe_128.log"
  timeout 35 $bench --tune --heads 16 --batches 32 --contexts 8192 2>&1 | tee "$out/probe_16.log"
  timeout 60 python3 -m pytest tests/functional/test_mla_gpu.py -q -x -p no:cacheprovider -W ignore \
    2>&1 | tee "$out/functional_mla.log" | tail -8
elif [ "$mode" = final ]; then
  # one process: the 16-head batch-32 / 8k candidates (--pick), the winner installed in the table
  # for this run, then the final table (FINAL_PARTS: 16 heads everywhere, 32/64/128 heads at batch
  # >= 32 and context >= 8k, verify rows), absorbed vs decompressed, KV bytes; then the GPU tests
  pick="16,32,8192"; [ -n "$quick" ] && pick="16,4,256"
  timeout 170 python3 bench/bench_mla.py $quick --pick "$pick" --winner-file "$out/winner.json" --final 2>&1 \
    | tee "$out/final.log"
  timeout 55 python3 -m pytest tests/functional/test_mla_gpu.py -q -x -p no:cacheprovider -W ignore 2>&1 \
    | tee "$out/functional_mla.log" | tail -4
  echo "== summary: the pick, the winner, rows of batch >= 32 / context >= 8k under 70 % of the copy (table column)"
  grep -E "fastest:|default again|is --pick's winner" "$out/final.log"
  awk '/query row\(s\) a request/ {rows=$5} / heads$/ {heads=$1} /^ +[0-9]+ +[0-9]+ / && $1 >= 32 && $2 >= 8192 && $6 < 70 \
    {print "   below 70 %: " heads " heads, " rows " row(s), B " $1 ", context " $2 ": " $6 " %"}' "$out/final.log"
elif [ "$mode" = verify ]; then
  # the 16-head verify-row candidates (1 + S = 3 rows, batch 32 / 8k), the winner in the table's
  # verify entry for this run, the verify rows' table at 16 heads (batch 1/32/128 x 2k-32k); the GPU
  # tests (13-15 of them: ~70 s with the compiles); decode rows beside (the kernel's column masks
  # changed with this mode); last, 128-head verify rows with the --tune candidates. ~210 s in all:
  # mla4's 180 s call cut the tests after 12 passed and the last two parts
  pick="16,32,8192"; [ -n "$quick" ] && pick="16,4,256"
  timeout 55 python3 bench/bench_mla.py $quick --kernels-only --rows 3 --pick "$pick" \
    --winner-file "$out/winner_verify.json" 2>&1 | tee "$out/verify_pick.log"
  timeout 35 python3 bench/bench_mla.py $quick --kernels-only --rows 3 --heads 16 --batches 1,32,128 \
    --contexts 2048,8192,32768 --winner-file "$out/winner_verify.json" 2>&1 | tee "$out/verify_table.log"
  timeout 80 python3 -m pytest tests/functional/test_mla_gpu.py -q -x -p no:cacheprovider -W ignore 2>&1 \
    | tee "$out/functional_mla.log" | tail -4
  echo "== summary"
  grep -E "fastest:|default again|is --pick's winner" "$out/verify_pick.log" "$out/verify_table.log"
  timeout 20 python3 bench/bench_mla.py $quick --kernels-only --rows 1 --heads 16 --batches 32,128 --contexts 8192 \
    2>&1 | tee "$out/decode_check.log"
  timeout 25 python3 bench/bench_mla.py $quick --kernels-only --rows 3 --heads 128 --batches 32 --contexts 8192 \
    --tune 2>&1 | tee "$out/verify_128.log"
elif [ "$mode" = wgmma ]; then
  python3 -c "import triton; print('triton', triton.__version__)" | tee -a "$out/device.txt"
  timeout 45 python3 -m pytest tests/functional/test_mla_gpu.py -q -x -p no:cacheprovider -W ignore -k wgmma 2>&1 \
    | tee "$out/functional_wgmma.log" | tail -6
  grid="--heads 64,128 --batches 1,32,128 --contexts 2048,8192,32768"; [ -n "$quick" ] && grid=""
  timeout 95 python3 bench/bench_mla.py $quick --wgmma $grid 2>&1 | tee "$out/wgmma.log"
  timeout 40 python3 -m pytest tests/functional/test_mla_gpu.py -q -x -p no:cacheprovider -W ignore \
    -k "every_tile or deepseek_shape" 2>&1 | tee "$out/functional_mla.log" | tail -4
  grid="--heads 16 --batches 32,128 --contexts 8192,32768"; [ -n "$quick" ] && grid=""
  timeout 25 python3 bench/bench_mla.py $quick --wgmma --rows 3 $grid 2>&1 | tee "$out/wgmma_verify.log"
  echo "== summary: tests, then batch >= 32 / context >= 8k (Gluon % of the copy)"
  grep -hE "passed|failed|error" "$out/functional_wgmma.log" "$out/functional_mla.log" | tail -4
  awk '/ heads$/ {heads=$1} /^ +[0-9]+ +[0-9]+ / && $1 >= 32 && $2 >= 8192 \
    {print "   " heads " heads, B " $1 ", context " $2 ": triton " $4 " %, gluon " $8 " % (" $10 ")"}' \
    "$out/wgmma.log" "$out/wgmma_verify.log"
elif [ "$mode" = overlap ]; then
  # the warp-specialized schedule (mbarrier hand-overs: a hang would cost its process only) runs in
  # processes of its own, after the others
  python3 -c "import triton; print('triton', triton.__version__)" | tee -a "$out/device.txt"
  base=.scratch/baseline/mla_wgmma_main.py
  [ -f "$base" ] || echo "no baseline kernel at $base: its column is left out"
  tests="python3 -m pytest tests/functional/test_mla_gpu.py -q -x -p no:cacheprovider -W ignore"
  timeout 60 $tests -k "wgmma and not warp_specialized" 2>&1 | tee "$out/functional_wgmma.log" | tail -4
  # 30 s cut this part after its 9 decode-row cases (mla6's call: the verify variants' compiles)
  timeout 60 $tests -k "wgmma and warp_specialized" 2>&1 | tee "$out/functional_ws.log" | tail -4
  grid="--heads 128,64 --batches 32,128,1 --contexts 8192,32768,2048"; [ -n "$quick" ] && grid=""
  timeout 60 python3 bench/bench_mla.py $quick --wgmma --baseline "$base" --gluon-columns main,serial,async $grid \
    2>&1 | tee "$out/overlap.log"
  timeout 45 python3 bench/bench_mla.py $quick --wgmma --baseline "$base" --gluon-columns main,ws $grid \
    2>&1 | tee "$out/overlap_ws.log"
  grid="--heads 16 --batches 32,128 --contexts 8192,32768"; [ -n "$quick" ] && grid=""
  timeout 55 python3 bench/bench_mla.py $quick --wgmma --baseline "$base" --rows 3 $grid 2>&1 \
    | tee "$out/overlap_verify.log"
  echo "== summary: tests; batch >= 32 / context >= 8k: % of the copy per column (triton, then the Gluon columns)"
  grep -hE "passed|failed|error" "$out/functional_wgmma.log" "$out/functional_ws.log" | tail -4
  for log in overlap overlap_ws overlap_verify; do
    echo "   $log: $(grep -o 'Gluon columns: [a-z, ]*' "$out/$log.log" | head -1)"
    awk '/ heads$/ {heads=$1} /^ +[0-9]+ +[0-9]+ / && $1 >= 32 && $2 >= 8192 \
      {line = "   " heads " heads, B " $1 ", context " $2 ":"; for (i = 4; i <= NF - 4; i += 3) line = line " " $i;
       print line " %, best " $(NF - 3) " " $(NF - 2)}' "$out/$log.log"
  done
elif [ "$mode" = splits ]; then
  python3 -c "import triton; print('triton', triton.__version__)" | tee -a "$out/device.txt"
  tests="python3 -m pytest tests/functional/test_mla_gpu.py -q -x -p no:cacheprovider -W ignore"
  # 13 cases (mla6's 30 s and 60 s cut them in the verify-row compiles)
  timeout 90 $tests -k "wgmma and warp_specialized" 2>&1 | tee "$out/functional_ws.log" | tail -4
  timeout 60 python3 bench/bench_mla_splits.py $quick --ws-baseline .scratch/baseline/mla_wgmma_ws_main.py 2>&1 \
    | tee "$out/splits.log"
  grid="--heads 16 --batches 1,32,128 --contexts 8192,32768"; [ -n "$quick" ] && grid=""
  timeout 50 python3 bench/bench_mla.py $quick --wgmma --rows 3 --gluon-columns serial,ws $grid 2>&1 \
    | tee "$out/verify_ws.log"
  echo "== summary: tests; per point the fastest split count; 16-head verify rows (% of the copy: triton, serial, ws)"
  grep -hE "passed|failed|error" "$out/functional_ws.log" | tail -2
  grep -hE "^[0-9]+ heads, B|fastest|main ws" "$out/splits.log"
  awk '/ heads$/ {heads=$1} /^ +[0-9]+ +[0-9]+ / {print "   " heads " heads, B " $1 ", context " $2 ": " $4 " / " $7 \
    " / " $10 " %, best " $12}' "$out/verify_ws.log"
elif [ "$mode" = combine ]; then
  python3 -c "import triton; print('triton', triton.__version__)" | tee -a "$out/device.txt"
  base=.scratch/baseline
  [ -f "$base/mtp_ctrl/triton_ops/paged_attn.py" ] || echo "no baseline at $base: main's columns are left out"
  timeout 50 python3 bench/bench_split_combine.py $quick --combine-sweep --baseline "$base" 2>&1 \
    | tee "$out/combine_sweep.log"
  timeout 45 python3 -m pytest tests/functional/test_attention_gpu.py tests/functional/test_mla_gpu.py -q -x \
    -p no:cacheprovider -W ignore -k "combine or mixed_batch or (warp_specialized and not verify_rows)" 2>&1 \
    | tee "$out/functional_combine.log" | tail -4
  timeout 20 python3 bench/bench_split_combine.py $quick --baseline "$base" 2>&1 | tee "$out/split_combine.log"
  grid="--heads 128 --batches 32,128 --contexts 8192"; [ -n "$quick" ] && grid=""
  timeout 15 python3 bench/bench_mla.py $quick --wgmma --gluon-columns ws $grid 2>&1 | tee "$out/bench_mla_ws.log"
  echo "== summary: tests; the combine's fastest tiles; the MLA op per combine (% of the copy)"
  grep -hE "passed|failed|error" "$out/functional_combine.log" | tail -2
  grep -hE "splits x B|fastest|heads, B" "$out/combine_sweep.log"
elif [ "$mode" = tune ]; then
  timeout 240 $bench --tune 2>&1 | tee "$out/bench_mla_tune.log"
else
  timeout 240 python3 bench/bench_mla.py --e2e 2>&1 | tee "$out/bench_mla.log"
fi
