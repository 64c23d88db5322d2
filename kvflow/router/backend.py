"""`RouterBackend`: the router as a `Backend` of the HTTP API, so `kvflow.api.server.build_app` serves it with every
route, check and error of `kvflow serve` (the prompt is templated, tokenized and validated here, once).

A request goes to the instance the pool chooses as `/v1/completions` with the prompt as token ids, streamed, with
`return_token_ids`, through the router's own HTTP client (`kvflow.router.sse.SSEClient`). The router keeps the
request's output in its own `Request` (the object the engine keeps), fed with the token ids the instance streams: its
stop checks, detokenizer and held-back text are the engine's, so the client sees what one instance would have sent.
If the instance fails (connection refused or reset, an error event, its `down` event), the request is re-sent to
another instance with its generated prefix — prompt + tokens so far, `max_tokens` and `min_tokens` reduced by what
was generated — and its stream goes on from the next token: no token is lost or sent twice. A greedy request then
continues exactly as it would have on batch-invariant instances (a seeded sampled one does not: the new instance's
generator starts afresh; presence and frequency penalties count only the tokens after the move). A stop string that
spans the move is still found (by the router's `Request`; the stream on the instance is then closed, which aborts
it).

P/D pools (`RouterConfig.prefill` / `decode`, or roles set at runtime): while both pools have a healthy instance, a
request first goes to a prefill instance with `max_tokens` 1 — its first token streams to the client from there — and
then, with that token, to a decode instance, told in `kv_transfer_params` where the prompt ran: the decode instance
pulls the prompt's full KV blocks from the prefill instance (`kvflow.streaming.kv_pull`) and computes only the rest of
its last block. A greedy request's tokens are those one instance gives (batch-invariant instances); a seeded sampled
one continues with a fresh generator, as after a failover.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvflow.model.loader import load_config
from kvflow.perf.perf_model import PerfModel
from kvflow.model.tokenizer import IncrementalDetokenizer, Tokenizer
from kvflow.router.config import RouterConfig
from kvflow.router.fleet import Fleet
from kvflow.router.roles import BalanceConfig, RoleBalancer
from kvflow.router.scaling import Autoscaler, LoadMeter, ScalingConfig
from kvflow.router.sse import HTTPFailed, HTTPStatus, SSEClient
from kvflow.router.length import LengthModel
from kvflow.router.pool import Instance, InstancePool, ModelInfo, NoInstance, probe
from kvflow.sched.request import Request, RequestOutput
from kvflow.sched.sampling import SamplingParams
from kvflow.serving.backend import BackendStats, BackendUnavailable
from kvflow.simulator.config import SimConfig

log = logging.getLogger(__name__)


class InstanceFailed(Exception):
    """The instance broke off the request (connection refused or reset, an error event, taken out)."""


class InstanceRefused(Exception):
    """The instance answered the request with an HTTP error (`status`, its message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Chunk:
    token_ids: list[int]
    finish_reason: str | None


ROUTER_ONLY = ("skip_special_tokens",)  # the router detokenizes; instances need not


def request_body(model: str, prompt: list[int], params: SamplingParams, generated: int) -> dict:
    """The `/v1/completions` body that continues a request after `generated` tokens (0: the whole request): every
    sampling field under its own name (the API's fields are `SamplingParams`'), max/min tokens less `generated`."""
    body = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name not in ROUTER_ONLY}
    body = {k: list(v) if isinstance(v, tuple) else v for k, v in body.items()}
    body.update(model=model, prompt=prompt, stream=True, return_token_ids=True, max_tokens=params.max_tokens - generated,
                min_tokens=max(params.min_tokens - generated, 0))
    return body


async def _stream(client: SSEClient, inst: Instance, body: dict) -> AsyncIterator[Chunk]:
    """The instance's chunks for one request; raises `InstanceFailed` or `InstanceRefused`."""
    try:
        async for data in client.events(inst.url, "/v1/completions", json.dumps(body).encode(), abort_on=inst.down):
            event = json.loads(data)
            if "error" in event:
                raise InstanceFailed(f"error event: {event['error'].get('message')}")
            for choice in event.get("choices", ()):
                yield Chunk(choice.get("token_ids") or [], choice.get("finish_reason"))
    except HTTPStatus as e:
        text = e.args[0]
        try:
            text = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise InstanceRefused(e.status, text) from None
    except HTTPFailed as e:
        raise InstanceFailed("taken out of the pool" if inst.down.is_set() else str(e)) from e


