# Does speculative output equal plain output token for token on this GPU (bench/RESULTS.md,
# "Adaptive draft length", sixteenth session: one request in 256 differed once)? One call:
#  1. bench/check_row_invariance.py: which of the demo model's GEMMs give a row other bits at
#     another row count (fp32 and bf16; ~1 min);
#  2. bench/check_lossless.py at batch LOSSLESS_BATCH (128), T = 1: plain, S = 2 and S = 1 over
#     LOSSLESS_SCHEDULES (3) arrival schedules and the held-joins one (--held-joins 4), with the
#     prefix cache, then without it (--no-prefix-caching).
source bench/gpu_env.sh >/dev/null
o=${OUT:-/tmp}
timeout 150 python bench/check_row_invariance.py 2>&1 | grep -v -i warn | tee $o/row_invariance.txt
for caching in "" "--no-prefix-caching"; do
  echo "== check_lossless ${caching:-with the prefix cache}"
  timeout 200 python bench/check_lossless.py --batch ${LOSSLESS_BATCH:-128} --temperature 1 \
    --schedules ${LOSSLESS_SCHEDULES:-3} --held-joins 4 --S 2 1 $caching 2>&1 | grep -v -i warn \
    | tee $o/lossless${caching:+_no_prefix}.txt
done
