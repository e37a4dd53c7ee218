"""``GET /metrics``: the server's counters in Prometheus' text format (no client library needed).

Counted by the engine thread as requests start, tokens arrive and requests end:
- requests started and ended (by finish reason: ``stop``, ``length``, ``abort``, ``error``),
  prompt and generated tokens;
- time to first token (submission to the first token's arrival on the host) and inter-token
  latency (the gap between two arrivals of one request, divided by the tokens the later one
  brought: a speculative step brings several) as histograms, in seconds.
Read from the controller when scraped: generated tokens per second of step time, mean accepted
length and acceptance per draft depth, queued requests, and KV blocks in use.
"""

import bisect
import threading
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


class ServerMetrics:
    def __init__(self, controller):
        self.controller = controller
        self.started = time.time()
        self._lock = threading.Lock()  # written by the engine thread, read by the scrape
        self.requests_started = 0
        self.requests_ended: Dict[str, int] = {}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.time_to_first_token = Histogram()
        self.inter_token_latency = Histogram()
        self._last_arrival: Dict[int, float] = {}  # id(handle) -> time of its last tokens

    def request_started(self, prompt_tokens: int) -> None:
        with self._lock:
            self.requests_started += 1
            self.prompt_tokens += prompt_tokens

    def tokens_arrived(self, handle, count: int, now: float) -> None:
        with self._lock:
            self.generated_tokens += count
            last = self._last_arrival.get(id(handle))
            if last is None:
                self.time_to_first_token.observe(now - handle.submitted_at)
            else:
                self.inter_token_latency.observe((now - last) / count, times=count)
            self._last_arrival[id(handle)] = now

    def request_ended(self, handle, reason: str) -> None:
        with self._lock:
            self.requests_ended[reason] = self.requests_ended.get(reason, 0) + 1
            self._last_arrival.pop(id(handle), None)

    def render(self) -> str:
        """The Prometheus text exposition (read on the server's thread: controller figures are
        host values the engine thread updates; a scrape may see them one step apart)."""
        stats = self.controller.metrics.as_dict()
        context = self.controller.context
        used_blocks = context.allocator.num_blocks - context.allocator.num_free_blocks
        with self._lock:
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
                   [f"tokens_per_second {stats['tokens_per_second']}"])
            metric("mean_accepted_length", "gauge", "Tokens gained per verify step (1 + accepted drafts).",
                   [f"mean_accepted_length {stats['mean_accepted_length']}"])
            metric("acceptance_rate", "gauge", "Share of drafts accepted, per draft depth.",
                   [f'acceptance_rate{{depth="{depth + 1}"}} {rate}'
                    for depth, rate in enumerate(stats["acceptance_per_depth"])])
            metric("queued_requests", "gauge", "Requests waiting for a row.",
                   [f"queued_requests {self.controller.debug_view().num_waiting}"])
            metric("kv_blocks_used", "gauge", "KV cache blocks in use.", [f"kv_blocks_used {used_blocks}"])
            metric("kv_blocks_total", "gauge", "KV cache blocks in the pool.",
                   [f"kv_blocks_total {context.allocator.num_blocks}"])
            prefix = stats["prefix_cache"]
            metric("prefix_cache_hit_rate", "gauge", "Prompt tokens found in the prefix cache / looked up.",
                   [f"prefix_cache_hit_rate {prefix['hit_rate']}"])
            metric("prefix_cache_hit_tokens_total", "counter", "Prompt tokens not recomputed (prefix cache hits).",
                   [f"prefix_cache_hit_tokens_total {prefix['hit_tokens']}"])
            metric("kv_blocks_cached", "gauge", "KV blocks in the prefix cache (held or not).",
                   [f"kv_blocks_cached {prefix['cached_blocks']}"])
            metric("kv_block_evictions_total", "counter", "Cached KV blocks evicted to make room.",
                   [f"kv_block_evictions_total {prefix['evictions']}"])
            metric("time_to_first_token_seconds", "histogram", "From submission to the first token on the host.",
                   self.time_to_first_token.lines("time_to_first_token_seconds"))
            metric("inter_token_latency_seconds", "histogram", "Gap between arrivals over the tokens they bring.",
                   self.inter_token_latency.lines("inter_token_latency_seconds"))
        return "\n".join(lines) + "\n"
