"""/metrics: what the API times itself plus `Backend.stats()`, exposed with `prometheus_client`
(text format 0.0.4).

The routes update thread-safe accumulators (`APIMetrics`); a scrape turns them and the backend's
stats into metric families, and `prometheus_client` writes the text, so every label value is
escaped by construction. Labels take values from fixed sets only: `endpoint` is a route template
of the app or `other` (`endpoint_label`), never the raw request path, so no client can add series.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import BaseRoute, Match

from kvflow.serving.backend import BackendStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RATE_WINDOW_S = 10.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OTHER_ENDPOINT = "other"  # the `endpoint` label of every path that is no route of the app


def endpoint_label(routes: Sequence[BaseRoute], scope: dict) -> str:
    """The route template `scope` is for (a method the route does not take counts as the route), or `other`."""
    for route in routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            return getattr(route, "path", OTHER_ENDPOINT)
    return OTHER_ENDPOINT


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if list(self.buckets) != sorted(self.buckets):
            raise ValueError("histogram buckets must be increasing")
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def family(self, name: str, help: str) -> HistogramMetricFamily:
        cumulative, cum = [], 0
        for le, c in zip(self.buckets, self.counts):
            cum += c
            cumulative.append((f"{le:g}", cum))
        cumulative.append(("+Inf", self.n))
        return HistogramMetricFamily(name, help, buckets=cumulative, sum_value=self.total)


class _Families(Collector):
    """One scrape's metric families, as the collector `generate_latest` reads."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def _gauge(name: str, help: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help, value=value)


def _counter(name: str, help: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help, value=value)


def _labelled(kind: type[Metric], name: str, help: str, labels: Sequence[str], samples: Iterable[tuple]) -> Metric:
    """A family of `kind` with one sample per (label values..., value)."""
    family = kind(name, help, labels=list(labels))
    for *values, value in samples:
        family.add_metric([str(v) for v in values], value)
    return family


