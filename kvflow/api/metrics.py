"""/metrics: Prometheus text exposition (format 0.0.4) of what the API times itself plus `Backend.stats()`.

Written by hand (no client library): counters, gauges and cumulative histograms with `le` buckets.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from kvflow.serving.backend import BackendStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RATE_WINDOW_S = 10.0


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

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for le, c in zip(self.buckets, self.counts):
            cum += c
            out.append(f'{name}_bucket{{le="{le:g}"}} {cum}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out.append(f"{name}_sum {self.total:.6f}")
        out.append(f"{name}_count {self.n}")
        return out


class APIMetrics:
    """Thread-safe accumulators the routes update; `render(stats, healthy)` writes the exposition."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.http = Counter()  # (endpoint, status code) -> count
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

    def render(self, stats: BackendStats | None, healthy: bool) -> str:
        tps = self.tokens_per_second()
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}", *samples])

        with self._lock:
            metric("kvflow_backend_healthy", "gauge", "1 when the backend can serve requests", [f"kvflow_backend_healthy {int(healthy)}"])
            metric("kvflow_http_requests_total", "counter", "HTTP responses by endpoint and status code",
                   [f'kvflow_http_requests_total{{endpoint="{e}",code="{c}"}} {n}' for (e, c), n in sorted(self.http.items())])
            metric("kvflow_request_finished_total", "counter", "Generation requests finished, by finish reason",
                   [f'kvflow_request_finished_total{{finish_reason="{r}"}} {n}' for r, n in sorted(self.finished.items())])
            metric("kvflow_api_requests_in_flight", "gauge", "Generation requests the API is serving now",
                   [f"kvflow_api_requests_in_flight {self.in_flight}"])
            metric("kvflow_api_prompt_tokens_total", "counter", "Prompt tokens of finished API requests",
                   [f"kvflow_api_prompt_tokens_total {self.prompt_tokens}"])
            metric("kvflow_api_generation_tokens_total", "counter", "Tokens generated for finished API requests",
                   [f"kvflow_api_generation_tokens_total {self.completion_tokens}"])
            metric("kvflow_generation_tokens_per_second", "gauge", f"Tokens sent to clients per second over the last {RATE_WINDOW_S:g} s",
                   [f"kvflow_generation_tokens_per_second {tps:.3f}"])
            metric("kvflow_time_to_first_token_seconds", "histogram", "Time from request arrival to its first token",
                   self.ttft.lines("kvflow_time_to_first_token_seconds"))
            metric("kvflow_time_per_output_token_seconds", "histogram", "Mean time between output tokens, per request",
                   self.tpot.lines("kvflow_time_per_output_token_seconds"))
            metric("kvflow_e2e_request_latency_seconds", "histogram", "Time from request arrival to its last token",
                   self.e2e.lines("kvflow_e2e_request_latency_seconds"))
        if stats is not None:
            _backend_lines(stats, metric)
        return "\n".join(lines) + "\n"


def _backend_lines(s: BackendStats, metric) -> None:
    metric("kvflow_num_requests_waiting", "gauge", "Requests queued in the backend", [f"kvflow_num_requests_waiting {s.waiting_requests}"])
    metric("kvflow_num_requests_running", "gauge", "Requests being processed by the backend", [f"kvflow_num_requests_running {s.running_requests}"])
    metric("kvflow_prompt_tokens_total", "counter", "Prompt tokens admitted by the backend", [f"kvflow_prompt_tokens_total {s.prompt_tokens_total}"])
    metric("kvflow_generation_tokens_total", "counter", "Tokens generated by the backend", [f"kvflow_generation_tokens_total {s.generated_tokens_total}"])
    metric("kvflow_kv_bytes_streamed_total", "counter", "KV-cache bytes streamed between workers", [f"kvflow_kv_bytes_streamed_total {s.kv_bytes_streamed_total}"])
    metric("kvflow_worker_busy_seconds_total", "counter", "Seconds each worker spent computing",
           [f'kvflow_worker_busy_seconds_total{{worker="{_esc(w)}"}} {t:.6f}' for w, t in sorted(s.worker_busy_seconds.items())])
    metric("kvflow_worker_up", "gauge", "1 while the worker is alive",
           [f'kvflow_worker_up{{worker="{_esc(w)}"}} {int(a)}' for w, a in sorted(s.workers_alive.items())])
    metric("kvflow_dropped_messages_total", "counter", "Internal messages dropped (not authentic, malformed or stale)",
           [f'kvflow_dropped_messages_total{{port="{_esc(w)}"}} {n}' for w, n in sorted(s.dropped_messages_total.items())])
    metric("kvflow_preemptions_total", "counter", "Requests preempted (KV freed, recomputed later)", [f"kvflow_preemptions_total {s.preemptions_total}"])
    metric("kvflow_worker_failures_total", "counter", "Workers lost (died, hung or failed a step)", [f"kvflow_worker_failures_total {s.worker_failures_total}"])
    metric("kvflow_recoveries_total", "counter", "Recoveries completed (worker replaced, requests resumed)", [f"kvflow_recoveries_total {s.recoveries_total}"])
    metric("kvflow_recovery_seconds_total", "counter", "Seconds spent recovering", [f"kvflow_recovery_seconds_total {s.recovery_seconds_total:.6f}"])
    metric("kvflow_recovering", "gauge", "1 while a recovery is under way", [f"kvflow_recovering {int(s.recovering)}"])
    metric("kvflow_replicated_bytes_total", "counter", "KV bytes streamed to replicas (ring replication)",
           [f"kvflow_replicated_bytes_total {s.replicated_bytes_total}"])
    metric("kvflow_replication_lag_tokens", "gauge", "Most KV tokens of one running request not yet in its stage's replica",
           [f"kvflow_replication_lag_tokens {s.replication_lag_tokens}"])
    metric("kvflow_resumed_requests_total", "counter", "Requests resumed from a replica after a failure",
           [f"kvflow_resumed_requests_total {s.resumed_requests_total}"])
    metric("kvflow_recomputed_tokens_total", "counter", "Tokens recomputed after failures (lost past the replica)",
           [f"kvflow_recomputed_tokens_total {s.recomputed_tokens_total}"])
    pc = sorted(s.prefix_cache.items())
    lab = [f'pool="{_esc(pool)}",tier="{_esc(tier)}"' for (pool, tier), _ in pc]
    metric("kvflow_prefix_cache_queries_total", "counter", "Tokens of admitted requests looked up in the prefix cache",
           [f"kvflow_prefix_cache_queries_total{{{l}}} {c.queries}" for l, (_, c) in zip(lab, pc)])
    metric("kvflow_prefix_cache_hits_total", "counter", "Of those, tokens found cached (not prefilled, or not streamed on a token pool)",
           [f"kvflow_prefix_cache_hits_total{{{l}}} {c.hits}" for l, (_, c) in zip(lab, pc)])
    metric("kvflow_prefix_cache_hit_rate", "gauge", "hits / queries since start (0 before any query)",
           [f"kvflow_prefix_cache_hit_rate{{{l}}} {c.hit_rate:.6f}" for l, (_, c) in zip(lab, pc)])
    metric("kvflow_prefix_cache_evictions_total", "counter", "Cached blocks evicted to make room",
           [f"kvflow_prefix_cache_evictions_total{{{l}}} {c.evictions}" for l, (_, c) in zip(lab, pc)])


def _esc(label: str) -> str:
    return label.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
