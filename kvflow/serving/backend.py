"""What the HTTP API needs from whatever generates tokens: the `Backend` interface and its single-process form.

The API layer (`kvflow/api/`) talks only to a `Backend`. Two implement it: `EngineBackend` here
(one `LLMEngine` in a background thread — the depth-1 colocated case) and the distributed
controller (`kvflow/controller/`), which drives pipeline-stage worker processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue as thread_queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvflow.config import EngineConfig
from kvflow.engine.engine import LLMEngine
from kvflow.kv.manager import PrefixCacheStats
from kvflow.sched.request import RequestOutput
from kvflow.sched.sampling import SamplingParams
from kvflow.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class BackendUnavailable(Exception):
    """The backend cannot take a request now (pipeline failed, recovering, shutting down): the API answers 503.

    Raised by `Backend.generate` before it yields anything; the request was not queued.
    """


@dataclass
class BackendStats:
    """Point-in-time numbers for /metrics (counters only grow)."""

    waiting_requests: int = 0
    running_requests: int = 0
    generated_tokens_total: int = 0
    prompt_tokens_total: int = 0
    kv_bytes_streamed_total: int = 0
    hidden_ring_bytes_total: int = 0  # hidden states passed between stages through shared memory (not on messages)
    worker_busy_seconds: dict[str, float] = field(default_factory=dict)  # worker name -> busy time
    workers_alive: dict[str, bool] = field(default_factory=dict)
    dropped_messages_total: dict[str, int] = field(default_factory=dict)  # port owner -> messages dropped
    preemptions_total: int = 0
    worker_failures_total: int = 0
    recoveries_total: int = 0
    recovery_seconds_total: float = 0.0
    recovering: bool = False
    replicated_bytes_total: int = 0
    replication_lag_tokens: int = 0
    resumed_requests_total: int = 0
    recomputed_tokens_total: int = 0
    # (block pool, tier) -> its prefix cache's counters; pools: "engine", or the controller's pipelines
    prefix_cache: dict[tuple[str, str], PrefixCacheStats] = field(default_factory=dict)
    # KV of the pools a request decodes in (the engine's; a controller's colocated or token pipelines), in tokens:
    # room for new tokens (free and evictable cached blocks) and all of it; None where there is no such pool
    kv_free_tokens: int | None = None
    kv_capacity_tokens: int | None = None
    # KV blocks pulled from other instances (the router's P/D pools): received, and asked for in vain (recomputed)
    kv_pulled_blocks: int = 0
    kv_pull_missed_blocks: int = 0
    kv_pull_seconds: float = 0.0


class Backend(Protocol):
    """Contract used by the HTTP API.

    - `generate` validates (raising ValueError for input that can never run: too long, bad ids;
      `BackendUnavailable` when it cannot serve right now) *before* yielding anything, then yields
      `RequestOutput` deltas until one has finished=True.
      A request that fails inside the system (e.g. its worker died) ends with finish_reason
      "error" and `error` set — it never hangs and is never silently dropped.
    - Cancelling the iterator (client went away) aborts the request and frees its resources.
    - `healthy()` is False while the backend cannot serve (the API then answers 503 without calling
      `generate`); `degraded()` is why it serves only with a delay now (recovering from a worker's
      loss: requests queue), else None; `stats()` feeds /metrics. All are called on the event loop
      and must not block.
    - `kv_source` (the router's P/D pools): another instance that computed this prompt, whose KV blocks the
      backend may pull instead of computing them (the engine does, into its host tier; others recompute).
    - Nothing here may block the event loop for longer than a queue operation: in particular no lock
      that is held across an engine step.
    """

    model_name: str
    max_model_len: int
    tokenizer: Tokenizer

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 kv_source: str | None = None) -> AsyncIterator[RequestOutput]: ...

    def healthy(self) -> bool: ...

    def degraded(self) -> str | None: ...

    def stats(self) -> BackendStats: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...


async def drain(queue: asyncio.Queue, done: Callable[[bool], None]) -> AsyncIterator[RequestOutput]:
    """Yield the outputs a backend puts on `queue` until one is final; then, or when the consumer
    stops early (client gone), call `done(finished)` so the backend can abort and clean up."""
    finished = False
    try:
        while not finished:
            out: RequestOutput = await queue.get()
            finished = out.finished
            yield out
    finally:
        done(finished)


class Deliveries:
    """Outputs for event-loop queues, collected on a backend's own thread and handed over in one
    `call_soon_threadsafe` per loop (`flush`, once per step): each call wakes the loop through its
    self-pipe and hands the GIL over, so one per output (64 a step at batch 64) cost more than the
    puts themselves. Each queue still gets its outputs in order."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}

    def add(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, out: RequestOutput) -> None:
        self._by_loop.setdefault(loop, []).append((queue, out))

    def flush(self) -> None:
        by_loop, self._by_loop = self._by_loop, {}
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: nobody is reading those queues any more
                pass


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


class EngineBackend:
    """One `LLMEngine` owned by a background thread; the event loop only talks to it through queues.

    `generate` posts the request to the thread's inbox and awaits its admission (or the ValueError
    that rejects it); aborts go through the same inbox. The engine itself is touched only by its
    thread, so the event loop never waits for a step to finish.

    `from_config` (what `kvflow serve` uses) also builds the engine on that thread, so that every
    torch operation of the process runs on one thread and OpenMP keeps one team of workers. libgomp
    gives each thread that starts parallel regions a team of its own; once a process has more
    OpenMP threads than CPUs (the main thread's team from loading the model, plus the engine
    thread's) it stops spinning between regions and puts its workers to sleep after each one, and
    every region then pays a wake-up, which made every decode step and every small op markedly slower
    (docs/results.md, 2026-11-24 serving, "one OpenMP team per process").
    """

    @classmethod
    def from_config(cls, config: EngineConfig, model_name: str | None = None,
                    api_key: str | None = None) -> "EngineBackend":
        """Load the model and build the engine on the engine thread itself (see the class note);
        returns once it is built, raising what building raised. `start()` then runs it. `api_key`: the one this
        deployment's instances share, sent with this engine's pulls of KV from the others."""
        built: dict = {}
        ready, go = threading.Event(), threading.Event()

        def thread_main() -> None:
            try:
                engine = LLMEngine.from_config(config)
                if engine.runner.tiers is not None:
                    engine.runner.tiers.puller.api_key = api_key
                built["backend"] = backend = cls(engine, model_name or engine.model.cfg.name)
            except BaseException as e:  # raised by from_config, in the caller's thread
                built["error"] = e
                return
            finally:
                ready.set()
            go.wait()
            backend._loop()

        thread = threading.Thread(target=thread_main, name="kvflow-engine", daemon=True)
        thread.start()
        ready.wait()
        if "error" in built:
            raise built["error"]
        self = built["backend"]
        self._thread, self._go = thread, go
        return self

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        if engine.tokenizer is None:
            raise ValueError("serving needs a checkpoint with a tokenizer")
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self._inbox: thread_queue.SimpleQueue[Callable[[], None]] = thread_queue.SimpleQueue()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # engine thread only
        self._deliveries = Deliveries()  # engine thread only
        self._stop = False
        self._closed = False  # set by the engine thread when it has stopped taking jobs
        self._close_lock = threading.Lock()  # only orders `_post` against closing; never held across a step
        self._thread: threading.Thread | None = None
        self._go: threading.Event | None = None  # from_config: the built engine's thread waits for start()
        self._busy = 0.0
        self._gen_tokens = 0
        self._prompt_tokens = 0

    async def start(self) -> None:
        if self._go is not None:  # the thread that built the engine runs it
            self._go.set()
            return
        self._thread = threading.Thread(target=self._loop, name="kvflow-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._go is not None:
            self._go.set()  # (never started: the loop sees the stop at once)
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5.0)

    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    def degraded(self) -> str | None:
        return None

    def stats(self) -> BackendStats:
        sched = self.engine.scheduler
        return BackendStats(
            waiting_requests=len(sched.waiting),
            running_requests=len(sched.running),
            generated_tokens_total=self._gen_tokens,
            prompt_tokens_total=self._prompt_tokens,
            worker_busy_seconds={"engine": self._busy},
            workers_alive={"engine": self.healthy()},
            prefix_cache={("engine", tier): c for tier, c in self.engine.kv_manager.tier_stats().items()},
            kv_free_tokens=self.engine.kv_manager.num_free_blocks * self.engine.kv_manager.block_size,
            kv_capacity_tokens=self.engine.kv_manager.capacity_tokens,
            kv_pulled_blocks=self.engine.kv_manager.pulled[1],
            kv_pull_missed_blocks=self.engine.kv_manager.pulled[0],
            kv_pull_seconds=tiers.moved["from_remote"][1] if (tiers := self.engine.runner.tiers) is not None else 0.0,
        )

    def kv_blocks(self, body: bytes) -> list | None:
        """Any thread (the API's, for another instance's pull, `kvflow.streaming.kv_pull`): the frame of the KV of the
        leading blocks a pull body names that this engine's device pool holds, or None; ValueError for a bad body."""
        from kvflow.streaming.kv_pull import parse_pull, read_blocks

        hashes = parse_pull(body, self.engine.kv_cache.layout)
        return read_blocks(self.engine.kv_cache, self.engine.kv_manager, hashes)

    def _post(self, job: Callable[[], None]) -> None:
        with self._close_lock:
            if self._closed:
                raise BackendUnavailable("the engine has been shut down")
            self._inbox.put(job)
        self._wake.set()

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       kv_source: str | None = None) -> AsyncIterator[RequestOutput]:
        if not self.healthy():
            raise BackendUnavailable("the engine is not running")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        admitted: asyncio.Future = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if admitted.done():  # cancelled: the client left while waiting
                return
            if error is not None:
                admitted.set_exception(error)
            else:
                admitted.set_result(None)

        def add() -> None:  # engine thread
            try:
                self.engine.add_request(prompt_token_ids, params, request_id, kv_source)
            except Exception as e:  # ValueError: the client's fault; anything else is reported the same way
                loop.call_soon_threadsafe(settle, e)
                return
            self._queues[request_id] = (loop, queue)
            self._prompt_tokens += len(prompt_token_ids)
            loop.call_soon_threadsafe(settle, None)

        self._post(add)
        try:
            await admitted
        except asyncio.CancelledError:  # the client left while the request was waiting for admission
            with contextlib.suppress(BackendUnavailable):
                self._post(lambda: self._forget(request_id, finished=False))
            raise

        def forget(finished: bool) -> None:
            with contextlib.suppress(BackendUnavailable):  # closed: the thread already failed everything
                self._post(lambda: self._forget(request_id, finished))

        async for out in drain(queue, forget):
            yield out

    def _forget(self, request_id: str, finished: bool) -> None:  # engine thread
        self._queues.pop(request_id, None)
        if not finished:
            self.engine.abort_request(request_id)

    def _run_inbox(self) -> None:
        while True:
            try:
                job = self._inbox.get_nowait()
            except thread_queue.Empty:
                return
            job()

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._run_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._step()
        finally:  # stopped (or crashed): take no more jobs, admit what was posted, then fail it all loudly
            with self._close_lock:
                self._closed = True
            self._run_inbox()
            self._fail_all("the engine was shut down" if self._stop else "the engine thread crashed")

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outs = self.engine.step()
        except Exception as e:  # a bug, not bad input: fail every request loudly, keep the thread alive
            log.exception("engine step failed")
            self._fail_all(f"engine step failed: {e}")
            return
        self._busy += time.perf_counter() - t0
        for out in outs:
            self._gen_tokens += len(out.new_token_ids)
            target = self._queues.get(out.request_id)
            if target is not None:
                self._deliveries.add(*target, out)
        self._deliveries.flush()

    def _fail_all(self, message: str) -> None:  # engine thread
        for rid, (loop, q) in list(self._queues.items()):
            req = self.engine.requests.get(rid)
            self.engine.abort_request(rid)
            if req is not None:
                req.finish("error", message)
                loop.call_soon_threadsafe(q.put_nowait, req.take_output())
