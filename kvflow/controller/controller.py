"""The controller: a `Backend` that serves requests with pipelines of worker processes.

One thread owns all scheduling state. Its loop, per event: `handle(message)` (a microbatch's
logits, KV arrival, heartbeat, worker error), then `schedule()` (fill free microbatch slots).
Colocated: `depth` microbatches circulate through one pipeline; each returns to the controller
after the last stage, gets its next tokens sampled, and goes round again; a microbatch whose
requests all finished is replaced by a new one (microbatch-level scheduling, DéjàVu's improved
baseline). Disaggregated: prompt microbatches go through the prompt pipeline, whose workers stream
each layer's KV to the token workers; a request joins a token microbatch once its first token is
sampled and every token stage has reported its KV complete.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch
import zmq

from kvflow.controller.messages import Free, Heartbeat, KVArrived, Ready, SeqStep, Shutdown, Step, StepResult, Wire, WorkerError, decode, encode
from kvflow.controller.pipeline import ClusterConfig, Pipeline, StageHandle, even_split, spawn_stage
from kvflow.sched.request import Request, RequestOutput
from kvflow.sched.sampling import SamplingParams, sample
from kvflow.sched.scheduler import Limits, validate
from kvflow.kv.manager import KVCacheManager
from kvflow.model.loader import load_config
from kvflow.model.tokenizer import IncrementalDetokenizer, Tokenizer
from kvflow.serving.backend import BackendStats, drain

log = logging.getLogger(__name__)


@dataclass
class Microbatch:
    id: int
    pipeline: Pipeline
    requests: list[Request]
    steps: int = 0


class Controller:
    """Implements `kvflow.serving.backend.Backend` over worker processes (see module docstring)."""

    def __init__(self, cfg: ClusterConfig, model_name: str | None = None, spawn: bool = True) -> None:
        self.cfg = cfg
        mc, directory = load_config(cfg.model)  # converts a GGUF once, before the workers look for it
        self.tokenizer = Tokenizer(directory)
        self.model_name = model_name or mc.name
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.vocab_size = mc.vocab_size
        eos = set(mc.eos_token_ids) | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.eos_token_ids = tuple(sorted(eos))
        self.spawn = spawn
        self.pipelines: list[Pipeline] = []
        for name, role, depth, mbs in cfg.pipelines():
            stages = [StageHandle(f"{name}-{i}", layers) for i, layers in enumerate(even_split(mc.num_layers, depth))]
            self.pipelines.append(Pipeline(name, role, mbs, stages, KVCacheManager(cfg.num_kv_blocks, cfg.block_size), depth))
        self.stages = {s.name: s for p in self.pipelines for s in p.stages}
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        port = self.inbox.bind_to_random_port(f"tcp://{cfg.host}")
        self.address = f"tcp://{cfg.host}:{port}"
        self.to_stage: dict[str, zmq.Socket] = {}
        # scheduling state (owned by the loop thread once started)
        self.submissions: deque = deque()
        self.waiting: deque[Request] = deque()
        self.ready: deque[Request] = deque()  # disaggregated: first token sampled, KV at every token stage
        self.kv_pending: dict[str, set[str]] = {}  # rid -> token stages whose KV has not arrived
        self.prompt_blocks: dict[str, list[int]] = {}
        self.in_flight: dict[int, Microbatch] = {}
        self.sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # who to tell
        self.reqs: dict[str, Request] = {}  # every request still holding (or about to hold) KV blocks
        self.mb_ids = itertools.count()
        self.failure: str | None = None
        self.generated = 0
        self.prompt_tokens = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ Backend: life cycle
    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.start_blocking)

    def start_blocking(self) -> None:
        if self.spawn:
            for p in self.pipelines:
                for s in p.stages:
                    s.process = spawn_stage(self.cfg, self.address, s.name, p.role, s.layers)
        self._await_ready()
        token = self.pipelines[-1]
        for p in self.pipelines:
            for i, s in enumerate(p.stages):
                nxt = p.stages[i + 1].step_addr if i + 1 < p.depth else self.address
                peers = [(t.layers[0], t.layers[1], t.kv_addr) for t in token.stages] if p.role == "prompt" else []
                self.to_stage[s.name].send_multipart(encode(Wire(nxt, peers)))
        now = time.monotonic()
        for s in self.stages.values():
            s.last_heartbeat = now
        self._thread = threading.Thread(target=self._loop, name="kvflow-controller", daemon=True)
        self._thread.start()

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self.cfg.start_timeout_s
        pending = set(self.stages)
        while pending:
            for name in pending:
                proc = self.stages[name].process
                if proc is not None and proc.poll() is not None:
                    self._kill_all()
                    raise RuntimeError(f"worker {name} exited with code {proc.returncode} during start-up")
            if time.monotonic() > deadline:
                self._kill_all()
                raise RuntimeError(f"workers {sorted(pending)} did not start within {self.cfg.start_timeout_s}s")
            if not self.inbox.poll(200):
                continue
            msg, _ = decode(self.inbox.recv_multipart())
            if isinstance(msg, Ready) and msg.name in pending:
                s = self.stages[msg.name]
                s.step_addr, s.kv_addr = msg.step_addr, msg.kv_addr
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(msg.step_addr)
                self.to_stage[msg.name] = sock
                pending.discard(msg.name)

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown_blocking)

    def shutdown_blocking(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        for sock in self.to_stage.values():
            try:
                sock.send_multipart(encode(Shutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + 5.0
        for s in self.stages.values():
            if s.process is not None:
                try:
                    s.process.wait(max(0.1, deadline - time.monotonic()))
                except Exception:
                    s.process.kill()
                    s.process.wait()
        self.ctx.destroy(linger=0)

    def _kill_all(self) -> None:
        for s in self.stages.values():
            if s.process is not None and s.process.poll() is None:
                s.process.kill()

    # ------------------------------------------------------------------ Backend: requests
    def healthy(self) -> bool:
        return self.failure is None and self._thread is not None and self._thread.is_alive()

    def stats(self) -> BackendStats:
        return BackendStats(
            waiting_requests=len(self.waiting) + len(self.ready),
            running_requests=sum(len(m.requests) for m in list(self.in_flight.values())),
            generated_tokens_total=self.generated,
            prompt_tokens_total=self.prompt_tokens,
            kv_bytes_streamed_total=sum(s.kv_bytes_sent for s in self.stages.values()),
            worker_busy_seconds={s.name: s.busy_s for s in self.stages.values()},
            workers_alive={s.name: s.alive for s in self.stages.values()},
        )

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        req = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, detok)
        validate(req, Limits(self.max_model_len, self.vocab_size), [p.kv for p in self.pipelines])
        queue: asyncio.Queue = asyncio.Queue()
        self.submissions.append(("add", req, (asyncio.get_running_loop(), queue)))

        def done(finished: bool) -> None:
            if not finished:
                self.submissions.append(("abort", req, None))

        async for out in drain(queue, done):
            yield out

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(5):
                while True:
                    try:
                        frames = self.inbox.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(*decode(frames))
            self._take_submissions()
            self._check_liveness()
            if self.failure is None:
                self._schedule()

    def _take_submissions(self) -> None:
        while self.submissions:
            kind, req, sink = self.submissions.popleft()
            if kind == "add":
                self.sinks[req.request_id] = sink
                self.reqs[req.request_id] = req
                self.prompt_tokens += req.num_prompt_tokens
                if self.failure is not None:
                    self._finish(req, "error", self.failure)
                else:
                    self.waiting.append(req)
            elif not req.is_finished:  # abort: free now unless a step still writes its KV
                req.finish("abort")
                for q in (self.waiting, self.ready):
                    if req in q:
                        q.remove(req)
                self._release(req)
                self.sinks.pop(req.request_id, None)

    def _handle(self, msg, tensor: torch.Tensor | None) -> None:
        if isinstance(msg, StepResult):
            self._on_result(msg, tensor)
        elif isinstance(msg, KVArrived):
            for rid in msg.rids:
                waiting_for = self.kv_pending.get(rid)
                if waiting_for is None:
                    continue
                waiting_for.discard(msg.name)
                if not waiting_for:
                    del self.kv_pending[rid]
                    req = self.reqs.get(rid)
                    if req is None:
                        continue
                    if req.is_finished:
                        self._release(req)
                    elif req.output_token_ids:
                        self.ready.append(req)
        elif isinstance(msg, Heartbeat):
            s = self.stages.get(msg.name)
            if s is not None:
                s.last_heartbeat = time.monotonic()
                s.busy_s, s.kv_bytes_sent = msg.busy_s, msg.kv_bytes_sent
        elif isinstance(msg, WorkerError):
            self._fail(f"worker {msg.name} failed: {msg.message}")

    # ------------------------------------------------------------------ scheduling
    def _schedule(self) -> None:
        first = self.pipelines[0]
        while self._count(first) < first.max_in_flight and self.waiting:
            reqs = self._admit(first)
            if not reqs:
                break
            kv_to = {}
            if first.role == "prompt":
                kv_to = {r.request_id: r.block_ids for r in reqs}
                for r in reqs:
                    self.kv_pending[r.request_id] = {s.name for s in self.pipelines[1].stages}
            self._send(Microbatch(next(self.mb_ids), first, reqs), prompt=True, kv_to=kv_to)
        if len(self.pipelines) == 2:
            token = self.pipelines[1]
            while self._count(token) < token.max_in_flight and self.ready:
                reqs = [self.ready.popleft() for _ in range(min(token.microbatch_size, len(self.ready)))]
                self._send(Microbatch(next(self.mb_ids), token, reqs), prompt=False)

    def _count(self, p: Pipeline) -> int:
        return sum(1 for m in self.in_flight.values() if m.pipeline is p)

    def _admit(self, p: Pipeline) -> list[Request]:
        """Up to a microbatch of waiting requests whose KV fits now (blocks reserved for prompt + max_tokens)."""
        reqs: list[Request] = []
        token_kv = self.pipelines[-1].kv
        while self.waiting and len(reqs) < p.microbatch_size:
            r = self.waiting[0]
            total = r.num_prompt_tokens + r.params.max_tokens
            if p.role == "prompt":
                table: list[int] = []
                if not token_kv.can_ensure(r.block_ids, total) or not p.kv.ensure(table, r.num_prompt_tokens):
                    break
                token_kv.ensure(r.block_ids, total)
                self.prompt_blocks[r.request_id] = table
            elif not p.kv.ensure(r.block_ids, total):
                break
            reqs.append(self.waiting.popleft())
        return reqs

    def _send(self, mb: Microbatch, prompt: bool, kv_to: dict[str, list[int]] | None = None) -> None:
        seqs, ids = [], []
        for r in mb.requests:
            if prompt:
                blocks = self.prompt_blocks.get(r.request_id, r.block_ids)
                seqs.append(SeqStep(r.request_id, r.num_prompt_tokens, r.num_prompt_tokens, list(blocks)))
                ids.extend(r.prompt_token_ids)
            else:
                seqs.append(SeqStep(r.request_id, 1, r.num_tokens, list(r.block_ids)))
                ids.append(r.token_ids[-1])
        self.in_flight[mb.id] = mb
        head = mb.pipeline.stages[0].name
        self.to_stage[head].send_multipart(encode(Step(mb.id, mb.steps, seqs, ids, kv_to or {})))

    def _on_result(self, msg: StepResult, logits: torch.Tensor) -> None:
        mb = self.in_flight.pop(msg.mb, None)
        if mb is None:
            return  # a microbatch failed meanwhile
        mb.steps += 1
        live = [(i, r) for i, r in enumerate(mb.requests) if not r.is_finished]
        if live:
            rows = [i for i, _ in live]
            reqs = [r for _, r in live]
            toks = sample(logits[rows], [r.params for r in reqs], [r.sampler for r in reqs], [r.banned_token_ids() for r in reqs])
            for r, t in zip(reqs, toks):
                r.num_computed_tokens = r.num_tokens
                self.generated += 1
                reason = r.append_token(t, self.max_model_len)
                if reason is not None:
                    r.finish(reason)
        for r in mb.requests:  # free before telling the client, so a finished request holds nothing
            if r.is_finished:
                self._release(r)
        for _, r in live:
            self._emit(r)
            if r.is_finished:
                self.sinks.pop(r.request_id, None)
        if mb.pipeline.role == "prompt":
            for r in mb.requests:
                self._release_prompt_blocks(r.request_id)
                if not r.is_finished and r.request_id not in self.kv_pending:
                    self.ready.append(r)
            return
        remaining = [r for r in mb.requests if not r.is_finished]
        if remaining:  # round again; a microbatch with none left frees its slot for a new one
            mb.requests = remaining
            self._send(mb, prompt=False)

    # ------------------------------------------------------------------ endings
    def _emit(self, req: Request) -> None:
        sink = self.sinks.get(req.request_id)
        if sink is not None:
            loop, q = sink
            loop.call_soon_threadsafe(q.put_nowait, req.take_output())

    def _finish(self, req: Request, reason, error: str | None = None) -> None:
        req.finish(reason, error)
        self._emit(req)
        self.sinks.pop(req.request_id, None)

    def _release(self, req: Request) -> None:
        """Free a finished request's blocks unless a microbatch step or a KV transfer may still write them."""
        if any(req in m.requests for m in self.in_flight.values()):
            return
        self._release_prompt_blocks(req.request_id)
        if req.request_id not in self.kv_pending and self.reqs.pop(req.request_id, None) is not None:
            self._release_token_blocks(req)

    def _release_prompt_blocks(self, rid: str) -> None:
        table = self.prompt_blocks.pop(rid, None)
        if table:
            self.pipelines[0].kv.release(table)

    def _release_token_blocks(self, req: Request) -> None:
        if req.block_ids:
            self.pipelines[-1].kv.release(req.block_ids)
        if self.pipelines[-1].role == "token":
            for s in self.pipelines[-1].stages:
                self.to_stage[s.name].send_multipart(encode(Free([req.request_id])))

    # ------------------------------------------------------------------ failures
    def _check_liveness(self) -> None:
        now = time.monotonic()
        for s in self.stages.values():
            if not s.alive:
                continue
            code = s.process.poll() if s.process is not None else None
            if code is not None:
                s.alive = False
                self._fail(f"worker {s.name} (layers {s.layers[0]}-{s.layers[1] - 1}) died (exit code {code})")
            elif now - s.last_heartbeat > self.cfg.heartbeat_timeout_s:
                s.alive = False
                self._fail(f"worker {s.name} stopped sending heartbeats for {now - s.last_heartbeat:.1f}s")

    def _fail(self, message: str) -> None:
        """Fail every unfinished request with a clear error; new requests are refused with it too."""
        log.error("%s; failing all in-flight requests", message)
        if self.failure is None:
            self.failure = message
        victims = list(self.reqs.values())
        self.in_flight.clear()
        self.waiting.clear()
        self.ready.clear()
        for r in victims:
            if not r.is_finished:
                self._finish(r, "error", message)
