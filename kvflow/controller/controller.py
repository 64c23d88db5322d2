"""The controller: a `Backend` that serves requests with pipelines of worker processes.

It is the process driver of the pipeline executor (`kvflow.sched.executor`): each pipeline runs a
`Scheduler`, and the executor decides which batches are in flight, what a returned batch samples,
when a request moves from the prompt to the token side, and how requests come back after a
failure. This module carries those decisions out with worker processes (`workers.py`) and wire
messages: a batch becomes a delta `Step` to the pipeline's stage 0, its logits come back as a
`StepResult`, a token stage's `KVArrived` says a prompt's KV is in. One thread owns all state; per
turn it drains the inbox (one dispatch, `handle`; the executor schedules after every result and KV
arrival, so decisions do not depend on how many messages one turn drains, as in the simulator),
takes new and aborted requests, checks liveness (a lost worker: `recovery.py`), and schedules.

Colocated: one pipeline, role "both" (continuous batching with chunked prefill and preemption, or
the "microbatch" baseline policy). Disaggregated: a prompt pipeline (role "prompt") whose admission
reserves the blocks the prompt's KV will occupy on the token side; the KV connector's plan rides on
the prompt step and the prompt workers stream each layer's KV as it is written; a request joins the
token pipeline (role "token") once its first token is sampled and every token stage reported its
KV complete.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator

import torch

from kvflow.config import ClusterConfig
from kvflow.controller.launcher import Launcher, SubprocessLauncher, local_gpus
from kvflow.controller.pipeline import Pipeline, StageHandle, StepRecord, even_split
from kvflow.controller.recovery import Recovery
from kvflow.controller.replica_store import ReplicaStore, fit_replicas
from kvflow.controller.workers import StartError, Workers
from kvflow.engine.memory import StageMemory, pipeline_pools
from kvflow.kv.cache import KVLayout
from kvflow.kv.manager import KVCacheManager
from kvflow.model.loader import load_config
from kvflow.model.tokenizer import IncrementalDetokenizer, Tokenizer
from kvflow.sched.executor import KVStream, PipelineExecutor
from kvflow.sched.request import Request, RequestOutput
from kvflow.sched.sampler import argmax_only, sample_requests
from kvflow.sched.sampling import SamplingParams
from kvflow.sched.admission import Limits, validate
from kvflow.sched.scheduler import Scheduler, SchedulerOutput
from kvflow.serving.backend import BackendStats, BackendUnavailable, Deliveries, drain
from kvflow.streaming.connector import plan_handoff
from kvflow.streaming.transports.shm_segment import free_bytes
from kvflow.wire import Heartbeat, KVArrived, KVOut, Replicated, SeqStep, Step, StepResult, WorkerError, new_secret

log = logging.getLogger(__name__)

__all__ = ["Controller"]


class Controller:
    """Implements `kvflow.serving.backend.Backend` over worker processes (see module docstring)."""

    def __init__(self, cfg: ClusterConfig, model_name: str | None = None, launcher: Launcher | None = None) -> None:
        self.cfg = cfg
        ecfg = cfg.engine
        mc, directory = load_config(ecfg.model)  # converts a GGUF once, before the workers look for it
        self.tokenizer = Tokenizer(directory)
        self.model_name = model_name or mc.name
        self.max_model_len = ecfg.model_len(mc.max_position_embeddings)
        self.vocab_size = mc.vocab_size
        eos = set(mc.eos_token_ids) | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.eos_token_ids = tuple(sorted(eos))
        self.secret = new_secret()
        self.epoch = 0
        self.pipelines: list[Pipeline] = []  # (made once the pools are sized: `_build`)
        self.store: ReplicaStore | None = None  # replicas in shared memory; host caches of stages with no stage to replicate to
        self.measured: dict[str, StageMemory] = {}  # what each stage measured (pools sized from GPU memory)
        self.specs = {p.name: (p, [StageHandle(p.stage_name(i), i, layers) for i, layers in enumerate(even_split(mc.num_layers, p.depth))])
                      for p in cfg.pipelines()}
        self.workers = Workers(cfg, [s for _, stages in self.specs.values() for s in stages],
                               launcher if launcher is not None else SubprocessLauncher(local_gpus(ecfg.device)),
                               self.secret, mc.hidden_size * ecfg.torch_dtype.itemsize)
        self._mc = mc
        if ecfg.gpu_memory_utilization is None:
            self._build({name: ecfg.num_kv_blocks for name in self.specs})
        self.recovery = Recovery(self)
        self.stages, self.address = self.workers.stages, self.workers.address
        # state owned by the loop thread once started
        self.submissions: deque = deque()
        self.sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.deliveries = Deliveries()  # outputs for the event loops, handed over once per turn (controller thread)
        self.reqs: dict[str, Request] = {}  # every request not yet finished, or still holding blocks
        self.failure: str | None = None
        self.generated = 0
        self.prompt_tokens = 0
        self.stale_results = 0  # results from before a recovery, dropped
        self.loop_cpu_s = 0.0  # CPU seconds of the loop's thread (is the controller what bounds the pipelines?)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _build(self, blocks: dict[str, int]) -> None:
        """Each pipeline's block pool, scheduler and state, the replica store and the executor, for
        `blocks` blocks on each stage's device per pipeline (given, or measured by the stages:
        `engine.memory.pipeline_pools`); the pool holds more with swapping (`ClusterConfig.swap_layout`)."""
        cfg, ecfg, mc = self.cfg, self.cfg.engine, self._mc
        regions = [cfg.swap_layout(spec, blocks[name]) for name, (spec, _) in self.specs.items()]
        per_region = [r.region_blocks for r in regions if r.regions]
        self.limits = Limits(self.max_model_len, mc.vocab_size, min(per_region) if per_region else None)
        block_bytes = KVLayout.for_model(mc, 1, ecfg.block_size, dtype=ecfg.torch_dtype).bytes_per_block
        for (name, (spec, stages)), swap in zip(self.specs.items(), regions):
            # lower tiers for the pipelines that prefill (a token pool's blocks are filled by the prompt
            # side's stream, outside its own steps, so its evictions could not be copied out in order)
            host, disk = ecfg.tier_sizes(block_bytes, spec.depth).pools() if spec.role != "token" else (None, None)
            kv = KVCacheManager(swap.pool_blocks, ecfg.block_size, ecfg.enable_prefix_caching, host, disk)
            sched = Scheduler(cfg.scheduler_for(spec, blocks[name]), kv, self.max_model_len, spec.role)
            self.pipelines.append(Pipeline(spec, stages, kv, sched))
        for p in self.pipelines:
            if (mode := cfg.replicates(p.spec)) is not None:
                self.store = self.store or ReplicaStore(cfg.host, self.secret)
                for s in p.stages:
                    self.store.add(p.name, s.stage, KVLayout.for_model(mc, p.kv_manager.num_blocks, ecfg.block_size, s.layers,
                                                                       dtype=ecfg.torch_dtype), port=mode == "store")
        self.token = self.pipelines[-1] if cfg.mode == "disaggregated" else None
        prompt = self.pipelines[:-1] if self.token is not None else self.pipelines
        self.executor = PipelineExecutor(prompt, [self.token] if self.token is not None else [], self)
        self.workers.attach(self.pipelines, self.store)

    def _size(self, measured: dict[str, StageMemory]) -> None:
        """gpu_memory_utilization: the pools from what every stage measured with its layers loaded."""
        pipeline_of = {s.name: name for name, (_, stages) in self.specs.items() for s in stages}
        self.measured = measured
        blocks = pipeline_pools({n: (pipeline_of[n], m) for n, m in measured.items()}, self.cfg.engine.gpu_memory_utilization)
        log.info("KV pools from GPU memory: %s blocks per stage's device", blocks)
        replicas = {name: sum(measured[s.name].block_bytes for s in stages)  # (every stage of a replicated pipeline has a replica)
                    for name, (spec, stages) in self.specs.items() if self.cfg.replicates(spec)}
        fitted = fit_replicas(blocks, replicas, free_bytes())
        if fitted != blocks:
            log.warning("KV pools cut to %s blocks (from %s) so that their replicas fit in /dev/shm (%.1f GiB free); "
                        "--replication none, or a larger /dev/shm, keeps what the GPUs have room for",
                        fitted, blocks, (free_bytes() or 0) / 2**30)
        self._build(fitted)

    # ------------------------------------------------------------------ Backend: life cycle
    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.start_blocking)

    def start_blocking(self) -> None:
        for s in self.stages.values():
            self.workers.launch(s)
        try:
            self.workers.handshake(set(self.stages), self.epoch, None, self._size if not self.pipelines else None)
        except (StartError, ValueError) as e:  # (ValueError: no room on a GPU, `pipeline_pools`)
            self.workers.kill_all()
            self.shutdown_blocking()  # sockets and the replica store closed: nothing left to hold up an exit
            raise RuntimeError(str(e)) from None
        self.workers.wire(self.token)
        now = time.monotonic()
        for s in self.stages.values():
            s.last_heartbeat = now
        self._thread = threading.Thread(target=self._loop, name="kvflow-controller", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown_blocking)

    def shutdown_blocking(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self.workers.shutdown()
        if self.store is not None:
            self.store.close()
        self.workers.close()

    # ------------------------------------------------------------------ Backend: requests
    def healthy(self) -> bool:
        return self.failure is None and self._thread is not None and self._thread.is_alive()

    def degraded(self) -> str | None:
        return self.recovery.recovering

    def stats(self) -> BackendStats:
        rec, stages = self.recovery, self.stages.values()
        decoding = [self.token] if self.token is not None else self.pipelines  # where a request's KV grows
        return BackendStats(
            # (submissions: arrived, not yet taken by the loop, e.g. while it replaces a worker)
            waiting_requests=self.executor.num_waiting + len(self.submissions),
            running_requests=sum(len(p.sched.running) for p in self.pipelines),
            generated_tokens_total=self.generated,
            prompt_tokens_total=self.prompt_tokens,
            kv_bytes_streamed_total=sum(s.kv_bytes_sent for s in stages),
            hidden_ring_bytes_total=sum(s.hidden_bytes_sent for s in stages),
            worker_busy_seconds={s.name: s.busy_s for s in stages},
            workers_alive={s.name: s.alive for s in stages},
            dropped_messages_total={"controller": self.dropped_messages,
                                    **{s.name: s.dropped_messages for s in stages}},
            preemptions_total=self.executor.preemptions,
            worker_failures_total=rec.failures,
            recoveries_total=rec.recoveries,
            recovery_seconds_total=rec.recovery_seconds,
            recovering=rec.recovering is not None,
            replicated_bytes_total=sum(s.replica_bytes_sent for s in stages),
            replication_lag_tokens=rec.lag(),
            resumed_requests_total=rec.resumed,
            recomputed_tokens_total=rec.recomputed_tokens,
            prefix_cache={(p.name, tier): c for p in self.pipelines for tier, c in p.kv_manager.tier_stats().items()},
            kv_free_tokens=sum(p.kv_manager.num_free_blocks * p.kv_manager.block_size for p in decoding),
            kv_capacity_tokens=sum(p.kv_manager.capacity_tokens for p in decoding),
        )

    @property
    def preemptions(self) -> int:
        return self.executor.preemptions

    @property
    def dropped_messages(self) -> int:
        """Inbox messages dropped: not authentic, undecodable, or results from before a recovery."""
        return self.workers.dropped_messages + self.stale_results

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       kv_source: str | None = None) -> AsyncIterator[RequestOutput]:
        """`kv_source` is not used: a pipeline's KV lives in its workers, which pull nothing (the prompt is computed)."""
        if self.failure is not None or self._stop.is_set():  # (during a recovery requests queue)
            raise BackendUnavailable(self.failure or "the server is shutting down")
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        req = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, detok)
        validate(req, self.limits, [p.kv_manager for p in self.pipelines])
        queue: asyncio.Queue = asyncio.Queue()
        self.submissions.append(("add", req, (asyncio.get_running_loop(), queue)))

        def done(finished: bool) -> None:
            if not finished:
                self.submissions.append(("abort", req, None))

        async for out in drain(queue, done):
            yield out

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.thread_time()
            try:
                self._turn()
            except Exception as e:  # a bug, not a worker's failure: fail every request loudly, keep serving errors
                log.exception("controller loop failed")
                try:
                    self._fail(f"controller error: {type(e).__name__}: {e}")
                except Exception:  # (the requests were failed first; only the clean-up broke)
                    log.exception("cleaning up after a controller error failed too")
            finally:
                self.deliveries.flush()  # the turn's outputs, one hand-over per event loop
                self.loop_cpu_s += time.thread_time() - started

    def _turn(self) -> None:
        """One turn of the loop: drain the inbox, take submissions, check the workers, schedule."""
        timeout = 5
        while (got := self.workers.receive(timeout)) is not None:
            timeout = 0
            if got[0] is not None:
                self.handle(*got)
        self.recovery.store_events()
        self._take_submissions()
        self._check_liveness()
        if self.failure is None:
            self.executor.fill_all()

    def handle(self, msg, tensor: torch.Tensor | None) -> None:
        """The one dispatch of worker messages (also during a worker's start-up and a restore)."""
        if isinstance(msg, StepResult):
            if msg.epoch != self.epoch:
                self.stale_results += 1
                return
            self._on_result(msg, tensor)
        elif isinstance(msg, KVArrived):
            if self.recovery.kv_arrived(msg) or self.executor.handoff is None:
                return
            self.executor.kv_arrived(msg.rids, msg.name)
        elif isinstance(msg, Heartbeat):
            s = self.stages.get(msg.name)
            if s is not None:
                s.last_heartbeat = time.monotonic()
                s.busy_s, s.kv_bytes_sent, s.dropped_messages = msg.busy_s, msg.kv_bytes_sent, msg.dropped_messages
                s.replica_bytes_sent, s.hidden_bytes_sent, s.swap = msg.replica_bytes_sent, msg.hidden_bytes, msg.swap
                s.launched_ahead = msg.launched_ahead
            return
        elif isinstance(msg, Replicated):
            s = self.stages.get(msg.name)
            if s is not None and msg.epoch in (-1, self.epoch):  # (a step voided by a recovery wrote it: moot)
                p = self.workers.pipeline_of(s)
                of = msg.stage if msg.stage >= 0 else (s.stage - 1) % p.depth  # (its own: written in place)
                self.recovery.replicated(p, of, msg.rids, list(zip(msg.starts, msg.ends)))
            return
        elif isinstance(msg, WorkerError):
            if msg.epoch not in (-1, self.epoch):
                return  # an error of a step from before a recovery is moot
            epoch = self.epoch
            if msg.peer_gone:  # e.g. a prompt worker whose KV peer died: recover the dead one, not this one
                self.workers.await_exit()
            self._check_liveness()
            s = self.stages.get(msg.name)
            if epoch == self.epoch and s is not None and s.alive and self.failure is None:
                self._worker_lost(s, f"worker {msg.name} failed: {msg.message}")
            return
        else:
            return
        if self.failure is None and self.recovery.recovering is None:
            self.executor.fill_all()  # as the simulator: decide after each result or arrival

    def _on_result(self, msg: StepResult, logits: torch.Tensor) -> None:
        p = next((p for p in self.pipelines if msg.batch in p.in_flight), None)
        if p is None:
            return
        p.in_flight[msg.batch].tiers.failed = list(msg.tier_failed)  # disk blocks some stage rejected: recomputed
        now = time.perf_counter()
        p.step_log.append(StepRecord(p.in_flight[msg.batch].num_tokens, msg.busy_s, now - p.sent_at.pop(msg.batch, now)))
        self.executor.complete(p, msg.batch, (msg, logits))

    def _take_submissions(self) -> None:
        while self.submissions:
            kind, req, sink = self.submissions.popleft()
            if kind == "add":
                self.sinks[req.request_id] = sink
                self.reqs[req.request_id] = req
                self.prompt_tokens += req.num_prompt_tokens
                if self.failure is not None:
                    req.finish("error", self.failure)
                    self.emit(req)
                else:
                    self.executor.submit(req)
            elif not req.is_finished:  # the client went away
                self.sinks.pop(req.request_id, None)
                self.executor.abort(req)

    # ------------------------------------------------------------------ the executor's driver
    def dispatch(self, p: Pipeline, wire_id: int, out: SchedulerOutput, free: list[str], streams: list[KVStream]) -> None:
        """Send the batch to stage 0 as a delta `Step` with the current epoch."""
        seqs = [SeqStep(s.request.request_id, s.start, s.num_new_tokens, list(s.new_block_ids), s.full_table,
                        list(s.device_block_ids)) for s in out.seqs]
        if p.watermark:  # (re)computed from scratch, maybe in new blocks: no replica yet; freed: none needed
            self.recovery.forget(p, [s.request.request_id for s in out.seqs if s.start == 0] + free)
        kv_out = [KVOut(k.rid, k.start, k.end, k.total, k.dest_blocks, k.cached) for k in streams]
        kv_plan = [list(dataclasses.astuple(t)) for t in plan_handoff(p.layer_bounds, self.token.layer_bounds, len(kv_out))] if kv_out else []
        argmax = [i for i, s in enumerate(out.seqs) if s.completes_prompt and argmax_only(s.request)]
        if len(p.sent_at) > len(p.in_flight):  # batches dropped by a recovery never return
            p.sent_at = {w: t for w, t in p.sent_at.items() if w in p.in_flight}
        p.sent_at[wire_id] = time.perf_counter()
        self.workers.send(p.stages[0].name, Step(self.epoch, wire_id, seqs, out.token_ids, free, kv_out, kv_plan, out.tiers.to_wire(),
                                                 swap_region=out.swap_region, argmax_rows=argmax))

    def sample(self, p: Pipeline, out: SchedulerOutput, rows: list[int], result: tuple[StepResult, torch.Tensor]) -> list[int]:
        """The last stage took the argmax of the step's `argmax_rows` (sent as ids); the other rows'
        logits came in row order."""
        msg, logits = result
        argmaxed = dict(zip(msg.argmax_rows, msg.argmax_ids))
        at = {i: k for k, i in enumerate(i for i in range(len(out.seqs)) if i not in argmaxed)}  # row -> its logits row
        want = [i for i in rows if i not in argmaxed]
        sampled = dict(zip(want, sample_requests(logits[[at[i] for i in want]], [out.seqs[i].request for i in want]))) if want else {}
        self.generated += len(rows)
        return [argmaxed[i] if i in argmaxed else sampled[i] for i in rows]

    def emit(self, req: Request) -> None:
        sink = self.sinks.get(req.request_id)
        if sink is not None:
            self.deliveries.add(*sink, req.take_output())
            if req.is_finished:
                self.sinks.pop(req.request_id, None)

    def kv_parts(self, p: Pipeline) -> list[str]:
        return [t.name for t in self.token.stages]  # every token stage reports its layers' KV in

    def settled(self, req: Request) -> None:
        if not any(req.request_id in p.sched.in_flight for p in self.pipelines):
            self.reqs.pop(req.request_id, None)

    def forget_finished(self) -> None:
        """Drop finished requests that only waited for their blocks to settle (after a recovery)."""
        for rid, r in list(self.reqs.items()):
            if r.is_finished and not any(r in p.sched.running for p in self.pipelines):
                del self.reqs[rid]

    # ------------------------------------------------------------------ failures
    def _check_liveness(self) -> None:
        found = self.workers.lost()
        if found is not None:
            self._worker_lost(*found)

    def _worker_lost(self, s: StageHandle, message: str) -> None:
        s.alive = False
        self.recovery.failures += 1
        if self.cfg.recovery == "none":
            self._fail(message)
        elif not self.recovery.recover(s, message):
            self._fail(f"{message}; its replacement failed {self.cfg.max_restarts} times")

    def _fail(self, message: str) -> None:
        """Fail every unfinished request with a clear error; new requests are refused with it too."""
        log.error("%s; failing all in-flight requests", message)
        if self.failure is None:
            self.failure = message
        self.epoch += 1  # whatever is still on the wire from before is stale
        reqs, self.reqs = list(self.reqs.values()), {}
        for r in reqs:  # first: whatever the clean-up below meets, no client waits
            if not r.is_finished:
                r.finish("error", message)
                self.emit(r)
        self.executor.fail_all()
