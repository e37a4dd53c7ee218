#!/usr/bin/env bash
# Issue 26's same-run check: the step loop and joins/leaves of this tree against an older tree of
# the package, in one lease, alternating (bench/RESULTS.md, "Issue 26 ... same-run check").
# Usage (device machine, repo root): bash bench/run_redesign_gpu.sh BASE_DIR
#   BASE_DIR: the older tree (e.g. `git archive <commit> | tar -x -C .wt/base`, carried along).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
base="$(cd "$1" && pwd)"
here="$PWD"
cp -r mtp_ctrl/checkpoints "$base/mtp_ctrl/" 2>/dev/null || true
for round in $(seq 1 "${ROUNDS:-1}"); do
  for tree in "$base" "$here"; do
    name=$([ "$tree" = "$here" ] && echo now || echo base)
    echo "== round $round: $name"
    (cd "$tree" && PYTHONPATH="/tmp/site:$tree" timeout 150 python3 bench/bench_overlap.py --quick --batches 8,32 2>&1 \
      | grep -v Warning | tee "$out/overlap_${name}_$round.log" | tail -6)
    (cd "$tree" && PYTHONPATH="/tmp/site:$tree" timeout 100 python3 bench/bench_join_finish.py 2>&1 \
      | grep -v Warning | tee "$out/join_${name}_$round.log" | tail -6)
  done
done
