"""The controller: a `Backend` that serves requests with pipelines of worker processes.

It is an executor of the one scheduling core (`kvflow.sched`): each pipeline has a `Scheduler`, and
the controller keeps up to `depth` of its batches in flight (a batch queue, as vLLM does for
pipeline parallelism). One thread owns all state; per loop: handle messages (a batch's logits →
sample → `scheduler.update`; KV arrivals; heartbeats), take new and aborted requests, check
liveness, then `scheduler.schedule()` while a pipeline has a free slot and send each batch to its
stage 0 as a delta `Step` with the current epoch.

Colocated: one pipeline, role "both" (continuous batching with chunked prefill and preemption, or
the "microbatch" baseline policy). Disaggregated: a prompt pipeline (role "prompt") whose admission
reserves the blocks the prompt's KV will occupy on the token side; the KV connector's plan rides on
the prompt step and the prompt workers stream each layer's KV as it is written; a request joins
the token pipeline (role "token") once its first token is sampled and every token stage reported
its KV complete. A request preempted on the token side is recomputed by the prompt pipeline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator

import torch
import zmq

from kvflow.config import ClusterConfig, WorkerSpec, to_dict
from kvflow.controller.launcher import Launcher, SubprocessLauncher
from kvflow.controller.pipeline import Pipeline, StageHandle, even_split
from kvflow.kv.manager import KVCacheManager
from kvflow.model.loader import load_config
from kvflow.model.tokenizer import IncrementalDetokenizer, Tokenizer
from kvflow.sched.request import Request, RequestOutput
from kvflow.sched.sampling import SamplingParams, sample
from kvflow.sched.scheduler import Limits, Scheduler, SchedulerOutput, validate
from kvflow.serving.backend import BackendStats, BackendUnavailable, drain
from kvflow.streaming.connector import plan_handoff
from kvflow.wire import (
    Heartbeat, Hello, KVArrived, KVOut, Ready, Reset, SeqStep, Setup, Shutdown, Step, StepResult, Wire, WireError, WorkerError,
    decode, encode, new_secret,
)

log = logging.getLogger(__name__)


class StartError(RuntimeError):
    """A worker did not come up (exited, reported an error, or timed out)."""


class Controller:
    """Implements `kvflow.serving.backend.Backend` over worker processes (see module docstring)."""

    def __init__(self, cfg: ClusterConfig, model_name: str | None = None, launcher: Launcher | None = None) -> None:
        self.cfg = cfg
        ecfg = cfg.engine
        mc, directory = load_config(ecfg.model)  # converts a GGUF once, before the workers look for it
        self.tokenizer = Tokenizer(directory)
        self.model_name = model_name or mc.name
        self.max_model_len = min(ecfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.vocab_size = mc.vocab_size
        self.limits = Limits(self.max_model_len, mc.vocab_size)
        eos = set(mc.eos_token_ids) | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.eos_token_ids = tuple(sorted(eos))
        self.launcher = launcher if launcher is not None else SubprocessLauncher()
        self.secret = new_secret()
        self.epoch = 0
        self.pipelines: list[Pipeline] = []
        for spec in cfg.pipelines():
            stages = [StageHandle(f"{spec.name}-{i}", i, layers) for i, layers in enumerate(even_split(mc.num_layers, spec.depth))]
            kv = KVCacheManager(ecfg.num_kv_blocks, ecfg.block_size)
            hook = self._reserve_token_blocks if spec.role == "prompt" else None
            sched = Scheduler(cfg.scheduler_for(spec), kv, self.max_model_len, spec.role, hook)
            self.pipelines.append(Pipeline(spec, stages, kv, sched))
        self.stages = {s.name: s for p in self.pipelines for s in p.stages}
        self.token = self.pipelines[-1] if cfg.mode == "disaggregated" else None
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        port = self.inbox.bind_to_random_port(f"tcp://{cfg.host}")
        self.address = f"tcp://{cfg.host}:{port}"
        self.to_stage: dict[str, zmq.Socket] = {}
        # state owned by the loop thread once started
        self.submissions: deque = deque()
        self.sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.reqs: dict[str, Request] = {}  # every request not yet finished, or still holding blocks
        self.token_tables: dict[str, list[int]] = {}  # disaggregated: token-side blocks reserved per request
        self.kv_pending: dict[str, set[str]] = {}  # rid -> token stages whose KV has not arrived
        self.handed_off: dict[str, Request] = {}  # first token sampled, waiting for its KV
        self.ready: deque[Request] = deque()  # microbatch policy on the token side: KV in place
        self.failure: str | None = None
        self.generated = 0
        self.prompt_tokens = 0
        self.dropped_messages = 0
        self.preemptions = 0
        self.failures = 0
        self.recoveries = 0
        self.recovery_seconds = 0.0
        self.recovering: str | None = None
        self._batch_ids = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ Backend: life cycle
    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.start_blocking)

    def start_blocking(self) -> None:
        for s in self.stages.values():
            s.process = self.launcher.start(s.name, self.address, self.cfg.host, self.secret)
        try:
            self._handshake()
        except StartError as e:
            self._kill_all()
            raise RuntimeError(str(e)) from None
        self._wire_all()
        now = time.monotonic()
        for s in self.stages.values():
            s.last_heartbeat = now
        self._thread = threading.Thread(target=self._loop, name="kvflow-controller", daemon=True)
        self._thread.start()

    def _handshake(self, names: set[str] | None = None) -> None:
        """Hello -> Setup (spec + engine config) -> Ready, for the stages `names` (default: all).
        Other messages that arrive meanwhile (a recovery runs while the rest of the cluster works)
        are handled as usual."""
        deadline = time.monotonic() + self.cfg.start_timeout_s
        roles = {s.name: p.role for p in self.pipelines for s in p.stages}
        hello, ready = set(names or self.stages), set(names or self.stages)
        while ready:
            for name in ready:
                proc = self.stages[name].process
                if proc is not None and proc.poll() is not None:
                    raise StartError(f"worker {name} exited with code {proc.poll()} during start-up")
            if time.monotonic() > deadline:
                raise StartError(f"workers {sorted(ready)} did not start within {self.cfg.start_timeout_s}s")
            if not self.inbox.poll(200):
                continue
            msg, tensor = self._decode(self.inbox.recv_multipart())
            if isinstance(msg, Hello) and msg.name in hello:
                s = self.stages[msg.name]
                s.step_addr = msg.step_addr
                old = self.to_stage.pop(msg.name, None)
                if old is not None:
                    old.close(0)
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(msg.step_addr)
                self.to_stage[msg.name] = sock
                hello.discard(msg.name)
                spec = WorkerSpec(s.name, s.stage, s.layers[0], s.layers[1], roles[s.name], self.cfg.threads_per_worker,
                                  self.cfg.kv_send_mode)
                self._send_to(s.name, Setup(to_dict(spec), to_dict(self.cfg.engine), self.epoch))
            elif isinstance(msg, Ready) and msg.name in ready and msg.name not in hello:
                self.stages[msg.name].kv_addr = msg.kv_addr
                self.stages[msg.name].last_heartbeat = time.monotonic()
                ready.discard(msg.name)
            elif isinstance(msg, WorkerError) and msg.name in ready:
                raise StartError(f"worker {msg.name} failed: {msg.message}")
            elif msg is not None and self._thread is not None and not isinstance(msg, WorkerError):
                self._handle(msg, tensor)  # (a worker failing meanwhile is found by the next liveness check)

    def _wire_all(self) -> None:
        bounds = self.token.layer_bounds if self.token is not None else []
        for p in self.pipelines:
            for i, s in enumerate(p.stages):
                nxt = p.stages[i + 1].step_addr if i + 1 < p.depth else self.address
                peers = [[t.stage, t.layers[0], t.layers[1], t.kv_addr] for t in self.token.stages] if p.role == "prompt" else []
                self._send_to(s.name, Wire(nxt, peers, bounds))

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown_blocking)

    def shutdown_blocking(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        for name in self.to_stage:
            try:
                self.to_stage[name].send_multipart(encode(Shutdown(), self.secret), flags=zmq.NOBLOCK)
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

    def degraded(self) -> str | None:
        return self.recovering

    def stats(self) -> BackendStats:
        return BackendStats(
            # (submissions: arrived, not yet taken by the loop, e.g. while it replaces a worker)
            waiting_requests=sum(len(p.sched.waiting) for p in self.pipelines) + len(self.handed_off) + len(self.ready)
            + len(self.submissions),
            running_requests=sum(len(p.sched.running) for p in self.pipelines),
            generated_tokens_total=self.generated,
            prompt_tokens_total=self.prompt_tokens,
            kv_bytes_streamed_total=sum(s.kv_bytes_sent for s in self.stages.values()),
            worker_busy_seconds={s.name: s.busy_s for s in self.stages.values()},
            workers_alive={s.name: s.alive for s in self.stages.values()},
            dropped_messages_total={"controller": self.dropped_messages, **{s.name: s.dropped_messages for s in self.stages.values()}},
            preemptions_total=self.preemptions,
            worker_failures_total=self.failures,
            recoveries_total=self.recoveries,
            recovery_seconds_total=self.recovery_seconds,
            recovering=self.recovering is not None,
        )

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        if self.failure is not None or self._stop.is_set():  # (during a recovery requests queue)
            raise BackendUnavailable(self.failure or "the server is shutting down")
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        req = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, detok)
        validate(req, self.limits, [p.kv for p in self.pipelines])
        queue: asyncio.Queue = asyncio.Queue()
        self.submissions.append(("add", req, (asyncio.get_running_loop(), queue)))

        def done(finished: bool) -> None:
            if not finished:
                self.submissions.append(("abort", req, None))

        async for out in drain(queue, done):
            yield out

    # ------------------------------------------------------------------ the loop
    def _decode(self, frames: list):
        try:
            return decode(frames, self.secret)
        except WireError as e:
            self.dropped_messages += 1
            if self.dropped_messages & (self.dropped_messages - 1) == 0:  # 1st, 2nd, 4th, ...: no log flood
                log.warning("dropped a message on the controller port (%d so far): %s", self.dropped_messages, e)
            return None, None

    def _send_to(self, name: str, msg, tensor=None) -> None:
        self.to_stage[name].send_multipart(encode(msg, self.secret, tensor))

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
                    msg, tensor = self._decode(frames)
                    if msg is not None:
                        self._handle(msg, tensor)
            self._take_submissions()
            self._check_liveness()
            if self.failure is None:
                self._schedule()

    def _take_submissions(self) -> None:
        while self.submissions:
            kind, req, sink = self.submissions.popleft()
            rid = req.request_id
            if kind == "add":
                self.sinks[rid] = sink
                self.reqs[rid] = req
                self.prompt_tokens += req.num_prompt_tokens
                if self.failure is not None:
                    self._finish(req, "error", self.failure)
                else:
                    self.pipelines[0].sched.add(req)
            elif not req.is_finished:  # the client went away
                self.sinks.pop(rid, None)
                for p in self.pipelines:
                    if req in p.sched.waiting or req in p.sched.running:
                        p.sched.abort(req)
                if not req.is_finished:  # handed off, or queued for a token microbatch
                    req.finish("abort")
                    if req in self.ready:
                        self.ready.remove(req)
                self._settle(req)

    def _handle(self, msg, tensor: torch.Tensor | None) -> None:
        if isinstance(msg, StepResult):
            if msg.epoch == self.epoch:
                self._on_result(msg, tensor)
            else:
                self.dropped_messages += 1  # a result from before a recovery
        elif isinstance(msg, KVArrived):
            for rid in msg.rids:
                pending = self.kv_pending.get(rid)
                if pending is None:
                    continue
                pending.discard(msg.name)
                if not pending:
                    del self.kv_pending[rid]
                    req = self.handed_off.pop(rid, None)
                    if req is not None:
                        self._to_token_side(req)
                    elif rid in self.reqs and self.reqs[rid].is_finished:
                        self._settle(self.reqs[rid])
        elif isinstance(msg, Heartbeat):
            s = self.stages.get(msg.name)
            if s is not None:
                s.last_heartbeat = time.monotonic()
                s.busy_s, s.kv_bytes_sent, s.dropped_messages = msg.busy_s, msg.kv_bytes_sent, msg.dropped_messages
        elif isinstance(msg, WorkerError):
            if msg.epoch not in (-1, self.epoch):
                return  # an error of a step from before a recovery is moot
            epoch = self.epoch
            self._check_liveness()  # e.g. a prompt worker whose KV peer died: recover the dead one
            s = self.stages.get(msg.name)
            if epoch == self.epoch and s is not None and s.alive and self.failure is None:
                self._worker_lost(s, f"worker {msg.name} failed: {msg.message}")

    # ------------------------------------------------------------------ scheduling
    def _schedule(self) -> None:
        if self.token is not None and self.token.sched.config.policy == "microbatch":
            while self.ready and len(self.token.sched.groups) < self.token.depth:
                n = min(self.token.spec.microbatch_size, len(self.ready))
                self.token.sched.add_microbatch([self.ready.popleft() for _ in range(n)])
        for p in self.pipelines:
            while len(p.in_flight) < p.depth:
                out = p.sched.schedule()
                self.preemptions += len(out.preempted)
                for r in out.preempted:
                    self._preempted(p, r)
                if out.is_empty:
                    p.pending_free += out.freed
                    break
                self._send(p, out)

    def _reserve_token_blocks(self, req: Request) -> bool:
        """Prompt admission (disaggregated): the token-side blocks this request's KV will land in."""
        table = self.token_tables.setdefault(req.request_id, [])
        return self.token.kv.ensure(table, req.num_tokens)

    def _send(self, p: Pipeline, out: SchedulerOutput) -> None:
        seqs, ids = [], []
        for s in out.seqs:
            r = s.request
            seqs.append(SeqStep(r.request_id, s.start, s.num_new_tokens, list(s.new_block_ids), s.reset))
            ids.extend(r.token_ids[s.start:s.end])
        kv_out, kv_plan = [], []
        if p.role == "prompt":
            token_names = {t.name for t in self.token.stages}
            for s in out.seqs:
                rid = s.request.request_id
                kv_out.append(KVOut(rid, s.start, s.end, s.request.num_tokens, list(self.token_tables[rid])))
                if s.start == 0:
                    self.kv_pending[rid] = set(token_names)
            kv_plan = [list(dataclasses.astuple(t)) for t in plan_handoff(p.layer_bounds, self.token.layer_bounds, len(out.seqs))]
        free, p.pending_free = p.pending_free + out.freed, []
        wire_id = next(self._batch_ids)  # unique across pipelines (each scheduler numbers its own batches)
        p.in_flight[wire_id] = out
        p.batch_log.append((out.batch_id, [(s.request.request_id, s.num_new_tokens) for s in out.seqs]))
        self._send_to(p.stages[0].name, Step(self.epoch, wire_id, seqs, ids, free, kv_out, kv_plan))

    def _on_result(self, msg: StepResult, logits: torch.Tensor) -> None:
        p = next((p for p in self.pipelines if msg.batch in p.in_flight), None)
        if p is None:
            return
        out = p.in_flight.pop(msg.batch)
        p.step_log.append((sum(s.num_new_tokens for s in out.seqs), msg.busy_s))
        rows = [i for i, s in enumerate(out.seqs) if s.completes_prompt and not s.request.is_finished]
        sampled: dict[str, int] = {}
        if rows:
            reqs = [out.seqs[i].request for i in rows]
            toks = sample(logits[rows], [r.params for r in reqs], [r.sampler for r in reqs], [r.banned_token_ids() for r in reqs])
            sampled = {r.request_id: t for r, t in zip(reqs, toks)}
            self.generated += len(toks)
        changed = p.sched.update(out, sampled)
        for req in changed:
            self._emit(req)
            if req.is_finished:
                self._settle(req)
        for req in p.sched.take_handoffs():
            if req.request_id in self.kv_pending:
                self.handed_off[req.request_id] = req
            else:
                self._to_token_side(req)

    def _to_token_side(self, req: Request) -> None:
        if req.is_finished:
            self._settle(req)
            return
        req.block_ids = self.token_tables.pop(req.request_id)
        if self.token.sched.config.policy == "microbatch":
            self.ready.append(req)
        else:
            self.token.sched.add_running(req)

    def _preempted(self, p: Pipeline, req: Request) -> None:
        """A token-side preemption (disaggregated): the request is recomputed by the prompt pipeline."""
        if p.role == "token":
            self.pipelines[0].sched.add_front(req)

    # ------------------------------------------------------------------ endings
    def _emit(self, req: Request) -> None:
        sink = self.sinks.get(req.request_id)
        if sink is not None:
            loop, q = sink
            loop.call_soon_threadsafe(q.put_nowait, req.take_output())
            if req.is_finished:
                self.sinks.pop(req.request_id, None)

    def _finish(self, req: Request, reason, error: str | None = None) -> None:
        req.finish(reason, error)
        self._emit(req)

    def _settle(self, req: Request) -> None:
        """A finished request: free its token-side reservation once no KV is still on its way."""
        rid = req.request_id
        self.handed_off.pop(rid, None)
        if rid in self.kv_pending:
            return  # freed when the last token stage reports the KV in
        table = self.token_tables.pop(rid, None)
        if table:
            self.token.kv.release(table)
            self.token.pending_free.append(rid)
        if not any(rid in p.sched.in_flight for p in self.pipelines):
            self.reqs.pop(rid, None)

    # ------------------------------------------------------------------ failures
    def _check_liveness(self) -> None:
        now = time.monotonic()
        for s in self.stages.values():
            if not s.alive:
                continue
            code = s.process.poll() if s.process is not None else None
            if code is not None:
                self._worker_lost(s, f"worker {s.name} (layers {s.layers[0]}-{s.layers[1] - 1}) died (exit code {code})")
                return
            if now - s.last_heartbeat > self.cfg.heartbeat_timeout_s:
                self._worker_lost(s, f"worker {s.name} stopped sending heartbeats for {now - s.last_heartbeat:.1f}s")
                return

    def _worker_lost(self, s: StageHandle, message: str) -> None:
        s.alive = False
        self.failures += 1
        if self.cfg.recovery == "none":
            self._fail(message)
        else:
            self._recover(s, message)

    def _recover(self, lost: StageHandle, message: str) -> None:
        """Fence the lost worker, start a replacement, and recompute every request that lost KV.

        Every pipeline is reset (the new epoch voids whatever is still on the wire): the requests
        keep the tokens they produced and are recomputed from prompt + output, so greedy and seeded
        outputs are exactly those of a run without the failure. While this runs, new requests queue.
        """
        t0 = time.monotonic()
        log.warning("%s; recovering (epoch %d -> %d)", message, self.epoch, self.epoch + 1)
        self.recovering = message
        self.epoch += 1
        self._reset_requests()
        for attempt in range(1, self.cfg.max_restarts + 1):
            if lost.process is not None and lost.process.poll() is None:
                lost.process.kill()  # fence: a worker that only hung must never write again
                lost.process.wait()
            for s in self.stages.values():
                if s is not lost and s.name in self.to_stage:
                    self._send_to(s.name, Reset(self.epoch))
            lost.process = self.launcher.start(lost.name, self.address, self.cfg.host, self.secret)
            try:
                self._handshake({lost.name})
                break
            except StartError as e:
                log.error("replacing %s failed (attempt %d of %d): %s", lost.name, attempt, self.cfg.max_restarts, e)
        else:
            self._fail(f"{message}; its replacement failed {self.cfg.max_restarts} times")
            return
        self._wire_all()
        lost.alive = True
        now = time.monotonic()
        for s in self.stages.values():
            s.last_heartbeat = now
        self.recovering = None
        self.recoveries += 1
        self.recovery_seconds += now - t0
        log.warning("recovered from the loss of %s in %.2fs", lost.name, now - t0)

    def _reset_requests(self) -> None:
        """Every pipeline forgets its KV; unfinished requests are queued to be recomputed."""
        again: list[Request] = []
        for p in self.pipelines:
            again += p.sched.reset()
            p.in_flight.clear()
            p.pending_free.clear()
        if self.token is not None:
            again += [r for r in list(self.handed_off.values()) + list(self.ready) if not r.is_finished]
            self.handed_off.clear()
            self.ready.clear()
            self.kv_pending.clear()
            for table in self.token_tables.values():
                if table:
                    self.token.kv.release(table)
            self.token_tables.clear()
            first = self.pipelines[0].sched
            for r in sorted(again, key=lambda r: r.arrival_time, reverse=True):
                if r not in first.waiting:
                    first.add_front(r)
        for rid, r in list(self.reqs.items()):  # finished requests that only waited for blocks to settle
            if r.is_finished:
                del self.reqs[rid]

    def _fail(self, message: str) -> None:
        """Fail every unfinished request with a clear error; new requests are refused with it too."""
        log.error("%s; failing all in-flight requests", message)
        if self.failure is None:
            self.failure = message
        self.epoch += 1  # whatever is still on the wire from before is stale
        for p in self.pipelines:
            p.sched.fail_all()
            p.in_flight.clear()
        self.handed_off.clear()
        self.ready.clear()
        self.kv_pending.clear()
        for r in list(self.reqs.values()):
            if not r.is_finished:
                self._finish(r, "error", message)
        self.reqs.clear()
