"""DistServe-style goodput: the highest request rate a layout serves while at least `target` of
requests meet both the TTFT and TPOT SLOs, found by searching the rate over simulated Poisson runs.
`search_rate` is the one rate search; `max_rate` applies it to one layout, and
`kvflow.planner.placement` to each phase of DistServe's Algorithm 1."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from kvflow.perf.perf_model import PerfModel
from kvflow.simulator.config import Layout, SimConfig
from kvflow.simulator.simulator import simulate
from kvflow.simulator.workload import Workload
from kvflow.slo import SLO


@dataclass(frozen=True)
class RateSearch:
    rate: float  # the largest rate found with attainment >= target (0 if none)
    attainment: float  # measured at `rate`
    simulations: int


def search_rate(attainment_at: Callable[[float], float], target: float = 0.9, hi: float = 1.0,
                rel_tol: float = 0.05, max_steps: int = 20, cap: float = math.inf) -> RateSearch:
    """Largest rate (at most `cap`) with `attainment_at(rate) >= target`. `hi` is a first guess: it
    doubles while attainment holds and halves while it fails (at most `max_steps` times each), then
    the bracket is bisected to `rel_tol`. Attainment is treated as non-increasing in rate, which
    holds for these FIFO pipelines up to sampling noise (callers reuse one seed for every rate, so
    the noise is common to all rates).

    `cap`: a rate no steady state can exceed (e.g. a pipeline's throughput bound). A finite trial
    cannot tell overload from a burst the memory absorbs: past the bound every request may still be
    admitted at once and finish within the SLO, so without a cap the search would never stop."""
    if not 0 < target <= 1:
        raise ValueError("attainment target must be in (0, 1]")
    if hi <= 0 or rel_tol <= 0 or cap <= 0:
        raise ValueError("the first guess, the cap and the tolerance must be positive")
    hi = min(hi, cap)
    sims = 0

    def ok(rate: float) -> tuple[bool, float]:
        nonlocal sims
        sims += 1
        a = attainment_at(rate)
        return a >= target, a

    good, att = ok(hi)
    if good:
        lo, lo_att = hi, att
        for _ in range(max_steps):
            if lo >= cap:
                return RateSearch(lo, lo_att, sims)
            hi = min(2 * lo, cap)
            good, att = ok(hi)
            if not good:
                break
            lo, lo_att = hi, att
        else:
            return RateSearch(lo, lo_att, sims)
    else:
        lo, lo_att = 0.0, 1.0
        for _ in range(max_steps):
            good, att = ok(hi / 2)
            if good:
                lo, lo_att = hi / 2, att
                break
            hi /= 2
        else:
            return RateSearch(0.0, att, sims)
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        good, att = ok(mid)
        if good:
            lo, lo_att = mid, att
        else:
            hi = mid
    return RateSearch(lo, lo_att, sims)


@dataclass(frozen=True)
class Goodput:
    layout: Layout
    rate: float  # requests/s the layout sustains within the SLO attainment target
    attainment: float  # measured at `rate`
    simulations: int

    @property
    def per_machine(self) -> float:
        return self.rate / self.layout.machines


def attainment_at(perf: PerfModel, layout: Layout, rate: float, workload_at: Callable[[float], Workload],
                  slo: SLO, swapping: bool = False) -> float:
    return simulate(SimConfig(layout, swapping=swapping, prefix_caching=False), perf, workload_at(rate)).slo_attainment(slo)


def max_rate(perf: PerfModel, layout: Layout, workload_at: Callable[[float], Workload], slo: SLO,
             target: float = 0.9, hi: float = 1.0, rel_tol: float = 0.05, swapping: bool = False) -> Goodput:
    """Goodput of one layout (the planner's microbatch policy): `search_rate` over simulated runs."""
    r = search_rate(lambda rate: attainment_at(perf, layout, rate, workload_at, slo, swapping), target, hi, rel_tol)
    return Goodput(layout, r.rate, r.attainment, r.simulations)


def best_goodput(perf: PerfModel, layouts: list[Layout], workload_at: Callable[[float], Workload], slo: SLO,
                 target: float = 0.9, guess: Callable[[Layout], float] | None = None) -> list[Goodput]:
    """Goodput of each candidate layout, best per machine first."""
    res = [max_rate(perf, lay, workload_at, slo, target, hi=guess(lay) if guess else 1.0) for lay in layouts]
    return sorted(res, key=lambda g: -g.per_machine)
