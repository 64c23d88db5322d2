"""DistServe's Algorithm 1 (high node-affinity placement): choose the prefill (prompt) and decoding
(token) instance configurations separately — tensor-parallel degree, pipeline depth, batch size —
each by its simulated goodput per device, then replicate each to carry the target rate.

The simulator runs the server's continuous-batching scheduler (`policy="continuous"`), with each
phase on its own performance model (`Simulator(token_perf=...)`), so the prompt and token batch
sizes and tensor-parallel degrees may differ. Per phase, every memory-feasible configuration is
ranked by its analytic capacity per device (`prompt_stage_time`, `token_stage_time`; those whose
unloaded latency already breaks the SLO are dropped) and the best `top_k` are simulated:

- prefill: requests with one output token, so only TTFT counts (`simu_prefill`);
- decoding: the whole system with the best prefill configuration replicated 1.5x beyond the rate
  tried, judged on both SLOs (prompt admission reserves token-side blocks, so a decode instance
  that cannot keep up shows as TTFT misses, as it would in the server) (`simu_decode`).

Then n = ceil(R / prefill goodput), m = ceil(R / decode goodput), and the whole placement is
simulated at R; while it misses the attainment target, the phase with the smaller spare capacity
gets one more instance (at most `max_fixups` times). The best colocated configuration (one pipeline
doing both phases, continuous batching, as vLLM) is searched the same way for comparison.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvflow.perf.perf_model import PerfModel
from kvflow.planner.formulas import Infeasible
from kvflow.planner.goodput import search_rate
from kvflow.planner.search import fits
from kvflow.sched.scheduler import SchedulerConfig
from kvflow.simulator.config import Layout, PipelineGroup, SimConfig
from kvflow.simulator.simulator import simulate
from kvflow.simulator.workload import Workload
from kvflow.slo import SLO


@dataclass(frozen=True)
class PhaseConfig:
    """One instance: `depth` pipeline stages (inter-op) of `tp` devices each (intra-op), batches of
    up to `microbatch` requests."""

    tp: int
    depth: int
    microbatch: int

    @property
    def devices(self) -> int:
        return self.tp * self.depth

    def spec(self, count: int = 1) -> PipelineGroup:
        return PipelineGroup(self.depth, self.microbatch, count)

    def label(self) -> str:
        return f"({self.depth}p, {self.tp}tp, {self.microbatch}b)"


@dataclass(frozen=True)
class PhaseGoodput:
    config: PhaseConfig
    rate: float  # requests/s one instance sustains at the attainment target
    attainment: float
    simulations: int

    @property
    def per_device(self) -> float:
        return self.rate / self.config.devices


@dataclass(frozen=True)
class GoodputSpace:
    """What may vary and how hard to look. `top_k`: configurations simulated per phase after the
    analytic ranking; `rel_tol`: the rate search's resolution."""

    tp: tuple[int, ...] | None = None  # None: every degree the performance model prices
    max_depth: int = 16
    microbatches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_microbatches: tuple[int, ...] | None = None  # None: `microbatches` (decode batches may be larger)
    top_k: int = 2
    colocated_top_k: int = 1
    rel_tol: float = 0.08
    max_fixups: int = 4

    def __post_init__(self) -> None:
        if self.max_depth < 1 or self.top_k < 1 or not self.microbatches or min(self.microbatches) < 1:
            raise ValueError("max_depth and top_k must be >= 1, microbatches non-empty and positive")


@dataclass(frozen=True)
class Placement:
    prefill: PhaseGoodput
    decode: PhaseGoodput
    prefill_instances: int  # n of Algorithm 1
    decode_instances: int  # m
    rate: float  # the target traffic rate R
    attainment: float  # of the whole placement, simulated at R
    colocated: PhaseGoodput | None  # the best colocated instance, for comparison
    simulations: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def devices(self) -> int:
        return self.prefill_instances * self.prefill.config.devices + self.decode_instances * self.decode.config.devices

    @property
    def layout(self) -> Layout:
        return Layout(self.prefill.config.spec(self.prefill_instances), self.decode.config.spec(self.decode_instances))

    @property
    def per_device(self) -> float:
        """Goodput per device of the pair of phases (DistServe's figure of merit): the rate the
        slower phase's instances carry, per device of both."""
        p, d = self.prefill, self.decode
        return 1.0 / (p.config.devices / p.rate + d.config.devices / d.rate) if p.rate > 0 and d.rate > 0 else 0.0

    @property
    def colocated_devices(self) -> int | None:
        c = self.colocated
        return None if c is None or c.rate <= 0 else math.ceil(self.rate / c.rate) * c.config.devices

    def label(self) -> str:
        return (f"{self.prefill_instances} x prefill {self.prefill.config.label()} + "
                f"{self.decode_instances} x decode {self.decode.config.label()}")


