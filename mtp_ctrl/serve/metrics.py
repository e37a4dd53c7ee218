"""``GET /metrics``: the server's counters in Prometheus' text format (no client library needed).

Counted by the frontend (:class:`ServerMetrics`, on its event loop) as requests start, tokens
arrive from the engine and requests end:
- requests started and ended (by finish reason: ``stop``, ``length``, ``abort``, ``error``),
  prompt and generated tokens;
- time to first token (submission to the first token's arrival from the engine) and inter-token
  latency (the gap between two arrivals of one request, divided by the tokens the later one
  brought: a speculative step brings several) as histograms, in seconds.
Read from the controller in the engine process when scraped (:func:`controller_figures`):
generated tokens per second of step time, steps launched and seconds inside ``step()``, mean accepted length and acceptance per draft depth,
queued requests, KV blocks in use, the prefix cache.
"""

import bisect
import time
from typing import Dict, List, Sequence

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class Histogram:
    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bucket
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def lines(self, name: str) -> List[str]:
        lines, running = [], 0
        for bound, count in zip(self.buckets, self.counts):
            running += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {running}')
        lines += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}", f"{name}_count {self.count}"]
        return lines


def controller_figures(controller) -> Dict[str, object]:
    """In the engine process: the controller's figures ``/metrics`` shows (host values)."""
    stats = controller.metrics.as_dict()
    allocator = controller.context.allocator
    return dict(tokens_per_second=stats["tokens_per_second"], mean_accepted_length=stats["mean_accepted_length"],
                emitted_tokens=stats["emitted_tokens"], steps=stats["step_time"]["steps"],
                step_seconds=stats["step_time"]["step_seconds"],
                acceptance_per_depth=list(stats["acceptance_per_depth"]), prefix_cache=dict(stats["prefix_cache"]),
                queued_requests=controller.debug_view().num_waiting, kv_blocks_total=allocator.num_blocks,
                kv_blocks_used=allocator.num_blocks - allocator.num_free_blocks)


class ServerMetrics:
    """The frontend's counters (one event loop writes and reads them: no lock)."""

    def __init__(self):
        self.started = time.time()
        self.requests_started = 0
        self.requests_ended: Dict[str, int] = {}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.time_to_first_token = Histogram()
        self.inter_token_latency = Histogram()

    def request_started(self, prompt_tokens: int) -> None:
        self.requests_started += 1
        self.prompt_tokens += prompt_tokens

    def tokens_arrived(self, submitted_at: float, last_arrival: float, count: int, now: float) -> None:
        """``last_arrival``: of the request's previous tokens, 0.0 for its first."""
        self.generated_tokens += count
        if not last_arrival:
            self.time_to_first_token.observe(now - submitted_at)
        else:
            self.inter_token_latency.observe((now - last_arrival) / count, times=count)

    def request_ended(self, reason: str) -> None:
        self.requests_ended[reason] = self.requests_ended.get(reason, 0) + 1

    def render(self, figures: Dict[str, object]) -> str:
        """The Prometheus text exposition; ``figures``: :func:`controller_figures` of the engine."""
        lines = []

        def metric(name: str, kind: str, help_text: str, samples: List[str]) -> None:
            lines.extend([f"# HELP mtp_ctrl_{name} {help_text}", f"# TYPE mtp_ctrl_{name} {kind}"])
            lines.extend(f"mtp_ctrl_{sample}" for sample in samples)

        metric("requests_started_total", "counter", "Requests added to the engine.",
               [f"requests_started_total {self.requests_started}"])
        metric("requests_ended_total", "counter", "Requests ended, by finish reason.",
               [f'requests_ended_total{{reason="{reason}"}} {count}'
                for reason, count in sorted(self.requests_ended.items())])
        metric("prompt_tokens_total", "counter", "Prompt tokens of started requests.",
               [f"prompt_tokens_total {self.prompt_tokens}"])
        metric("generated_tokens_total", "counter", "Tokens sent to clients.",
               [f"generated_tokens_total {self.generated_tokens}"])
        metric("tokens_per_second", "gauge", "Generated tokens per second of step time (controller metrics).",
               [f"tokens_per_second {figures['tokens_per_second']}"])
        metric("steps_total", "counter", "Steps launched (each step of a decode run counts).",
               [f"steps_total {figures['steps']}"])
        metric("step_seconds_total", "counter", "Wall seconds inside controller.step() (the rest of the engine "
               "loop, messages and idle waits, is not counted).", [f"step_seconds_total {figures['step_seconds']}"])
        metric("mean_accepted_length", "gauge", "Tokens gained per verify step (1 + accepted drafts).",
               [f"mean_accepted_length {figures['mean_accepted_length']}"])
        metric("acceptance_rate", "gauge", "Share of drafts accepted, per draft depth.",
               [f'acceptance_rate{{depth="{depth + 1}"}} {rate}'
                for depth, rate in enumerate(figures["acceptance_per_depth"])])
        metric("queued_requests", "gauge", "Requests waiting for a row.",
               [f"queued_requests {figures['queued_requests']}"])
        metric("kv_blocks_used", "gauge", "KV cache blocks in use.", [f"kv_blocks_used {figures['kv_blocks_used']}"])
        metric("kv_blocks_total", "gauge", "KV cache blocks in the pool.",
               [f"kv_blocks_total {figures['kv_blocks_total']}"])
        prefix = figures["prefix_cache"]
        metric("prefix_cache_hit_rate", "gauge", "Prompt tokens found in the prefix cache / looked up.",
               [f"prefix_cache_hit_rate {prefix['hit_rate']}"])
        metric("prefix_cache_hit_tokens_total", "counter", "Prompt tokens not recomputed (prefix cache hits).",
               [f"prefix_cache_hit_tokens_total {prefix['hit_tokens']}"])
        metric("kv_blocks_cached", "gauge", "KV blocks in the prefix cache (held or not).",
               [f"kv_blocks_cached {prefix['cached_blocks']}"])
        metric("kv_block_evictions_total", "counter", "Cached KV blocks evicted to make room.",
               [f"kv_block_evictions_total {prefix['evictions']}"])
        metric("time_to_first_token_seconds", "histogram", "From submission to the first token from the engine.",
               self.time_to_first_token.lines("time_to_first_token_seconds"))
        metric("inter_token_latency_seconds", "histogram", "Gap between arrivals over the tokens they bring.",
               self.inter_token_latency.lines("inter_token_latency_seconds"))
        return "\n".join(lines) + "\n"
