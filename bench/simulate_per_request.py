"""The per-request goodput policy in a scripted serving loop on the CPU (issue 34): no model, no GPU.

    PYTHONPATH=$PWD python bench/simulate_per_request.py [--batch 64] [--steps 600] [--closed]

A queue of requests labelled 0.9 / 0.6 / 0.2 (each draft lands with that probability, given the
ones before it), ``--new-tokens`` each, admitted as slots free (one a step, a 64-token prompt chunk:
the step that admits it is a mixed step). The controller's side is the real one
(``DraftLengths.choose``: holds, joins take the held choice's ``join_length()``); the outcomes come
to ``observe`` one step late (the overlapped loop's read-back). The cost of a step is scripted from
the 1B's H100 figures at batch 64 (bench/RESULTS.md, "Adaptive", ragged): a decode-only step
``1.35 ms + 2.5 us a row over G + 30 us a draft depth``, a mixed step its token bucket's time
(``rows + 64`` rounded up to a power of two from 128: 1.6 / 1.95 / 2.3 ms) plus the depths; the
policy gets those same costs as its warm-up row costs (``set_row_costs``). ``--row-costs-json``: the
step costs are instead a GPU run's warm-up replays (``bench_adaptive.py --json``: the per-request
engine's table at ``--batch``; a decode-only step costs the smallest recorded token count >= its rows
at its depth or above, a mixed step its token bucket's), the same ones the policy gets. Prints tokens per ms of
fixed S = 0..3, of ``GoodputPolicy`` (one depth for the batch) and of the per-request policy, the policy's mean s by label over decode steps (s of a request's
verify steps, its first step's join length included), the policy's host time per decision, and the
seconds and tokens a step it priced its searches' choices at beside the simulated steps' means.
``--oracle``: also every static per-label assignment (a request of label 0.9 / 0.6 / 0.2 always
drafts s_0.9 / s_0.6 / s_0.2, knowing its label: 64 runs), the best of them and its ratio to the best
fixed S: how far above the best fixed S a per-request policy could get on this workload.
"""

import argparse
import collections
import itertools
import json
import time

import numpy as np

import mtp_ctrl
from mtp_ctrl.controllers import GoodputPolicy, PerRequestGoodputPolicy
from mtp_ctrl.controllers.draft_lengths import DraftLengths
from mtp_ctrl.controllers.draft_policy import DraftLengthPolicy, FixedDraftLength
from mtp_ctrl.state import EngineShape

RATES = (0.9, 0.6, 0.2)
CHUNK = 64  # prompt rows a join's prefill chunk carries


def bucket(tokens: int) -> int:
    return max(128, 1 << int(np.ceil(np.log2(max(tokens, 1)))))


def scripted_seconds(G: int, rows: int, depth: int, mixed: int) -> float:
    """A step's scripted cost (module docstring), seconds; ``mixed``: the prompt chunks it carries."""
    if mixed:
        return 1.2e-3 + 3e-6 * bucket(rows + CHUNK * mixed) + 3e-5 * depth
    return 1.35e-3 + 2.5e-6 * (rows - G) + 3e-5 * depth


class MeasuredCosts:
    """Step costs from a GPU run's warm-up replays (``{(G, T, D, mixed): seconds}``, the table
    ``bench_adaptive.py --json`` records for its per-request engine), in ``scripted_seconds``' terms."""

    def __init__(self, path: str, batch: int):
        with open(path) as file:
            # the engine that recorded the most token counts at this batch: the per-request engine's
            # ragged decode counts (a goodput engine's table has one decode count a depth)
            rows = max((row["costs"]["rows"] for row in json.load(file)
                        if row["batch"] == batch and "rows" in (row.get("costs") or {})), key=len)
        self.table = {}
        for key, ms in rows.items():
            fields = dict(part.split("=") for part in key.split(", ") if "=" in part)
            self.table[(int(fields["G"]), int(fields["T"]), int(fields["D"]), key.endswith("mixed"))] = ms * 1e-3

    def seconds(self, G: int, rows: int, depth: int, mixed: int) -> float:
        """The recorded replay a step of ``rows`` verify rows (plus ``mixed`` prompt chunks) pads to."""
        tokens = rows + CHUNK * mixed
        keys = sorted(((d, t) for g, t, d, m in self.table if g == G and m == bool(mixed) and d >= depth
                       and t >= tokens), key=lambda key: (key[0] != depth, key[1], key[0]))
        d, t = keys[0] if keys else max((d, t) for g, t, d, m in self.table if g == G and m == bool(mixed))
        return self.table[(G, t, d, bool(mixed))]


