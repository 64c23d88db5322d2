"""The discrete-event simulator: a simulated executor of the real scheduling core.

Each pipeline runs `kvflow.sched.Scheduler` over a `KVCacheManager` block pool, and the loop is the
controller's (`kvflow/controller/controller.py`) with modelled step times instead of worker
processes: while a pipeline has fewer than `depth` batches in flight, `out = sched.schedule()` and
the batch is placed on its stages with the performance model's `step_time`; when the pass leaves the
last stage, every request that completed its prompt gets a token and `sched.update(out, sampled)`
applies it. Colocated pipelines (Baseline, Baseline-DP) have role "both". Disaggregated layouts have
prompt pipelines (role "prompt"; admission reserves the token-side blocks, `admit_hook`) whose
stages stream each layer's KV over their own link as they compute it; a request joins a token
pipeline (`add_running`, or a token microbatch) once its first token is sampled and its KV is in;
a request preempted on the token side is recomputed by a prompt pipeline. Failures void the passes
in flight; recovery resets the pipeline (recompute from prompt + produced tokens) or resumes from
the replicated KV.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque

from kvflow.kv.manager import KVCacheManager
from kvflow.perf.perf_model import BatchShape, PerfModel
from kvflow.sched.handoff import Handoff
from kvflow.sched.request import Request
from kvflow.sched.sampling import SamplingParams
from kvflow.sched.scheduler import Scheduler, SchedulerOutput
from kvflow.simulator.config import PipelineSpec, SimConfig
from kvflow.simulator.events import Arrival, Event, KVReady, PassDone, Recovered, WorkerFailure
from kvflow.simulator.executor import Pass, SimPipeline
from kvflow.simulator.metrics import SimResult
from kvflow.simulator.workload import Workload

UNLIMITED_CONTEXT = 1 << 40
SAMPLED = 0  # the token every simulated step "samples" (requests ignore EOS: lengths come from the workload)


class Simulator:
    """One simulation run. `Simulator(config, perf, workload).run()` returns a `SimResult`."""

    def __init__(self, config: SimConfig, perf: PerfModel, workload: Workload, log_batches: bool = False,
                 token_perf: PerfModel | None = None) -> None:
        """`log_batches`: keep every pipeline's `batch_log` (what each batch ran), as the controller does.
        `token_perf`: the token pipelines' performance model when it differs from the prompt side's
        (another tensor-parallel degree, DistServe-style placement); `perf` prices everything else."""
        if workload.n == 0:
            raise ValueError("workload has no requests")
        if token_perf is not None and token_perf.shape != perf.shape:
            raise ValueError("prompt and token performance models must serve the same model")
        self.config, self.perf, self.workload = config, perf, workload
        self.token_perf = token_perf or perf
        self.log_batches = log_batches
        layout = config.layout
        self.arrival = workload.arrival.tolist()
        self.prompt_len = workload.prompt_len.tolist()
        self.out_len = workload.output_len.tolist()
        n = workload.n
        self.first_token = [math.nan] * n
        self.finish = [math.nan] * n
        self.kv_wait = [0.0] * n
        self.completions = [0] * n
        self.restarts = 0
        self.max_model_len = config.max_model_len or UNLIMITED_CONTEXT
        self.queue: deque = deque()  # prompt-side requests not yet offered: workload indices or Requests
        self.prompt = self._group(layout.prompt, "prompt" if layout.token else "both")
        self.token = self._group(layout.token, "token") if layout.token else []
        # the controller's hand-off; a request's KV arrives in one part: the time it is complete
        self.handoff = Handoff(self.token) if self.token else None
        self._wire_ids = itertools.count()
        self._times: dict[tuple, float] = {}
        self._dirty: set[SimPipeline] = set()
        self._idle: set[SimPipeline] = set(self.prompt)  # prompt-side pipelines with a free slot
        self._version = 0  # bumped when the prompt queue grows or token blocks are freed
        self._tried: dict[SimPipeline, int] = {}

    def _group(self, spec: PipelineSpec, role: str) -> list[SimPipeline]:
        own = self.config.dispatch == "round_robin"
        perf = self.token_perf if role == "token" else self.perf
        out = []
        for i in range(spec.count):
            kv = KVCacheManager(self._pool_blocks(spec, role, perf), self.config.block_size, self.config.prefix_caching)
            hook = (lambda req: self.handoff.reserve(req)) if role == "prompt" else None
            sched = Scheduler(self.config.scheduler_for(spec), kv, self.max_model_len, role, hook)
            out.append(SimPipeline(role, i, spec, kv, sched, deque() if own else self.queue, perf))
        return out

    def _pool_blocks(self, spec: PipelineSpec, role: str, perf: PerfModel) -> int:
        """The configured pool, or what the most loaded stage's memory holds (`kv_capacity_tokens`)."""
        if self.config.kv_blocks is not None:
            return self.config.kv_blocks
        resident = min(2, spec.depth) if self.config.swapping and role != "prompt" else None
        tokens = perf.kv_capacity_tokens(spec.depth, resident)
        if tokens < self.config.block_size:
            raise ValueError(f"a {spec.depth}-stage pipeline of {perf.shape.name} on {perf.machine.name} "
                             f"has no memory left for KV")
        return tokens // self.config.block_size

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> SimResult:
        heap: list[tuple[float, int, Event]] = []
        seq = itertools.count()
        for ev in [Arrival(self.arrival[0], 0)] + [
                WorkerFailure(f.time, (self.token if f.role == "token" else self.prompt)[f.pipeline])
                for f in self.config.failures]:
            heapq.heappush(heap, (ev.time, next(seq), ev))
        while heap:
            now, _, ev = heapq.heappop(heap)
            for nxt in ev.handle(self) + self._schedule_all(now):
                heapq.heappush(heap, (nxt.time, next(seq), nxt))
        return SimResult.build(self)

    # --- scheduling: the controller's `_schedule` ------------------------------------------------

    def _schedule_all(self, now: float) -> list[Event]:
        """Give every pipeline that may have something to do a chance to fill its free slots, prompt
        pipelines first (their admission reserves token-side blocks), as the controller does."""
        todo = self._dirty
        self._dirty = set()
        if self.queue or self.config.dispatch == "round_robin":
            for p in self._idle:
                if p.queue and self._tried.get(p) != self._version:
                    todo.add(p)
        events: list[Event] = []
        for p in sorted(todo, key=lambda p: (p.role == "token", p.index)):
            events += self._schedule(p, now)
        return events

    def _schedule(self, p: SimPipeline, now: float) -> list[Event]:
        if p.down:
            return []
        self._tried[p] = self._version
        if p.ready:  # token side, microbatch policy: KV in place, waiting for a microbatch slot
            Handoff.fill_microbatches(p)
        admitting = not (self.config.rigid_rounds and p.sched.running)
        events: list[Event] = []
        while len(p.in_flight) < p.depth:
            offered = self._offer(p) if admitting and p.role != "token" else []
            out = p.sched.schedule()
            self._take_back(p, offered)
            for r in out.preempted:
                if p.role == "token":  # recomputed by a prompt pipeline
                    self.queue.appendleft(r)
                    self._version += 1
            if out.is_empty:
                if out.preempted and p.role != "token":
                    continue  # the blocks it freed may admit a waiting request (the controller's next turn)
                break
            events.append(self._send(p, out, now))
        if p.role != "token":
            if len(p.in_flight) < p.depth:
                self._idle.add(p)
            else:
                self._idle.discard(p)
        return events

    def _offer(self, p: SimPipeline) -> list[Request]:
        """Move up to one batch's worth of queued requests into `p`'s scheduler; as the scheduler
        only ever admits from the head of its queue and at most `microbatch` per batch, it decides
        exactly as if every queued request were in it (without holding a million of them)."""
        offered = []
        while p.queue and len(offered) < p.spec.microbatch:
            item = p.queue.popleft()
            req = self._request(item) if isinstance(item, int) else item
            p.sched.add(req)
            offered.append(req)
        return offered

    def _take_back(self, p: SimPipeline, offered: list[Request]) -> None:
        """Return the offered requests `p` did not admit to the front of the queue, in order."""
        ids = {id(r) for r in offered}
        back = []
        while p.sched.waiting and id(p.sched.waiting[-1]) in ids:
            back.append(p.sched.waiting.pop())
        p.queue.extendleft(back)

    def _request(self, i: int) -> Request:
        params = SamplingParams(max_tokens=self.out_len[i], temperature=0.0, ignore_eos=True)
        return Request(str(i), [i] * self.prompt_len[i], params, arrival_time=self.arrival[i])  # a prompt of its own

    def _send(self, p: SimPipeline, out: SchedulerOutput, now: float) -> PassDone:
        """Place the batch on `p`'s stages: one `step_time` per stage, activation hops between them;
        a prompt pipeline's stages also stream the KV they compute."""
        seqs = [(s.num_new_tokens, s.end) for s in out.seqs]
        shape = BatchShape.of(seqs)
        t = self._step_time(shape, p)
        hop = self._hop(shape.tokens, p) if p.depth > 1 else 0.0
        spans = p.place(now, t, hop, self._durations(shape, p, t))
        pas = Pass(out, t)
        if p.role == "prompt":  # what the token side's cached prefix lacks, as the controller streams
            tokens = 0
            for s in out.seqs:
                lo, hi = self.handoff.stream_range(s)
                tokens += max(0, hi - lo)
            pas.kv_done = p.stream(spans, [p.perf.kv_transfer_time(tokens, p.depth, k) for k in range(p.depth)])
        wire_id = next(self._wire_ids)
        p.in_flight[wire_id] = pas
        if self.log_batches:
            p.batch_log.append([(s.request.request_id, s.num_new_tokens) for s in out.seqs])
        return PassDone(spans[-1][1], p, wire_id)

    def _step_time(self, shape: BatchShape, p: SimPipeline) -> float:
        key = (shape, p.depth, p.role)
        t = self._times.get(key)
        if t is None:
            t = p.perf.step_time(shape, p.depth)
            if self.config.swapping and p.role != "prompt" and shape.decode_seqs and not shape.prefill_seqs:
                ctx = -(-shape.decode_context // shape.decode_seqs)
                t = max(t, p.perf.swap_in_time(shape.decode_seqs, ctx, p.depth))
            self._times[key] = t
        return t

    def _durations(self, shape: BatchShape, p: SimPipeline, t: float):
        """Each stage's time for the pass (`place`'s `duration`), or None when every stage takes `t`:
        stages of unequal shares price their own (`stage_step_time`; with swapping, the slowest
        stage's `t` covers the swap-in); on a shared host a stage that starts while another stage
        of the host is busy runs slower by `co_run_factor` for as long as they overlap."""
        per_stage = p.depth > 1 and not self.config.swapping and not p.perf.uniform_stages
        factor = p.perf.co_run_factor(shape) if self.config.shared_host else 1.0
        if not per_stage and factor <= 1.0:
            return None  # (the planner's case: every stage takes `t`)
        stages = [self._stage_time(shape, p, k) for k in range(p.depth)] if per_stage else [t] * p.depth

        def duration(k: int, start: float) -> float:
            tk = stages[k]
            if factor <= 1.0:
                return tk
            busy = max((end for q in self.prompt + self.token for j, end in enumerate(q.stage_free)
                        if not (q is p and j == k)), default=0.0) - start
            if busy <= 0.0:
                return tk
            return tk * factor if busy >= tk * factor else busy + (tk - busy / factor)
        return duration

    def _stage_time(self, shape: BatchShape, p: SimPipeline, stage: int) -> float:
        key = (shape, p.depth, p.role, stage)
        t = self._times.get(key)
        if t is None:
            t = self._times[key] = p.perf.stage_step_time(shape, p.depth, stage)
        return t

    def _hop(self, tokens: int, p: SimPipeline) -> float:
        key = ("hop", tokens, p.role)
        h = self._times.get(key)
        if h is None:
            h = self._times[key] = p.perf.hop_time(1, tokens)
        return h

    # --- disaggregation: the controller's hand-off ---------------------------------------------

    def _to_token_side(self, req: Request) -> None:
        if req.is_finished:
            self._settle(req)
        else:
            self._dirty.add(self.handoff.join(req))

    def _settle(self, req: Request) -> None:
        """A finished request: free its token-side reservation once no KV is still on its way."""
        if self.handoff is not None and self.handoff.settle(req) is not None:
            self._version += 1

    # --- handlers ------------------------------------------------------------------------------

    def on_arrival(self, now: float, first: int) -> list[Event]:
        i, n = first, len(self.arrival)
        rr = self.config.dispatch == "round_robin"
        while i < n and self.arrival[i] <= now:
            (self.prompt[i % len(self.prompt)].queue if rr else self.queue).append(i)
            i += 1
        self._version += 1
        return [Arrival(self.arrival[i], i)] if i < n else []

    def on_pass_done(self, now: float, p: SimPipeline, wire_id: int) -> list[Event]:
        pas = p.in_flight.pop(wire_id)
        p.busy += pas.stage_time
        out = pas.out
        sampled = {s.request.request_id: SAMPLED for s in out.seqs
                   if s.completes_prompt and not s.request.is_finished}
        if p.role == "prompt":
            for s in out.seqs:
                if s.completes_prompt:
                    self.handoff.kv_sent(s.request.request_id, [pas.kv_done])
        for req in p.sched.update(out, sampled):
            i = int(req.request_id)
            if self.first_token[i] != self.first_token[i]:  # NaN: its first token
                self.first_token[i] = now
            if req.is_finished:
                self.finish[i] = now
                self.completions[i] += 1
                if p.role != "prompt":
                    self._version += 1  # its blocks were freed
                self._settle(req)
        events: list[Event] = []
        if p.role == "prompt":  # handed off, or finished at its first token: both wait for their KV
            for req in p.sched.take_handoffs():
                if self.handoff.sampled(req):
                    self._to_token_side(req)
            done = pas.kv_done
            for s in out.seqs:
                rid = s.request.request_id
                if rid not in self.handoff.parked:
                    continue
                self.kv_wait[int(rid)] = max(0.0, done - now)
                if done > now:
                    events.append(KVReady(done, rid))
                else:
                    self.on_kv_ready(done, rid)
        self._dirty.add(p)
        return events

    def on_kv_ready(self, now: float, rid: str) -> list[Event]:
        req = self.handoff.kv_arrived(rid, now)  # nothing if re-planned since (its prompt pipeline failed)
        if req is not None:
            self._to_token_side(req)
        return []

    def on_failure(self, now: float, p: SimPipeline) -> list[Event]:
        """Restart mode, and any prompt pipeline (prompt KV is not replicated): the pipeline's
        requests lose their KV and are recomputed (`Scheduler.reset`). Resume mode: the replacement
        restores the lost stage's KV from its replica and the passes in flight run again."""
        rec = self.config.recovery
        restore = 0.0
        p.kv.reset_prefix_cache()  # the replacement's cache is empty (as the controller's `_recover`)
        if rec.mode == "restart" or p.role == "prompt":
            lost = p.sched.reset()
            p.in_flight.clear()
            self.restarts += len(lost)
            for r in lost:
                if self.handoff is not None:
                    self.handoff.forget_kv(r.request_id)
            # From scratch: a workload index in the queue becomes a fresh request when offered.
            again = {id(r) for r in lost} if rec.mode == "restart" and rec.from_scratch else set()
            if p.role == "token":
                self.queue.extendleft(reversed([int(r.request_id) if id(r) in again else r for r in lost]))
            else:
                p.queue.extendleft(reversed([int(r.request_id) if id(r) in again else r for r in p.sched.waiting]))
                p.sched.waiting.clear()
            self._version += 1
        else:
            if rec.restore_s is not None:
                restore = rec.restore_s
            else:
                restore = p.perf.kv_transfer_time(sum(r.num_computed_tokens for r in p.sched.running), p.depth)
        back = max(now, p.stage_free[0] if p.down else now) + rec.detect_s + rec.down_s + restore
        p.fail(back)
        self._idle.discard(p)
        return [Recovered(back, p)]

    def on_recovered(self, now: float, p: SimPipeline) -> list[Event]:
        p.down = False
        events: list[Event] = []
        for wire_id in sorted(p.in_flight):  # resume: the voided passes run again, in order
            pas = p.in_flight[wire_id]
            shape = BatchShape.of((s.num_new_tokens, s.end) for s in pas.out.seqs)
            spans = p.place(now, pas.stage_time, self._hop(shape.tokens, p) if p.depth > 1 else 0.0)
            events.append(PassDone(spans[-1][1], p, wire_id))
        self._dirty.add(p)
        return events


def simulate(config: SimConfig, perf: PerfModel, workload: Workload, token_perf: PerfModel | None = None) -> SimResult:
    """Run one simulation (convenience wrapper); `token_perf` as in `Simulator`."""
    return Simulator(config, perf, workload, token_perf=token_perf).run()
