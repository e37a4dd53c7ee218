"""The controller's side of the draft-length policy (``draft_policy.py``): ask it for each step's
lengths (a choice holds for ``policy.decide_every`` steps while the batch stays the same), remember
what each request drafted, feed the outcomes back (gathered, one ``observe`` per choice), and
time steady steps for the policy's cost model (``step_costs.py``).

Timing: the lengths chosen when step N is built are the drafts step N makes (its draft phase
runs ``D = max s_r`` depths), staged with step N's one host-to-device copy and kept beside the
drafts in a device row of the request table; step N + 1 verifies them (its draft rows past
``s_r`` are masked). So the lengths a step's decode requests *verify* are those chosen one
sampling step earlier (the context keeps them per slot: ``StepMetadata.host_verify_lengths``):
:meth:`DraftLengths.launched` records them per launched step, and
:meth:`DraftLengths.applied` hands them with the read-back's accepted counts to the policy and
the metrics. Host values only, no sync.

Step timing: the controller measures each ``step()`` call (the wall time since the previous
call returned, the applied launch's GPU time); :meth:`DraftLengths.step_timing` keeps it when this
call and the one before each applied one steady launch of the same (grid, D) (steps with prefill
chunks apart, and the share of them), and
:meth:`DraftLengths.record_timing` hands it (the first TP rank's, on every rank) to the cost model
at the next call's lockstep check.

The queue: when the policy is asked, the controller's ``queue_view`` (if set) tells it how many
requests wait to be admitted, how many tokens each of the step's sampling requests may still
emit and how many a waiting request may (the mean budget of the next ones; ``DraftLengthQuery.num_waiting``,
``tokens_left``, ``joining_tokens``): a batch nobody waits to join ends with its slowest request
(``GoodputPolicy``'s drain objective); in a queue, the requests a step finishes bring prompt
chunks, as many as finish (``RowCostModel.queue_seconds``).
"""

import collections
from typing import Callable, Deque, Dict, List, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch.distributed as dist

from mtp_ctrl.controllers.config import SamplingParams
from mtp_ctrl.controllers.draft_policy import DraftLengthPolicy, DraftLengthQuery, FixedDraftLength
from mtp_ctrl.controllers.request_rows import RequestRows
from mtp_ctrl.state import EngineShape, StepMetadata


TIMING_EVERY = 4  # step_timing keeps one in this many steady calls of the same (G, D)
# step_timing hands the realised samples of consecutive calls at one (G, V, mixed) over together, once
# they hold this many steps: one record a few steps (the host pays a record per call otherwise, ~5 us
# on the GPU hosts, a few % of a host-bound step); the cost model decays and clips per record
REALISED_EVERY = 4

# sampling request ids [n] -> (waiting, tokens left [n], the waiting requests' mean token budget or None);
# a view that returns the first two only leaves joining_tokens None
QueueView = Callable[[np.ndarray], Tuple]


class StepTiming(NamedTuple):
    """One call's measured cost (``DraftLengths.step_timing``): a steady step's (the cost model's
    sample), or only the call's realised wall and tokens (``steady`` False)."""

    batch_size: int  # G, the step's grid
    num_drafts: int  # D (= its verify width V); a realised-only call: V, the drafts it verified
    wall_seconds: float  # the loop's wall time per step (between consecutive step() returns)
    gpu_seconds: float  # the launch's GPU time per step (CUDA events), -1 off CUDA
    mixed: bool = False  # a step with prefill chunks (the cost model keeps those apart)
    steady: bool = True  # a steady sample (the cost model's tables); False: realised sums only
    tokens: int = -1  # tokens the applied launch's decode requests emitted (-1: none counted)
    request_steps: int = 0  # its decode requests x steps
    steps: int = 1  # steps its realised part covers (a steady sample's own launch, and the calls summed with it)
    realised_seconds: float = -1.0  # wall seconds of those steps; -1: wall_seconds * steps (the sample's own)
    expected_tokens: float = -1.0  # the tokens the policy expected of its request-steps when launched; -1: unknown


