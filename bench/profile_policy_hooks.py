"""The draft-length path's host time per step, without a model (issue 34): the controller's calls
into ``DraftLengths`` (choose, needs_mask, launched, applied, step_timing, record_timing) replayed
for closed batches of decode requests, fixed S against ``GoodputPolicy`` at the same lengths
(its step costs make D = S the best depth, as on the demo at batch 32), wall time of each hook per
step (``time.perf_counter``, the median over ``--repeats`` passes). The overlapped loop's order:
a call builds step N + 1 (choose), launches it (needs_mask, launched), applies step N (applied),
then times itself (step_timing), and the next call's lockstep check records it (record_timing).
Each request emits 1 + accepted tokens a step (accepted: binomial-ish, a draft lands with
probability ``--accept``) until it has ``--new-tokens``; finished requests leave the batch (the
grid stays G, as with a CUDA-graph batch).

    PYTHONPATH=$PWD python bench/profile_policy_hooks.py [--batch 32] [--new-tokens 192] [--S 2]
"""

import argparse
import collections
import statistics
import time

import numpy as np
import torch

import mtp_ctrl
from mtp_ctrl.controllers import GoodputPolicy
from mtp_ctrl.controllers.draft_lengths import DraftLengths
from mtp_ctrl.state import EngineShape
from mtp_ctrl.state.batch_dimensions import BatchDimensions

HOOKS = ("choose", "needs_mask", "launched", "applied", "step_timing", "record_timing")


class FakeStep:
    """What ``DraftLengths`` reads of a ``StepMetadata`` (a decode-only step, graph grid G)."""

    def __init__(self, request_ids: np.ndarray, lengths: np.ndarray, verify: np.ndarray, grid: int, S: int):
        n = request_ids.shape[0]
        self.host_request_ids = request_ids  # [n] int64
        self.num_decode = n
        self.num_prefill = 0
        self.num_steps = 1
        self.num_sampling_requests = n
        self.host_draft_lengths = tuple(lengths.tolist())
        self.host_verify_lengths = tuple(verify.tolist())
        self.num_drafts = int(lengths.max()) if n else S
        self.verify_width = int(verify.max()) if n else S
        self.dimensions = BatchDimensions(grid * (1 + self.verify_width), grid, False)
        self.decode_only = True
        self.host_query_start_loc = None


