# The D = 0 step on an S = 2 engine against a plain engine's step (bench/RESULTS.md, "Adaptive draft
# length"): graph-replayed kernel time by torch.profiler ("kernels"), the host's parts by perf_counter
# ("host"), the GPU tests of the step's MTP bookkeeping and draft lengths ("tests"), the demo's
# adaptive points ("demo": batches D0_DEMO_BATCHES, default "128 1"). D0_KINDS (default "kernels
# host"), D0_BATCHES="128 1", D0_ROUNDS (host profile rounds, default 2); "compare": the host parts
# of plain, S = 2 none / fixed / goodput built in one process, round-robin (profile_step_host --compare).
# D0_CONFIGS: the kernels/host engines, "S policy" comma-separated (default all four).
source bench/gpu_env.sh >/dev/null
o=$OUT; kinds="${D0_KINDS:-kernels host}"; batches="${D0_BATCHES:-128 1}"
IFS=, read -ra configs <<< "${D0_CONFIGS:-0 fixed,2 none,2 fixed,2 goodput}"  # "S policy" each
if [[ $kinds == *kernels* ]]; then
  for b in $batches; do for cfg in "${configs[@]}"; do set -- $cfg
    echo "=== batch $b S=$1 $2" >> $o/kernels.txt
    python bench/profile_step_kernels.py --graphs --batch $b --num-speculative-tokens $1 --draft-policy $2 --steps 72 \
      --top 40 2>/dev/null >> $o/kernels.txt
  done; done
  grep "GPU ops" $o/kernels.txt
fi
if [[ $kinds == *host* ]]; then
  for b in $batches; do for round in $(seq "${D0_ROUNDS:-2}"); do for cfg in "${configs[@]}"; do set -- $cfg
    echo "=== batch $b S=$1 $2 round $round" >> $o/host.txt
    python bench/profile_step_host.py --timed --batch $b --num-speculative-tokens $1 --draft-policy $2 2>/dev/null >> $o/host.txt
  done; done; done
  grep -A2 "===" $o/host.txt | grep -v "^--"
fi
if [[ $kinds == *tests* ]]; then
  bash bench/run_functional_gpu.sh 240 test_step_glue_gpu.py test_adaptive_gpu.py test_decode_runs_gpu.py \
    test_graph_replay_gpu.py test_prefix_cache_gpu.py | tail -8
fi
if [[ $kinds == *demo* ]]; then
  python bench/bench_adaptive.py --skip-large --demo-batches ${D0_DEMO_BATCHES:-128 1} --demo-goodput skip --no-pinned \
    --repeats 3 --json $o/demo.json 2>/dev/null | grep -v '^{' | tail -40
fi
if [[ $kinds == *compare* ]]; then
  for b in $batches; do
    python bench/profile_step_host.py --batch $b --compare 0:fixed 2:none 2:fixed 2:goodput --steps 200 --rounds 4 \
      2>/dev/null | tail -6
  done
fi
