"""`InstancePool`: the kvflow instances behind the router — who is in, who is healthy, what each is doing — and the
placement decision over them (`route`, then `choose` by the configured policy of `kvflow.router.policies`).

An instance joins (`add`: from the config, or `POST /router/instances` at runtime) once its /v1/models names the
pool's model, and is a candidate from its next `choose` on. A periodic check reads each instance's /metrics (its
health gauge, queue lengths and free KV tokens; /health where /metrics is not readable); `failure_threshold` failed checks in a row
take it out, as does one failed stream (`fail`: connection refused or reset). An instance that is out keeps being
checked, and one good check brings it back with an empty cache record (it may have restarted). Taking an instance
out sets its `down` event, which the streams open on it watch, so that requests stuck on a hung instance move too.
`remove` stops routing to an instance; the requests open on it finish there.

Roles (`kvflow.router.config.ROLES`): placement chooses among the instances of the roles a request's phase may use
(`choose(..., roles)`). `set_role` changes an instance's role (TetriInfer's flip, Splitwise's pools): draining first —
it takes no new request while requests it took in its old role are open there, then serves in its new role.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from kvflow.kv.prefix_hash import extend_hashes
from kvflow.router.config import ROLES, RouterConfig, instance_url
from kvflow.router.length import LengthModel
from kvflow.router.policies import POLICIES, InstanceState, RouteRequest, with_kv_room

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Flight:
    """One request open on one instance, as placement counts it (`generated` moves through `InstancePool.advance`)."""

    prompt_len: int
    predicted: float
    generated: int = 0

    @property
    def work(self) -> tuple[float, float]:
        """(predicted output tokens left, predicted KV tokens): its share of its instance's totals."""
        return max(self.predicted - self.generated, 0.0), self.prompt_len + max(self.predicted, float(self.generated))


@dataclass(frozen=True)
class ModelInfo:
    """What every instance of a pool must agree on (from its /v1/models)."""

    name: str
    max_model_len: int


@dataclass(eq=False)
class Instance:
    url: str
    role: str = "mixed"
    next_role: str | None = None  # draining: the role it takes once the requests open there have finished
    healthy: bool = False
    failures: int = 0  # consecutive failed checks
    waiting: int = 0
    running: int = 0
    cached: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # LRU of prefix-hash chain entries sent
    flights: set[Flight] = field(default_factory=set)
    down: asyncio.Event = field(default_factory=asyncio.Event)
    routed_total: int = 0
    failures_total: int = 0  # times taken out
    # the flights' `work`, summed as flights open, advance and close (`state` is read for every instance at every
    # placement: a sum over each one's flights there made placement cost grow with instances x requests open)
    decode_left: float = 0.0
    kv_tokens: float = 0.0
    free_kv_tokens: float | None = None  # as its last scrape said (None: it does not say)
    kv_since_scrape: float = 0.0  # predicted KV of the requests sent here since that scrape

    def state(self) -> InstanceState:
        free = None if self.free_kv_tokens is None else self.free_kv_tokens - self.kv_since_scrape
        return InstanceState(self.url, self.waiting, self.running, len(self.flights), self.cached.keys(),
                             self.decode_left, self.kv_tokens, free)

    def scraped(self, waiting: int, running: int, free_kv_tokens: float | None) -> None:
        self.waiting, self.running, self.free_kv_tokens, self.kv_since_scrape = waiting, running, free_kv_tokens, 0.0

    def _count(self, flight: Flight, sign: int) -> None:
        left, kv = flight.work
        self.decode_left += sign * left
        self.kv_tokens += sign * kv
        if not self.flights:  # (no drift left over from the additions and subtractions)
            self.decode_left = self.kv_tokens = 0.0


class NoInstance(Exception):
    """No healthy instance is left to send a request to."""


async def probe(client: httpx.AsyncClient, url: str, timeout: float) -> ModelInfo:
    """The model an instance serves (its /v1/models); raises httpx errors when it does not answer."""
    r = await client.get(f"{url}/v1/models", timeout=timeout)
    r.raise_for_status()
    card = r.json()["data"][0]
    return ModelInfo(card["id"], int(card["max_model_len"]))


