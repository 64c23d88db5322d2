"""DistServe-style goodput: the highest request rate a layout serves while at least `target` of
requests meet both the TTFT and TPOT SLOs, found by binary search over simulated Poisson runs;
and the placement that maximises it per machine (Algorithm 1's choice, replicated to the cluster)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvflow.perf.perf_model import PerfModel
from kvflow.simulator.config import Layout, SimConfig
from kvflow.simulator.metrics import SLO
from kvflow.simulator.simulator import simulate
from kvflow.simulator.workload import Workload


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
    return simulate(SimConfig(layout, swapping=swapping), perf, workload_at(rate)).slo_attainment(slo)


def max_rate(perf: PerfModel, layout: Layout, workload_at: Callable[[float], Workload], slo: SLO,
             target: float = 0.9, hi: float = 1.0, rel_tol: float = 0.05, swapping: bool = False) -> Goodput:
    """Binary search of the largest rate with SLO attainment >= `target`.

    `hi` is a first guess; it doubles until attainment fails (at most 20 times). Attainment is
    treated as non-increasing in rate, which holds for these FIFO pipelines up to sampling noise
    (every rate reuses the same seed, so the noise is common to all rates).
    """
    if not 0 < target <= 1:
        raise ValueError("attainment target must be in (0, 1]")
    sims = 0

    def ok(rate: float) -> tuple[bool, float]:
        nonlocal sims
        sims += 1
        a = attainment_at(perf, layout, rate, workload_at, slo, swapping)
        return a >= target, a

    lo, lo_att = 0.0, 1.0
    for _ in range(20):
        good, att = ok(hi)
        if not good:
            break
        lo, lo_att, hi = hi, att, hi * 2
    else:
        return Goodput(layout, lo, lo_att, sims)
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        good, att = ok(mid)
        if good:
            lo, lo_att = mid, att
        else:
            hi = mid
    return Goodput(layout, lo, lo_att, sims)


def best_goodput(perf: PerfModel, layouts: list[Layout], workload_at: Callable[[float], Workload], slo: SLO,
                 target: float = 0.9, guess: Callable[[Layout], float] | None = None) -> list[Goodput]:
    """Goodput of each candidate layout, best per machine first."""
    res = [max_rate(perf, lay, workload_at, slo, target, hi=guess(lay) if guess else 1.0) for lay in layouts]
    return sorted(res, key=lambda g: -g.per_machine)
