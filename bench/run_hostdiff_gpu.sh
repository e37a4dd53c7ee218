# Where the goodput engine's host time goes beside fixed S's at the same lengths (bench/RESULTS.md,
# "Adaptive draft length"): cProfile over the demo's steady decode steps of S = 2 fixed and S = 2
# GoodputPolicy (which runs D = 2 at T = 0) at batches HOSTDIFF_BATCHES (default "1 32"), then the
# host parts of both and plain built in one process, round-robin (profile_step_host --compare).
source bench/gpu_env.sh >/dev/null
o=$OUT
for b in ${HOSTDIFF_BATCHES:-1 32}; do
  for p in fixed goodput; do
    timeout 120 python bench/profile_step_host.py --batch $b --num-speculative-tokens 2 --draft-policy $p --steps 180 \
      --top 45 > $o/cprof_${b}_$p.txt 2>&1
    head -3 $o/cprof_${b}_$p.txt
  done
  timeout 200 python bench/profile_step_host.py --batch $b --compare 2:fixed 2:goodput 0:fixed 2:none --steps 180 \
    --rounds 8 2>/dev/null | tail -6 | tee $o/compare_$b.txt
done
