#!/usr/bin/env bash
# One device call for issue 34 (the adaptive policy's host cost per step): the demo's host-bound
# loop, fixed S = 2 against GoodputPolicy (S_max = 2) at batch 32 and 128, greedy and T = 1, 192 new
# tokens: bench_adaptive.py's wall ms and GPU ms a step, on this checkout's code and on main's
# (MAIN_ROOT, default ../..: the lead's checkout that `run` sends, this one under .wt/<name>), in
# one call: this checkout, main, then this checkout again while time is left (drift shows).
# Each part under its own timeout; the step-time lines of each last. Logs and JSON to $OUT.
# Usage (device, this checkout's root): bash bench/run_policyhost_gpu.sh [--quick]
#   --quick: CPU smoke run (the demo at batch 1, 8 tokens).
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
main_root="${MAIN_ROOT:-$(cd "$here/../.." && pwd)}"
out="${OUT:-$here/gpu_logs}"; mkdir -p "$out"
site=""; [ -d /tmp/site ] && site="/tmp/site:"
total="${POLICYHOST_TOTAL:-180}"  # seconds this script may take
if [ "${1:-}" = "--quick" ]; then
  args=(--quick --skip-large --demo-batches 1 --no-pinned --demo-goodput skip --new-tokens 8)
else
  args=(--skip-large --demo-batches 32 128 --no-pinned --demo-goodput skip --new-tokens 192)
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
fi
# a copy under .wt/<name> is an archive: git there would name the enclosing checkout's commit
rev="archive"; [ -e "$here/.git" ] && rev="$(git -C "$here" rev-parse --short HEAD)"
echo "branch: $here ($rev); main: $main_root"

run_part() {  # label, checkout root, seconds
  local label=$1 root=$2 limit=$3
  (cd "$root" && PYTHONPATH="$site$root" timeout "$limit" python3 bench/bench_adaptive.py "${args[@]}" \
    --budget-seconds $((limit - 30)) --json "$out/$label.json") > "$out/$label.log" 2>&1
  echo "== $label: rc $? at ${SECONDS} s"
}

run_part branch "$here" $((total * 9 / 20))
run_part main "$main_root" $((total * 9 / 20))
if [ $((total - SECONDS)) -gt 60 ]; then
  run_part branch_again "$here" $((total - SECONDS - 5))
fi
# from each part's JSON (rewritten after every point: a part cut by its timeout keeps its finished points)
echo "== wall ms / GPU ms a step (demo, S_max = 2; $(cat "$out/device.txt" 2>/dev/null || echo CPU))"
for label in branch main branch_again; do
  [ -f "$out/$label.json" ] && python3 bench/adaptive_report.py --details "$out/$label.json" 2>&1 \
    | grep -E "(fixed S=2|goodput S=2): [0-9]" | sed "s/^/$label /"
done