class RouterBackend:
    """A `Backend` over an `InstancePool` (see the module docstring)."""

    def __init__(self, config: RouterConfig, model: ModelInfo, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...],
                 length_model: LengthModel) -> None:
        self.config = config
        self.model_name, self.max_model_len = model.name, model.max_model_len
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(config.health_timeout_s, connect=config.connect_timeout_s))
        self.streams = SSEClient(config.connect_timeout_s)  # the requests themselves (`client`: health checks)
        self.pool = InstancePool(config, model, self.client, length_model)
        for url, role in config.roles().items():
            self.pool.add_unchecked(url, role)
        self._started = False
        self._prompt_tokens = self._generated_tokens = 0
        self.fleet: Fleet | None = None  # the instances this router started, if any (`connect`)
        self.autoscaler: Autoscaler | None = None  # sizes the fleet (`scale`)
        self.meter: LoadMeter | None = None
        self._supervisor: asyncio.Task | None = None
        self.balancer: RoleBalancer | None = None  # moves instances between the P/D pools (`balance`)
        self._balancing: asyncio.Task | None = None

    @classmethod
    async def connect(cls, config: RouterConfig, model: str | None = None, wait_s: float = 60.0,
                      fleet: Fleet | None = None) -> "RouterBackend":
        """Wait (up to `wait_s`) until one configured instance answers /v1/models, take the model's name and context
        from it, and load the tokenizer of `model` (the checkpoint the instances serve: a GGUF file or a checkpoint
        directory; None: the embedded default). `fleet`: the instances the router started (`kvflow.router.fleet`),
        kept running from now on; the wait ends early, with their logs' last lines, if every one of them gave up."""
        if not config.roles():
            raise ValueError("the router needs at least one instance (--instance URL or `instances` in --config)")
        info: ModelInfo | None = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        async with httpx.AsyncClient() as client:
            while info is None:
                for url in config.roles():
                    try:
                        info = await probe(client, url, config.health_timeout_s)
                        break
                    except (httpx.HTTPError, KeyError, IndexError, ValueError):
                        continue
                if info is None:
                    if fleet is not None:
                        await asyncio.to_thread(fleet.supervise)  # (a Ray fleet's calls wait on its actors)
                        if all(i.given_up for i in fleet.instances):
                            raise ValueError("every instance the router started exited:\n" + "\n".join(
                                f"{i.log_path}:\n{fleet.tail(i)}" for i in fleet.instances))
                    if loop.time() > deadline:
                        raise ValueError(f"no instance answered /v1/models within {wait_s:g} s: {list(config.roles())}")
                    await asyncio.sleep(0.2)
        mcfg, directory = await asyncio.to_thread(load_config, model)
        tokenizer = await asyncio.to_thread(Tokenizer, directory)
        eos = set(mcfg.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        backend = cls(config, info, tokenizer, tuple(sorted(eos)), LengthModel.load(config.length_model))
        backend.fleet = fleet
        return backend

    # ------------------------------------------------------------------ Backend
    async def start(self) -> None:
        await self.pool.check_all()  # the configured instances that are up are healthy before the first request
        self.pool.start()
        if self.fleet is not None:
            self._supervisor = asyncio.get_running_loop().create_task(self._supervise(), name="kvflow-router-fleet")
        if self.balancer is not None:
            self._balancing = asyncio.get_running_loop().create_task(self._balance(), name="kvflow-router-roles")
        self._started = True

    def balance(self, cfg: BalanceConfig) -> None:
        """Move instances between the P/D pools as the measured TTFT and TPOT call for it (`kvflow.router.roles`):
        from `start` on, or at once when called on the event loop of a router already serving."""
        self.balancer = RoleBalancer(cfg, self.pool)
        if self._started and self._balancing is None:
            self._balancing = asyncio.get_running_loop().create_task(self._balance(), name="kvflow-router-roles")

    async def _balance(self) -> None:
        while True:
            await asyncio.sleep(self.balancer.cfg.interval_s)
            try:
                pressures = self.balancer.pressures()
                moved = self.balancer.decide()
                if moved:
                    log.info("P/D pools: %s moves to the %s pool (p90 TTFT and TPOT over their SLOs: %.2f, %.2f)",
                             *moved, *pressures)
            except Exception:  # one failed decision must not stop the balancing
                log.exception("re-balancing the P/D pools failed")

    def scale(self, cfg: ScalingConfig, perf: PerfModel, instance: SimConfig) -> None:
        """Size the fleet for the measured load from now on (`kvflow.router.scaling`): `perf` and `instance` are one
        instance's step times and scheduler, as the simulated cluster runs them. Call before `start`."""
        if self.fleet is None:
            raise ValueError("scaling needs instances the router started (--launch)")
        self.meter = LoadMeter(cfg.window_s)
        own = {i.url for i in self.fleet.instances}
        pd = any(i.role != "mixed" for u, i in self.pool.instances.items() if u in own)  # its P/D pools: sized per role
        fixed = 0 if pd else sum(1 for u in self.pool.instances if u not in own)
        self.autoscaler = Autoscaler(cfg, perf, instance, self.config, self.fleet, self.pool, self.meter, fixed, pd)

    async def _supervise(self) -> None:
        """Start again the router's own instances that exited (the health check then brings them back), and size the
        fleet every `ScalingConfig.interval_s` when scaling (the simulated trials on a thread)."""
        loop = asyncio.get_running_loop()
        next_decision = loop.time() + (self.autoscaler.cfg.interval_s if self.autoscaler else 0.0)
        trials = None
        if self.autoscaler is not None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            from kvflow.router.scaling import instances_needed

            trials = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        try:
            while True:
                await asyncio.sleep(self.config.health_interval_s)
                try:
                    await asyncio.to_thread(self.fleet.supervise)  # (a Ray fleet's calls wait on its actors)
                    self._follow_moves()
                    if trials is not None and loop.time() >= next_decision:
                        self.autoscaler.step(await loop.run_in_executor(trials, instances_needed, *self.autoscaler.trial()))
                        next_decision = loop.time() + self.autoscaler.cfg.interval_s
                except Exception:  # one failed start or decision must not stop the supervision
                    log.exception("supervising the router's instances failed")
        finally:
            if trials is not None:
                trials.shutdown(wait=False, cancel_futures=True)

    def _follow_moves(self) -> None:
        """The pool follows the router's instances that started again at a new URL (a Ray fleet's, on another node):
        the old URL leaves, the new one joins in the same role, used once its health check passes."""
        for inst in self.fleet.instances:
            if inst.moved_from is not None:
                old = self.pool.instances.get(inst.moved_from)
                self.pool.remove(inst.moved_from)
                self.pool.add_unchecked(inst.url, old.role if old is not None else "mixed")
                log.info("instance %s moved to %s", inst.moved_from, inst.url)
                inst.moved_from = None

    async def shutdown(self) -> None:
        self._started = False
        for task in (self._supervisor, self._balancing):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.pool.stop()
        await self.client.aclose()
        await self.streams.aclose()
        if self.fleet is not None:  # the instances drain what the router no longer waits for
            await asyncio.to_thread(self.fleet.close)

    def healthy(self) -> bool:
        return self._started and any(i.healthy for i in self.pool.instances.values())

    def degraded(self) -> str | None:
        out = [i.url for i in self.pool.instances.values() if not i.healthy]
        return f"{len(out)} of {len(self.pool.instances)} instances out: {', '.join(out)}" if out else None

    def stats(self) -> BackendStats:
        insts = self.pool.instances.values()
        return BackendStats(waiting_requests=sum(i.waiting for i in insts),
                            running_requests=sum(len(i.flights) for i in insts),
                            prompt_tokens_total=self._prompt_tokens, generated_tokens_total=self._generated_tokens)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       kv_source: str | None = None) -> AsyncIterator[RequestOutput]:
        req = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids,
                      IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens))
        route = self.pool.route(req.token_ids, params.max_tokens)
        failed: set[str] = set()
        self._prompt_tokens += len(prompt_token_ids)
        if self.meter is not None:  # the load the autoscaler sizes the fleet for
            self.meter.arrived()
        # (`kv_source`, a client's `kv_transfer_params`, is not used: the router decides where prompts run)
        prefilled_on: str | None = None  # P/D pools: the prefill instance that ran the prompt (its KV is pulled there)
        while True:
            generated = len(req.output_token_ids)
            prefill, roles = self.pool.phase(generated, prefilled_on)  # P/D pools: the prompt's phase, then the rest
            try:
                inst = self.pool.choose(route, failed, roles)
            except NoInstance as e:
                if not generated:
                    raise BackendUnavailable(str(e)) from None
                req.finish("error", f"{e}; {generated} tokens were generated")
                yield req.take_output()
                return
            flight = self.pool.open(inst, route, generated)
            body = request_body(self.model_name, list(req.token_ids), params, generated)
            if prefill:
                body.update(max_tokens=1, min_tokens=min(body["min_tokens"], 1))
            elif prefilled_on is not None and prefilled_on != inst.url:
                body["kv_transfer_params"] = {"source": prefilled_on}
            stream = _stream(self.streams, inst, body)
            handed = False  # the prefill instance gave the first token: on to a decode instance
            try:
                async for chunk in stream:
                    reason = None
                    for t in chunk.token_ids:
                        reason = req.append_token(t, self.max_model_len)
                        self._generated_tokens += 1
                        if reason:
                            break
                    handed = prefill and not reason and chunk.finish_reason == "length" and len(req.output_token_ids) > 0
                    reason = reason or (None if handed else _instance_finish(chunk.finish_reason))
                    if reason:
                        req.finish(reason)
                    self.pool.advance(inst, flight, len(req.output_token_ids))
                    if req.is_finished:
                        whole = self.pool.route(req.token_ids, 0, route.block_hashes)
                        self.pool.remember(inst, whole.block_hashes)  # its output's blocks too
                        if chunk.finish_reason is not None:  # the instance is done too: read its [DONE] before the
                            async for _ in stream:  # last output (the API closes this generator after it), so the
                                pass  # connection goes back to the pool; else closing the stream aborts it there
                        if self.meter is not None:
                            self.meter.finished(len(prompt_token_ids), len(req.output_token_ids))
                        n = len(req.output_token_ids)
                        if self.balancer is not None and prefilled_on is not None and n > 1:  # went through both pools
                            self.balancer.observe(req.first_token_time - req.arrival_time,
                                                  (time.monotonic() - req.first_token_time) / (n - 1))
                        yield req.take_output()
                        return
                    if chunk.token_ids:
                        yield req.take_output()
                    if handed:
                        async for _ in stream:  # its [DONE]
                            pass
                        break
                if not handed:
                    raise InstanceFailed("the stream ended before the request finished")
            except InstanceRefused as e:
                if e.status < 500 and not generated:
                    raise ValueError(e.args[0]) from None  # the request itself: 400 (or 404) to the client
                log.warning("instance %s refused request %s (%d): %s", inst.url, request_id, e.status, e.args[0])
            except InstanceFailed as e:
                self.pool.fail(inst, str(e))
            finally:
                await stream.aclose()
                self.pool.close(inst, flight)
            if handed:
                prefilled_on = inst.url
                self.pool.handoffs_total += 1
                route = self.pool.route(req.token_ids, params.max_tokens - len(req.output_token_ids), route.block_hashes)
                continue
            failed.add(inst.url)
            if len(failed) > self.config.max_resends:
                if not req.output_token_ids:
                    raise BackendUnavailable(f"request {request_id} failed on {len(failed)} instances")
                req.finish("error", f"failed on {len(failed)} instances")
                yield req.take_output()
                return
            self.pool.failovers_total += 1
            self.pool.resent_tokens_total += len(req.output_token_ids)
            route = self.pool.route(req.token_ids, params.max_tokens - len(req.output_token_ids), route.block_hashes)

    # ------------------------------------------------------------------ /metrics
    def metric_families(self) -> Iterable[Metric]:
        insts = sorted(self.pool.instances.values(), key=lambda i: i.url)

        def per_instance(kind, name: str, help: str, value) -> Metric:
            family = kind(name, help, labels=["instance"])
            for i in insts:
                family.add_metric([i.url], value(i))
            return family

        return [
            per_instance(GaugeMetricFamily, "kvflow_router_instance_up", "1 while the instance is in the pool's rotation",
                         lambda i: int(i.healthy)),
            per_instance(GaugeMetricFamily, "kvflow_router_instance_in_flight", "Requests the router has open there",
                         lambda i: len(i.flights)),
            per_instance(GaugeMetricFamily, "kvflow_router_instance_queue",
                         "Requests waiting + running there, as its last /metrics said", lambda i: i.waiting + i.running),
            per_instance(CounterMetricFamily, "kvflow_router_routed_total", "Requests (and re-sent requests) sent there",
                         lambda i: i.routed_total),
            per_instance(CounterMetricFamily, "kvflow_router_instance_failures_total", "Times the instance was taken out",
                         lambda i: i.failures_total),
            CounterMetricFamily("kvflow_router_handoffs_total",
                                "Requests moved from a prefill instance to a decode instance after their first token",
                                value=self.pool.handoffs_total),
            CounterMetricFamily("kvflow_router_failovers_total", "Requests re-sent to another instance after a failure",
                                value=self.pool.failovers_total),
            CounterMetricFamily("kvflow_router_resent_tokens_total",
                                "Generated tokens re-sent as prompt with those requests", value=self.pool.resent_tokens_total),
        ]


def _instance_finish(reason: str | None) -> str | None:
    """The instance's finish reason where the router's own checks did not already end the request: "stop" or
    "length" end it as on the instance; "error" or "abort" mean the instance failed it (raises)."""
    if reason in (None, "stop", "length"):
        return reason
    raise InstanceFailed(f"the instance ended the request with {reason!r}")
