"""The server's Prometheus metrics, in a registry of their own (no global state)."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_WINDOW_S = 10.0  # tokens/s is measured over this many seconds


class Metrics:
    """Gauges, counters and histograms the scheduler updates and ``GET /metrics`` renders."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("deft_num_requests_running", "Requests decoding in the batch", registry=r)
        self.waiting = Gauge("deft_num_requests_waiting", "Requests admitted to the queue, not yet running",
                             registry=r)
        self.requests = Counter("deft_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.generated = Counter("deft_generation_tokens", "Tokens generated", registry=r)
        self.prompt = Counter("deft_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.computed = Counter("deft_prompt_tokens_computed",
                                "Prompt tokens computed (shared prompts and cache hits are computed once)",
                                registry=r)
        self.tokens_per_s = Gauge("deft_generation_tokens_per_second",
                                  f"Tokens generated per second over the last {_WINDOW_S:g} s", registry=r)
        self.ttft = Histogram("deft_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("deft_request_queue_time_seconds", "Arrival to the first step run",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("deft_e2e_request_latency_seconds", "Arrival to the last event",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("deft_inter_token_latency_seconds", "Time between a request's tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.pages_total = Gauge("deft_kv_pages_total", "KV cache pages of the pool", registry=r)
        self.pages_used = Gauge("deft_kv_pages_in_use", "KV cache pages in use (prefix cache included)",
                                registry=r)
        self.kv_usage = Gauge("deft_kv_cache_usage_perc", "KV cache pages in use over the pool's (0 to 1)",
                              registry=r)
        self.pages_requests = Gauge("deft_kv_pages_requests",
                                    "KV cache pages on the paths of running requests", registry=r)
        self.lookups = Counter("deft_prefix_cache_lookups", "Prompts looked up in the prefix cache",
                               registry=r)
        self.hits = Counter("deft_prefix_cache_hits", "Prompts forked from a cached prefix", registry=r)
        self.hit_tokens = Counter("deft_prefix_cache_hit_tokens", "Prompt tokens served from the cache",
                                  registry=r)
        self.hit_rate = Gauge("deft_prefix_cache_hit_rate", "Hits over lookups since start", registry=r)
        self.entries = Gauge("deft_prefix_cache_entries", "Prompts kept in the prefix cache", registry=r)
        self.preempted = Counter("deft_preemptions", "Requests preempted for pages, recomputed later",
                                 registry=r)
        self._recent: deque[tuple[float, int]] = deque()

    def count_tokens(self, n: int) -> None:
        """``n`` tokens were generated now."""
        now = time.monotonic()
        self.generated.inc(n)
        self._recent.append((now, n))
        while self._recent and self._recent[0][0] < now - _WINDOW_S:
            self._recent.popleft()
        self.tokens_per_s.set(sum(k for _, k in self._recent) / _WINDOW_S)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