MEASURED = None  # MeasuredCosts when --row-costs-json is given


def step_seconds(G: int, rows: int, depth: int, mixed: int) -> float:
    return (MEASURED or _Scripted).seconds(G, rows, depth, mixed)


class _Scripted:
    seconds = staticmethod(scripted_seconds)


def row_costs(G: int, S: int):
    """The warm-up's replay times the controller would hand the policy: ragged counts (decode only)
    and the mixed token buckets, at every depth."""
    if MEASURED is not None:
        return {key: seconds for key, seconds in MEASURED.table.items() if key[0] == G and key[2] <= S}
    costs = {}
    for depth in range(S + 1):
        for rows in range(G, G * (1 + depth) + 1, max(1, G // 4)):
            costs[(G, rows, depth, False)] = scripted_seconds(G, rows, depth, False)
        for tokens in (128, 256, 512, 1024, 2048, 4096, 8192):
            costs[(G, tokens, depth, True)] = scripted_seconds(G, tokens - CHUNK, depth, 1)
    return costs


def simulate(policy, G: int = 64, S: int = 3, steps: int = 600, new_tokens: int = 48, queued: bool = True,
             seed: int = 0, warm_costs: bool = True, length_spread: float = 0.0, waves: int = 0, warm_runs: int = 0):
    """Run the scripted loop; returns ``(tokens, seconds, lengths by label [list of s per decode
    step], decision host seconds [list], (the per-request policy's searches' priced (seconds, tokens)
    a step [list], each simulated step's (seconds, tokens) [list]))``. ``length_spread`` x: request i's tokens are drawn
    uniformly from ``new_tokens * (1 -+ x)`` (the same draws for every policy: seeded by request id).
    ``waves`` W > 0: a known queue of W x G requests (``bench_adaptive.py``'s "queued 4x" at W = 4),
    run until every one is done (``steps`` is then only a bound); ``warm_runs``: run the workload this
    many times first with the same policy (the benchmark times warm engines), the figures of the last."""
    shape = EngineShape(max_requests=G, max_model_len=256, block_size_tokens=16, num_speculative_tokens=S,
                        max_tokens_per_step=G * (1 + S) + CHUNK * G)
    lengths_of = DraftLengths(policy, shape)
    if isinstance(policy, GoodputPolicy) and warm_costs:
        costs = {(G, d): step_seconds(G, G * (1 + d), d, False) for d in range(S + 1)}
        lengths_of.set_step_costs(costs, row_costs=row_costs(G, S))
        for depth in range(S + 1):  # every depth measured (a warmed-up loop): no exploration holds
            policy.cost_model.record(G, depth, costs[(G, depth)], costs[(G, depth)])
    first_id = 0
    for run in range(warm_runs + 1):
        result = _run(policy, lengths_of, G, steps if not waves else 100 * waves * new_tokens, new_tokens, queued,
                      seed + run, length_spread, waves * G, first_id)
        first_id = result[-1]
    return result[:-1]


def _run(policy, lengths_of, G, steps, new_tokens, queued, seed, length_spread, known_requests, first_id):
    """One run of :func:`simulate`'s loop (requests from id ``first_id``); returns its figures and the next free id."""
    rng = np.random.default_rng(seed)

    def tokens_of(request_id):
        if not length_spread:
            return new_tokens
        low, high = int(new_tokens * (1 - length_spread)), int(new_tokens * (1 + length_spread))
        return int(np.random.default_rng([seed, request_id]).integers(max(low, 1), high + 1))
    next_id, slots = first_id, {}  # request id -> [rate, tokens left, held drafts (verified next step)]
    waiting = (known_requests or steps * G) if queued else 0
    if not queued:
        for _ in range(G):
            slots[next_id] = [RATES[next_id % 3], tokens_of(next_id), 0]
            next_id += 1
    lengths_of.queue_view = lambda ids: (waiting, np.array([slots[i][1] for i in ids.tolist()], dtype=np.int64),
                                         round(np.mean([tokens_of(next_id + i) for i in range(min(waiting, 16))]))
                                         if waiting else None)  # as the controller's: the next 16 waiting
    tokens = seconds = 0.0
    by_label = collections.defaultdict(list)
    decisions = []  # thread seconds of each policy.choose
    choose = type(policy).choose.__get__(policy)  # the class's (an earlier run's timed wrapper is an attribute)
    priced = []  # the per-request policy's searches: (seconds, tokens) a step it priced its choice at

    def timed_choose(query):
        started = time.thread_time()
        searches = getattr(policy, "searches", 0)
        try:
            return choose(query)
        finally:
            decisions.append(time.thread_time() - started)
            if getattr(policy, "searches", 0) > searches and policy.last_priced is not None:
                priced.append(policy.last_priced)
    policy.choose = timed_choose
    pending = None  # the last step's outcomes, observed one step late
    simulated = []  # (seconds, tokens) of each step
    for _ in range(steps):
        joined = 0
        while queued and len(slots) < G and waiting:  # every free slot: a 64-token prompt chunk each
            slots[next_id] = [RATES[next_id % 3], tokens_of(next_id), 0]
            next_id, waiting, joined = next_id + 1, waiting - 1, joined + 1
        if not slots:
            break
        ids = np.array(sorted(slots), dtype=np.int64)
        if pending is not None:
            policy.observe(*pending)
        chosen = lengths_of.choose(ids, ids.shape[0], G)  # [n]: the drafts each makes this step
        # verify what each holds (drafted last step), then hold what it drafts now
        verified = np.array([slots[i][2] for i in ids.tolist()], dtype=np.int64)
        accepted = np.zeros_like(verified)
        for index, request_id in enumerate(ids.tolist()):
            rate = slots[request_id][0]
            while accepted[index] < verified[index] and rng.random() < rate:
                accepted[index] += 1
            by_label[rate].append(int(verified[index]))
        rows = int(ids.shape[0] + verified.sum())
        cost = step_seconds(G, rows, int(chosen.max()) if chosen.shape[0] else 0, joined)
        seconds += cost
        step_tokens = tokens
        pending = (ids, verified, accepted)
        if isinstance(policy, GoodputPolicy):  # what the controller's step_timing tells the cost model
            policy.cost_model.record_launches(int(joined > 0), 1)
            if joined:
                policy.cost_model.record_prefill_rows(CHUNK * joined)
                policy.cost_model.record_prefill_chunks(CHUNK * joined, joined)
        for index, request_id in enumerate(ids.tolist()):
            slot = slots[request_id]
            emitted = min(1 + int(accepted[index]), slot[1])
            tokens += emitted
            slot[1] -= emitted
            slot[2] = int(chosen[index])
            if slot[1] <= 0:
                del slots[request_id]
                lengths_of.forget(request_id)
        simulated.append((cost, tokens - step_tokens))
    return tokens, seconds, by_label, decisions, (priced, simulated), next_id


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--closed", action="store_true", help="one closed batch (drains), not a queue")
    parser.add_argument("--waves", type=int, default=0,
                        help="W: a known queue of W x batch requests, run to the end (0: an endless queue, --steps)")
    parser.add_argument("--warm-runs", type=int, default=0,
                        help="run the workload this many times first with the same policy (warm, as the benchmark's)")
    parser.add_argument("--length-spread", type=float, default=0.0,
                        help="x: each request's tokens uniform in new-tokens * (1 -+ x) (default 0: all equal)")
    parser.add_argument("--row-costs-json", default=None,
                        help="step costs from this bench_adaptive.py --json file's warm-up replays at --batch")
    parser.add_argument("--oracle", action="store_true",
                        help="also the best static per-label lengths (64 runs; the module docstring)")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args()
    mtp_ctrl.quiet_known_warnings(args.verbose)
    global MEASURED
    MEASURED = MeasuredCosts(args.row_costs_json, args.batch) if args.row_costs_json else None
    queued = not args.closed
    S = 3
    best_fixed = 0.0  # tokens per second of the best fixed S (--oracle's reference)
    for label, make in [(f"fixed S = {s}", (lambda s=s: _Fixed(s))) for s in range(S + 1)] + \
                       [("goodput", GoodputPolicy), ("per-request", PerRequestGoodputPolicy)]:
        tokens, seconds, by_label, decisions, (priced, simulated) = simulate(
            make(), args.batch, S, args.steps, args.new_tokens, queued, length_spread=args.length_spread,
            waves=args.waves, warm_runs=args.warm_runs)
        line = f"{label:>12}: {tokens / seconds / 1e3:7.2f} tok/ms"
        if decisions:
            line += "; mean s by label " + " / ".join(f"{rate}: {np.mean(by_label[rate]):.2f}" for rate in RATES)
            line += f"; {len(decisions)} decisions, {np.mean(decisions) * 1e3:.3f} ms host each"
        if priced:  # what the policy expected of its choices against what the scripted steps gave
            (priced_s, priced_tokens), (step_s, step_tokens) = np.mean(priced, axis=0), np.mean(simulated, axis=0)
            line += (f"\n{'':>14}priced {priced_s * 1e3:.3f} ms, {priced_tokens:.1f} tokens a step "
                     f"({priced_tokens / priced_s / 1e3:.1f} tok/ms; mean of its searches' choices), simulated "
                     f"{step_s * 1e3:.3f} ms, {step_tokens:.1f} tokens")
        print(line, flush=True)
        best_fixed = max(best_fixed, tokens / seconds) if label.startswith("fixed") else best_fixed
    if args.oracle:
        scored = []
        for lengths in itertools.product(range(S + 1), repeat=len(RATES)):
            tokens, seconds, *_ = simulate(_PerLabel(lengths), args.batch, S, args.steps, args.new_tokens, queued,
                                           length_spread=args.length_spread, waves=args.waves)
            scored.append((tokens / seconds, lengths))
        scored.sort(reverse=True)
        print("   per-label: " + "; ".join(
            f"s = {' / '.join(map(str, lengths))}: {rate / 1e3:.2f} tok/ms, {rate / best_fixed:.3f}x the best fixed S"
            for rate, lengths in scored[:3]) + " (the best three static assignments by label "
            + " / ".join(map(str, RATES)) + ")", flush=True)


class _PerLabel(DraftLengthPolicy):
    """The oracle's static lengths: a request of label ``RATES[i]`` (request id i mod 3) drafts ``lengths[i]``."""

    per_request_lengths = True

    def __init__(self, lengths):
        super().__init__()
        self.lengths = np.asarray(lengths, dtype=np.int64)  # [3] int64

    def choose(self, query):
        return np.minimum(query.caps, self.lengths[query.request_ids % len(RATES)])


class _Fixed(FixedDraftLength):
    """Fixed S below the engine's S (the scripted loop's baseline)."""

    def __init__(self, s: int):
        super().__init__()
        self.s = s

    def choose(self, query):
        return np.minimum(query.caps, self.s)


if __name__ == "__main__":
    main()
