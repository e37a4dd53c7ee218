"""The tables of ``bench_adaptive.py`` from its rows (no torch): print them again from its JSON files.

    python bench/adaptive_report.py gpu_logs/adaptive_1b.json gpu_logs/adaptive_demo.json

Each row is one engine at one point (part, batch, workload): ``runs`` (tokens/s of each timed
generate, interleaved round-robin with the point's other engines), ``tokens_per_s`` (their median),
``spread_pct`` ((max - min) / median, %). A comparison's verdict: "above" when every run of the
engine beats every run of the reference (the two ranges do not meet), "below" when every run is
behind, "within spread" otherwise (the margin does not exceed the spread: not settled). "paired":
the engine's run over the best fixed S's run of the same round-robin round, their median and
min-max over rounds (drift common to a round cancels: on a host-bound point whose runs spread by
tens of percent the paired median is the steadier estimate; all above or all below 1 is a sign the
ratio holds).
"""

import argparse
import json
import statistics


def median(values):
    return statistics.median(values) if values else None


def spread_pct(values):
    """(max - min) / median of ``values``, %."""
    return round(100 * (max(values) - min(values)) / statistics.median(values), 1) if values else None


def verdict(runs, reference_runs):
    """'above' / 'below' when the min-max ranges of ``runs`` and ``reference_runs`` are apart, else
    'within spread'; 'one run' when either has fewer than two runs (no spread to judge by)."""
    if len(runs) < 2 or len(reference_runs) < 2:
        return "one run"
    if min(runs) > max(reference_runs):
        return "above"
    if max(runs) < min(reference_runs):
        return "below"
    return "within spread"


def _runs(row):
    return row.get("runs") or [row["tokens_per_s"]]


def rows_cost(costs):
    """From a policy's cost table (``costs["rows"]``: warm-up replay ms by ``"G=g, T=t, D=d[, mixed]"``):
    ``(G, ms at T = G, D = 0, T_max, ms at the largest decode-only T)``, the step's cost at one row a
    request against its most rows, or None."""
    rows = (costs or {}).get("rows")
    if not rows:
        return None
    decode = {}
    for key, ms in rows.items():
        fields = dict(part.split("=") for part in key.split(", ") if "=" in part)
        if "mixed" not in key:
            decode[(int(fields["G"]), int(fields["T"]), int(fields["D"]))] = ms
    plain = [(g, ms) for (g, t, d), ms in decode.items() if t == g and d == 0]
    if not plain:
        return None
    grid, low = plain[0]
    t_max = max(t for g, t, _ in decode if g == grid)
    high = max(ms for (g, t, _), ms in decode.items() if g == grid and t == t_max)
    return grid, low, t_max, high


def paired_ratios(runs, reference_runs):
    """Run i of ``runs`` over run i of ``reference_runs`` (the same round-robin round: the same host
    drift), sorted; [] when the counts differ."""
    return sorted(a / b for a, b in zip(runs, reference_runs)) if len(runs) == len(reference_runs) else []


def _rate(row, best_runs, plain_runs):
    """'tokens/s (spread %)  /best  /plain  verdict vs best  paired /best: median (min-max over rounds)'."""
    rate, best, plain = row["tokens_per_s"], median(best_runs), median(plain_runs)
    paired = paired_ratios(_runs(row), best_runs)
    paired = f"{median(paired):.2f} ({paired[0]:.2f}-{paired[-1]:.2f})" if len(paired) > 1 else "-"
    return (f"{rate:8.0f} ({row.get('spread_pct', 0) or 0:4.1f}%) {rate / best:5.2f} {rate / plain:5.2f} "
            f"{verdict(_runs(row), best_runs):>13} {paired:>16}")


def print_workloads(rows, header=True):
    """One block per (part, batch, workload): fixed S medians and spreads, each policy's median
    over the best fixed S's median and over plain's (S = 0), and the verdicts."""
    workloads = {}
    for row in rows:
        workloads.setdefault((row["part"], row["batch"], row["workload"]), []).append(row)
    if header:
        print(f"\n{'part':>5} {'batch':>5} {'workload':>14} | fixed S tokens/s: median (spread: (max - min) / median) "
              f"| policy: median (spread) /best /plain, vs best fixed S, paired /best (each round's ratio: median (min-max)) "
              "| lengths | == plain")
    for (part, batch, workload), point in workloads.items():
        fixed = {row["S"]: row for row in point if row["policy"] == "fixed"}
        text = " ".join(f"S{s}={row['tokens_per_s']:.0f} ({row.get('spread_pct', 0) or 0:.1f}%)"
                        for s, row in sorted(fixed.items()))
        same = all(row["equal_plain"] for row in point)
        repeats = max(len(_runs(row)) for row in point)
        print(f"{part:>5} {batch:5d} {workload:>14} | {text} | runs {repeats} | == plain {same}")
        if not fixed:
            continue
        best_s = max(fixed, key=lambda s: fixed[s]["tokens_per_s"])
        best_runs, plain_runs = _runs(fixed[best_s]), _runs(fixed.get(0, fixed[best_s]))
        print(f"{'':>27}| best fixed S = {best_s}")
        by_name = {row["policy"]: row for row in point if row["policy"] != "fixed"}
        for name, row in by_name.items():
            extra = ""
            if name == "per-request":
                extra = f" | vs goodput {verdict(_runs(row), _runs(by_name['goodput']))}" if "goodput" in by_name else ""
                extra += f" | mean s by label {row.get('label_lengths')}"
            if name == "pinned" and row["S"] in fixed:
                extra = f" | {row['tokens_per_s'] / fixed[row['S']]['tokens_per_s']:.2f}x fixed S = {row['S']}"
            if row.get("retired"):
                extra += f" | retired {row['retired']}"
            print(f"{'':>27}| {name:>12}: {_rate(row, best_runs, plain_runs)} | {row['lengths']}{extra}")
            for objective, entry in (row.get("trace") or {}).items():  # TimedGoodput: its prices by objective
                print(f"{'':>27}|   {objective:>8}: {entry['choices']} choices, chosen by D {entry['chosen']}"
                      + ("" if entry["ms"] is None else f", priced ms {entry['ms']}, score/best "
                         f"{entry['relative_score']}, expected tokens {entry['tokens']}"))
        cost = next((rows_cost(row.get("costs")) for row in point if rows_cost(row.get("costs"))), None)
        if cost:
            grid, low, t_max, high = cost
            print(f"{'':>27}| rows cost (warm-up replays): G{grid} T{grid} D0 {low:.3f} ms -> T{t_max} {high:.3f} ms "
                  f"({high / low:.2f}x)")