def sim_config(layout: Layout, prompt: PhaseConfig, token: PhaseConfig | None, max_prompt: int) -> SimConfig:
    """Continuous batching as the server runs it: a batch holds up to `microbatch` sequences and
    whole prompts (no chunking below the longest prompt); running requests are not capped beyond
    `microbatch` per batch in flight."""
    b_max = max(prompt.microbatch, token.microbatch if token else 0)
    seqs = max(prompt.microbatch * prompt.depth, token.microbatch * token.depth if token else 0)
    sched = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=b_max * max_prompt, prefill_chunk_size=max_prompt)
    return SimConfig(layout, policy="continuous", scheduler=sched, prefix_caching=False)


class PlacementSearch:
    """Algorithm 1 for one model, device type, workload and SLO. `workload_at(rate)` gives the
    trial workload (same seed for every rate)."""

    def __init__(self, perf: PerfModel, workload_at: Callable[[float], Workload], slo: SLO, target: float = 0.9,
                 space: GoodputSpace = GoodputSpace()) -> None:
        if slo.ttft is None or slo.tpot is None:
            raise ValueError("a goodput placement needs both a TTFT and a TPOT SLO")
        self.perf, self.workload_at, self.slo, self.target, self.space = perf, workload_at, slo, target, space
        w = workload_at(1.0)
        self.prompt_len = float(np.mean(w.prompt_len))
        self.max_prompt = int(w.prompt_len.max())
        self.mean_output = float(np.mean(w.output_len))
        self.sims = 0
        degrees = perf.tensor_parallel_degrees
        self.tps = tuple(d for d in (space.tp or degrees) if d in degrees)
        if not self.tps:
            raise ValueError(f"none of the tensor-parallel degrees {space.tp} is priced by this model ({degrees})")
        self.perfs = {tp: perf.with_tensor_parallel(tp) for tp in self.tps}

    # --- candidates: (throughput bound per device, config), best first --------------------------
    # The bound is what one instance could carry in steady state with every batch full and every
    # context at its shortest; the rate search never goes past it (`search_rate`'s cap).

    def _configs(self, microbatches) -> list[PhaseConfig]:
        return [PhaseConfig(tp, d, b) for tp in self.tps for d in range(1, min(self.space.max_depth, self.perf.shape.layers) + 1)
                for b in microbatches]

    def prefill_candidates(self) -> list[tuple[float, PhaseConfig]]:
        s, out = max(1, round(self.prompt_len)), []
        for c in self._configs(self.space.microbatches):
            perf = self.perfs[c.tp]
            if not fits(perf, c.depth, c.microbatch, self.max_prompt, c.depth):
                continue
            y = perf.prompt_stage_time(c.microbatch, s, c.depth)
            if c.depth * y > self.slo.ttft:
                continue
            out.append((c.microbatch / y / c.devices, c))
        return sorted(out, key=lambda x: (-x[0], x[1].devices))

    def decode_candidates(self) -> list[tuple[float, PhaseConfig]]:
        ctx = max(1, round(self.prompt_len))
        tokens = int(self.max_prompt + self.mean_output)
        steps = max(1.0, self.mean_output - 1)
        out = []
        for c in self._configs(self.space.decode_microbatches or self.space.microbatches):
            perf = self.perfs[c.tp]
            if not fits(perf, c.depth, c.microbatch, tokens, c.depth):
                continue
            t = perf.token_stage_time(c.microbatch, ctx, c.depth)
            if c.depth * t > self.slo.tpot:
                continue
            out.append((c.microbatch / (t * steps) / c.devices, c))
        return sorted(out, key=lambda x: (-x[0], x[1].devices))

    def colocated_candidates(self) -> list[tuple[float, PhaseConfig]]:
        s = ctx = max(1, round(self.prompt_len))
        tokens = int(self.max_prompt + self.mean_output)
        steps = max(1.0, self.mean_output - 1)
        out = []
        for c in self._configs(self.space.microbatches):
            perf = self.perfs[c.tp]
            if not fits(perf, c.depth, c.microbatch, tokens, c.depth):
                continue
            y = perf.prompt_stage_time(c.microbatch, s, c.depth)
            t = perf.token_stage_time(c.microbatch, ctx, c.depth)
            if c.depth * perf.prompt_stage_time(1, s, c.depth) > self.slo.ttft or c.depth * t > self.slo.tpot:
                continue
            per_request = (y + steps * t) / c.microbatch  # one prompt and its decode steps, in full batches
            out.append((1.0 / per_request / c.devices, c))
        return sorted(out, key=lambda x: (-x[0], x[1].devices))

    # --- simulated goodput per phase -----------------------------------------------------------

    def _attainment(self, layout: Layout, prompt: PhaseConfig, token: PhaseConfig | None, w: Workload,
                    slo: SLO) -> float:
        self.sims += 1
        cfg = sim_config(layout, prompt, token, self.max_prompt)
        tperf = self.perfs[token.tp] if token else None
        return simulate(cfg, self.perfs[prompt.tp], w, token_perf=tperf).slo_attainment(slo)

    def _search(self, attainment_at: Callable[[float], float], bound: float) -> tuple[float, float, int]:
        r = search_rate(attainment_at, self.target, hi=0.8 * bound, rel_tol=self.space.rel_tol, cap=bound)
        return r.rate, r.attainment, r.simulations

    def prefill_goodput(self, c: PhaseConfig, bound: float) -> PhaseGoodput:
        """simu_prefill: one instance, one output token per request, judged on TTFT only."""
        def att(rate: float) -> float:
            w = self.workload_at(rate)
            w = Workload(w.arrival, w.prompt_len, np.ones_like(w.output_len))
            return self._attainment(Layout(c.spec(), c.spec()), c, c, w, SLO(ttft=self.slo.ttft))
        return PhaseGoodput(c, *self._search(att, bound))

    def decode_goodput(self, c: PhaseConfig, prefill: PhaseGoodput, bound: float) -> PhaseGoodput:
        """simu_decode: one decode instance behind 1.5x enough prefill instances, both SLOs."""
        def att(rate: float) -> float:
            n = max(1, math.ceil(1.5 * rate / prefill.rate))
            return self._attainment(Layout(prefill.config.spec(n), c.spec()), prefill.config, c,
                                    self.workload_at(rate), self.slo)
        return PhaseGoodput(c, *self._search(att, bound))

    def colocated_goodput(self, c: PhaseConfig, bound: float) -> PhaseGoodput:
        def att(rate: float) -> float:
            return self._attainment(Layout(c.spec()), c, None, self.workload_at(rate), self.slo)
        return PhaseGoodput(c, *self._search(att, bound))

    def _best(self, ranked, goodput_of, top_k: int) -> PhaseGoodput:
        if not ranked:
            raise Infeasible("no configuration fits in memory and meets the SLO even unloaded")
        tried = [goodput_of(c, bound * c.devices) for bound, c in ranked[:top_k]]
        return max(tried, key=lambda g: (g.per_device, -g.config.devices))

    # --- Algorithm 1 ---------------------------------------------------------------------------

    def place(self, rate: float, device_limit: int | None = None, colocated: bool = True) -> Placement:
        if rate <= 0:
            raise ValueError("the target rate must be positive")
        t0 = time.perf_counter()
        self.sims = 0
        k = self.space.top_k
        prefill = self._best(self.prefill_candidates(), self.prefill_goodput, k)
        decode = self._best(self.decode_candidates(), lambda c, b: self.decode_goodput(c, prefill, b), k)
        if prefill.rate <= 0 or decode.rate <= 0:
            raise Infeasible("no simulated configuration meets the SLO attainment target at any rate")
        n, m = math.ceil(rate / prefill.rate), math.ceil(rate / decode.rate)
        notes = []
        att = self._whole(prefill.config, decode.config, n, m, rate)
        for _ in range(self.space.max_fixups):
            if att >= self.target:
                break
            if n * prefill.rate <= m * decode.rate:
                n += 1
            else:
                m += 1
            att = self._whole(prefill.config, decode.config, n, m, rate)
            notes.append(f"whole placement missed the target at R; added an instance -> {n} + {m}: {att:.0%}")
        colo = None
        if colocated:
            try:
                colo = self._best(self.colocated_candidates(), self.colocated_goodput, self.space.colocated_top_k)
            except Infeasible:
                notes.append("no colocated configuration meets the SLO even unloaded")
        pl = Placement(prefill, decode, n, m, rate, att, colo, self.sims, time.perf_counter() - t0, notes)
        if device_limit is not None and pl.devices > device_limit:
            raise Infeasible(f"rate {rate} needs {pl.devices} devices ({pl.label()}); the cluster has {device_limit}")
        return pl

    def _whole(self, p: PhaseConfig, d: PhaseConfig, n: int, m: int, rate: float) -> float:
        return self._attainment(Layout(p.spec(n), d.spec(m)), p, d, self.workload_at(rate), self.slo)
