"""Simulation results: per-request times, per-machine busy time, and their summary statistics."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvflow.simulator.config import Layout
from kvflow.slo import SLO

if TYPE_CHECKING:
    from kvflow.simulator.simulator import Simulator


@dataclass(frozen=True)
class Summary:
    """Scalar outcome of one run. Latency percentiles are over all requests; cost is in
    machine-hours (DéjàVu's 'normalized cost': multiples of one VM's hourly price) and dollars."""

    layout: str
    machines: int
    requests: int
    makespan_s: float
    throughput_rps: float
    tokens_per_s: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_p50: float
    tpot_p90: float
    tpot_p99: float
    norm_latency_p50: float
    norm_latency_p90: float
    utilization_mean: float
    utilization_min: float
    bubble_s_mean: float
    machine_hours: float
    cost: float
    slo_attainment: float | None
    restarted_requests: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SimResult:
    """Raw outcome of a run: per-request arrays and per-machine busy seconds."""

    layout: Layout
    arrival: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    output_len: np.ndarray
    completions: np.ndarray  # how many times each request completed (1 when conserved)
    machine_busy: np.ndarray  # seconds each machine computed, prompt machines first
    cost_per_hour: float
    restarts: int  # requests that lost their KV to a failure and were recomputed
    kv_wait: np.ndarray  # disaggregated: seconds from a request's first token until its KV was in

    @classmethod
    def build(cls, sim: "Simulator") -> "SimResult":
        busy = [p.busy for p in sim.prompt + sim.token for _ in range(p.depth)]
        return cls(sim.config.layout, sim.workload.arrival, np.array(sim.first_token), np.array(sim.finish),
                   sim.workload.output_len, np.array(sim.completions), np.array(busy),
                   sim.perf.machine.cost_per_hour, sim.restarts, np.array(sim.kv_wait))

    @property
    def makespan(self) -> float:
        return float(np.max(self.finish) - np.min(self.arrival))

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> np.ndarray:
        """Mean time between output tokens after the first (0 for one-token outputs)."""
        gaps = np.maximum(self.output_len - 1, 1)
        return np.where(self.output_len > 1, (self.finish - self.first_token) / gaps, 0.0)

    @property
    def normalized_latency(self) -> np.ndarray:
        """End-to-end latency divided by output tokens (Orca / vLLM / DéjàVu Fig. 8 metric)."""
        return (self.finish - self.arrival) / self.output_len

    def slo_attainment(self, slo: SLO) -> float:
        return float(np.mean(slo.met(self.ttft, self.tpot)))

    def summary(self, slo: SLO | None = None) -> Summary:
        span = self.makespan
        util = self.machine_busy / span if span > 0 else np.ones_like(self.machine_busy)
        hours = self.layout.machines * span / 3600
        p = lambda a, q: float(np.percentile(a, q))  # noqa: E731
        return Summary(
            layout=f"{self.layout.kind} {self.layout.label()}", machines=self.layout.machines,
            requests=len(self.arrival), makespan_s=span,
            throughput_rps=len(self.arrival) / span if span > 0 else math.inf,
            tokens_per_s=float(self.output_len.sum()) / span if span > 0 else math.inf,
            ttft_p50=p(self.ttft, 50), ttft_p90=p(self.ttft, 90), ttft_p99=p(self.ttft, 99),
            tpot_p50=p(self.tpot, 50), tpot_p90=p(self.tpot, 90), tpot_p99=p(self.tpot, 99),
            norm_latency_p50=p(self.normalized_latency, 50), norm_latency_p90=p(self.normalized_latency, 90),
            utilization_mean=float(util.mean()), utilization_min=float(util.min()),
            bubble_s_mean=float(span - self.machine_busy.mean()), machine_hours=hours,
            cost=hours * self.cost_per_hour,
            slo_attainment=None if slo is None else self.slo_attainment(slo),
            restarted_requests=self.restarts)