class InstancePool:
    """`client` reads the instances' /health, /metrics and /v1/models (None: a pool no one checks, whose instances
    are made healthy by its owner: the simulated cluster, `kvflow.router.simulated`)."""

    def __init__(self, config: RouterConfig, model: ModelInfo, client: httpx.AsyncClient | None,
                 length_model: LengthModel) -> None:
        self.config, self.model, self.client, self.length_model = config, model, client, length_model
        self.policy = POLICIES[config.policy]
        self.instances: dict[str, Instance] = {}
        self.turn = 0
        self.failovers_total = 0
        self.handoffs_total = 0  # requests moved from a prefill instance to a decode instance
        self.resent_tokens_total = 0
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ membership
    async def add(self, url: str, role: str | None = None) -> Instance:
        """Admit an instance: it must answer /v1/models with the pool's model and context length now (raises
        ValueError otherwise). Used by the next `choose`, in `role` (None: the role it has, "mixed" when new)."""
        url = instance_url(url)
        _check_role(role)
        try:
            info = await probe(self.client, url, self.config.health_timeout_s)
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise ValueError(f"instance {url} did not answer /v1/models: {e}") from e
        if info != self.model:
            raise ValueError(f"instance {url} serves {info}, this router {self.model}")
        inst = self.instances.get(url) or Instance(url)
        if role is not None:
            inst.role, inst.next_role = role, None
        inst.healthy, inst.failures = True, 0
        inst.down.clear()
        self.instances[url] = inst
        log.info("instance %s joined (%d in the pool)", url, len(self.instances))
        return inst

    def add_unchecked(self, url: str, role: str = "mixed") -> None:
        """An instance from the config that is not up yet: checked like the others, used once a check passes."""
        url = instance_url(url)
        _check_role(role)
        self.instances.setdefault(url, Instance(url, role))

    def set_role(self, url: str, role: str) -> Instance:
        """Give an instance another role, draining first (see the module docstring); KeyError if it is not here."""
        _check_role(role)
        inst = self.instances[instance_url(url)]
        if role == inst.role:
            inst.next_role = None
        elif inst.flights:
            inst.next_role = role
        else:
            inst.role, inst.next_role = role, None
        log.info("instance %s: role %s%s", inst.url, inst.role, f" -> {inst.next_role} (draining)" if inst.next_role else "")
        return inst

    def phase(self, generated: int, prefilled_on: str | None) -> tuple[bool, tuple[str, ...]]:
        """Where a request goes next: (whether this is its prompt phase on the P/D pools, the roles to choose among).
        While both P/D pools have an instance taking requests, a new request's prompt and first token go to the
        prefill pool, and the rest, after that, to the decode pool; else the whole request goes to the mixed pool
        (then the decode pool)."""
        prefill = not generated and prefilled_on is None and bool(self.serving("prefill") and self.serving("decode"))
        return prefill, ("prefill",) if prefill else ("decode", "mixed") if prefilled_on else ("mixed", "decode")

    def serving(self, role: str) -> list[Instance]:
        """The healthy instances taking new requests in `role`."""
        return [i for i in self.instances.values() if i.role == role and i.healthy and i.next_role is None]

    def remove(self, url: str) -> bool:
        return self.instances.pop(instance_url(url), None) is not None

    def fail(self, inst: Instance, why: str) -> None:
        """Take an instance out now (a stream to it broke); the health check may bring it back."""
        if inst.healthy:
            log.warning("instance %s taken out: %s", inst.url, why)
            inst.failures_total += 1
        inst.healthy, inst.failures = False, self.config.failure_threshold
        inst.cached.clear()
        inst.down.set()

    # ------------------------------------------------------------------ placement
    def route(self, token_ids: Sequence[int], max_tokens: int | None = None, known: Sequence[bytes] = ()) -> RouteRequest:
        """A request as placement sees it: its prefix-hash chain (`known`: the chain of a prefix of `token_ids`
        computed before, extended here) and its predicted output length (at most `max_tokens`)."""
        bt = self.config.block_tokens
        hashes = extend_hashes(list(known), token_ids, len(token_ids) // bt, bt)
        return RouteRequest(len(token_ids), tuple(hashes), self.length_model.predict(len(token_ids), max_tokens))

    def choose(self, route: RouteRequest, exclude: set[str] = frozenset(), roles: tuple[str, ...] = ROLES) -> Instance:
        """The policy's choice among the healthy instances in one of `roles` that are not draining and not in
        `exclude`; when there is none, among those in any role (a request is never refused for want of a role)."""
        healthy = [i for i in self.instances.values() if i.healthy and i.url not in exclude]
        up = [i for i in healthy if i.next_role is None]
        candidates = [i for i in up if i.role in roles] or up or healthy
        if not candidates:
            raise NoInstance(f"no healthy instance ({len(self.instances)} in the pool, {len(exclude)} failed this request)")
        states = [i.state() for i in candidates]
        if self.config.placement.kv_room and self.config.policy != "round_robin":  # (the baseline stays blind)
            room = with_kv_room(route, states)
            if len(room) < len(states):
                candidates, states = [candidates[i] for i in room], [states[i] for i in room]
        chosen = candidates[self.policy(route, states, self.config.placement, self.turn)]
        self.turn += 1
        return chosen

    def open(self, inst: Instance, route: RouteRequest, generated: int = 0) -> Flight:
        """A request placed on `inst` (`generated`: tokens it already has, when it moved here after a failure)."""
        flight = Flight(route.prompt_len, route.predicted_output, generated)
        inst.flights.add(flight)
        inst._count(flight, 1)
        inst.kv_since_scrape += flight.work[1]
        inst.routed_total += 1
        self.remember(inst, route.block_hashes)
        return flight

    def advance(self, inst: Instance, flight: Flight, generated: int) -> None:
        """The request now has `generated` output tokens."""
        if flight in inst.flights:
            inst._count(flight, -1)
            flight.generated = generated
            inst._count(flight, 1)
        else:
            flight.generated = generated

    def close(self, inst: Instance, flight: Flight) -> None:
        if flight in inst.flights:
            inst.flights.discard(flight)
            inst._count(flight, -1)
        if inst.next_role is not None and not inst.flights:  # drained: it serves in its new role from now on
            inst.role, inst.next_role = inst.next_role, None
            log.info("instance %s drained: role %s", inst.url, inst.role)

    def remember(self, inst: Instance, block_hashes: Sequence[bytes]) -> None:
        """The instance now likely caches these blocks: most recently used first to stay in the bounded record."""
        for h in block_hashes:
            inst.cached[h] = None
            inst.cached.move_to_end(h)
        while len(inst.cached) > self.config.cached_blocks:
            inst.cached.popitem(last=False)

    # ------------------------------------------------------------------ health
    async def check(self, inst: Instance) -> None:
        timeout = self.config.health_timeout_s
        try:
            m = await self.client.get(f"{inst.url}/metrics", timeout=timeout)
            gauges = scrape(m.text) if m.status_code == 200 else {}
            if "kvflow_backend_healthy" in gauges:  # one read: health (as /health judges it) and queue lengths
                ok = gauges["kvflow_backend_healthy"] == 1
                inst.scraped(*(int(gauges.get(name, 0)) for name in QUEUE_GAUGES), gauges.get(KV_GAUGE))
            else:  # /metrics behind a key the router lacks, or not a kvflow instance's page
                ok = (await self.client.get(f"{inst.url}/health", timeout=timeout)).status_code == 200
            if ok and not inst.healthy:  # back (or up for the first time): the same model?
                info = await probe(self.client, inst.url, timeout)
                if info != self.model:
                    log.warning("instance %s serves %s, this router %s: not used", inst.url, info, self.model)
                    ok = False
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            ok = False
        if ok:
            if not inst.healthy:
                log.info("instance %s is up", inst.url)
                inst.cached.clear()
                inst.down.clear()
            inst.healthy, inst.failures = True, 0
            return
        inst.failures += 1
        if inst.failures >= self.config.failure_threshold and inst.healthy:
            self.fail(inst, f"{inst.failures} failed health checks")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(i) for i in list(self.instances.values())))

    async def _loop(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # one bad check must not stop the checking
                log.exception("health check failed")
            await asyncio.sleep(self.config.health_interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvflow-router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def _check_role(role: str | None) -> None:
    if role is not None and role not in ROLES:
        raise ValueError(f"an instance's role is one of {ROLES}, got {role!r}")


QUEUE_GAUGES = ("kvflow_num_requests_waiting", "kvflow_num_requests_running")
KV_GAUGE = "kvflow_kv_free_tokens"
CHECKED = ("kvflow_backend_healthy", *QUEUE_GAUGES, KV_GAUGE)


def scrape(text: str, names: tuple[str, ...] = CHECKED) -> dict[str, float]:
    """The values of unlabelled gauges from an instance's /metrics text (a line scan, not the Prometheus parser: every
    instance's page is read every second, and only these lines are needed)."""
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[name] = float(value.split(" ", 1)[0])
    return values

