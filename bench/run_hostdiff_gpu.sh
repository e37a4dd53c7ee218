# Where the goodput engine's host time goes beside fixed S's at the same lengths (bench/RESULTS.md,
# "Adaptive draft length"): cProfile over the demo's steady decode steps of the engines
# HOSTDIFF_PROFILED (default "2:fixed 2:goodput": S = 2 fixed and S = 2 GoodputPolicy, which runs
# D = 2 at T = 0) at batches HOSTDIFF_BATCHES (default "1 32"; skipped with HOSTDIFF_CPROFILE=0), then
# the host parts of HOSTDIFF_ENGINES (default plain, S = 2 at D = 0, S = 2 fixed, S = 2 goodput) built
# in one process, round-robin (profile_step_host --compare; HOSTDIFF_ROUNDS, default 8).
source bench/gpu_env.sh >/dev/null
o=$OUT
for b in ${HOSTDIFF_BATCHES:-1 32}; do
  if [ "${HOSTDIFF_CPROFILE:-1}" = 1 ]; then
    for engine in ${HOSTDIFF_PROFILED:-2:fixed 2:goodput}; do
      s=${engine%%:*}; p=${engine##*:}
      timeout 120 python bench/profile_step_host.py --batch $b --num-speculative-tokens $s --draft-policy $p \
        --steps 180 --top 45 > $o/cprof_${b}_${s}_$p.txt 2>&1
      head -3 $o/cprof_${b}_${s}_$p.txt
    done
  fi
  timeout 200 python bench/profile_step_host.py --batch $b \
    --compare ${HOSTDIFF_ENGINES:-0:fixed 2:none 2:fixed 2:goodput} --steps 240 \
    --rounds ${HOSTDIFF_ROUNDS:-8} 2>/dev/null | tail -40 | tee $o/compare_$b.txt
done
