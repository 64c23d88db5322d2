"""Scaling the router's own instances: the fewest that meet the SLOs for the load arriving now (Aladdin's question),
decided in the simulated cluster and applied through the fleet; for P/D pools, the fewest in all and their split
between the prefill and the decode pool (the simulated cluster runs the pools too).

`LoadMeter` keeps what the router saw over the last `window_s` seconds: arrivals (the rate) and the prompt and output
lengths of the requests that finished (the mix). `instances_needed` answers the question in the simulated cluster of
`kvflow.router.simulated` (the router's own placement over simulated instances, each the real scheduler with step
times from a `PerfModel`, e.g. a `kvflow profile` of one instance): a Poisson workload at the measured rate, lengths
drawn from the mix, replayed for candidate counts (bisection between `min_instances` and `max_instances`) to find the
fewest that meet the SLOs for `attainment` of its requests. `Autoscaler.step` applies the answer: more instances are started at once (the fleet's `grow`; the
health check brings them into the pool), fewer only after `scale_down_after` answers in a row (one instance at a
time: out of the pool first, so no new request goes there, then SIGTERM, on which `kvflow serve` drains the requests
still open on it).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np

from kvflow.perf.perf_model import PerfModel
from kvflow.router.config import RouterConfig, ScalingConfig
from kvflow.router.fleet import Fleet
from kvflow.router.pool import InstancePool
from kvflow.router.simulated import simulate_cluster
from kvflow.config import default_block_size
from kvflow.sched.config import SchedulerConfig
from kvflow.simulator.config import Layout, PipelineGroup, SimConfig
from kvflow.simulator.workload import Workload
from kvflow.slo import SLO

log = logging.getLogger(__name__)


class LoadMeter:
    """Arrival times and finished requests' (prompt, output) lengths over the last `window_s` seconds."""

    def __init__(self, window_s: float, clock=time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self.arrivals: deque[float] = deque()
        self.lengths: deque[tuple[float, int, int]] = deque()

    def arrived(self) -> None:
        self.arrivals.append(self.clock())

    def finished(self, prompt_len: int, output_len: int) -> None:
        if output_len > 0:
            self.lengths.append((self.clock(), prompt_len, output_len))

    def _trim(self, now: float) -> None:
        while self.arrivals and now - self.arrivals[0] > self.window_s:
            self.arrivals.popleft()
        while self.lengths and now - self.lengths[0][0] > self.window_s:
            self.lengths.popleft()

    def rate(self) -> float:
        """Arrivals per second over the window."""
        self._trim(self.clock())
        return len(self.arrivals) / self.window_s

    def mix(self) -> tuple[list[int], list[int]]:
        """The prompt and output lengths of the requests that finished within the window."""
        self._trim(self.clock())
        return [p for _, p, _ in self.lengths], [o for _, _, o in self.lengths]


def instances_needed(rate: float, prompt_lens: list[int], output_lens: list[int], cfg: ScalingConfig, perf: PerfModel,
                     instance: SimConfig, router: RouterConfig, fixed: int = 0, seed: int = 0,
                     pd: bool = False) -> int | tuple[int, int]:
    """The fewest instances in [min_instances, max_instances] (besides `fixed` ones the router does not scale) whose
    simulated cluster meets the SLOs for `attainment` of a Poisson workload of `trial_requests` requests at `rate`
    with lengths drawn from the mix; `max_instances` when none does; `min_instances` when nothing arrives or no
    request finished yet. `pd`: P/D pools (`fixed` not counted), the answer (prefill, decode) instances: the fewest
    in all that meet the SLOs with their best split, the split with the highest attainment."""
    if rate <= 0 or not output_lens:
        return _pd_split(cfg.min_instances) if pd else cfg.min_instances
    rng = np.random.default_rng(seed)
    n = cfg.trial_requests  # (not the window's count: a steady state at `rate`, not the few requests of one window)
    longest = instance.max_model_len - 1
    prompts = np.minimum(rng.choice(np.asarray(prompt_lens, dtype=np.int64), n), longest)
    outputs = np.clip(rng.choice(np.asarray(output_lens, dtype=np.int64), n), 1, np.maximum(instance.max_model_len - prompts, 1))
    w = Workload(np.cumsum(rng.exponential(1.0 / rate, n)), prompts, outputs)
    slo = SLO(cfg.ttft_slo_s, cfg.tpot_slo_s)

    def attained(k: int) -> float:
        return simulate_cluster(k + fixed, instance, perf, w, router).result.slo_attainment(slo)

    def best_split(k: int) -> tuple[float, tuple[int, int]]:
        return max((simulate_cluster(k, instance, perf, w, router, roles=("prefill",) * p + ("decode",) * (k - p))
                    .result.slo_attainment(slo), (p, k - p)) for p in range(1, k))

    lo, hi = max(cfg.min_instances, 2 if pd else 1), max(cfg.max_instances, 2 if pd else 1)
    while lo < hi:  # bisection: attainment grows with the instances
        k = (lo + hi) // 2
        if (best_split(k)[0] if pd else attained(k)) >= cfg.attainment:
            hi = k
        else:
            lo = k + 1
    return best_split(lo)[1] if pd else lo


def _pd_split(n: int) -> tuple[int, int]:
    """P/D pools of `n` instances before anything is measured: a third of them prefill, at least one of each."""
    p = max(1, n // 3) if n >= 2 else 1
    return p, max(1, n - p)


def instance_config(max_model_len: int, block_size: int | None = None, scheduler: SchedulerConfig | None = None) -> SimConfig:
    """One simulated instance: `kvflow serve`'s scheduler (its defaults unless given) and KV block size (the CPU
    default unless given), continuous batching, prefix caching on."""
    return SimConfig(Layout(PipelineGroup(1, (scheduler or SchedulerConfig()).max_num_seqs)), policy="continuous",
                     block_size=block_size or default_block_size("cpu"), max_model_len=max_model_len,
                     scheduler=scheduler or SchedulerConfig())


class Autoscaler:
    """Applies `instances_needed` to `fleet` every `cfg.interval_s` (see the module docstring). `fixed`: instances
    in the pool the router did not start (counted in the simulated cluster, never retired). `pd`: the fleet's
    instances are P/D pools, sized per role (answers are (prefill, decode) counts)."""

    def __init__(self, cfg: ScalingConfig, perf: PerfModel, instance: SimConfig, router: RouterConfig,
                 fleet: Fleet, pool: InstancePool, meter: LoadMeter, fixed: int = 0, pd: bool = False) -> None:
        self.cfg, self.perf, self.instance, self.router = cfg, perf, instance, router
        self.fleet, self.pool, self.meter, self.fixed, self.pd = fleet, pool, meter, fixed, pd
        self.lower = 0  # consecutive answers below the current count
        self.decisions: list[tuple[float, int | tuple[int, int], int]] = []  # (rate, answer, instances after)

    def trial(self) -> tuple:
        """`instances_needed`'s arguments for the load measured now (picklable: the router runs it in a process of
        its own, so that the simulated trials do not hold the event loop's interpreter)."""
        return (self.meter.rate(), *self.meter.mix(), self.cfg, self.perf, self.instance, self.router, self.fixed, 0,
                self.pd)

    def _by_role(self) -> dict[str, list]:
        """The fleet's active instances per role (as the pool has them now: re-balancing may have moved some)."""
        out: dict[str, list] = {"prefill": [], "decode": []}
        for inst in self.fleet.active:
            member = self.pool.instances.get(inst.url)
            out.setdefault(member.role if member is not None else "mixed", []).append(inst)
        return out

    def _step_roles(self, want: tuple[int, int]) -> int:
        have = self._by_role()
        short = [(role, n - len(have[role])) for role, n in zip(("prefill", "decode"), want) if n > len(have[role])]
        extra = [role for role, n in zip(("prefill", "decode"), want) if n < len(have[role])]
        if short:
            self.lower = 0
            for role, k in short:
                for inst in self.fleet.grow(k):
                    self.pool.add_unchecked(inst.url, role)
                log.info("scaling up the %s pool by %d for %.2f requests/s", role, k, self.meter.rate())
        elif extra:
            self.lower += 1
            if self.lower >= self.cfg.scale_down_after:
                self.lower = 0
                inst = have[extra[0]][-1]
                self.pool.remove(inst.url)
                self.fleet.retire(inst)
                log.info("scaling down the %s pool by 1 for %.2f requests/s", extra[0], self.meter.rate())
        else:
            self.lower = 0
        self.decisions.append((self.meter.rate(), want, len(self.fleet.active)))
        return len(self.fleet.active)

    def step(self, want: int | tuple[int, int]) -> int:
        """Apply one answer of `instances_needed(*self.trial())` (the router computes it in a process of its own);
        the fleet's size after it."""
        if self.pd:
            return self._step_roles(want)
        have = len(self.fleet.active)
        if want > have:
            self.lower = 0
            for inst in self.fleet.grow(want - have):
                self.pool.add_unchecked(inst.url)  # a candidate once its health check passes
            log.info("scaling up: %d -> %d instances for %.2f requests/s", have, want, self.meter.rate())
        elif want < have:
            self.lower += 1
            if self.lower >= self.cfg.scale_down_after:
                self.lower = 0
                inst = self.fleet.active[-1]
                self.pool.remove(inst.url)  # no new request goes there; the open ones drain on SIGTERM
                self.fleet.retire(inst)
                log.info("scaling down: %d -> %d instances for %.2f requests/s", have, have - 1, self.meter.rate())
        else:
            self.lower = 0
        self.decisions.append((self.meter.rate(), want, len(self.fleet.active)))
        return len(self.fleet.active)
