# The D = 0 step on an S = 2 engine against a plain engine's step: graph-replayed kernel time by
# torch.profiler, then the host profile (bench/RESULTS.md, "Adaptive draft length").
source bench/gpu_env.sh >/dev/null
o=$OUT; kinds="${D0_KINDS:-kernels host}"
if [[ $kinds == *kernels* ]]; then
for b in 128 1; do
  for cfg in "0 fixed" "2 none" "2 fixed" "2 goodput"; do set -- $cfg
    echo "=== batch $b S=$1 $2" >> $o/kernels.txt
    python bench/profile_step_kernels.py --graphs --batch $b --num-speculative-tokens $1 --draft-policy $2 --steps 72 --top 40 2>/dev/null >> $o/kernels.txt
  done
done
grep "GPU ops" $o/kernels.txt
fi
if [[ $kinds == *host* ]]; then
for b in 1 128; do for cfg in "2 fixed" "2 goodput" "0 fixed" "2 none"; do set -- $cfg
  echo "=== batch $b S=$1 $2" >> $o/host.txt
  python bench/profile_step_host.py --batch $b --num-speculative-tokens $1 --draft-policy $2 --top 40 2>/dev/null >> $o/host.txt
done; done
grep "tok/s" $o/host.txt
fi
