"""User-facing configuration: how the engine is sized, and how one request samples.

Both are frozen dataclasses validated on construction, so a bad value fails where it is
written, naming the field, before any state exists.
"""

import dataclasses
import math
from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:  # imported where used: SamplingParams' users (the HTTP frontend) import this module
    from mtp_ctrl.state.engine_shape import EngineShape  # without torch, which mtp_ctrl.state loads

MTP_ATTENTION_MODES = ("paged", "single_position")
MTP_IDLE_WINDOWS = ("run", "skip")
ACCEPTANCE_MODES = ("exact_match", "rejection")
MOE_BACKENDS = ("triton", "grouped_mm", "megatron")  # mtp_ctrl.models.moe_inference.MOE_BACKENDS
MAX_DECODE_STEPS_PER_LAUNCH = 64  # a decode run's graph holds every one of its steps
_INT64_MAX = 2**63 - 1  # seeds, top_k, max_new_tokens and token ids live in int64 rows
_FLOAT32_MAX = 3.4028234663852886e38  # temperature and top_p live in float32 device rows


def _require_int(name: str, value, low: int, high: Optional[int] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _require_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:  # an int too large for a double
        raise ValueError(f"{name} must be finite and fit in float32 (<= {_FLOAT32_MAX:.7g}), got {value}") from None


def _require_float32(name: str, value: float) -> None:
    """Raise ValueError unless ``value`` (a finite float) is within float32's range, where it is stored."""
    if not abs(value) <= _FLOAT32_MAX:  # also NaN
        raise ValueError(f"{name} must be finite and fit in float32 (<= {_FLOAT32_MAX:.7g}), got {value}")


def _require_tuple(name: str, value, what: str) -> tuple:
    """``value`` as a tuple; raise TypeError naming ``name`` unless it is a list, tuple or range
    (a set or dict has no order, a str or a single int is a common slip)."""
    if not isinstance(value, (list, tuple, range)):
        raise TypeError(f"{name} must be a tuple or list of {what}, got {type(value).__name__} {value!r}")
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class InferenceConfig:
    """How the controller sizes its state.

    num_speculative_tokens: S, drafts per decode step (0 = plain decoding). Must not exceed the
        model's MTP depth (unless ``mtp_reuse_last_layer``); the controller checks that against the model.
    max_requests: requests running at once; more are queued.
    block_size_tokens: tokens per KV block.
    num_kv_blocks / kv_cache_bytes: the KV pool, as a block count or a byte budget (one of them;
        neither = enough blocks for max_requests full-length requests).
    max_model_len: prompt + generated tokens of one request.
    max_tokens_per_step: query rows of one forward pass; at least max_requests x (1 + S), so every
        decode request runs every step (prefill chunks share the rest).
    cuda_graph_batch_sizes: decode batch buckets captured as CUDA graphs (CUDA only; empty = eager).
    cuda_graph_token_counts: token counts of the graphs of steps with prefill chunks (strictly
        increasing, each <= max_tokens_per_step; a step above the last runs eagerly). Empty (the
        default): ``batch_dimensions.token_buckets(max_tokens_per_step)``.
    mtp_attention: "paged" drafts with each MTP layer attending over its own paged KV cache (as
        trained); "single_position" attends to the current row only (Megatron-LM's inference).
    mtp_reuse_last_layer: S may exceed the model's MTP layers: the deeper depths run its last MTP
        layer again, each with a KV cache of its own (Qwen3-Next ships one MTP layer). Lossless
        either way; how many of those drafts are accepted depends on how the layer was trained.
    mtp_idle_windows: what paged MTP drafting does on a step where no request drafts (a
        draft-length policy chose D = 0). "skip" (default) records a decode-only step's tokens and
        keeps the decoder hidden of its positions without running the depths: that step costs
        about what a plain step does (the demo at batch 128 on an H100: a D = 0 step's GPU 0.37 ms
        against 0.61 running the windows, plain 0.36); the next step that runs the windows widens
        them to cover the skipped positions (``MTPProposer(catch_up_positions=16)`` rows more, and
        a forced catch-up step when a request would fall further behind), so the depths' caches
        and the drafts are the same as with "run", which runs every depth over its window on
        every step. Steps with prefill chunks run the windows either way. The same per depth: a
        decode-only step that drafts D < S runs depths 0..D-1 only, and the depths past D catch up
        exactly on a later step that runs them (so a D = 1 step of an S = 2 engine costs near a
        fixed S = 1 step); with "run" every step runs every depth's window.
    mtp_catch_up_positions: with mtp_idle_windows="skip", M: the most positions a request's MTP
        windows may fall behind (its hidden ring holds S + M positions); a catch-up window has M
        rows more, and a step that would leave a skipped depth more than M behind runs every
        depth instead (a forced catch-up: in steady D = 1 at S = 2, one step in M / 2 + 1).
        Default 16: on the demo (H200, D = 1 at S = 2, batch 32 / 128) the D = 1 step's mean GPU
        time with its forced catch-ups was 0.471 / 0.568 ms at M = 16 against 0.487 / 0.581 at
        M = 8; the ring costs ``(R + 1) (S + M) H`` KV-dtype elements (the 1B model, H = 2048,
        bf16, S = 3, R = 64: 5.1 MB at M = 16).
    ragged_rows: with a draft-length policy whose lengths differ per request
        (``DraftLengthPolicy.per_request_lengths``, e.g. ``PerRequestGoodputPolicy``), a single
        step gives each decode request ``1 + s_r`` forward rows (the drafts it holds) instead of
        ``1 + V`` (V: the most any of the step's decode requests holds), so a request that drafts
        nothing costs one row. Default True; it applies where the proposer takes ragged rows
        (``Proposer.takes_ragged_rows``: paged and single-position MTP) and the model has no
        Mamba / GDN layers (those keep ``1 + V`` rows a request). False: ``1 + V`` rows always.
    overlap_scheduling: the host prepares step N + 1 while the GPU runs step N and learns step
        N's outcome one step late (default). False runs one step at a time (debugging, and the
        comparison); outputs are identical either way.
    finished_results_kept: finished requests' results the step API keeps until ``pop_result``
        takes them; beyond this many the oldest are dropped (``generate`` takes its own).
    acceptance: how a sampled request's drafts are verified. "exact_match" (default) keeps a draft
        while it equals the target's own sample at its position: output identical to plain
        decoding for the same seed, token for token and batch-invariant (up to float rounding
        that depends on a step's row count: README, "Two acceptance rules"). "rejection" is
        speculative sampling: draft d is kept with probability min(1, p(d) / q(d)), the first
        rejected one replaced by a draw from max(0, p - q): the same distribution as plain
        sampling (not the same tokens), and more drafts accepted at temperature > 0. Greedy
        requests are verified by exact match either way.
    decode_steps_per_launch: when every running request decodes and none waits, the host may
        build once, launch up to this many decode steps back to back (one CUDA graph) and apply
        their read-back at once: its work per step shrinks by about this factor, which matters
        when a step's GPU work is shorter than the host's (a small model). A ``step()`` call then
        returns the tokens of every step it applied. Runs end before any request can reach
        max_model_len; a request that stops mid-run (eos, stop sequence, max_new_tokens) is cut
        there and the rest of its run is discarded. 1 (default): one step per launch. Outputs are
        identical for every value.
    join_hold_steps: while requests wait for a row, how many steps a freed row may stay empty
        so that the waiting requests join together (plus the rest of a decode run the limit falls
        in). The hold ends once enough rows are free for every waiting request or a quarter of
        ``max_requests`` (so below 8 requests it never holds), and none is taken while nothing
        else runs, a request is paused for KV, or the next waiting request was evicted
        (``Scheduler.joins_held``). A step that admits requests costs several decode steps' time
        whatever it admits, and speculation spreads the finishes that plain decoding keeps in
        lockstep, so one join of many costs less than many of one. 0 (default): a freed row is
        filled at once. Outputs are identical for every value.
    moe_backend: how the MoE layers of a mixture-of-experts model compute. "triton" (default) and
        "grouped_mm" take the sync-free path (expert dispatch sized on the device, grouped expert
        products by a Triton fused-MoE kernel or torch's grouped GEMM), so MoE steps replay CUDA
        graphs like dense ones; a model setting that path does not cover raises ValueError naming
        it. "megatron" runs megatron's own MoELayer, which syncs with the host: steps run eagerly
        (the comparison). Dense models ignore it.
    fused_rope: rope q and k inside the paged KV write (True, default), or megatron's own rotary
        per layer (False, the comparison). Same tokens either way.
    fused_glue: layers built by ``build_gpt_model`` run their bias / residual / norm / activation
        glue as Triton kernels (True) or megatron's element-wise ops (False); None (default): on
        for a model on CUDA, off elsewhere (on the CPU the kernels would run through Triton's
        interpreter). Same math; fp32 tokens are identical.
    mamba_kernels: the Mamba mixers' conv / scan / decode-row ops are the Triton kernels (True)
        or their torch twins (False); None (default): each mixer's own choice, kernels on CUDA,
        twins elsewhere.
    prefix_caching: reuse the KV of full blocks a new request's prompt shares with earlier
        prompts (a chained hash of the tokens; reference-counted blocks, least recently used
        evicted first when the pool needs room). On by default: with nothing shared it costs
        nothing measurable (bench/RESULTS.md). Output is identical either way. Requests then
        prefill only the rest of their prompt. Hybrid models (Mamba-2, Gated DeltaNet) also
        restore a snapshot of their recurrent state after the reused blocks (see
        ``prefix_state_snapshots``). Proposers whose state cannot be reused
        (``Proposer.prefix_cache_lookahead`` None: EAGLE, parallel drafting,
        ``mtp_attention="single_position"``) take no hit. Per request: ``add_request(...,
        prefix_caching=False)``.
    prefix_state_snapshots: hybrid models with prefix caching: how many recurrent-state snapshots
        (every recurrent layer's conv and SSM state at a prompt-block boundary) are kept on the
        device, least recently used evicted first; paid from ``kv_cache_bytes`` when that is
        given. None (default): max(2 x max_requests, 8). 0: hybrids take no hit. Models without
        recurrent layers ignore it.
    tp_check_timeout_s: under tensor parallelism every ``step()`` first checks that all ranks
        build the same step (``tp_lockstep.py``); a rank that gets no answer within this many
        seconds raises instead of waiting for the process group's timeout. Allow for the slowest
        first step (kernel compilation) of any rank.
    """

    num_speculative_tokens: int = 0
    max_requests: int = 8
    block_size_tokens: int = 16
    num_kv_blocks: Optional[int] = None
    kv_cache_bytes: Optional[int] = None
    max_model_len: int = 512
    max_tokens_per_step: int = 256
    cuda_graph_batch_sizes: Tuple[int, ...] = ()
    cuda_graph_token_counts: Tuple[int, ...] = ()
    mtp_attention: str = "paged"
    mtp_reuse_last_layer: bool = False
    mtp_idle_windows: str = "skip"
    mtp_catch_up_positions: int = 16
    ragged_rows: bool = True
    overlap_scheduling: bool = True
    finished_results_kept: int = 4096
    acceptance: str = "exact_match"
    decode_steps_per_launch: int = 1
    join_hold_steps: int = 0
    moe_backend: str = "triton"
    tp_check_timeout_s: float = 300.0
    fused_rope: bool = True
    fused_glue: Optional[bool] = None
    mamba_kernels: Optional[bool] = None
    prefix_caching: bool = True
    prefix_state_snapshots: Optional[int] = None

    def __post_init__(self):
        _require_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        _require_int("max_requests", self.max_requests, 1)
        _require_int("block_size_tokens", self.block_size_tokens, 1)
        _require_int("max_model_len", self.max_model_len, 2)
        _require_int("max_tokens_per_step", self.max_tokens_per_step, 1)
        if self.num_kv_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give num_kv_blocks or kv_cache_bytes, not both")
        if self.num_kv_blocks is not None:
            _require_int("num_kv_blocks", self.num_kv_blocks, 1)
        if self.kv_cache_bytes is not None:
            _require_int("kv_cache_bytes", self.kv_cache_bytes, 1)
        stride = self.num_speculative_tokens + 1
        if self.max_tokens_per_step < self.max_requests * stride:
            raise ValueError(
                f"max_tokens_per_step ({self.max_tokens_per_step}) must hold every running request's "
                f"decode rows: max_requests x (1 + num_speculative_tokens) = {self.max_requests * stride}"
            )
        buckets = _require_tuple("cuda_graph_batch_sizes", self.cuda_graph_batch_sizes, "batch sizes (() = eager)")
        for size in buckets:
            _require_int("cuda_graph_batch_sizes entries", size, 1)
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"cuda_graph_batch_sizes must be strictly increasing, got {buckets}")
        if buckets and buckets[-1] * stride > self.max_tokens_per_step:
            raise ValueError(
                f"cuda_graph_batch_sizes: the largest batch ({buckets[-1]} requests x {stride} rows) exceeds "
                f"max_tokens_per_step ({self.max_tokens_per_step})"
            )
        object.__setattr__(self, "cuda_graph_batch_sizes", buckets)
        counts = _require_tuple("cuda_graph_token_counts", self.cuda_graph_token_counts, "token counts (() = default)")
        for count in counts:
            _require_int("cuda_graph_token_counts entries", count, 1, high=self.max_tokens_per_step)
        if list(counts) != sorted(set(counts)):
            raise ValueError(f"cuda_graph_token_counts must be strictly increasing, got {counts}")
        object.__setattr__(self, "cuda_graph_token_counts", counts)
        if not isinstance(self.fused_rope, bool):
            raise TypeError(f"fused_rope must be a bool, got {type(self.fused_rope).__name__}")
        for name in ("fused_glue", "mamba_kernels"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool or None, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.mtp_reuse_last_layer, bool):
            raise TypeError(f"mtp_reuse_last_layer must be a bool, got {type(self.mtp_reuse_last_layer).__name__}")
        if not isinstance(self.prefix_caching, bool):
            raise TypeError(f"prefix_caching must be a bool, got {type(self.prefix_caching).__name__}")
        if self.prefix_state_snapshots is not None:
            _require_int("prefix_state_snapshots", self.prefix_state_snapshots, 0)
        if not isinstance(self.ragged_rows, bool):
            raise TypeError(f"ragged_rows must be a bool, got {type(self.ragged_rows).__name__}")
        if not isinstance(self.overlap_scheduling, bool):
            raise TypeError(f"overlap_scheduling must be a bool, got {type(self.overlap_scheduling).__name__}")
        _require_int("finished_results_kept", self.finished_results_kept, 0)
        if not isinstance(self.mtp_idle_windows, str):
            raise TypeError(f"mtp_idle_windows must be a str, one of {MTP_IDLE_WINDOWS}, "
                            f"got {type(self.mtp_idle_windows).__name__}")
        if self.mtp_idle_windows not in MTP_IDLE_WINDOWS:
            raise ValueError(f"mtp_idle_windows must be one of {MTP_IDLE_WINDOWS}, got {self.mtp_idle_windows!r}")
        _require_int("mtp_catch_up_positions", self.mtp_catch_up_positions, 1)
        if self.mtp_attention not in MTP_ATTENTION_MODES:
            raise ValueError(f"mtp_attention must be one of {MTP_ATTENTION_MODES}, got {self.mtp_attention!r}")
        if not isinstance(self.acceptance, str):
            raise TypeError(f"acceptance must be a str, one of {ACCEPTANCE_MODES}, got {type(self.acceptance).__name__}")
        if self.acceptance not in ACCEPTANCE_MODES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_MODES}, got {self.acceptance!r}")
        _require_int("decode_steps_per_launch", self.decode_steps_per_launch, 1, high=MAX_DECODE_STEPS_PER_LAUNCH)
        _require_int("join_hold_steps", self.join_hold_steps, 0)
        if not isinstance(self.moe_backend, str):
            raise TypeError(f"moe_backend must be a str, one of {MOE_BACKENDS}, got {type(self.moe_backend).__name__}")
        if self.moe_backend not in MOE_BACKENDS:
            raise ValueError(f"moe_backend must be one of {MOE_BACKENDS}, got {self.moe_backend!r}")
        timeout = _require_number("tp_check_timeout_s", self.tp_check_timeout_s)
        if not 0.0 < timeout < math.inf:
            raise ValueError(f"tp_check_timeout_s must be finite and > 0, got {self.tp_check_timeout_s}")

    def engine_shape(self, vocab_size: int, device, kv_dtype) -> "EngineShape":
        """The sizes the engine is built for (the one object every part reads them from), for a
        model with ``vocab_size`` tokens whose K/V are computed in ``kv_dtype`` on ``device``."""
        from mtp_ctrl.state.engine_shape import EngineShape

        return EngineShape(max_requests=self.max_requests, max_model_len=self.max_model_len,
                           block_size_tokens=self.block_size_tokens, num_speculative_tokens=self.num_speculative_tokens,
                           max_tokens_per_step=self.max_tokens_per_step,
                           decode_steps_per_launch=self.decode_steps_per_launch,
                           join_hold_steps=self.join_hold_steps, device=device, kv_dtype=kv_dtype,
                           vocab_size=vocab_size)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature: 0 = greedy (argmax; so is anything below 1e-5); > 0 samples from
        softmax(logits / temperature). Must be finite.
    top_k: keep the k most likely tokens (0 = all). top_p: nucleus mass in (0, 1] (1 = all).
    seed: per-request seed; equal seeds give equal outputs, with or without speculation and on
        every tensor-parallel rank. None draws one from the controller's generator.
    eos_token_ids: generation stops after emitting any of these (the token is emitted).
    stop_sequences: generation stops once the output ends with one of these token sequences
        (the sequence is emitted).
    max_new_tokens: at most this many generated tokens.
    num_speculative_tokens: the most drafts this request verifies per step (0 = no speculation for
        it; None = the engine's S). Output does not depend on it; the draft-length policy
        (``controllers/draft_policy.py``) chooses at most this many each step.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    eos_token_ids: Tuple[int, ...] = ()
    stop_sequences: Tuple[Tuple[int, ...], ...] = ()
    num_speculative_tokens: Optional[int] = None

    def __post_init__(self):
        _require_int("max_new_tokens", self.max_new_tokens, 1, high=_INT64_MAX)
        if self.num_speculative_tokens is not None:
            _require_int("num_speculative_tokens", self.num_speculative_tokens, 0, high=_INT64_MAX)
        temperature = _require_number("temperature", self.temperature)
        if not 0.0 <= temperature < math.inf:  # also rejects NaN
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        _require_float32("temperature", temperature)
        _require_int("top_k", self.top_k, 0, high=_INT64_MAX)
        top_p = _require_number("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            _require_int("seed", self.seed, 0, high=_INT64_MAX)
        eos = _require_tuple("eos_token_ids", self.eos_token_ids, "token ids (() = none)")
        for token in eos:
            _require_int("eos_token_ids entries", token, 0, high=_INT64_MAX)
        stops = _require_tuple("stop_sequences", self.stop_sequences, "token sequences, e.g. ((13, 13),)")
        stops = tuple(_require_tuple("stop_sequences entries", seq, "token ids, e.g. ((13, 13),)") for seq in stops)
        for seq in stops:
            if not seq:
                raise ValueError("stop_sequences must not contain an empty sequence")
            for token in seq:
                _require_int("stop_sequences tokens", token, 0, high=_INT64_MAX)
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "eos_token_ids", eos)
        object.__setattr__(self, "stop_sequences", stops)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a stop token lies outside the vocabulary."""
        for token in self.eos_token_ids:
            if token >= vocab_size:
                raise ValueError(f"eos_token_ids entry {token} is outside the vocabulary ({vocab_size})")
        for seq in self.stop_sequences:
            for token in seq:
                if token >= vocab_size:
                    raise ValueError(f"stop_sequences token {token} is outside the vocabulary ({vocab_size})")