class HeldChoice:
    """The policy's last choice, reused while its requests stay the same, lose some, or (a policy
    with ``joins_take_held_depth``) gain some (``DraftLengths.choose``)."""

    __slots__ = ("request_ids", "lengths", "steps", "hold", "key", "depth", "uniform")

    def __init__(self, request_ids: np.ndarray, lengths: np.ndarray, steps: int, hold: int, key: bytes,
                 depth: Optional[int] = None, caps: Optional[np.ndarray] = None):
        self.request_ids = request_ids  # [n] int64, the sampling requests it serves, in row order
        self.lengths = lengths  # [n] int64
        self.steps = steps  # steps it has served (counted in place: the held path is per step)
        self.hold = hold  # steps it may serve (decide_every, doubled while the policy repeats itself)
        self.key = key  # request_ids.tobytes()
        # the held depth D (the most drafts of the choice the policy made, or its join_length), what a
        # joining request takes; None: the choice held no request
        self.depth = depth if depth is not None or not lengths.shape[0] else int(lengths.max())  # host-ok: numpy
        # every request drafts min(D, its cap) (``caps`` [n], the requests' caps), as a joining one
        # does: the lengths of any requests are then their capped D, no lookup (GoodputPolicy's choices)
        self.uniform = self.depth is not None and caps is not None and \
            bool((lengths == np.minimum(self.depth, caps)).all())  # host-ok: numpy

    def serve(self, request_ids: np.ndarray, lengths: np.ndarray, key: bytes) -> None:
        """It serves one more step, to ``request_ids`` (``[n]``, a copy kept) with ``lengths``."""
        self.request_ids, self.lengths, self.key = request_ids.copy(), lengths, key
        self.steps += 1

    def lengths_of(self, request_ids: np.ndarray, join_caps: Optional[Callable[[np.ndarray], np.ndarray]] = None
                   ) -> Optional[np.ndarray]:
        """``[m]`` the lengths held for ``request_ids`` (``[m]`` int64). A request not held: None,
        or with ``join_caps`` (the caps ``[k]`` of ``[k]`` new ids) ``min(depth, its cap)``."""
        if self.depth is None or (join_caps is None and request_ids.shape[0] > self.request_ids.shape[0]):
            return None
        if self.request_ids.shape[0] == 0:  # nobody held: every request joins
            return None if join_caps is None else np.minimum(self.depth, join_caps(request_ids))
        order = np.argsort(self.request_ids)
        positions = np.searchsorted(self.request_ids, request_ids, sorter=order).clip(max=order.shape[0] - 1)
        found = order[positions]  # [m]
        held = self.request_ids[found] == request_ids  # [m] bool
        if held.all():
            return self.lengths[found]
        if join_caps is None:
            return None
        lengths = self.lengths[found]  # a copy (fancy indexing)
        joining = ~held
        lengths[joining] = np.minimum(self.depth, join_caps(request_ids[joining]))
        return lengths


