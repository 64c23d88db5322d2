"""The simulated cluster: the router's own placement over N simulated instances.

Each instance is the simulator's engine model — one single-stage pipeline of `kvflow.simulator.Simulator` (the real
`Scheduler` over a `KVCacheManager` block pool, prefix caching included; step times from a `PerfModel`) — and the
router's own `InstancePool` (`route`, `choose`, `open`, `close`, `remember`, the policies of
`kvflow.router.policies`: the code `RouterBackend.generate` runs) decides where each arriving request goes. The pool
learns what the router learns: its own count of the requests open on each instance and their predicted work left
(`Flight`s, updated at every token), the prompts and outputs it sent there (the cache record), and each instance's
`waiting` / `running` and free KV tokens as a health check reads them every `RouterConfig.health_interval_s` (here: at the first arrival
after each interval).

P/D pools (`roles`: each instance's, as `RouterConfig.prefill` / `decode` give them): the router's own `phase` decides,
as for a real request, whether a request's prompt runs on the prefill pool with one token to produce. When that token
comes, the request goes on, prompt + token, to a decode instance of the policy's choice. Once the prompt's KV has
travelled there (the router's own time `hop_s`, then its KV bytes over `pull_bandwidth`, by default the perf model's
network link; `PullDone`), its full blocks are registered in that instance's pool as cached blocks — what a pull into
the host tier and the promotion at admission amount to — and the request is queued there: its admission finds them
as a prefix hit and computes the rest of the last block.

Not modelled: failures and re-sends, role changes, and the router's own time on a request (`hop_s`: a fixed delay
before a request reaches its instance, counted in its TTFT).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from kvflow.perf.perf_model import PerfModel
from kvflow.router.config import RouterConfig
from kvflow.router.length import LengthModel
from kvflow.router.pool import Flight, Instance, InstancePool, ModelInfo
from kvflow.router.policies import RouteRequest
from kvflow.sched.request import Request
from kvflow.sched.sampling import SamplingParams
from kvflow.simulator.config import Layout, PipelineGroup, SimConfig
from kvflow.simulator.events import ARRIVAL, Arrival, Event
from kvflow.simulator.metrics import SimResult
from kvflow.simulator.simulator import SAMPLED, Simulator
from kvflow.simulator.workload import Workload


def instances_config(n: int, config: SimConfig) -> SimConfig:
    """`config` (one instance's scheduler, pool, policy) as `n` independent single-stage instances, each with its own
    queue (the router binds a request to its instance at arrival)."""
    return SimConfig(Layout(PipelineGroup(1, config.scheduler.max_num_seqs, n)), dispatch="round_robin",
                     policy=config.policy, scheduler=config.scheduler, kv_blocks=config.kv_blocks,
                     block_size=config.block_size, max_model_len=config.max_model_len,
                     prefix_caching=config.prefix_caching, shared_host=config.shared_host)


class PullDone(Event):
    """Request `i`'s prompt KV has reached decode instance `k`: it is queued there."""

    __slots__ = ("i", "k")

    def __init__(self, time: float, i: int, k: int) -> None:
        self.time, self.i, self.k, self.rank = time, i, k, ARRIVAL

    def handle(self, sim: "RoutedSimulator") -> list[Event]:
        sim.pulled(self.i, self.k)
        return []


@dataclass(frozen=True)
class ClusterResult:
    result: SimResult  # per-request times, counted from each request's arrival at the router
    decode_tokens: list[int]  # tokens each instance generated
    routed: list[int]  # requests placed on each instance
    placed: list[int]  # each request's instance


class RoutedSimulator(Simulator):
    """`Simulator` over `config.layout.prompt.count` instances, placement by `router.policy` (see the module
    docstring). `hop_s`: seconds from a request's arrival at the router to its arrival at the instance."""

    def __init__(self, config: SimConfig, perf: PerfModel, workload: Workload, router: RouterConfig,
                 length_model: LengthModel, hop_s: float = 0.0, roles: tuple[str, ...] = (),
                 pull_bandwidth: float | None = None) -> None:
        spec = config.layout.prompt
        if config.layout.disaggregated or spec.depth != 1 or config.dispatch != "round_robin":
            raise ValueError("a routed cluster is single-stage instances with queues of their own (`instances_config`)")
        if hop_s < 0:
            raise ValueError(f"hop_s must be >= 0, got {hop_s}")
        self.hop_s, self.original = hop_s, workload
        if hop_s:
            workload = Workload(workload.arrival + hop_s, workload.prompt_len, workload.output_len, workload.prompts)
        super().__init__(config, perf, workload)
        self.router = router
        self.pool = InstancePool(router, ModelInfo(perf.shape.name, config.max_model_len or 0), None, length_model)
        roles = roles or ("mixed",) * len(self.prompt)
        if len(roles) != len(self.prompt):
            raise ValueError(f"{len(roles)} roles for {len(self.prompt)} instances")
        if set(roles) - {"mixed"} and not config.prefix_caching:
            raise ValueError("P/D pools hand a prompt's KV over as cached blocks: they need prefix caching")
        self.members: dict[str, int] = {}  # instance URL -> pipeline index
        for p, role in zip(self.prompt, roles):
            url = f"http://sim-{p.index}:1"
            self.pool.add_unchecked(url, role)
            self.pool.instances[url].healthy = True
            self.members[url] = p.index
        self.pull_bandwidth = pull_bandwidth  # bytes/s of a KV pull between instances (None: the perf model's link)
        self.prefilling: set[int] = set()  # requests whose prompt phase runs on a prefill instance
        self.decoding: set[int] = set()  # requests handed over to a decode instance (their first token came before)
        self.open_flights: dict[int, tuple[Instance, Flight, RouteRequest]] = {}
        self.decode_tokens = [0] * len(self.prompt)
        self.routed = [0] * len(self.prompt)
        self.placed = [-1] * workload.n
        self._scraped = -math.inf

    def prompt_tokens(self, i: int) -> list[int]:
        """Request `i`'s prompt as the router hashes it: the workload's, or one of its own (as the simulator's)."""
        if self.workload.prompts is not None:
            return list(self.workload.prompts[i])
        return [i] * self.prompt_len[i]

    def _scrape(self, now: float) -> None:
        """The health check's read of each instance's queue lengths and free KV (its /metrics)."""
        if now - self._scraped < self.router.health_interval_s:
            return
        self._scraped = now
        for url, k in self.members.items():
            p = self.prompt[k]
            kv = p.kv_manager
            self.pool.instances[url].scraped(len(p.queue) + len(p.sched.waiting), len(p.sched.running),
                                             kv.num_free_blocks * kv.block_size)

    def on_arrival(self, now: float, first: int) -> list[Event]:
        self._scrape(now)
        i, n = first, len(self.arrival)
        while i < n and self.arrival[i] <= now:
            route = self.pool.route(self.prompt_tokens(i), self.out_len[i])  # (sent as max_tokens, ignore_eos)
            prefill, roles = self.pool.phase(0, None)
            inst = self.pool.choose(route, roles=roles)
            self.open_flights[i] = (inst, self.pool.open(inst, route), route)
            k = self.members[inst.url]
            self.routed[k] += 1
            self.placed[i] = k
            if prefill and self.out_len[i] > 1:  # its prompt and first token only, then on to a decode instance
                self.prefilling.add(i)
                self.executor.submit(Request(str(i), self.prompt_tokens(i), SamplingParams(
                    max_tokens=1, temperature=0.0, ignore_eos=True), arrival_time=self.arrival[i]), self.prompt[k])
            else:
                self.executor.submit(i, self.prompt[k])
            i += 1
        return [Arrival(self.arrival[i], i)] if i < n else []

    def emit(self, req: Request) -> None:
        i = int(req.request_id)
        inst, flight, route = self.open_flights[i]
        prompt_phase = i in self.prefilling
        base = 1 if i in self.decoding else 0  # (the decode phase's request starts after the first token)
        generated = base + len(req.output_token_ids)
        if not (prompt_phase and req.is_finished):  # (the prompt phase's end is not the request's)
            super().emit(req)
        elif self.first_token[i] != self.first_token[i]:
            self.first_token[i] = self.now
        self.decode_tokens[self.members[inst.url]] += generated - flight.generated
        self.pool.advance(inst, flight, generated)
        if req.is_finished:
            self.pool.close(inst, flight)
            self.pool.remember(inst, self.pool.route(req.token_ids, 0, route.block_hashes).block_hashes)
            del self.open_flights[i]
            if prompt_phase:
                self._hand_over(i, req, inst, route)
            else:
                self.decoding.discard(i)

    def _hand_over(self, i: int, req: Request, prefill: Instance, route: RouteRequest) -> None:
        """Request `i`'s first token came from `prefill`: on to a decode instance, once the prompt's KV got there."""
        self.prefilling.discard(i)
        route = self.pool.route(req.token_ids, self.out_len[i] - 1, route.block_hashes)
        _, roles = self.pool.phase(1, prefill.url)
        inst = self.pool.choose(route, roles=roles)
        self.open_flights[i] = (inst, self.pool.open(inst, route, 1), route)
        self.decoding.add(i)
        k = self.members[inst.url]
        self.routed[k] += 1
        self.placed[i] = k
        pull = self.perf.transfer_time(self.prompt_len[i] * self.perf.shape.kv_bytes_per_token, self.pull_bandwidth)
        self._events.append(PullDone(self.now + self.hop_s + pull, i, k))  # (the router's second request, then the pull)

    def pulled(self, i: int, k: int) -> None:
        """The prompt's full blocks land in instance `k`'s pool as cached blocks (when it has room; else they are
        computed there), and the request, prompt + its first token, is queued there for the rest of its output."""
        prompt = self.prompt_tokens(i)
        p = self.prompt[k]
        kv = p.kv_manager
        full = len(prompt) // kv.block_size * kv.block_size
        table: list[int] = []
        if full and kv.ensure(table, full):
            kv.cache_blocks(table, prompt, [], 0, full)
            kv.release(table)
        req = Request(str(i), prompt + [SAMPLED], SamplingParams(max_tokens=self.out_len[i] - 1, temperature=0.0,
                                                           ignore_eos=True), arrival_time=self.arrival[i])
        self.executor.submit(req, p)

    def run_cluster(self) -> ClusterResult:
        res = self.run()
        if self.hop_s:  # times count from the arrival at the router
            res = dataclasses.replace(res, arrival=self.original.arrival)
        return ClusterResult(res, list(self.decode_tokens), list(self.routed), list(self.placed))


def simulate_cluster(n: int, config: SimConfig, perf: PerfModel, workload: Workload, router: RouterConfig,
                     length_model: LengthModel | None = None, hop_s: float = 0.0,
                     roles: tuple[str, ...] = (), pull_bandwidth: float | None = None) -> ClusterResult:
    """Run `workload` through `n` simulated instances of `config` behind the router's placement (`router.policy`);
    `roles`: each instance's (default: all mixed), `pull_bandwidth`: of the P/D pools' KV pulls (bytes/s)."""
    model = length_model or LengthModel.load(router.length_model)
    return RoutedSimulator(instances_config(n, config), perf, workload, router, model, hop_s, roles,
                           pull_bandwidth).run_cluster()


def imbalance(decode_tokens: list[int]) -> float:
    """Max over mean of the instances' decode load (1: perfectly even)."""
    mean = float(np.mean(decode_tokens))
    return max(decode_tokens) / mean if mean else 1.0
