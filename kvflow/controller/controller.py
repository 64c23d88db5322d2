"""The controller: a `Backend` that serves requests with pipelines of worker processes.

It is an executor of the one scheduling core (`kvflow.sched`): each pipeline has a `Scheduler`, and
the controller keeps up to `depth` of its batches in flight (a batch queue, as vLLM does for
pipeline parallelism). One thread owns all state; per loop: handle messages (a batch's logits →
sample → `scheduler.update`; KV arrivals; heartbeats), take new and aborted requests, check
liveness, then `scheduler.schedule()` while a pipeline has a free slot and send each batch to its
stage 0 as a delta `Step` with the current epoch. Scheduling also follows each result and KV
arrival at once, so the decisions do not depend on how many results one loop turn drains (the
simulator decides after each event, too).

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
from kvflow.controller.replica_store import ReplicaStore
from kvflow.kv.cache import KVLayout
from kvflow.kv.manager import KVCacheManager
from kvflow.model.loader import load_config
from kvflow.model.tokenizer import IncrementalDetokenizer, Tokenizer
from kvflow.sched.handoff import Handoff
from kvflow.sched.request import Request, RequestOutput
from kvflow.sched.sampling import SamplingParams, sample
from kvflow.sched.scheduler import Limits, Scheduler, SchedulerOutput, validate
from kvflow.serving.backend import BackendStats, BackendUnavailable, drain
from kvflow.streaming.connector import plan_handoff
from kvflow.wire import (
    Heartbeat, Hello, KVArrived, KVOut, Ready, Replicated, Reset, Restore, SeqStep, Setup, Shutdown, Step, StepResult, Wire, WireError, WorkerError,
    decode, encode, new_secret,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RecoveryRecord:
    """One completed recovery: when the loss was detected (time.monotonic()), how long starting the
    replacement (spawn, load, handshake) and restoring its KV from the replica took, the total, and
    how many requests resumed (0: recomputed). The measured costs the simulator's failure model takes."""

    worker: str
    detected_at: float
    replace_s: float
    restore_s: float
    total_s: float
    resumed: int


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
        per_region = [cfg.swap_layout(p)[1] for p in cfg.pipelines() if cfg.swap_layout(p)[0]]
        self.limits = Limits(self.max_model_len, mc.vocab_size, min(per_region) if per_region else None)
        eos = set(mc.eos_token_ids) | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.eos_token_ids = tuple(sorted(eos))
        self.launcher = launcher if launcher is not None else SubprocessLauncher()
        self.secret = new_secret()
        self.epoch = 0
        self.pipelines: list[Pipeline] = []
        block_bytes = KVLayout.for_model(mc, 1, ecfg.block_size, dtype=ecfg.torch_dtype).bytes_per_block
        for spec in cfg.pipelines():
            stages = [StageHandle(spec.stage_name(i), i, layers) for i, layers in enumerate(even_split(mc.num_layers, spec.depth))]
            # lower tiers for the pipelines that prefill (a token pool's blocks are filled by the prompt
            # side's stream, outside its own steps, so its evictions could not be copied out in order)
            host, disk = ecfg.tier_sizes(block_bytes, spec.depth).pools() if spec.role != "token" else (None, None)
            kv = KVCacheManager(cfg.swap_layout(spec)[2], ecfg.block_size, ecfg.enable_prefix_caching, host, disk)
            hook = (lambda req: self.handoff.reserve(req)) if spec.role == "prompt" else None
            sched = Scheduler(cfg.scheduler_for(spec), kv, self.max_model_len, spec.role, hook)
            self.pipelines.append(Pipeline(spec, stages, kv, sched))
        self.stages = {s.name: s for p in self.pipelines for s in p.stages}
        self.store: ReplicaStore | None = None  # host replicas of stages with no stage to replicate to
        for p in self.pipelines:
            if cfg.replicates(p.spec) == "store":
                self.store = self.store or ReplicaStore(cfg.host, self.secret)
                for s in p.stages:
                    self.store.add(p.name, s.stage, KVLayout.for_model(mc, p.kv.num_blocks, ecfg.block_size, s.layers,
                                                                       dtype=ecfg.torch_dtype))
        self.token = self.pipelines[-1] if cfg.mode == "disaggregated" else None
        self.handoff = Handoff([self.token]) if self.token is not None else None
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        port = self.inbox.bind_to_random_port(f"tcp://{cfg.host}")
        self.address = f"tcp://{cfg.host}:{port}"
        self.to_stage: dict[str, zmq.Socket] = {}
        # state owned by the loop thread once started
        self.submissions: deque = deque()
        self.sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.reqs: dict[str, Request] = {}  # every request not yet finished, or still holding blocks
        self.failure: str | None = None
        self.generated = 0
        self.prompt_tokens = 0
        self.dropped_messages = 0
        self.preemptions = 0
        self.failures = 0
        self.recoveries = 0
        self.recovery_seconds = 0.0
        self.recovery_log: list[RecoveryRecord] = []  # one per completed recovery, in order
        self.recovering: str | None = None
        self._restoring: tuple[str, set[str]] | None = None  # (replacement, requests whose KV it still awaits)
        self.resumed = 0  # requests brought back from a replica (not recomputed from scratch)
        self.lost_tokens = 0  # KV tokens the failed pipelines had computed (all recomputed without a replica)
        self.recomputed_tokens = 0  # of those, the tokens that had to be computed again
        self._batch_ids = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ Backend: life cycle
    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.start_blocking)

    def start_blocking(self) -> None:
        for s in self.stages.values():
            s.process = self._launch(s.name)
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

    def _launch(self, name: str):
        proc = self.launcher.start(name, self.address, self.cfg.host, self.secret)
        if proc is not None:
            log.info("started worker %s (pid %s)", name, proc.pid)
        return proc

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
                p = self._pipeline_of(s)
                rl = p.stages[(s.stage - 1) % p.depth].layers if self.cfg.replicates(p.spec) == "ring" else (-1, -1)
                spec = WorkerSpec(s.name, s.stage, s.layers[0], s.layers[1], roles[s.name], self.cfg.threads_per_worker,
                                  self.cfg.kv_send_mode, replica_layer_start=rl[0], replica_layer_end=rl[1],
                                  replicated=self.cfg.replicates(p.spec) is not None,
                                  host_kv_slots=p.kv.host.num_slots if p.kv.host else 0,
                                  disk_kv_slots=p.kv.disk.num_slots if p.kv.disk else 0,
                                  swap_regions=self.cfg.swap_layout(p.spec)[0], swap_region_blocks=self.cfg.swap_layout(p.spec)[1],
                                  pool_blocks=p.kv.num_blocks)
                self._send_to(s.name, Setup(to_dict(spec), to_dict(self.cfg.engine), self.epoch))
            elif isinstance(msg, Ready) and msg.name in ready and msg.name not in hello:
                self.stages[msg.name].kv_addr = msg.kv_addr
                self.stages[msg.name].replica_addr = msg.replica_addr
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
                mode = self.cfg.replicates(p.spec)
                replica_to = (p.stages[(i + 1) % p.depth].replica_addr if mode == "ring" else
                              self.store.addresses[(p.name, i)] if mode == "store" else "")
                self._send_to(s.name, Wire(nxt, peers, bounds, replica_to))

    def _advance_watermark(self, p: Pipeline, stage: int, rids: list[str], spans: list[tuple[int, int]]) -> None:
        """Stage `stage`'s replica received tokens [a, b) of these requests."""
        wm = p.watermark.setdefault(stage, {})
        for rid, (a, b) in zip(rids, spans):
            if rid in self.reqs and a <= wm.get(rid, 0):  # contiguous from token 0
                wm[rid] = max(wm.get(rid, 0), b)

    def _store_events(self) -> None:
        while self.store is not None and self.store.events:
            name, stage, rids, spans = self.store.events.popleft()
            self._advance_watermark(next(p for p in self.pipelines if p.name == name), stage, rids, spans)

    def _pipeline_of(self, s: StageHandle) -> Pipeline:
        return next(p for p in self.pipelines if s in p.stages)

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
        if self.store is not None:
            self.store.close()
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
            waiting_requests=sum(len(p.sched.waiting) for p in self.pipelines) + (self.handoff.num_waiting if self.handoff else 0)
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
            replicated_bytes_total=sum(s.replica_bytes_sent for s in self.stages.values()),
            replication_lag_tokens=self._replication_lag(),
            resumed_requests_total=self.resumed,
            recomputed_tokens_total=self.recomputed_tokens,
            prefix_cache={(p.name, tier): c for p in self.pipelines for tier, c in p.kv.tier_stats().items()},
        )

    def _replication_lag(self) -> int:
        """Max over replicating pipelines' stages and running requests of progress - watermark
        (read from the event loop while the loop thread updates it: a best-effort gauge)."""
        lag = 0
        try:
            for p in self.pipelines:
                if not self.cfg.replicates(p.spec):
                    continue
                running = [(r.request_id, r.num_computed_tokens) for r in list(p.sched.running)]
                for st in range(p.depth):
                    wm = p.watermark.get(st, {})
                    lag = max([lag] + [n - wm.get(rid, 0) for rid, n in running])
        except RuntimeError:  # a dict changed size while read
            pass
        return lag

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
            try:
                self._turn(poller)
            except Exception as e:  # a bug, not a worker's failure: fail every request loudly, keep serving errors
                log.exception("controller loop failed")
                try:
                    self._fail(f"controller error: {type(e).__name__}: {e}")
                except Exception:  # (the requests were failed first; only the clean-up broke)
                    log.exception("cleaning up after a controller error failed too")

    def _turn(self, poller: zmq.Poller) -> None:
        """One turn of the loop: drain the inbox, take submissions, check the workers, schedule."""
        if poller.poll(5):
            while True:
                try:
                    frames = self.inbox.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg, tensor = self._decode(frames)
                if msg is not None:
                    self._handle(msg, tensor)
                    if isinstance(msg, (StepResult, KVArrived)) and self.failure is None:
                        self._schedule()  # as the simulator: decide after each result, however they arrive
        self._store_events()
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
                self._settle(req)

    def _handle(self, msg, tensor: torch.Tensor | None) -> None:
        if isinstance(msg, StepResult):
            if msg.epoch == self.epoch:
                self._on_result(msg, tensor)
            else:
                self.dropped_messages += 1  # a result from before a recovery
        elif isinstance(msg, KVArrived):
            if self._restoring is not None and msg.name == self._restoring[0]:
                self._restoring[1].difference_update(msg.rids)
                return
            if self.handoff is not None:
                for rid in msg.rids:
                    req = self.handoff.kv_arrived(rid, msg.name)
                    if req is not None:
                        self._to_token_side(req)
        elif isinstance(msg, Heartbeat):
            s = self.stages.get(msg.name)
            if s is not None:
                s.last_heartbeat = time.monotonic()
                s.busy_s, s.kv_bytes_sent, s.dropped_messages = msg.busy_s, msg.kv_bytes_sent, msg.dropped_messages
                s.replica_bytes_sent, s.swap = msg.replica_bytes_sent, msg.swap
        elif isinstance(msg, Replicated):
            s = self.stages.get(msg.name)
            if s is not None:
                p = self._pipeline_of(s)
                self._advance_watermark(p, (s.stage - 1) % p.depth, msg.rids, list(zip(msg.starts, msg.ends)))
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
        if self.handoff is not None:
            self.handoff.fill_microbatches(self.token)
        for p in self.pipelines:
            while len(p.in_flight) < p.depth:
                out = p.sched.schedule()
                self.preemptions += len(out.preempted)
                for r in out.preempted:
                    self._preempted(p, r)
                if out.is_empty and not out.tiers:
                    p.pending_free += out.freed
                    break
                self._send(p, out)  # (copies between KV tiers alone make a step too: disk loads)

    def _send(self, p: Pipeline, out: SchedulerOutput) -> None:
        seqs, ids = [], []
        for s in out.seqs:
            r = s.request
            seqs.append(SeqStep(r.request_id, s.start, s.num_new_tokens, list(s.new_block_ids), s.reset, list(s.device_block_ids)))
            if s.start == 0 and p.watermark:  # (re)computed from scratch, maybe in new blocks: no replica yet
                for wm in p.watermark.values():
                    wm.pop(r.request_id, None)
            ids.extend(r.token_ids[s.start:s.end])
        kv_out, kv_plan = [], []
        if p.role == "prompt":
            token_names = {t.name for t in self.token.stages}
            for s in out.seqs:
                rid, total = s.request.request_id, s.request.num_tokens
                lo, hi = self.handoff.stream_range(s)  # what the token side's cached prefix lacks
                have = self.handoff.cached_tokens(rid)
                if lo < hi:
                    kv_out.append(KVOut(rid, lo, hi, total, list(self.handoff.table(rid)), have))
                if s.reset and have < total:
                    self.handoff.kv_sent(rid, token_names)
            if kv_out:
                kv_plan = [list(dataclasses.astuple(t)) for t in plan_handoff(p.layer_bounds, self.token.layer_bounds, len(kv_out))]
        free, p.pending_free = p.pending_free + out.freed, []
        for rid in free:
            for wm in p.watermark.values():
                wm.pop(rid, None)
        wire_id = next(self._batch_ids)  # unique across pipelines (each scheduler numbers its own batches)
        p.in_flight[wire_id] = out
        p.batch_log.append((out.batch_id, [(s.request.request_id, s.num_new_tokens) for s in out.seqs]))
        self._send_to(p.stages[0].name, Step(self.epoch, wire_id, seqs, ids, free, kv_out, kv_plan, out.tiers.to_wire(),
                                                 swap_region=out.swap_region))

    def _on_result(self, msg: StepResult, logits: torch.Tensor) -> None:
        p = next((p for p in self.pipelines if msg.batch in p.in_flight), None)
        if p is None:
            return
        out = p.in_flight.pop(msg.batch)
        out.tiers.failed = list(msg.tier_failed)  # disk blocks some stage rejected: recomputed
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
            if self.handoff.sampled(req):
                self._to_token_side(req)

    def _to_token_side(self, req: Request) -> None:
        if req.is_finished:
            self._settle(req)
        else:
            self.handoff.join(req)

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
        if self.handoff is not None:
            if self.handoff.settle(req) is not None:
                self.token.pending_free.append(rid)
            if rid in self.handoff.pending:
                return  # freed when the last token stage reports the KV in
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
        """Fence the lost worker, start a replacement, and bring every request back.

        A new epoch voids whatever is still on the wire. If the lost stage's pipeline replicates and
        the stage holding its replica (x+1 mod depth) is alive, its requests resume: the holder sends
        the replica back into the replacement's cache, the previous stage (x-1) refills the replica
        the replacement holds, and each request continues from min(its progress, the replication
        watermark), recomputing only the tokens after it. Otherwise the pipeline's requests are
        recomputed from prompt + produced tokens. Other pipelines only redo their in-flight batches
        (prompt pipelines re-run their prompts: their KV is streamed, never kept). Greedy and seeded
        outputs are exactly those of a run without the failure. While this runs, new requests queue.
        """
        t0 = time.monotonic()
        log.warning("%s; recovering (epoch %d -> %d)", message, self.epoch, self.epoch + 1)
        self.recovering = message
        self.epoch += 1
        lp = self._pipeline_of(lost)
        lp.kv.reset_prefix_cache()  # the replacement's cache is empty: no cached prefix of this pipeline holds
        holder = lp.stages[(lost.stage + 1) % lp.depth]
        prev = lp.stages[(lost.stage - 1) % lp.depth]
        resume = None
        mode = self.cfg.replicates(lp.spec)
        if mode == "store" or (mode == "ring" and holder.alive and prev.alive):
            wm = lp.watermark.get(lost.stage, {})
            resume = {r.request_id: min(r.num_computed_tokens, wm.get(r.request_id, 0)) for r in lp.sched.running
                      if not r.is_finished}
        for attempt in range(1, self.cfg.max_restarts + 1):
            if lost.process is not None and lost.process.poll() is None:
                lost.process.kill()  # fence: a worker that only hung must never write again
                lost.process.wait()
            for s in self.stages.values():
                if s is not lost and s.name in self.to_stage:
                    self._send_to(s.name, Reset(self.epoch))
            if self.store is not None:
                self.store.reset(self.epoch)
            lost.process = self._launch(lost.name)
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
        t_replaced = time.monotonic()
        if resume is not None and not self._restore(lp, lost, holder, prev, resume):
            resume = None
        t_restored = time.monotonic()
        computed = {r.request_id: r.num_computed_tokens for r in lp.sched.running if not r.is_finished}
        self.lost_tokens += sum(computed.values())
        self.recomputed_tokens += sum(n - (resume or {}).get(rid, 0) for rid, n in computed.items())
        self._reset_requests(lp, resume)
        now = time.monotonic()
        for s in self.stages.values():
            s.last_heartbeat = now
        self.recovering = None
        self.recoveries += 1
        self.recovery_seconds += now - t0
        self.recovery_log.append(RecoveryRecord(lost.name, t0, t_replaced - t0, t_restored - t_replaced, now - t0,
                                                len(resume) if resume is not None else 0))
        how = f"{len(resume)} request(s) resumed from the replica" if resume is not None else "requests recomputed"
        log.warning("recovered from the loss of %s in %.2fs (%s)", lost.name, now - t0, how)

    def _restore(self, p: Pipeline, new: StageHandle, holder: StageHandle, prev: StageHandle, resume: dict[str, int]) -> bool:
        """Replica -> the replacement's cache, and (ring) the previous stage's KV -> the replica the
        replacement holds; waits until both are in. False (then the caller recomputes) on failure."""
        tables = {r.request_id: list(r.block_ids) for r in p.sched.running}
        back = [[rid, n, tables[rid]] for rid, n in resume.items() if n > 0]
        ring = self.cfg.replicates(p.spec) == "ring"
        refill = [[rid, n, tables[rid]] for rid, n in resume.items() if n > 0] if ring else []
        if ring:
            p.watermark[prev.stage] = {}  # the replica of prev was on the lost worker (the others are intact)
        if not back:
            return True
        self._restoring = (new.name, {rid for rid, _, _ in back})
        if ring:
            self._send_to(holder.name, Restore(self.epoch, "replica", new.kv_addr, new.stage, back))
            self._send_to(prev.name, Restore(self.epoch, "main", new.replica_addr, prev.stage, refill))
        else:
            try:
                self.store.restore(p.name, new.stage, back, new.kv_addr, self.epoch)
            except Exception as e:
                log.error("restoring %s from the host store failed: %s; recomputing instead", new.name, e)
                self._restoring = None
                return False
        want = {rid: n for rid, n, _ in refill}
        deadline = time.monotonic() + self.cfg.start_timeout_s
        try:
            while self._restoring[1] or any(p.watermark[prev.stage].get(r, 0) < n for r, n in want.items()):
                if time.monotonic() > deadline or not all(s.process is None or s.process.poll() is None for s in (holder, prev, new)):
                    log.error("restoring %s from its replica failed; recomputing instead", new.name)
                    return False
                if self.inbox.poll(50):
                    msg, tensor = self._decode(self.inbox.recv_multipart())
                    if isinstance(msg, WorkerError) and msg.epoch == self.epoch:
                        log.error("restoring %s failed: %s: %s; recomputing instead", new.name, msg.name, msg.message)
                        return False
                    if msg is not None and not isinstance(msg, (StepResult, WorkerError)):
                        self._handle(msg, tensor)
                self._store_events()
            self.resumed += len(resume)
            return True
        finally:
            self._restoring = None

    def _reset_requests(self, lost: Pipeline, resume: dict[str, int] | None) -> None:
        """After a recovery: the pipeline that lost a stage resumes from the replica's watermark
        (`resume`) or, without one, forgets its KV and queues its unfinished requests to be
        recomputed, as every prompt pipeline does; every other pipeline keeps its KV and redoes its
        in-flight batches (`rewind` to its progress)."""
        again: list[Request] = []
        for p in self.pipelines:
            if (p is lost and resume is None) or p.role == "prompt":
                again += p.sched.reset()
                p.watermark.clear()
            else:
                progress = resume if p is lost else {r.request_id: r.num_computed_tokens for r in p.sched.running}
                for r in p.sched.rewind(progress):
                    self._settle(r)
            p.in_flight.clear()
            p.pending_free.clear()
        if self.handoff is not None:
            again += self.handoff.reset()
            first = self.pipelines[0].sched
            for r in sorted(again, key=lambda r: r.arrival_time, reverse=True):
                if r not in first.waiting:
                    first.add_front(r)
        for rid, r in list(self.reqs.items()):  # finished requests that only waited for blocks to settle
            if r.is_finished and not any(r in p.sched.running for p in self.pipelines):
                del self.reqs[rid]

    def _fail(self, message: str) -> None:
        """Fail every unfinished request with a clear error; new requests are refused with it too."""
        log.error("%s; failing all in-flight requests", message)
        if self.failure is None:
            self.failure = message
        self.epoch += 1  # whatever is still on the wire from before is stale
        reqs, self.reqs = list(self.reqs.values()), {}
        for r in reqs:  # first: whatever the clean-up below meets, no client waits
            if not r.is_finished:
                self._finish(r, "error", message)
        for p in self.pipelines:
            p.sched.fail_all()
            p.in_flight.clear()
        if self.handoff is not None:
            self.handoff.reset()