class DraftLengths:
    """``policy``: the draft-length policy (None: :class:`FixedDraftLength`). :meth:`add` each
    request's SamplingParams (its ``num_speculative_tokens`` caps its lengths)."""

    def __init__(self, policy: Optional[DraftLengthPolicy], shape: EngineShape):
        policy = FixedDraftLength() if policy is None else policy
        if not isinstance(policy, DraftLengthPolicy):
            raise TypeError(f"draft_policy must be a DraftLengthPolicy, got {type(policy).__name__}")
        self.policy, self.shape = policy, shape
        self._caps: Dict[int, int] = {}  # request id -> its cap, for requests capped below S
        self._cap_index = RequestRows()  # the capped requests' rows of _cap_values (looked up per batch)
        self._cap_values = np.zeros(0, dtype=np.int64)  # [rows] int64
        # ids whose cap was set since the last lookup: their rows are written then, in one batch (a row
        # each as they come cost ~40 us a request: 10 ms to queue 256 requests that opt out)
        self._pending_caps: List[int] = []
        if self.S > 0:
            policy.bind(shape)
        self._fixed = type(policy) is FixedDraftLength  # S each unless capped: no bookkeeping needed
        # some request may verify fewer than S drafts (the step masks draft rows by length); stays on
        self.masked = self.S > 0 and not self._fixed
        # per launched step: [k, n_d], None (S each) or 0 (0 each)
        self._in_flight: Deque[Union[np.ndarray, None, int]] = collections.deque()
        # per launched step: the tokens a request-step the policy expected at its verify width (-1: unknown),
        # and the last applied launch's (step_timing's realised sample keeps it beside the tokens that came)
        self._expected_in_flight: Deque[float] = collections.deque()
        self._applied_expected = -1.0
        self._held: Optional[HeldChoice] = None  # the policy's last choice
        # the fixed policy's last lengths (each request's cap, read-only) and the ids' bytes they are for
        self._fixed_caps: Optional[Tuple[bytes, np.ndarray]] = None
        # read-only int64 arrays handed out step after step, made once (_filled): (shape, value) -> an
        # array of value (the held and fixed paths' lengths; the lengths verified by launches where
        # every request verified S, or none a draft)
        self._filled_arrays: Dict[Tuple[Tuple[int, ...], int], np.ndarray] = {}
        self._outcomes: List[Tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # applied, not yet observed
        self._outcome_runs = False  # some of _outcomes is a decode run's ([k, n_d], k > 1)
        self._timed_key, self._steady_calls = None, 0  # step_timing's (G, D, mixed) and its steady calls in a row
        self._busy = False  # the last step() call returned with work left (the time since it is the loop's)
        self._decided = False  # the policy made a choice since the last step_timing
        # realised samples not handed over yet: [(G, V, mixed), wall seconds, steps, tokens, request-steps]
        self._realised_pending: Optional[list] = None
        self.queue_view: Optional[QueueView] = None  # set by the controller (None: nobody waits, lengths unknown)
        # request id -> None: the proposer's side of a retirement (set by the controller: SlotLifecycle)
        self.on_retired: Optional[Callable[[int], None]] = None

    @property
    def S(self) -> int:
        """The engine's most drafts (``EngineShape.num_speculative_tokens``)."""
        return self.shape.num_speculative_tokens

    def warmup_depths(self) -> Tuple[int, ...]:
        if self.S == 0:
            return (0,)
        return tuple(sorted({int(d) for d in self.policy.warmup_depths(self.S) if 0 <= int(d) <= self.S}))

    def warmup_tiers(self) -> Tuple[Tuple[int, int], ...]:
        """The (verify width V, draft depths D) pairs whose step graphs ``warmup()`` captures, for
        decode-only and mixed shapes alike: every pair of the policy's warm-up depths (a step
        verifies what its decode requests drafted, so V follows the last D), and (S, D) (a step
        with no decode request keeps V = S)."""
        depths = self.warmup_depths()
        return tuple(sorted({(v, d) for v in depths for d in depths} | {(self.S, d) for d in depths}))

    def needs_mask(self, step: StepMetadata) -> bool:
        """Whether ``step`` must mask draft rows by length: some decode request verifies fewer than
        the step's V drafts (the drafts it holds; in a decode run's later steps, the run's own
        lengths). A decode-only step where every decode request verifies V (a policy that gives
        the batch one length, as GoodputPolicy does uncapped) skips the masking (a graph without
        it); a step with prefill chunks masks whenever the policy may vary lengths (one graph per
        mixed shape and tier: the masking ops are small beside its prefill rows)."""
        V = step.verify_width
        if not self.masked or V == 0:
            return False
        if not step.decode_only:  # prefill chunks, with decode requests or not: the variant warmup() captured
            return True
        if step.num_decode == 0:
            return False
        if step.dimensions.is_ragged(V):
            return True  # a ragged token count below the tier (warmup() captures its masked graph only)
        held = step.host_verify_lengths  # each <= V (V is their most): some < V iff not all == V
        if held.count(V) != len(held):  # tuple.count: ~3x cheaper than min() at batch 128
            return True
        return step.num_steps > 1 and min(step.host_draft_lengths[: step.num_decode]) < V

    def warmup_masks(self, verify_width: int, decode_only: bool = True) -> Tuple[bool, ...]:
        """The masking variants of a verify tier's graphs that ``warmup()`` captures (a mixed
        shape's: masked only, see :meth:`needs_mask`)."""
        if not self.masked or verify_width == 0:
            return (False,)
        return (False, True) if decode_only else (True,)

    def choose(self, request_ids: np.ndarray, num_sampling: int, batch_size: int) -> np.ndarray:
        """``[num_sampling]`` int64 draft lengths of the step's sampling requests (row order). The
        policy's last choice holds for up to ``policy.decide_every`` steps while the sampling
        requests stay the same or some of them left (no per-step policy work on steady decoding,
        nor while a batch drains), and twice as long each time the policy repeats it (for the same
        requests; a policy of one depth for the batch, not ``per_request_lengths``: that depth,
        whoever joined or left), up to ``policy.longest_hold`` steps. A new request takes the held depth (capped)
        until the hold ends when ``policy.joins_take_held_depth``, else asks the policy at once."""
        S = self.S
        if num_sampling == 0:  # a step of prompt chunks that end no prompt: no lengths, the held choice untouched
            return np.zeros(0, dtype=np.int64)
        ids = request_ids[:num_sampling]  # [n] int64
        held = self._held
        if held is not None and held.steps < held.hold:
            key = ids.tobytes()  # comparing bytes: ~10x cheaper than np.array_equal
            if key == held.key:
                held.steps += 1
                return held.lengths
            # requests finished since: the others keep their lengths; requests joined: the held depth
            joins = self.policy.joins_take_held_depth
            if held.uniform and joins:  # everyone's length is its capped D, whoever stays or joins
                kept = self._capped(ids, held.depth)
            else:
                kept = held.lengths_of(ids, self._caps_of if joins else None)
            if kept is not None:
                held.serve(ids, kept, key)
                return kept
        if S == 0 or (self._fixed and not self._caps):
            return self._filled((num_sampling,), S)  # fixed S, nobody capped: S each (a shared read-only array)
        if self._fixed:  # each request's cap: no decision, no queue view; looked up again only when ids change
            key = ids.tobytes()
            if self._fixed_caps is None or self._fixed_caps[0] != key:
                caps = self._caps_of(ids)  # [n] int64
                caps.setflags(write=False)
                self._fixed_caps = (key, caps)
            return self._fixed_caps[1]
        caps = self._caps_of(ids)  # [n] int64
        self._flush_outcomes()  # the policy decides on every outcome so far
        self._decided = True  # this call's wall holds the decision: no sample of a depth (step_timing)
        steps = 1 if held is None else held.steps
        view = (0, None) if self.queue_view is None else self.queue_view(ids)
        num_waiting, tokens_left, joining = view[0], view[1], (view[2] if len(view) > 2 else None)
        lengths = self.policy.choose(DraftLengthQuery(ids.copy(), caps.copy(), S, batch_size, steps, num_waiting,
                                                      tokens_left, joining if num_waiting else None))
        lengths = np.asarray(lengths)
        if lengths.shape != (num_sampling,) or not np.issubdtype(lengths.dtype, np.integer):
            raise TypeError(f"{type(self.policy).__name__}.choose must return [{num_sampling}] ints, "
                            f"got {lengths.dtype} {lengths.shape}")
        retiring = self.policy.retiring()
        if len(retiring):
            retiring = np.asarray(retiring, dtype=np.int64).reshape(-1)  # [k] int64
            unknown = retiring[~np.isin(retiring, ids)]
            if unknown.shape[0]:  # checked before anything changes
                shown = unknown[:8].tolist()  # host-ok: numpy, the error's message
                raise ValueError(f"{type(self.policy).__name__}.retiring must return ids of the choice's requests, "
                                 f"got {shown}")
            for request_id in retiring.tolist():  # host-ok: numpy
                self.retire(request_id)
            caps = self._caps_of(ids)  # a retired request verifies no draft from this step on
        lengths = np.clip(lengths.astype(np.int64), 0, caps)
        # the same choice again (for the same requests, or, from a policy of one depth for the batch, that
        # depth again whoever joined or left: a queue's batch changes every few steps): hold it twice as
        # long (up to the policy's longest_hold); anything else starts over at decide_every
        key = ids.tobytes()
        choice = HeldChoice(ids.copy(), lengths, 1, self.policy.decide_every, key, self.policy.join_length(), caps)
        one_depth_again = not self.policy.per_request_lengths and held is not None and held.uniform and \
            choice.uniform and held.depth == choice.depth
        if one_depth_again or (held is not None and held.key == key and np.array_equal(held.lengths, lengths)):
            choice.hold = max(choice.hold, min(2 * held.hold, self.policy.longest_hold or choice.hold))
        self._held = choice
        return lengths

    def _filled(self, shape: Tuple[int, ...], value: int) -> np.ndarray:
        """An int64 array of ``shape`` filled with ``value``, read-only, made once per (shape, value):
        the same lengths are handed out step after step, with no allocation per step."""
        filled = self._filled_arrays.get((shape, value))
        if filled is None:
            filled = self._filled_arrays[(shape, value)] = np.full(shape, value, dtype=np.int64)
            filled.setflags(write=False)
        return filled

    def _capped(self, request_ids: np.ndarray, depth: int) -> np.ndarray:
        """``[n]`` int64: ``min(depth, cap)`` of each of ``request_ids``."""
        if not self._caps:
            return self._filled(request_ids.shape, min(depth, self.S))
        return np.minimum(depth, self._caps_of(request_ids))

    def _caps_of(self, request_ids: np.ndarray) -> np.ndarray:
        """``[n]`` int64: each request's most drafts, min(S, its SamplingParams cap)."""
        caps = np.full(request_ids.shape[0], self.S, dtype=np.int64)  # [n] int64
        if self._caps:
            if self._pending_caps:
                self._write_pending_caps()
            rows = self._cap_index.rows(request_ids)[0]  # [n] int64, -1: not capped
            caps[rows >= 0] = self._cap_values[rows[rows >= 0]]
        return caps

    def launched(self, step: StepMetadata) -> None:
        """Record what ``step``'s decode requests verify (each step of a decode run after the first
        verifies the run's own lengths) and what its sampling requests drafted."""
        if self.S == 0:
            return
        expected = self.policy.expected_tokens  # [D + 1] of the choice in force, or None
        self._expected_in_flight.append(float(expected[step.verify_width])
                                        if expected is not None and step.verify_width < expected.shape[0] else -1.0)
        if step.verify_width == 0 and step.num_drafts == 0:  # V and D are the most drafts held and chosen
            self._in_flight.append(0)  # nobody verifies or drafts (a no-draft step after one): nothing to observe
            return
        num_decode, chosen, held, S = step.num_decode, step.host_draft_lengths, step.host_verify_lengths, self.S
        if held.count(S) == len(held) and chosen.count(S) == step.num_sampling_requests:
            self._in_flight.append(None)  # every request verifies and drafts S (the fixed-S path)
            return
        verified = np.empty((step.num_steps, num_decode), dtype=np.int64)  # [k, n_d] int64
        verified[0] = held  # the drafts each holds (the context's record, chosen when it last sampled)
        verified[1:] = chosen[:num_decode]
        self._in_flight.append(verified)

    def applied(self, step: StepMetadata, accepted_counts: np.ndarray) -> np.ndarray:
        """``accepted_counts``: ``[k, n_d]`` the read-back's counts of the oldest launched step (its
        decode rows, step row order). Tells the policy; returns the lengths verified, ``[k, n_d]``."""
        verified = self._in_flight.popleft() if self._in_flight else None
        self._applied_expected = self._expected_in_flight.popleft() if self._expected_in_flight else -1.0
        if verified is None:  # S each: a shared read-only array per shape
            verified = self._filled(accepted_counts.shape, self.S)
        elif isinstance(verified, int):  # 0: no request verified a draft (an outcome of s = 0 tells the policy nothing)
            return self._filled(accepted_counts.shape, 0)
        if self.S > 0 and not self._fixed and accepted_counts.size:
            # kept as they come (the read-back's rows are reused: a copy); flattened once per observe,
            # when the policy next decides (or every longest_hold steps)
            self._outcomes.append((step.host_request_ids[: step.num_decode], verified, accepted_counts.copy()))
            self._outcome_runs |= verified.shape[0] > 1
            if len(self._outcomes) >= max(self.policy.longest_hold or 1, self.policy.decide_every):
                self._flush_outcomes()
        return verified

    def _flush_outcomes(self) -> None:
        """Hand the outcomes gathered since the last call to the policy, in one ``observe``."""
        if self._outcomes:
            parts, self._outcomes = self._outcomes, []
            ids, verified, accepted = zip(*parts)
            if self._outcome_runs:  # decode runs: [k, n_d] each, ids once a step (flattened: step order)
                self._outcome_runs = False
                ids = [i if lengths.shape[0] == 1 else np.tile(i, lengths.shape[0]) for i, lengths in zip(ids, verified)]
                verified, accepted = [v.ravel() for v in verified], [a.ravel() for a in accepted]
            # else [1, n_d] each: one row a part, joined along axis 1 (axis=None, flattening each, is 2x slower)
            self.policy.observe(np.concatenate(ids), np.concatenate(verified, axis=-1).ravel(),
                                np.concatenate(accepted, axis=-1).ravel())

    def add(self, request_id: int, params: SamplingParams) -> None:
        """A request was queued: note its cap (kept until :meth:`drop`)."""
        if params.num_speculative_tokens is not None and params.num_speculative_tokens < self.S:
            self._set_cap(request_id, params.num_speculative_tokens)

    def _set_cap(self, request_id: int, cap: int) -> None:
        self._caps[request_id] = cap
        self._pending_caps.append(request_id)
        self._fixed_caps = None  # a live request's cap may have changed (a retirement)
        self.masked = True

    def _write_pending_caps(self) -> None:
        """The rows of the caps set since the last lookup (of requests not dropped since), in one batch."""
        ids = [request_id for request_id in dict.fromkeys(self._pending_caps) if request_id in self._caps]
        self._pending_caps = []
        if not ids:
            return
        rows, _ = self._cap_index.rows(np.array(ids, dtype=np.int64), create=True)
        if self._cap_index.capacity > self._cap_values.shape[0]:
            self._cap_values = np.resize(self._cap_values, self._cap_index.capacity)
        self._cap_values[rows] = [self._caps[request_id] for request_id in ids]

    def admitted(self, request_id: int) -> bool:
        """A request took a table slot (admitted, or back after a preemption): whether it may
        draft. Not if its cap is 0 (``SamplingParams(num_speculative_tokens=0)``, or retired), nor
        if the policy admits no drafting request now (``DraftLengthPolicy.admits_drafts``: it is
        then retired)."""
        if self.S == 0 or self._caps.get(request_id) == 0:
            return False
        if not self.policy.admits_drafts():
            self._set_cap(request_id, 0)  # retired on admission (the proposer is told by the caller)
            return False
        return True

    def retire(self, request_id: int) -> None:
        """The request never drafts again (``DraftLengthPolicy.retiring``): its cap is 0 until it is
        gone for good, and ``on_retired`` (set by the controller: the proposer's side) is told."""
        if self._caps.get(request_id) == 0:
            return
        self._set_cap(request_id, 0)
        if self._held is not None:  # a held choice of a length > 0 for it ends here
            self._held.hold = 0
        if self.on_retired is not None:
            self.on_retired(request_id)

    def forget(self, request_id: int) -> None:
        """The request is gone for good (finished or aborted; a preempted one is not forgotten: it
        comes back, and its acceptance counts stay its own): the policy forgets it (its outcomes
        not yet observed count in the policy's batch model only)."""
        self.policy.forget(request_id)

    def drop(self, request_id: int) -> None:
        """The controller is done with the request (gone for good): :meth:`forget`, and its cap goes."""
        self.forget(request_id)
        if self._caps.pop(request_id, None) is not None:
            self._cap_index.remove(request_id)
            if not self._caps:  # no capped request left: nothing pending may be looked up again
                self._pending_caps = []

    def abandon(self) -> None:
        """The steps in flight were abandoned (a step raised): their outcomes never come."""
        self._in_flight.clear()
        self._expected_in_flight.clear()

    def step_timing(self, applied: List[Tuple[StepMetadata, Optional[float]]], wall_seconds: Optional[float],
                    steps_launched: int, decode_tokens: Optional[int] = None,
                    work_left: bool = False) -> Optional[StepTiming]:
        """What one ``step()`` call measured for the policy's cost model (``step_costs.py``), or None:
        ``applied``, the launches the call applied with their GPU seconds (None off CUDA);
        ``wall_seconds``, the time since the previous call returned (None: the first call).
        Kept only for a steady call (it applied one launch, verify width = draft depths D, and
        launched as many steps) right after a call that applied one launch of the same grid and D
        (the loop was running that depth: no idle pause or first call in the wall time; the step
        before a switch of depth verifies the old width, so the second step after a switch is
        measured); a decode-only one only after a decode-only call (no prefill in its wall time),
        a step with prefill chunks (``mixed``) after either: ``(G, D, wall seconds per step, GPU
        seconds per step or -1, mixed)``; of a run of such calls, the first and then every
        ``TIMING_EVERY``-th (the averages move slowly; a depth tried is measured at once). Every
        call also tells the cost model how many of its applied launches carried prefill chunks
        (``StepCostModel.mixed_share``).

        Realised (``decode_tokens`` given: the tokens the applied launches' decode requests emitted;
        ``work_left``: whether this call returns with work in flight or waiting, kept for the next
        call: only after such a return is the time since the loop's, not an idle caller's): any
        other call that applied one launch with decode
        requests that verified what it drafted (V = D: a switch's launch, which verifies the old
        depth and drafts the new, is left out: in a short hold it would charge the switch to the
        depth) is a realised sample for the cost model's sums (``record_realised``): its grid, V,
        wall and tokens. Consecutive such calls at one (grid, V, mixed) are summed and handed over
        as one timing with ``steady`` False once they hold ``REALISED_EVERY`` steps, or when a
        sample at another key comes (the sum so far goes then, the new one waits). A steady sample
        carries its own call's, and the sum waiting at its key (``StepTiming.realised_seconds``):
        one hand-over a few calls in a long run at one depth.

        A call whose build asked the policy (:meth:`choose` past a hold) is no sample at all: the
        decision is the policy's host time whatever the depth (0.4-3 ms on the GPU hosts), and
        charged to the depth whose hold it ended it made a depth timed in short holds look dear
        (the demo's D = 0, timed in exploration holds of 8 steps, by ~0.3 ms a step)."""
        if self._fixed or self.S == 0:
            return None
        busy, self._busy = self._busy, work_left
        decided, self._decided = self._decided, False
        cost_model = self.policy.cost_model
        if len(applied) != 1:  # none, or several (a sync applied one before): no sample
            if applied and cost_model is not None:
                cost_model.record_launches(sum(1 for step, _ in applied if step.num_prefill), len(applied))
                for step, _ in applied:
                    self._record_prefill_rows(cost_model, step)
            self._timed_key, self._steady_calls = None, 0
            return None
        step, gpu_seconds = applied[0]
        mixed = step.num_prefill > 0
        if cost_model is not None:
            cost_model.record_launches(int(mixed), 1)
            if mixed:
                self._record_prefill_rows(cost_model, step)
        launch_key = (step.dimensions.request_count, step.num_drafts, mixed)
        verifies_drafts = step.verify_width == step.num_drafts  # V = D
        previous, self._timed_key = self._timed_key, launch_key
        realised = decode_tokens is not None and busy and wall_seconds is not None and step.num_decode > 0 \
            and verifies_drafts and not decided
        tokens = decode_tokens if realised else -1
        request_steps = step.num_decode * step.num_steps if realised else 0
        expected = self._applied_expected * request_steps if realised and self._applied_expected >= 0 else -1.0
        if not verifies_drafts or steps_launched != step.num_steps or previous is None or wall_seconds is None or \
                decided or (previous[:2] != launch_key[:2] if mixed else previous != launch_key):
            self._steady_calls = 0
            return self._add_realised(step, wall_seconds, tokens, request_steps, expected) if realised else None
        self._steady_calls += 1
        if (self._steady_calls - 1) % TIMING_EVERY:
            return self._add_realised(step, wall_seconds, tokens, request_steps, expected) if realised else None
        gpu = -1.0 if gpu_seconds is None else gpu_seconds / step.num_steps
        pending = self._realised_pending
        if realised and pending is not None and pending[0] == launch_key:  # (G, V = D, mixed): sums join it
            self._realised_pending = None
            return StepTiming(launch_key[0], launch_key[1], wall_seconds / step.num_steps, gpu, mixed, True,
                              tokens + pending[3], request_steps + pending[4], step.num_steps + pending[2],
                              wall_seconds + pending[1], _summed(expected, pending[5]))
        return StepTiming(launch_key[0], launch_key[1], wall_seconds / step.num_steps, gpu, mixed, True,
                          tokens, request_steps, step.num_steps, -1.0, expected)

    @staticmethod
    def _record_prefill_rows(cost_model, step: StepMetadata) -> None:
        """The rows of prefill chunks ``step`` carried (a mixed step), for the cost model."""
        if step.num_prefill:
            starts = step.host_query_start_loc
            rows = int(starts[-1] - starts[step.num_decode])
            cost_model.record_prefill_rows(rows)
            cost_model.record_prefill_chunks(rows, step.num_prefill)

    def _add_realised(self, step: StepMetadata, wall_seconds: float, tokens: int, request_steps: int,
                      expected: float = -1.0) -> Optional[StepTiming]:
        """Sum a realised-only sample into the pending ones; the timing to hand over now, if any."""
        key, pending = (step.dimensions.request_count, step.verify_width, bool(step.num_prefill)), self._realised_pending
        if pending is not None and pending[0] == key:
            pending[1] += wall_seconds
            pending[2] += step.num_steps
            pending[3] += tokens
            pending[4] += request_steps
            pending[5] = _summed(expected, pending[5])
            if pending[2] < REALISED_EVERY:
                return None
            self._realised_pending = None
            return self._realised_timing(pending)
        self._realised_pending = [key, wall_seconds, step.num_steps, tokens, request_steps, expected]
        if pending is None and step.num_steps >= REALISED_EVERY:  # a decode run: enough steps at once
            pending, self._realised_pending = self._realised_pending, None
        return None if pending is None else self._realised_timing(pending)

    @staticmethod
    def _realised_timing(pending: list) -> StepTiming:
        (grid, verify_width, mixed), wall_seconds, steps, tokens, request_steps, expected = pending
        return StepTiming(grid, verify_width, wall_seconds / steps, -1.0, mixed, False, tokens, request_steps, steps,
                          -1.0, expected)

    def record_timing(self, timing: Optional[StepTiming]) -> None:
        """Feed a measurement (every TP rank gets the first rank's: ``TPLockstep.check``) to the cost model."""
        if timing is None or self.policy.cost_model is None:
            return
        if timing.tokens >= 0:  # first: against the model before this sample moves it
            wall = timing.wall_seconds * timing.steps if timing.realised_seconds < 0 else timing.realised_seconds
            # the tokens expected a request-step of those steps when they were launched (None: unknown)
            expected = timing.expected_tokens / timing.request_steps \
                if timing.expected_tokens >= 0 and timing.request_steps > 0 else None
            self.policy.cost_model.record_realised(timing.batch_size, timing.num_drafts, wall, timing.steps,
                                                   timing.tokens, timing.request_steps, timing.mixed, expected)
        if timing.steady:
            self.policy.cost_model.record(timing.batch_size, timing.num_drafts, timing.wall_seconds,
                                          None if timing.gpu_seconds < 0 else timing.gpu_seconds, timing.mixed)

    def set_step_costs(self, costs: Dict[Tuple[int, int], float], group=None,
                       row_costs: Optional[Dict[Tuple[int, int, int, bool], float]] = None) -> None:
        """The warm-up's replay times by (batch size, draft depths) for the policy's cost model,
        and by (batch size, token count, draft depths, has prefill) (``row_costs``:
        ``StepCostModel.set_row_costs``, kept by a cost model that costs rows); under tensor
        parallelism every rank takes the first rank's (``group``: the TP ranks' gloo group), so that
        every rank's policy makes the same choices."""
        if group is not None:
            shared = [costs, row_costs]
            dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
            costs, row_costs = shared
        cost_model = self.policy.cost_model
        self._realised_pending = None  # the model's realised sums start over
        if cost_model is not None:
            cost_model.set_measured(costs)
            if row_costs:
                cost_model.set_row_costs(row_costs)


def step_order_lengths(verified: np.ndarray, num_requests: int) -> np.ndarray:
    """``verified`` ``[k, n_d]`` (the step's decode requests) widened to ``[k, num_requests]`` (the
    step's requests in step order; 0 for its prefill requests)."""
    out = np.zeros((verified.shape[0], num_requests), dtype=np.int64)
    width = min(verified.shape[1], num_requests)
    out[:, :width] = verified[:, :width]
    return out


def _summed(expected: float, pending: float) -> float:
    """Expected tokens of two parts of a realised sample summed; -1 (unknown) if either is."""
    return expected + pending if expected >= 0 and pending >= 0 else -1.0