def print_details(rows):
    """Step times, measured acceptance, the policies' cost models, garbage collections."""
    print("\nstep time, ms (wall / GPU) per point (mean over its timed runs):")
    for row in rows:
        gpu = "-" if row.get("gpu_ms") is None else f"{row['gpu_ms']:.3f}"
        step = "-" if row.get("step_ms") is None else f"{row['step_ms']:.3f}"
        print(f"  {row['part']} batch {row['batch']} {row['workload']} {row['policy']} S={row['S']}: {step} / {gpu}"
              + ("" if row.get("steps") is None else f"; {row['steps']:.0f} steps and {row['outside_ms']:.1f} ms "
                 "outside step() a run")
              + f"; tokens/s of each run {[round(r) for r in _runs(row)]}")
    measured = [row for row in rows if row.get("acceptance")]
    if measured:
        print("\nmeasured per-depth acceptance by label (fixed S points; the label is the oracle's p):")
    for row in measured:
        print(f"  {row['part']} batch {row['batch']} {row['workload']} S={row['S']}: {row['acceptance']}")
    costed = [row for row in rows if row.get("costs")]
    if costed:
        print("\nthe policy's cost model after each point, ms per step by (grid G, depths D): the loop's wall "
              "of decode-only steps / GPU, 'mixed': the wall of steps with prefill chunks; 'real': every busy "
              "call's wall a step and its calibration (real / model); 'tok': realised tokens a request-step "
              "(expected at the last choice); 'explored': choices made to measure a depth so far; decisions: "
              "the policy's choices since the point before (its warm-up generates included)")
    for row in costed:
        costs = row["costs"]
        if "rows" in costs:
            print(f"  {row['part']} batch {row['batch']} {row['workload']} {row['policy']}: warm-up replay ms by "
                  "token count: " + ", ".join(f"{key.replace('=', '').replace(', ', ' ')} {value:.3f}"
                                               for key, value in costs["rows"].items())
                  + f"; prefill rows a mixed step {costs['prefill_rows']}")
        text = ", ".join(f"{key.replace('=', '').replace(', ', ' ')} {_ms(value['wall_ms'])}/{_ms(value['gpu_ms'])}"
                         + ("" if value.get("mixed_ms") is None else f" mixed {_ms(value['mixed_ms'])}")
                         + ("" if value.get("realised_ms") is None else
                            f" real {_ms(value['realised_ms'])} x{value['calibration']:.2f}")
                         + ("" if value.get("tokens") is None else f" tok {value['tokens']:.2f}")
                         + ("" if value.get("expected_tokens") is None else f" (exp {value['expected_tokens']:.2f})")
                         for key, value in costs.items() if key not in ("rows", "prefill_rows"))
        decisions = row.get("decisions")
        print(f"  {row['part']} batch {row['batch']} {row['workload']} {row['policy']}: {text}; "
              f"explored {row.get('explored')}"
              + ("" if not decisions else f"; {decisions[0]} decisions, {decisions[1]} host ms each"))
    print("\ngarbage collections in the timed generates (gen 0 / 1 / 2, ms in all):")
    for row in rows:
        if row.get("gc"):
            print(f"  {row['part']} batch {row['batch']} {row['workload']} {row['policy']} S={row['S']}: {row['gc']}")


def _ms(value):
    return "-" if value is None else f"{value:.3f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="bench_adaptive.py --json files (missing ones are skipped)")
    parser.add_argument("--details", action="store_true", help="also step times, acceptance, cost models, GC")
    parser.add_argument("--verbose", action="store_true", help="(no effect: no megatron-core here)")
    args = parser.parse_args(argv)
    rows = []
    for path in args.json:
        try:
            with open(path) as file:
                rows += json.load(file)
        except (OSError, ValueError) as error:
            print(f"{path}: skipped ({error})")
    print_workloads(rows)
    if args.details:
        print_details(rows)


if __name__ == "__main__":
    main()