def run(policy, args, rng_seed: int = 0):
    """Per hook: the list of per-step seconds of each pass (the last ``--repeats`` passes of ``--batches``)."""
    S, G = args.S, args.batch
    shape = EngineShape(max_requests=G, max_model_len=4096, block_size_tokens=16, num_speculative_tokens=S,
                        max_tokens_per_step=G * (S + 1), device=torch.device("cpu"))
    lengths_path = DraftLengths(policy, shape)
    # GPU seeds and walls that make D = S the best depth (walls by D: the demo's, batch 32, H200)
    walls = {d: (0.92 + 0.02 * d) * 1e-3 for d in range(S + 1)}
    lengths_path.set_step_costs({(G, d): walls[d] * 0.6 for d in range(S + 1)})
    rng = np.random.default_rng(rng_seed)
    clock = time.perf_counter
    decisions = [0, 0.0]  # the policy's own choose: calls, seconds (inside the choose hook's time)
    policy_choose = lengths_path.policy.choose

    def timed_choose(query):
        started = clock()
        try:
            return policy_choose(query)
        finally:
            decisions[0] += 1
            decisions[1] += clock() - started

    lengths_path.policy.choose = timed_choose
    passes = []
    next_id = 0
    for batch_index in range(args.batches):
        totals, steps = collections.Counter(), 0
        ids = np.arange(next_id, next_id + G, dtype=np.int64)
        next_id += G
        emitted = np.zeros(G, dtype=np.int64)
        held = np.full(G, S, dtype=np.int64)  # the drafts each holds (chosen when it last sampled)
        in_flight = None
        decisions[:] = [0, 0.0]
        # a closed batch (bench_adaptive's generate): nobody waits, tokens left known (the drain objective)
        lengths_path.queue_view = lambda request_ids: (0, args.new_tokens - emitted[np.searchsorted(ids, request_ids)])
        while True:
            live = emitted < args.new_tokens
            # build: choose
            started = clock()
            live_ids = ids[live]
            lengths = lengths_path.choose(live_ids, live_ids.shape[0], G) if live_ids.shape[0] else None
            t1 = clock()
            step = None
            if lengths is not None:
                step = FakeStep(live_ids, lengths, held[live], G, S)
                t2 = clock()
                lengths_path.needs_mask(step)
                t3 = clock()
                lengths_path.launched(step)
                t4 = clock()
                totals["needs_mask"] += t3 - t2
                totals["launched"] += t4 - t3
                held[live] = lengths
            totals["choose"] += t1 - started
            applied = []
            if in_flight is not None:
                previous = in_flight
                accepted = np.minimum(rng.geometric(1.0 - args.accept, previous.num_decode) - 1,
                                      np.array(previous.host_verify_lengths))[None, :]  # [1, n_d]
                t5 = clock()
                lengths_path.applied(previous, accepted)
                totals["applied"] += clock() - t5
                rows = np.searchsorted(ids, previous.host_request_ids)
                emitted[rows] += 1 + accepted[0]
                applied = [(previous, walls[previous.num_drafts] * 0.6)]
            in_flight = step
            wall = walls[step.num_drafts if step is not None else S]
            tokens = int(sum(1 + a for a in applied[0][0].host_verify_lengths)) if applied else 0
            t6 = clock()
            timing = lengths_path.step_timing(applied, wall, 1 if step is not None else 0, tokens, step is not None)
            t7 = clock()
            lengths_path.record_timing(timing)
            t8 = clock()
            totals["step_timing"] += t7 - t6
            totals["record_timing"] += t8 - t7
            steps += 1
            if step is None:
                break
        for request_id in ids.tolist():
            lengths_path.drop(request_id)
        if batch_index >= args.batches - args.repeats:
            passes.append({hook: totals[hook] / steps for hook in HOOKS} |
                          {"steps": steps, "decisions": decisions[0], "decision": decisions[1] / max(decisions[0], 1)})
    return passes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--S", type=int, default=2)
    parser.add_argument("--accept", type=float, default=0.75)
    parser.add_argument("--batches", type=int, default=20, help="closed batches run (the first ones warm up)")
    parser.add_argument("--repeats", type=int, default=14, help="of them, timed (per hook: the median)")
    parser.add_argument("--verbose", action="store_true", help="show megatron-core's import-time warnings too")
    args = parser.parse_args()
    mtp_ctrl.quiet_known_warnings(args.verbose)
    for label, make in (("fixed", lambda: None), ("goodput", GoodputPolicy)):
        policy = make()
        passes = run(policy, args)
        median = {hook: statistics.median(p[hook] for p in passes) * 1e6 for hook in HOOKS}
        depth = getattr(policy, "last_depth", None)
        print(f"{label:8s} batch {args.batch}, {passes[-1]['steps']} steps a batch"
              f"{'' if depth is None else f', last D = {depth}'}: per step (us) " +
              ", ".join(f"{hook} {median[hook]:.1f}" for hook in HOOKS) + f"; total {sum(median.values()):.1f}"
              f"; of it policy.choose {statistics.median(p['decisions'] * p['decision'] / p['steps'] for p in passes) * 1e6:.1f}"
              f" ({sum(p['decisions'] for p in passes) / len(passes):.1f} a batch, "
              f"{statistics.median([p['decision'] for p in passes if p['decisions']] or [0.0]) * 1e6:.0f} us each)", flush=True)


if __name__ == "__main__":
    main()