class APIMetrics:
    """Thread-safe accumulators the routes update; `render(stats, healthy)` writes the exposition."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.http = Counter()  # (endpoint label, status code) -> count: both from fixed sets
        self.finished = Counter()  # finish_reason -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.in_flight = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) deltas sent to clients

    def http_response(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.http[(endpoint, status)] += 1

    def tokens_sent(self, n: int) -> None:
        if n:
            with self._lock:
                self._recent.append((time.monotonic(), n))

    def request_done(self, finish_reason: str | None, prompt_tokens: int, completion_tokens: int, ttft: float | None,
                     e2e: float) -> None:
        with self._lock:
            self.finished[finish_reason or "none"] += 1
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.e2e.observe(e2e)
            if ttft is not None:
                self.ttft.observe(ttft)
                if completion_tokens > 1:
                    self.tpot.observe((e2e - ttft) / (completion_tokens - 1))

    def tokens_per_second(self) -> float:
        cutoff = time.monotonic() - RATE_WINDOW_S
        with self._lock:
            while self._recent and self._recent[0][0] < cutoff:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def families(self, stats: BackendStats | None, healthy: bool) -> list[Metric]:
        tps = self.tokens_per_second()
        with self._lock:
            out = [
                _gauge("kvflow_backend_healthy", "1 when the backend can serve requests", int(healthy)),
                _labelled(CounterMetricFamily, "kvflow_http_requests_total", "HTTP responses by endpoint and status code",
                          ("endpoint", "code"), ((e, c, n) for (e, c), n in sorted(self.http.items()))),
                _labelled(CounterMetricFamily, "kvflow_request_finished_total", "Generation requests finished, by finish reason",
                          ("finish_reason",), sorted(self.finished.items())),
                _gauge("kvflow_api_requests_in_flight", "Generation requests the API is serving now", self.in_flight),
                _counter("kvflow_api_prompt_tokens_total", "Prompt tokens of finished API requests", self.prompt_tokens),
                _counter("kvflow_api_generation_tokens_total", "Tokens generated for finished API requests",
                         self.completion_tokens),
                _gauge("kvflow_generation_tokens_per_second",
                       f"Tokens sent to clients per second over the last {RATE_WINDOW_S:g} s", tps),
                self.ttft.family("kvflow_time_to_first_token_seconds", "Time from request arrival to its first token"),
                self.tpot.family("kvflow_time_per_output_token_seconds", "Mean time between output tokens, per request"),
                self.e2e.family("kvflow_e2e_request_latency_seconds", "Time from request arrival to its last token"),
            ]
        if stats is not None:
            out += _backend_families(stats)
        return out

    def render(self, stats: BackendStats | None, healthy: bool, extra: Iterable[Metric] = ()) -> bytes:
        """The exposition text (`CONTENT_TYPE`) of one scrape; `extra`: a backend's own families (the router's)."""
        return generate_latest(_Families(self.families(stats, healthy) + list(extra)))


def _backend_families(s: BackendStats) -> list[Metric]:
    pc = sorted(s.prefix_cache.items())
    pool_tier = ("pool", "tier")
    return [
        _gauge("kvflow_num_requests_waiting", "Requests queued in the backend", s.waiting_requests),
        _gauge("kvflow_num_requests_running", "Requests being processed by the backend", s.running_requests),
        _counter("kvflow_prompt_tokens_total", "Prompt tokens admitted by the backend", s.prompt_tokens_total),
        _counter("kvflow_generation_tokens_total", "Tokens generated by the backend", s.generated_tokens_total),
        _counter("kvflow_kv_bytes_streamed_total", "KV-cache bytes streamed between workers", s.kv_bytes_streamed_total),
        _labelled(CounterMetricFamily, "kvflow_worker_busy_seconds_total", "Seconds each worker spent computing",
                  ("worker",), sorted(s.worker_busy_seconds.items())),
        _labelled(GaugeMetricFamily, "kvflow_worker_up", "1 while the worker is alive",
                  ("worker",), ((w, int(a)) for w, a in sorted(s.workers_alive.items()))),
        _labelled(CounterMetricFamily, "kvflow_dropped_messages_total",
                  "Internal messages dropped (not authentic, malformed or stale)",
                  ("port",), sorted(s.dropped_messages_total.items())),
        _counter("kvflow_preemptions_total", "Requests preempted (KV freed, recomputed later)", s.preemptions_total),
        _counter("kvflow_worker_failures_total", "Workers lost (died, hung or failed a step)", s.worker_failures_total),
        _counter("kvflow_recoveries_total", "Recoveries completed (worker replaced, requests resumed)", s.recoveries_total),
        _counter("kvflow_recovery_seconds_total", "Seconds spent recovering", s.recovery_seconds_total),
        _gauge("kvflow_recovering", "1 while a recovery is under way", int(s.recovering)),
        _counter("kvflow_hidden_ring_bytes_total", "Hidden-state bytes passed between pipeline stages through shared memory",
                 s.hidden_ring_bytes_total),
        _counter("kvflow_replicated_bytes_total", "KV bytes streamed to replicas (ring replication)", s.replicated_bytes_total),
        _gauge("kvflow_replication_lag_tokens", "Most KV tokens of one running request not yet in its stage's replica",
               s.replication_lag_tokens),
        _counter("kvflow_resumed_requests_total", "Requests resumed from a replica after a failure", s.resumed_requests_total),
        _counter("kvflow_recomputed_tokens_total", "Tokens recomputed after failures (lost past the replica)",
                 s.recomputed_tokens_total),
        _labelled(CounterMetricFamily, "kvflow_prefix_cache_queries_total",
                  "Tokens of admitted requests looked up in the prefix cache",
                  pool_tier, ((p, t, c.queries) for (p, t), c in pc)),
        _labelled(CounterMetricFamily, "kvflow_prefix_cache_hits_total",
                  "Of those, tokens found cached (not prefilled, or not streamed on a token pool)",
                  pool_tier, ((p, t, c.hits) for (p, t), c in pc)),
        _labelled(GaugeMetricFamily, "kvflow_prefix_cache_hit_rate", "hits / queries since start (0 before any query)",
                  pool_tier, ((p, t, c.hit_rate) for (p, t), c in pc)),
        _labelled(CounterMetricFamily, "kvflow_prefix_cache_evictions_total", "Cached blocks evicted to make room",
                  pool_tier, ((p, t, c.evictions) for (p, t), c in pc)),
        _counter("kvflow_kv_pulled_blocks_total", "KV blocks pulled from the instance that computed the prompt",
                 s.kv_pulled_blocks),
        _counter("kvflow_kv_pull_missed_blocks_total", "KV blocks asked for in a pull that were not there (recomputed)",
                 s.kv_pull_missed_blocks),
        _counter("kvflow_kv_pull_seconds_total", "Seconds the engine spent pulling KV blocks (before those steps)",
                 s.kv_pull_seconds),
        *([] if s.kv_free_tokens is None or not s.kv_capacity_tokens else [
            _gauge("kvflow_kv_free_tokens", "KV tokens free for decoding requests (free and evictable cached blocks)",
                   s.kv_free_tokens),
            _gauge("kvflow_kv_cache_usage", "Share of the decoding pools' KV blocks in use (0-1)",
                   1.0 - s.kv_free_tokens / s.kv_capacity_tokens)]),
    ]
