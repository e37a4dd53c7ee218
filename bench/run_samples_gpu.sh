# What the goodput policy's step timings are made of on the demo (issue 34; bench/RESULTS.md,
# "Adaptive draft length"): bench/diagnose_depth_samples.py at each of SAMPLES_POINTS ("batch:T",
# default "32:1 128:1 32:0"), plain / goodput / pinned 0 in one process each.
source bench/gpu_env.sh >/dev/null
o=${OUT:-/tmp}
for point in ${SAMPLES_POINTS:-32:1 128:1 32:0}; do
  b=${point%%:*}; t=${point##*:}
  timeout ${SAMPLES_TIMEOUT:-170} python bench/diagnose_depth_samples.py --batch $b --temperature $t \
    --repeats ${SAMPLES_REPEATS:-3} --json $o/samples_${b}_T$t.json 2>&1 | grep -v Warning | tee $o/samples_${b}_T$t.txt
done
