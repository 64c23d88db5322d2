"""What the HTTP API needs from whatever generates tokens: the `Backend` interface and its single-process form.

The API layer (`kvflow/api/`) talks only to a `Backend`. Two implement it: `EngineBackend` here
(one `LLMEngine` in a background thread — the depth-1 colocated case) and the distributed
controller (`kvflow/controller/`), which drives pipeline-stage worker processes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvflow.engine.engine import LLMEngine
from kvflow.sched.request import RequestOutput
from kvflow.sched.sampling import SamplingParams
from kvflow.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class BackendStats:
    """Point-in-time numbers for /metrics (counters only grow)."""

    waiting_requests: int = 0
    running_requests: int = 0
    generated_tokens_total: int = 0
    prompt_tokens_total: int = 0
    kv_bytes_streamed_total: int = 0
    worker_busy_seconds: dict[str, float] = field(default_factory=dict)  # worker name -> busy time
    workers_alive: dict[str, bool] = field(default_factory=dict)


class Backend(Protocol):
    """Contract used by the HTTP API.

    - `generate` validates (raising ValueError for input that can never run: too long, bad ids)
      *before* yielding anything, then yields `RequestOutput` deltas until one has finished=True.
      A request that fails inside the system (e.g. its worker died) ends with finish_reason
      "error" and `error` set — it never hangs and is never silently dropped.
    - Cancelling the iterator (client went away) aborts the request and frees its resources.
    - `healthy()` is False while the backend cannot serve; `stats()` feeds /metrics.
    """

    model_name: str
    max_model_len: int
    tokenizer: Tokenizer

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]: ...

    def healthy(self) -> bool: ...

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


class EngineBackend:
    """One `LLMEngine` stepped by a background thread; outputs are handed to asyncio queues."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        if engine.tokenizer is None:
            raise ValueError("serving needs a checkpoint with a tokenizer")
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self._busy = 0.0
        self._gen_tokens = 0
        self._prompt_tokens = 0
        self._error: str | None = None

    async def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvflow-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5.0)

    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def stats(self) -> BackendStats:
        sched = self.engine.scheduler
        return BackendStats(
            waiting_requests=len(sched.waiting),
            running_requests=len(sched.running),
            generated_tokens_total=self._gen_tokens,
            prompt_tokens_total=self._prompt_tokens,
            worker_busy_seconds={"engine": self._busy},
            workers_alive={"engine": self.healthy()},
        )

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self.engine.add_request(prompt_token_ids, params, request_id)  # ValueError propagates
            self._queues[request_id] = (loop, queue)
            self._prompt_tokens += len(prompt_token_ids)
        self._wake.set()

        def forget(finished: bool) -> None:
            with self._lock:
                self._queues.pop(request_id, None)
                if not finished:
                    self.engine.abort_request(request_id)

        async for out in drain(queue, forget):
            yield out

    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                busy = self.engine.has_unfinished()
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            try:
                with self._lock:
                    outs = self.engine.step()
                    targets = [(o, self._queues.get(o.request_id)) for o in outs]
            except Exception as e:  # a bug, not bad input: fail every request loudly, keep the thread alive
                log.exception("engine step failed")
                self._fail_all(f"engine step failed: {e}")
                continue
            self._busy += time.perf_counter() - t0
            for out, target in targets:
                self._gen_tokens += len(out.new_token_ids)
                if target is not None:
                    loop, q = target
                    loop.call_soon_threadsafe(q.put_nowait, out)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            for rid, (loop, q) in list(self._queues.items()):
                req = self.engine.requests.get(rid)
                self.engine.abort_request(rid)
                if req is not None:
                    req.finish("error", message)
                    loop.call_soon_threadsafe(q.put_nowait, req.take_output())
