"""Fixed draft length vs the goodput draft-length policy (issue 34), tokens/s on one GPU.

    python bench/bench_adaptive.py            # GPU: the demo model and a ~1B GPU-bound model
    python bench/bench_adaptive.py --quick    # CPU smoke run: tiny shapes, few points

Two parts (the 1B model first). A point is a workload at a batch size; every engine of the point
(fixed S = 0..S_max, the policies) is built and warmed first (CUDA graphs captured, an untimed
``generate``, the goodput policy's exploration: none of it timed), then each engine is timed
``--repeats`` times (default 3; the demo's points ``--demo-repeats``, default 7: its runs are
~0.1-0.3 s and its host-bound loop moves 15-35 % between runs on some leases, so a median of 3
says little), interleaved round-robin (A, B, C, A, B, C, ...) so host drift hits all alike, with
the heap made before them frozen out of garbage collection (as the server's engine loop runs:
one full collection of it took ~0.2 s, a whole demo run). Reported: each engine's median
tokens/s and its spread ((max - min) / median); "/best" and "/plain" from medians; a verdict per
comparison: "above" / "below" when the two engines' min-max ranges are apart, "within spread"
when the margin does not exceed the spread.
Every timed run's outputs are checked equal to plain decoding's.

1. (second) The trained demo model (MTP drafting, 2 MTP layers), 64-byte held-out prompts, batch 1, 8,
   32, 128, greedy and T = 1 (seeded): fixed S = 0, 1, 2 and ``GoodputPolicy`` at S_max = 2
   (``--pinned-plain``: also the S = 2 engine held at D = 0 by the policy's path, without and with
   retirement from speculation ("pinned 0", "retired 0"); ``--opted-out``: also the S = 2 engine
   with every request's ``num_speculative_tokens=0``).
   A point generates 192 tokens a request (the checkpoint trained on 256-token windows: prompt
   and output stay inside them) for 2 x batch requests (``--demo-waves``: the second wave takes
   the slots the first frees), so that one run is >= ~100 ms of GPU work at batch 32 and 128 (a
   run of 64 tokens was ~20 ms at batch 32: one garbage collection or slow host step moved it by
   10-30 %).
2. (first) A ~1B model (16 layers, hidden 2048, random bf16 weights: the step is GPU-bound) with a device
   oracle drafter: request r's draft at each depth is the true next token with probability
   ``p_r`` (a hash of request and position, no host work), so acceptance is set per request.
   Workloads: all 0.9, all 0.6, all 0.2, and a mix of the three (closed batches: as many
   requests as slots), and the mix queued (4x the slots in requests: a freed slot takes the next,
   as a server runs; 48 tokens each, or ``--length-spread x``: drawn from 48 x (1 -+ x), so that
   plain decoding's requests do not all finish in the same step); fixed S = 0..3, goodput at S_max = 3 (one depth for the batch), and
   ``PerRequestGoodputPolicy`` at S_max = 3 ("per-request": a length per request, ragged verify rows:
   a decode request runs 1 + s_r rows; its mean s per label 0.9 / 0.6 / 0.2 is printed). Batches
   128, 256, 64, 8: at 128 and 256 rows cost (a decode-only step's GEMMs leave the weight-bound
   regime: on an H200 at batch 256 the warm-up's replay at 4 rows a request costs 2.71x its replay
   at one; the table prints both per point), so the rows a low-acceptance request saves are worth
   something: where a length per request should beat one depth for the batch (at 256 no fixed
   S beat plain on the mix: there the policies must fall back to plain decoding). The random
   model's logits get wide margins (:func:`widen_logit_margins`), so that
   bf16 verify steps of any row count emit plain decoding's tokens (no near ties) and the oracle's
   "true token" is the one the target emits: a request labelled p accepts p per depth. The
   measured acceptance per label (from each fixed-S point's accepted drafts) is printed.

Per workload it prints tokens/s of each fixed S, of the policy, the policy's share of verify
steps at each draft length, and the best fixed S ("oracle best": the S one would pick knowing
the workload). A decode-only step verifies ``1 + V`` rows per decode request, V its verify tier
(the most drafts any of its requests holds; docs/draft_lengths.md), so the policy saves verify
rows as well as draft depths, and a step where it drafts nothing is a plain decode step.
``--budget-seconds`` stops starting new points after that much wall time; each finished point
prints its summary at once and rewrites ``--json`` (``bench/adaptive_report.py`` prints the
tables again from it, e.g. after a part was cut by a timeout).
"""

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU, tiny shapes, few points")
    parser.add_argument("--budget-seconds", type=float, default=1e9, help="start no new point after this long")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed generates of every engine a point, interleaved round-robin (default 3; quick 1)")
    parser.add_argument("--demo-repeats", type=int, default=None,
                        help="timed generates of each engine at a demo point (default: --repeats if given, else 7; "
                             "quick 1)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="tokens per request (default: demo 192, 1B 48; quick 8)")
    parser.add_argument("--length-spread", type=float, default=0.0,
                        help="1B: request i's tokens drawn uniformly from new-tokens * (1 -+ x) (seeded; default 0: "
                             "all equal, so plain decoding's queued requests finish in lockstep)")
    parser.add_argument("--demo-waves", type=int, default=None,
                        help="the demo's prompts a point, in batches (default 2: 2 x batch requests; quick 1)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--demo-first", action="store_true", help="run the demo part before the 1B one")
    parser.add_argument("--demo-batches", type=int, nargs="+", default=None, help="default 1 8 32 128 (quick: 1 4)")
    parser.add_argument("--large-batches", type=int, nargs="+", default=None, help="default 128 256 64 8 (quick: 4)")
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--large-workloads", nargs="+", default=None,
                        help="only these 1B workloads (0.9 0.6 0.2 mixed queued; default all)")
    parser.add_argument("--no-pinned", action="store_true", help="skip the demo's pinned-goodput engine")
    parser.add_argument("--pinned-plain", action="store_true",
                        help="the demo also runs the S = 2 engine held at D = 0 by the goodput policy's path, "
                             "without and with retirement from speculation")
    parser.add_argument("--opted-out", action="store_true",
                        help="the demo also runs the S = 2 engine with every request's num_speculative_tokens = 0")
    parser.add_argument("--demo-goodput", choices=("both", "run", "skip"), default="both",
                        help="the demo's goodput engines: MTP windows skipped on no-draft steps and caught "
                             "up exactly (mtp_idle_windows='skip', the default engine), run, or both (default)")
    parser.add_argument("--demo-decode-steps", type=int, default=1,
                        help="InferenceConfig.decode_steps_per_launch of every demo engine (default 1; the "
                             "host-bound demo's documented remedy: a decode run launches this many steps at once)")
    parser.add_argument("--join-hold-steps", type=int, default=0,
                        help="InferenceConfig.join_hold_steps of every engine (0: rows filled at once)")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args(argv)
    given_repeats = args.repeats
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.demo_repeats is None:  # --repeats alone sets both parts' (as before --demo-repeats)
        args.demo_repeats = given_repeats or (1 if args.quick else 7)
    if not 0 <= args.length_spread < 1:
        parser.error(f"--length-spread must be in [0, 1), got {args.length_spread}")
    for name in ("repeats", "demo_repeats", "new_tokens", "demo_waves"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


if __name__ == "__main__":
    ARGS = parse_args()
    import mtp_ctrl

    mtp_ctrl.quiet_known_warnings(ARGS.verbose)

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # noqa: E402
import adaptive_report as report  # noqa: E402
from bench_forward import FULL_MODEL, QUICK_MODEL, build_model  # noqa: E402

import mtp_ctrl  # noqa: E402
from mtp_ctrl.cli.byte_corpus import evenly_spaced_windows, load_stdlib_corpus  # noqa: E402
from mtp_ctrl.controllers import (GoodputPolicy, InferenceConfig, PerRequestGoodputPolicy, Proposer,  # noqa: E402
                                  SamplingParams, TextGenerationController)
from mtp_ctrl.controllers.draft_policy import DraftLengthPolicy  # noqa: E402
from mtp_ctrl.controllers.step_costs import StepCostModel  # noqa: E402

PROMPT_LEN = 64
DEMO_NEW_TOKENS = 192  # the demo checkpoint trained on 256-token windows: prompt + output stay inside them
MIXES = {"0.9": (0.9,), "0.6": (0.6,), "0.2": (0.2,), "mixed": (0.9, 0.6, 0.2)}


class AcceptanceOracle(Proposer):
    """Drafts the plain output's token with probability ``rates[r]`` per depth (else a wrong token):
    ``sequences`` ``[n, L]`` int64 on the device (prompt + plain output of prompt ``r``), request
    ``id`` being prompt ``(id - first_id) % n`` (``first_id``: a device scalar the caller sets to
    the controller's next request id before each ``generate``; the graphs read it)."""

    takes_ragged_rows = True  # reads bonus_positions only

    def __init__(self, sequences: torch.Tensor, rates: torch.Tensor, first_id: torch.Tensor):
        self.sequences, self.rates, self.first_id = sequences, rates, first_id  # [n, L] int64, [n] float32, [] int64

    def propose(self, batch):
        S = self.draft_context.shape.num_speculative_tokens
        count, n = batch.num_requests, self.sequences.shape[0]
        rows = (batch.step.device_request_ids[:count] - self.first_id).clamp(min=0) % n  # [G]
        positions = batch.bonus_positions[:count, None] + 1 + torch.arange(S, device=rows.device)  # [G, S]
        true = self.sequences[rows].gather(1, positions.clamp(0, self.sequences.shape[1] - 1))  # [G, S]
        mixed = (rows[:, None] * 1000003 + positions * 7919 + 12345) & 0xFFFFFFFF
        mixed = ((mixed ^ (mixed >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
        mixed = ((mixed ^ (mixed >> 12)) * 0x297A2D39) & 0xFFFFFFFF
        uniform = (mixed ^ (mixed >> 15)).float() / 4294967296.0  # [G, S] in [0, 1)
        right = uniform < self.rates[rows][:, None]
        return torch.where(right, true, (true + 1) % self.draft_context.shape.vocab_size)

    def on_no_drafts(self, batch):
        pass

    def prefix_cache_lookahead(self):
        """0: it keeps no state, so requests start from cached prompt blocks as plain decoding's do
        (the default None computed every prompt in full: the closed 1B batches' speculative engines
        prefilled 4096 tokens a generate where the plain engine prefilled 1024, ~6 ms of GPU more)."""
        return 0


def widen_logit_margins(model, embedding_std: float = 2.0) -> None:
    """Make the random model's next token ``(token + 1) % vocab`` with a wide logit margin: the
    embedding rows grow to ``embedding_std`` (the decoder layers' random outputs, ~1 in size, no
    longer decide the residual stream) and the output layer's row ``t + 1`` is embedding row
    ``t``, so the winning logit is ~``hidden`` against ~``4 sqrt(hidden)`` for the runner-up. bf16
    rounding differences between verify steps of different row counts (~1e-2 relative) then never
    flip the argmax: every S emits plain decoding's tokens. The step's cost is unchanged (same
    shapes, same layers)."""
    with torch.no_grad():
        embedding = model.embedding.word_embeddings.weight  # [V, H]
        embedding.mul_(embedding_std / embedding.float().std().item())
        model.output_layer.weight.copy_(embedding.roll(1, dims=0))  # row t + 1 = embedding row t


def per_depth_acceptance(results, labels, S):
    """``{label: p}``: the per-depth acceptance p that explains each label's mean accepted drafts
    per verify step ``A = p + p^2 + ... + p^S`` (fixed S; solved by bisection)."""
    out = {}
    for label in sorted(set(labels)):
        steps = sum(r.decode_steps for r, l in zip(results, labels) if l == label)
        accepted = sum(r.accepted_drafts for r, l in zip(results, labels) if l == label)
        mean = accepted / max(steps, 1)
        low, high = 0.0, 1.0
        for _ in range(40):
            middle = (low + high) / 2
            low, high = (middle, high) if sum(middle ** k for k in range(1, S + 1)) < mean else (low, middle)
        out[f"{label:g}"] = round(low, 3)
    return out


class DecisionTimer:
    """Mixin for a draft-length policy: times each decision (thread CPU time of ``choose``) for the
    report (``take_decisions``)."""

    def choose(self, query):
        started = time.thread_time()
        try:
            return super().choose(query)
        finally:
            self.decision_seconds.append(time.thread_time() - started)

    def take_decisions(self):
        """``(decisions since the last call, host ms a decision or None)``."""
        times, self.decision_seconds = self.decision_seconds, []
        return len(times), (round(float(np.mean(times)) * 1e3, 3) if times else None)


class TimedGoodput(DecisionTimer, GoodputPolicy):
    """``GoodputPolicy`` whose decisions are counted and timed (``DecisionTimer``), and summarised
    by objective (``trace``): what it priced each depth at and how it scored them."""

    def __init__(self):
        super().__init__()
        self.decision_seconds = []
        # objective -> [choices, [D + 1] sums of ms, of scores, of expected tokens, chosen counts, choices priced
        # at every depth (those sums' count: a choice over fewer depths is not summed)]
        self._trace = {}

    def choose(self, query):
        lengths = super().choose(query)
        if self.speculation_retired or self.last_seconds is None:  # a retired batch is not priced
            objective = "retired"
        else:
            objective = "queue" if query.num_waiting > 0 else "drain"
        depths = self.shape.num_speculative_tokens + 1
        entry = self._trace.setdefault(objective, [0, 0.0, 0.0, 0.0, np.zeros(depths), 0])
        entry[0] += 1
        entry[4][self.last_depth] += 1
        if objective != "retired" and self.last_seconds.shape[0] == depths:
            entry[5] += 1
            entry[1] = entry[1] + self.last_seconds * 1e3
            entry[2] = entry[2] + self.last_scores / self.last_scores.max()
            entry[3] = entry[3] + self.expected_tokens
        return lengths

    def take_trace(self):
        """``{objective: {choices, ms, relative_score, tokens, chosen}}`` since the last call: the mean
        priced ms a step, score over the best, expected tokens a request of each depth, and how often
        each depth was chosen ("retired": choices made while retired, not priced)."""
        trace, self._trace = self._trace, {}
        out = {}
        for objective, (count, ms, score, tokens, chosen, priced) in trace.items():
            mean = (lambda v: None if np.isscalar(v) else [round(float(x) / priced, 3) for x in v])
            out[objective] = dict(choices=count, ms=mean(ms), relative_score=mean(score), tokens=mean(tokens),
                                  chosen=[int(c) for c in chosen])
        return out


class RecordedPerRequest(DecisionTimer, PerRequestGoodputPolicy):
    """``PerRequestGoodputPolicy`` that sums the drafts each request verified (its ``observe``, numpy:
    no per-request Python added to the policy's host work), for the bench's lengths per label, and
    times each decision (thread CPU time of ``choose``)."""

    def __init__(self):
        super().__init__()
        self.verified = np.zeros(0, dtype=np.int64)  # [ids] drafts each request id verified
        self.decision_seconds = []  # thread seconds of each choose since the last lengths_by_label
        self._searches_before = 0

    def observe(self, request_ids, draft_lengths, accepted_counts):
        super().observe(request_ids, draft_lengths, accepted_counts)
        ids = np.asarray(request_ids, dtype=np.int64)
        if ids.size and int(ids.max()) >= self.verified.shape[0]:
            self.verified = np.concatenate([self.verified, np.zeros(2 * int(ids.max()) + 2 - self.verified.shape[0],
                                                                    dtype=np.int64)])
        np.add.at(self.verified, ids, np.asarray(draft_lengths, dtype=np.int64))

    def lengths_by_label(self, results, labels):
        """``{label: mean drafts a decode step}`` over the requests of ``results`` (labels in order): the
        drafts observed over the request's decode steps (a step where nobody verified a draft is not
        observed: it counts 0); and the point's decisions (its untimed generates included): their
        count, the searches among them, host ms a decision (mean)."""
        sums = {}
        for result, label in zip(results, labels):
            drafts = int(self.verified[result.request_id]) if result.request_id < self.verified.shape[0] else 0
            entry = sums.setdefault(f"{label:g}", [0, 0])
            entry[0] += drafts
            entry[1] += result.decode_steps
        out = {label: round(d / max(n, 1), 2) for label, (d, n) in sorted(sums.items())}
        out["decisions"], out["host_ms_a_decision"] = self.take_decisions()
        out["searches"] = self.searches - self._searches_before
        self._searches_before = self.searches
        return out


class EqualCosts(StepCostModel):
    def seconds(self, batch_size, num_drafts):
        return 1.0

    def policy_seconds(self, batch_size, num_drafts):
        return 1.0


class PinnedGoodput(GoodputPolicy):
    """``GoodputPolicy`` whose step costs are all equal, so it drafts S on every step (acceptance is
    never 0; no exploration, the tokens-per-second objective): against fixed S with the same
    lengths, the cost of the policy path itself."""

    def __init__(self):
        # no exploration of any kind: no unmeasured depth tried, no runner-up hold, no depth timed again
        super().__init__(drain_objective=False, explore_tries=0, explore_every=1 << 62, retime_explored=False)

    def bind(self, shape):
        super().bind(shape)
        self.cost_model = EqualCosts()


class DepthCosts(StepCostModel):
    """Every step costs 1 + 10 x its depths: drafting never pays (PinnedPlain)."""

    def seconds(self, batch_size, num_drafts):
        return 1.0 + 10.0 * num_drafts

    def policy_seconds(self, batch_size, num_drafts):
        return self.seconds(batch_size, num_drafts)


class PinnedPlain(PinnedGoodput):
    """``GoodputPolicy`` whose step costs make every draft a loss, so it holds D = 0 on every step
    through the whole policy path (timing, holds, decisions): the S_max engine's sustained D = 0
    against plain decoding's engine, in the same loop."""

    def bind(self, shape):
        GoodputPolicy.bind(self, shape)
        self.cost_model = DepthCosts()


class RetiredPlain(PinnedPlain):
    """``PinnedPlain`` whose grid counts as settled, so its retirement rule applies (``GoodputPolicy``,
    here ``retire_after=4``, holds of 1 to 4 launches: it retires within the first few launches of a
    run, where holds of up to 64 launches, carried over from the run before, could leave a whole
    wave unretired): held at D = 0 while requests wait, it retires the batch from speculation and
    admits the next requests retired (no MTP catch-ups from then on, and no MTP window over their
    prompts)."""

    def __init__(self):
        super().__init__()
        self.retire_after, self.decide_every, self.longest_hold = 4, 1, 4

    def settled(self, batch_size):
        return True


class NoDrafts(DraftLengthPolicy):
    """Every request drafts 0 on every step of an engine of S > 0 (held as a trained policy's choice):
    what a D = 0 step costs beside a plain engine's (S = 0), without the goodput policy's own path."""

    decide_every, longest_hold = 64, 64

    def warmup_depths(self, num_speculative_tokens):
        return (0,)

    def choose(self, query):
        return np.zeros_like(query.caps)


def explored(policy, batch):
    """Whether the goodput policy's one-time exploration at ``batch``'s grid is over (every depth
    measured, and timed a second time: ``GoodputPolicy.settled``); True for other policies."""
    if not isinstance(policy, GoodputPolicy) or isinstance(policy, PinnedGoodput):
        return True
    return policy.settled(batch)


class PointEngine:
    """One engine of a point: its fixed S (or S_max), name ("fixed", "goodput", ...), policy (None:
    fixed S), controller, and ``before()`` (runs before each of its generates; the oracle's first id)."""

    def __init__(self, S, name, policy, controller, before=None):
        self.S, self.name, self.policy, self.controller = S, name, policy, controller
        self.before = before or (lambda: None)

    def generate(self, prompts, params):
        self.before()
        return self.controller.generate(prompts, params)


class OptedOut(PointEngine):
    """An engine of S > 0 whose requests all opt out of speculation (``num_speculative_tokens=0``):
    what a request that never drafts costs beside plain decoding's engine."""

    def generate(self, prompts, params):
        return super().generate(prompts, dataclasses.replace(params, num_speculative_tokens=0))


def warm(entry, prompts, params):
    """Untimed generates: one (compile, capture, warm the policy), then up to 3 more until a goodput
    policy has measured every depth at this grid and timed each a second time (its one-time
    exploration, a server's first seconds); then the engine's metrics restart, so they cover only
    the timed runs."""
    entry.generate(prompts, params)
    for _ in range(3):
        if explored(entry.policy, entry.controller.config.max_requests):
            break
        entry.generate(prompts, params)
    entry.controller.metrics.reset()


def measure(engines, prompts, params, repeats, plain_outputs=None):
    """Every engine warmed (:func:`warm`), then timed ``repeats`` times, interleaved round-robin (A, B,
    C, A, B, C, ...) so host drift (clocks, other processes, the allocator) hits all alike. Per
    engine a dict: ``runs`` (tokens/s of each timed generate), ``equal_plain`` (every run's outputs
    == ``plain_outputs``; None: the first engine's first run is plain), ``results`` (the last run's),
    ``lengths`` (share of verify steps at each draft length), ``step_ms`` / ``gpu_ms`` (the metrics'
    mean wall / GPU per step over the timed runs), ``gc`` (collections inside them)."""
    for entry in engines:
        warm(entry, prompts, params)
    records = [dict(runs=[], equal_plain=True, collections=GarbageCollections()) for _ in engines]
    with frozen_heap():
        plain_outputs = _timed_runs(engines, records, prompts, params, repeats, plain_outputs)
    for entry, record in zip(engines, records):
        metrics = entry.controller.metrics.as_dict()
        counts = metrics["draft_length_counts"]
        record.update(lengths=[round(c / max(sum(counts), 1), 2) for c in counts],
                      step_ms=metrics["step_time"]["mean_step_ms"], gpu_ms=metrics["step_time"]["mean_gpu_ms"],
                      gc=record.pop("collections").summary(),
                      # per timed run: steps launched, and the run's wall outside step() calls (admission
                      # of the prompts, results), ms
                      steps=metrics["step_time"]["steps"] / repeats,
                      outside_ms=(sum(record["run_seconds"]) - metrics["step_time"]["step_seconds"]) / repeats * 1e3)
    return records


@contextlib.contextmanager
def frozen_heap():
    """The heap made so far (models, graphs, imports, the warm-up) left out of the garbage collections
    inside the block, as the server's engine loop leaves its start-up (``serve/engine.py``): a full
    collection of that heap took ~0.2 s on the GPU hosts, a whole demo run's wall."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _timed_runs(engines, records, prompts, params, repeats, plain_outputs):
    """:func:`measure`'s timed generates, round-robin; returns the plain outputs."""
    for _ in range(repeats):
        for entry, record in zip(engines, records):
            if entry.controller.shape.device.type == "cuda":
                torch.cuda.synchronize()
            with record["collections"]:
                started = time.perf_counter()
                results = entry.generate(prompts, params)
                seconds = time.perf_counter() - started
            outputs = [r.output_tokens for r in results]
            plain_outputs = outputs if plain_outputs is None else plain_outputs
            record["equal_plain"] &= outputs == plain_outputs
            record["runs"].append(sum(len(tokens) for tokens in outputs) / seconds)
            record.setdefault("run_seconds", []).append(seconds)
            record["results"] = results
    return plain_outputs


def run_point(controller, prompts, params, repeats=1, policy=None, before=None):
    """One engine alone (the profiling scripts' helper): :func:`measure` of it; returns (the best run's
    tokens/s, the last run's outputs, draft-length shares, ``{step_ms, gpu_ms, gc, results}``)."""
    record = measure([PointEngine(None, None, policy, controller, before)], prompts, params, repeats)[0]
    times = dict(step_ms=record["step_ms"], gpu_ms=record["gpu_ms"], gc=record["gc"], results=record["results"])
    return max(record["runs"]), [r.output_tokens for r in record["results"]], record["lengths"], times


def point_row(entry, record, **fields):
    """A table row of ``entry`` at a point from its :func:`measure` record (``results`` left out)."""
    runs = record["runs"]
    return dict(fields, S=entry.S, policy=entry.name, tokens_per_s=report.median(runs),
                spread_pct=report.spread_pct(runs), runs=[round(r, 1) for r in runs],
                lengths=record["lengths"], equal_plain=record["equal_plain"], step_ms=record["step_ms"],
                steps=record["steps"], outside_ms=round(record["outside_ms"], 3),
                gpu_ms=record["gpu_ms"], gc=record["gc"], costs=cost_table(entry.policy),
                explored=getattr(entry.policy, "explored", None),
                retired=getattr(entry.policy, "retired", None),  # requests retired from speculation, all runs
                # the policy's decisions since its last row (warm-up generates included), host ms each
                decisions=entry.policy.take_decisions() if isinstance(entry.policy, TimedGoodput) else None,
                trace=entry.policy.take_trace() if isinstance(entry.policy, TimedGoodput) else None)


class GarbageCollections:
    """Python's garbage collections inside ``with`` blocks: how many of each generation and their
    milliseconds (a host-bound loop's spread: a full collection over every engine's objects is ms)."""

    def __init__(self):
        self.counts, self.seconds, self._started, self._active = [0, 0, 0], 0.0, None, False

    def _callback(self, phase, info):
        if not self._active:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.counts[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._started
            self._started = None

    def __enter__(self):
        self._active = True
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        self._active = False
        gc.callbacks.remove(self._callback)

    def summary(self):
        """``[gen-0, gen-1, gen-2 collections, ms in all]``."""
        return self.counts + [round(self.seconds * 1e3, 2)]


def engine(model, S, batch, max_model_len, policy=None, proposer=None, device="cuda", idle_windows=None,
           catch_up_positions=None, decode_steps_per_launch=1, controller_class=None, join_hold_steps=0):
    """``idle_windows``: ``InferenceConfig.mtp_idle_windows`` (None: its default, "skip");
    ``catch_up_positions``: ``InferenceConfig.mtp_catch_up_positions`` (None: its default);
    ``decode_steps_per_launch``, ``join_hold_steps``: ``InferenceConfig``'s; ``controller_class``: a
    ``TextGenerationController`` subclass to build (None: the controller itself)."""
    options = dict(decode_steps_per_launch=decode_steps_per_launch, join_hold_steps=join_hold_steps)
    if idle_windows is not None:
        options["mtp_idle_windows"] = idle_windows
    if catch_up_positions is not None:
        options["mtp_catch_up_positions"] = catch_up_positions
    config = InferenceConfig(num_speculative_tokens=S, max_requests=batch, block_size_tokens=16,
                             max_model_len=max_model_len, max_tokens_per_step=max(batch * PROMPT_LEN, 256),
                             cuda_graph_batch_sizes=(batch,) if device == "cuda" else (), **options)
    controller = (controller_class or TextGenerationController)(model, config, proposer=proposer, draft_policy=policy)
    started = time.perf_counter()
    graphs = controller.warmup()
    print(f"warm-up: S = {S}, batch {batch}, {type(policy).__name__ if policy else 'fixed'}: {graphs} graphs in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    return controller


def cost_table(policy):
    """The goodput policy's learned step costs (ms by grid and depths), or None; with ragged rows
    also the warm-up's replay ms by (G, token count, D) ("rows")."""
    if not isinstance(policy, GoodputPolicy) or isinstance(policy, PinnedGoodput):
        return None
    table = {key: {name: None if value is None else round(value, 3) for name, value in row.items()}
             for key, row in policy.cost_model.table().items()}
    if policy.expected_tokens is not None:  # a request's expected tokens a step at each D, at the last choice
        for depth, tokens in enumerate(policy.expected_tokens.tolist()):
            for key, row in table.items():
                if key.endswith(f"D={depth}"):
                    row["expected_tokens"] = round(tokens, 3)
    rows = getattr(policy.cost_model, "row_gpu", None)
    if rows:
        table["rows"] = {f"G={g}, T={t}, D={d}{', mixed' if mixed else ''}": round(seconds * 1e3, 3)
                         for (g, t, d, mixed), seconds in sorted(rows.items())}
        table["prefill_rows"] = policy.cost_model.prefill_rows
    return table


class Table:
    """The rows so far: printed as JSON lines as they come, a point's summary when it is done, the
    JSON file rewritten after every point (a part killed by its timeout keeps what it measured)."""

    def __init__(self, args):
        self.args, self.rows, self.started = args, [], time.perf_counter()

    def out_of_time(self, what="") -> bool:
        late = time.perf_counter() - self.started > self.args.budget_seconds
        if late and what:
            print(f"skipped for time (--budget-seconds {self.args.budget_seconds:g}): {what}", flush=True)
        return late

    def add_point(self, rows):
        for row in rows:
            print(json.dumps(row), flush=True)
        self.rows += rows
        report.print_workloads(rows, header=False)
        if self.args.json:
            with open(self.args.json, "w") as file:
                json.dump(self.rows, file, indent=1)


def demo_part(args, table, device):
    model = mtp_ctrl.load_demo_model(device=device)
    held_out = load_stdlib_corpus().held_out
    new_tokens = args.new_tokens or (8 if args.quick else DEMO_NEW_TOKENS)
    waves = args.demo_waves or (1 if args.quick else 2)
    batches = args.demo_batches or ((1, 4) if args.quick else (1, 8, 32, 128))
    runs = f" runs of {args.demo_decode_steps}" if args.demo_decode_steps > 1 else ""  # the workload's label
    for batch in batches:
        if table.out_of_time(f"demo batch {batch}"):
            return
        prompts = [w.tolist() for w in evenly_spaced_windows(held_out, waves * batch, PROMPT_LEN)]
        # "goodput": the default engine (no-draft steps skip the MTP windows, caught up exactly later);
        # "goodput run": mtp_idle_windows="run" (every no-draft step runs every depth's window)
        kinds = [(S, "fixed", None) for S in (0, 1, 2)]
        kinds += [(2, name, TimedGoodput()) for name, kind in (("goodput", "skip"), ("goodput run", "run"))
                  if args.demo_goodput in ("both", kind)]
        if (batch >= 32 or args.quick) and not args.no_pinned:  # the policy path's own cost (fixed S = 2's lengths)
            kinds.append((2, "pinned", PinnedGoodput()))
        if args.pinned_plain:  # the S = 2 engine held at D = 0 by the policy path, against plain's engine
            kinds.append((2, "pinned 0", PinnedPlain()))
            kinds.append((2, "retired 0", RetiredPlain()))  # the same, retiring its requests from speculation
        if args.opted_out:  # the S = 2 engine with every request's num_speculative_tokens = 0
            kinds.append((2, "opted out", None))
        engines = [(OptedOut if name == "opted out" else PointEngine)(
            S, name, policy, engine(model, S, batch, PROMPT_LEN + new_tokens + 8, policy, device=device.type,
                                    idle_windows="run" if name == "goodput run" else None,
                                    decode_steps_per_launch=args.demo_decode_steps,
                                    join_hold_steps=args.join_hold_steps))
                   for S, name, policy in kinds]
        for temperature in (0.0, 1.0):
            if table.out_of_time(f"demo batch {batch} T = {temperature:g}"):
                break
            params = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=5)
            records = measure(engines, prompts, params, args.demo_repeats)  # fixed S = 0 first: its first run is plain
            workload = f"T={temperature:g}" + (f", {waves}x{new_tokens}" if waves > 1 else "") + runs
            table.add_point([point_row(entry, record, part="demo", batch=batch, workload=workload)
                             for entry, record in zip(engines, records)])
        for entry in engines:
            entry.controller.close()


QUEUED = 4  # the queued workload: this many times the slots in requests (freed slots are refilled)


def large_part(args, table, device):
    shape = QUICK_MODEL if args.quick else FULL_MODEL
    new_tokens = args.new_tokens or (8 if args.quick else 48)
    most_tokens = int(new_tokens * (1 + args.length_spread))
    max_model_len = PROMPT_LEN + most_tokens + 8
    model = build_model(shape, device, max_model_len + 8)
    if device.type == "cpu":
        model = model.float()
    widen_logit_margins(model)
    batches = args.large_batches or ((4,) if args.quick else (128, 256, 64, 8))
    generator = torch.Generator().manual_seed(0)
    for batch in batches:
        if table.out_of_time(f"1B batch {batch}"):
            return
        total = QUEUED * batch  # the queued workload's requests; the closed ones are its first `batch`
        all_prompts = torch.randint(0, shape["vocab_size"], (total, PROMPT_LEN), generator=generator).tolist()
        workloads = [(name, mix, all_prompts[:batch]) for name, mix in MIXES.items()]
        workloads.append((f"queued {QUEUED}x mixed", MIXES["mixed"], all_prompts))
        if args.large_workloads:
            workloads = [w for w in workloads if w[0].split()[0] in args.large_workloads]
        lengths = torch.randint(max(int(new_tokens * (1 - args.length_spread)), 1), most_tokens + 1, (total,),
                                generator=generator).tolist() if args.length_spread else [new_tokens] * total
        all_params = [SamplingParams(max_new_tokens=n) for n in lengths]  # [total]: request i's
        plain_engine = PointEngine(0, "fixed", None, engine(model, 0, batch, max_model_len, device=device.type,
                                                            join_hold_steps=args.join_hold_steps))
        plain = {len(prompts): [r.output_tokens for r in plain_engine.generate(prompts, all_params[: len(prompts)])]
                 for prompts in (all_prompts[:batch], all_prompts)}  # S = 0: the same for any mix
        width = PROMPT_LEN + most_tokens + 16
        sequences = torch.zeros(total, width, dtype=torch.int64)
        for index, (prompt, output) in enumerate(zip(all_prompts, plain[total])):
            sequences[index, : len(prompt) + len(output)] = torch.tensor(list(prompt) + list(output))
        sequences = sequences.to(device)
        rates = torch.zeros(total, device=device)
        first_id = torch.zeros((), dtype=torch.int64, device=device)
        engines = [plain_engine]
        for S, name, policy in [(S, "fixed", None) for S in (1, 2, 3)] + [(3, "goodput", TimedGoodput()),
                                                                           (3, "per-request", RecordedPerRequest())]:
            controller = engine(model, S, batch, max_model_len, policy, AcceptanceOracle(sequences, rates, first_id),
                                device.type, join_hold_steps=args.join_hold_steps)
            engines.append(PointEngine(S, name, policy, controller,
                                       before=lambda c=controller: first_id.fill_(c.debug_view().next_request_id)))
        if device.type == "cuda":  # the engines share the model; each holds its own KV, buffers and graph pools
            print(f"1B batch {batch}, {len(engines)} engines warmed: GPU memory reserved "
                  f"{torch.cuda.memory_reserved() / 2**30:.1f} GiB, peak allocated "
                  f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
        for workload, mix, prompts in workloads:
            if table.out_of_time(f"1B batch {batch} {workload}"):
                break
            labels = [mix[i % len(mix)] for i in range(total)]
            rates.copy_(torch.tensor(labels, device=device))
            records = measure(engines, prompts, all_params[: len(prompts)], args.repeats,
                              plain_outputs=plain[len(prompts)])
            workload += f", lengths +-{args.length_spread:g}" if args.length_spread else ""
            rows = []
            for entry, record in zip(engines, records):
                results = record["results"]
                rows.append(point_row(entry, record, part="1B", batch=batch, workload=workload,
                                      graphs=entry.controller.debug_view().num_cuda_graphs))
                if entry.name == "fixed" and entry.S > 0:
                    rows[-1]["acceptance"] = per_depth_acceptance(results, labels[: len(prompts)], entry.S)
                if entry.name == "per-request":
                    rows[-1]["label_lengths"] = entry.policy.lengths_by_label(results, labels)
            table.add_point(rows)
        for entry in engines:
            entry.controller.close()


def main(args):
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    mtp_ctrl.init_single_process(device)
    table = Table(args)
    parts = [(args.skip_large, large_part), (args.skip_demo, demo_part)]
    for skip, part in reversed(parts) if args.demo_first else parts:
        if not skip:
            part(args, table, device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\n== summary\n{name}; greedy unless T says otherwise; every engine of a point timed {args.repeats}x (the demo's: "
          f"{args.demo_repeats}x), interleaved "
          "round-robin, after its untimed generates; tokens/s: the median; '/best': over the best fixed S's "
          "median, '/plain': over S = 0's; verdict: the min-max ranges apart ('above' / 'below') or not")
    report.print_workloads(table.rows)
    report.print_details(table.rows)


if __name__ == "__main__":
    main(ARGS)
